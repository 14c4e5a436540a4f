"""A tensor to analyze: one key of a source, or several keys concatenated on dim 0 (a fused parameter).

Reads are in row blocks or 2-D boxes, so memory stays bounded by the caller's block size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workbench.debug.source import KeyMeta, Source

__all__ = ["TensorView", "bits"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers of the same size (NaN == NaN, -0.0 != 0.0); of the values a conjugate or
    negative view shows."""
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(_INT_OF_SIZE[t.element_size()])


@dataclass(frozen=True, slots=True)
class TensorView:
    """Keys of one source, concatenated on dim 0 (one key: the key itself).

    Attributes:
        source: where the bytes are; keys: the keys in concatenation order; name: what findings call it.
    """

    source: Source
    keys: tuple[str, ...]
    name: str

    @property
    def metas(self) -> tuple[KeyMeta, ...]:
        """Each key's metadata."""
        metas = self.source.metas()
        return tuple(metas[k] for k in self.keys)

    @property
    def dtype(self) -> torch.dtype | None:
        """The torch dtype (None when torch has none, or the keys disagree)."""
        dtypes = {m.dtype for m in self.metas}
        return self.metas[0].torch_dtype if len(dtypes) == 1 else None

    @property
    def shape(self) -> tuple[int, ...]:
        """Rows summed over the keys, trailing dims of the first key (a scalar counts as ``(1,)``)."""
        metas = self.metas
        first = metas[0].shape or (1,)
        return (sum(m.rows for m in metas), *first[1:])

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape as stored (a scalar stays ``()``)."""
        return self.metas[0].shape if len(self.keys) == 1 else self.shape

    @property
    def row_bytes(self) -> int:
        """Bytes of one dim-0 slice."""
        return self.metas[0].row_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole view."""
        return sum(m.nbytes for m in self.metas)

    def rows_per_block(self, block_bytes: int, expand: int = 1) -> int:
        """Rows per block so that ``expand`` x the block stays within ``block_bytes``."""
        return max(1, block_bytes // max(1, self.row_bytes * expand))

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (across keys when fused), stored dtype."""
        pieces = []
        base = 0
        for key, meta in zip(self.keys, self.metas):
            lo, hi = max(start, base), min(stop, base + meta.rows)
            if lo < hi:
                piece = self.source.read_rows(key, lo - base, hi - base)
                pieces.append(piece.reshape(hi - lo, *self.shape[1:]))
            base += meta.rows
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            dtype = self.dtype or torch.uint8
            return torch.empty((0, *self.shape[1:]), dtype=dtype)
        return torch.cat(pieces)

    def read_raw(self, start: int, stop: int) -> bytes:
        """Bytes ``start:stop`` of the view's data (across keys when fused)."""
        out = bytearray()
        base = 0
        for key, meta in zip(self.keys, self.metas):
            lo, hi = max(start, base), min(stop, base + meta.nbytes)
            if lo < hi:
                out += self.source.read_raw(key, lo - base, hi - base)
            base += meta.nbytes
        return bytes(out)

    def read_box(self, rows: tuple[int, int], cols: tuple[int, int], block_bytes: int) -> torch.Tensor:
        """Rows ``rows`` and dim-1 slice ``cols`` of a >= 2-d view, reading at most ``block_bytes`` at once."""
        out = []
        step = self.rows_per_block(block_bytes)
        for a in range(rows[0], rows[1], step):
            b = min(rows[1], a + step)
            out.append(self.read_rows(a, b)[:, cols[0] : cols[1]].clone())
        return torch.cat(out) if out else torch.empty((0, cols[1] - cols[0], *self.shape[2:]), dtype=self.dtype)

    def numel(self) -> int:
        """Elements."""
        return math.prod(self.shape)
