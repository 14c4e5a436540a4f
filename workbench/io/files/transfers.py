"""A rank's reads of one parameter as few strided boxes of file bytes, each moved into the local tensor by one copy.

A fused runtime tensor (an MoE layer's experts, one HF key per expert and projection) gives a rank one box per key:
thousands of small boxes per load. Where the keys lie one after another in a file in the order the parameter holds
them, those boxes repeat with one step in the file and one step in the local tensor, so they are one box of one
more dim: ``plan_transfers`` stacks them (and folds dims that are contiguous on both sides), then cuts what it made
into pieces of about ``piece_bytes`` along the leading dim, so a piece is read by one thread and copied by one op
while the next is read. Pure arithmetic on the plan's reads and the index's offsets: nothing is read here.

Example: 32 experts' ``gate_proj`` and ``up_proj`` keys of ``[512, 1024]`` bf16, expert-TP over 2 ranks
(interleaved): rank 0 owns rows 0-255 of each of the 64 keys, which the file holds 1 MiB apart and the local
tensor 512 KiB apart: one ``FileBox`` of sizes ``(64, 256 * 1024)`` with byte strides ``(1 MiB, 2)``, read as 64
runs into a buffer laid out like the local tensor, and one copy, where 64 reads and 64 copies were.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from workbench.errors import CheckpointError
from workbench.io.files.index import CheckpointIndex, torch_dtype
from workbench.plan.casts import check_fits
from workbench.plan.load_plan import KeyRead

__all__ = ["FileBox", "Transfer", "copy_transfers", "landing_views", "plan_transfers"]

PIECE_BYTES = 8 << 20  # a transfer is cut into pieces spanning at most this many file bytes (at least one row)


@dataclass(frozen=True, slots=True)
class FileBox:
    """A strided box of one file's data section: element ``i`` is at byte ``offset + sum(i[d] * strides[d])``
    from the start of the data section (every stride positive, the box's rows in file order)."""

    file: str
    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return math.prod(self.sizes)

    @property
    def nbytes(self) -> int:
        """Bytes the box holds."""
        return self.numel * self.dtype.itemsize

    @property
    def span(self) -> int:
        """Bytes from its first byte to its last (0 for an empty box)."""
        if not self.numel:
            return 0
        return sum((n - 1) * s for n, s in zip(self.sizes, self.strides)) + self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class Transfer:
    """Copy ``source`` into the local tensor's elements at ``offset + sum(i[d] * strides[d])`` (counted from the
    tensor's storage offset). ``key`` is the first HF key it reads and ``keys`` how many (for messages)."""

    source: FileBox
    offset: int
    strides: tuple[int, ...]
    key: str
    keys: int = 1


def plan_transfers(
    index: CheckpointIndex,
    reads: Iterable[KeyRead],
    local_strides: Sequence[int],
    *,
    piece_bytes: int = PIECE_BYTES,
) -> tuple[Transfer, ...]:
    """The transfers that carry ``reads`` (one parameter's, in order) into a local tensor of ``local_strides``.

    The reads are taken in file order (a file need not hold the keys in the order the parameter fuses them: ours
    hold every expert's ``gate_proj``, then every ``up_proj``). Neighbours of one file and dtype whose boxes have
    the same shape are stacked into one transfer while each is one constant step after the last in the file and in
    the local tensor (both steps at least the box's extent, so nothing overlaps); dims contiguous on both sides are
    folded; a transfer spanning more than ``piece_bytes`` is cut along its leading dim. Reads of no element are
    dropped.

    Raises:
        CheckpointError: a read names a key the index does not hold.
    """
    single = _Singles(index, tuple(local_strides))
    boxes = sorted((single(r) for r in reads if math.prod(r.sizes)), key=lambda b: (b.file, b.src))
    out: list[Transfer] = []
    group: _Group | None = None
    for box in boxes:
        if group is not None and group.take(box):
            continue
        if group is not None:
            out.extend(group.pieces(piece_bytes))
        group = _Group(box)
    if group is not None:
        out.extend(group.pieces(piece_bytes))
    return tuple(out)


@dataclass(slots=True)
class _Box:
    file: str
    dtype: torch.dtype
    src: int  # byte offset in the data section
    dst: int  # element offset in the local tensor
    sizes: tuple[int, ...]
    src_strides: tuple[int, ...]  # bytes
    dst_strides: tuple[int, ...]  # elements
    key: str

    def extents(self) -> tuple[int, int]:
        """Bytes from its first to past its last byte in the file; elements likewise in the local tensor."""
        src = sum((n - 1) * s for n, s in zip(self.sizes, self.src_strides)) + self.dtype.itemsize
        dst = sum((n - 1) * s for n, s in zip(self.sizes, self.dst_strides)) + 1
        return src, dst


class _Singles:
    """One read as a ``_Box``; what depends only on a key's shape and dtype, or on a box's shape, is worked out once
    per parameter (a fused parameter's keys share them): a few microseconds per read."""

    def __init__(self, index: CheckpointIndex, local_strides: tuple[int, ...]) -> None:
        self.index = index
        self.local_strides = local_strides
        self.keys: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]] = {}
        self.folds: dict[tuple, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}

    def __call__(self, r: KeyRead) -> _Box:
        try:
            info = self.index.keys[r.hf_key]
        except KeyError:
            raise CheckpointError(f"key {r.hf_key!r} is not in checkpoint {self.index.directory} "
                                  f"({len(self.index.keys)} keys)") from None
        shape = info.shape
        known = self.keys.get((info.dtype, shape))
        if known is None:
            dtype = torch_dtype(info.dtype)
            known = self.keys[info.dtype, shape] = (
                dtype, tuple(dtype.itemsize * math.prod(shape[d + 1:]) for d in range(len(shape))))
        dtype, key_strides = known
        if (len(r.key_offset) != len(shape) or len(r.local_offset) != len(self.local_strides)
                or any(o < 0 or o + n > f for o, n, f in zip(r.key_offset, r.sizes, shape))):
            raise CheckpointError(f"key {r.hf_key!r} ({info.dtype}{list(shape)}): a read of {r.sizes} at "
                                  f"{r.key_offset} does not fit it, or the local tensor's {len(self.local_strides)} "
                                  "dims")
        src = info.data_offsets[0] + sum(o * s for o, s in zip(r.key_offset, key_strides))
        dst = sum(o * s for o, s in zip(r.local_offset, self.local_strides))
        folded = self.folds.get((r.sizes, key_strides))
        if folded is None:
            folded = self.folds[r.sizes, key_strides] = _fold(r.sizes, key_strides, self.local_strides,
                                                              dtype.itemsize)
        return _Box(info.file, dtype, src, dst, *folded, r.hf_key)


def _fold(
    sizes: Sequence[int], src: Sequence[int], dst: Sequence[int], itemsize: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Drop dims of size 1 and merge each dim into the next where both sides are contiguous across them."""
    kept = [(n, s, d) for n, s, d in zip(sizes, src, dst) if n != 1] or [(1, itemsize, 1)]
    merged = [kept[-1]]
    for n, s, d in reversed(kept[:-1]):
        inner_n, inner_s, inner_d = merged[-1]
        if s == inner_n * inner_s and d == inner_n * inner_d:
            merged[-1] = (n * inner_n, inner_s, inner_d)
        else:
            merged.append((n, s, d))
    merged.reverse()
    return tuple(m[0] for m in merged), tuple(m[1] for m in merged), tuple(m[2] for m in merged)


class _Group:
    """Boxes of one shape stacked on a new leading dim while each is one constant step after the last."""

    def __init__(self, first: _Box) -> None:
        self.first = first
        self.count = 1
        self.step: tuple[int, int] | None = None  # (bytes, elements) from one box to the next
        self.extent = first.extents()

    def take(self, box: _Box) -> bool:
        f = self.first
        if (box.file != f.file or box.dtype != f.dtype or box.sizes != f.sizes or box.src_strides != f.src_strides
                or box.dst_strides != f.dst_strides):
            return False
        step = (box.src - f.src - (self.count - 1) * (self.step[0] if self.step else 0),
                box.dst - f.dst - (self.count - 1) * (self.step[1] if self.step else 0))
        if self.step is None:
            if step[0] < self.extent[0] or step[1] < self.extent[1] or step[0] % f.dtype.itemsize:
                return False
            self.step = step
        elif step != self.step:
            return False
        self.count += 1
        return True

    def pieces(self, piece_bytes: int) -> list[Transfer]:
        f = self.first
        if self.count == 1:
            sizes, src_strides, dst_strides = f.sizes, f.src_strides, f.dst_strides
        else:
            assert self.step is not None
            sizes, src_strides, dst_strides = _fold((self.count, *f.sizes), (self.step[0], *f.src_strides),
                                                    (self.step[1], *f.dst_strides), f.dtype.itemsize)
        row = sum((n - 1) * s for n, s in zip(sizes[1:], src_strides[1:])) + f.dtype.itemsize  # one leading index
        per = max(1, (piece_bytes - row) // src_strides[0] + 1) if row <= piece_bytes else 1
        if len(sizes) == 1:  # one run: cut it into runs of whole elements
            per = max(1, piece_bytes // src_strides[0])
        out = []
        for at in range(0, sizes[0], per):
            n = min(per, sizes[0] - at)
            source = FileBox(f.file, f.src + at * src_strides[0], (n, *sizes[1:]), src_strides, f.dtype)
            out.append(Transfer(source, f.dst + at * dst_strides[0], dst_strides, f.key, self.count))
        return out


def copy_transfers(
    transfers: Iterable[Transfer],
    read: Callable[[FileBox], torch.Tensor],
    out: torch.Tensor,
    *,
    non_blocking: bool = False,
    into: str = "the model's tensor",
) -> torch.Tensor:
    """Copy each transfer's box, as ``read`` hands it out, into its place in ``out`` (one copy per transfer: a
    cast where ``out`` has another dtype, of values that fit it (``plan.casts.check_fits``: otherwise an error
    naming the key and ``into``, what ``out`` is); queued on the current stream from pinned memory when
    ``non_blocking``). A box ``read`` hands out in its very place (read there, ``landing_views``) is not copied
    again."""
    for t, place in zip(transfers, landing_views(transfers, out)):
        piece = read(t.source)
        if tuple(piece.shape) != t.source.sizes:
            raise CheckpointError(f"reading {t.source} (from key {t.key!r}) gave shape {tuple(piece.shape)}")
        check_fits(piece, out.dtype, f"{t.key}, read into {into}")
        if not (piece.data_ptr() == place.data_ptr() and piece.stride() == place.stride()
                and piece.device == place.device):
            place.copy_(piece, non_blocking=non_blocking)
    return out


def landing_views(transfers: Iterable[Transfer], out: torch.Tensor) -> list[torch.Tensor]:
    """Each transfer's place in ``out``: a view of the transfer's shape."""
    base = out.storage_offset()
    return [out.as_strided(t.source.sizes, t.strides, base + t.offset) for t in transfers]
