"""Slice signatures: one 64-bit linear hash per dim-0 slice and per dim-1 slice of a tensor, streamed.

``s0[i] = sum_j bits[i, j] * w(j)`` and ``s1[j] = sum_i bits[i, j] * w(i)`` over the raw bits (as
integers), with int64 wrap-around arithmetic, so a signature is exact and does not depend on how the
rows were blocked. ``w(n)`` is a fixed mix of the index ``n`` alone, the same for every dim: so a
transposed tensor's ``s0`` equals the original's ``s1``. Any map between slices (a permutation, a
replication, a shard) is then tested on signatures in O(length) before the data is compared exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.debug.views import TensorView, bits

__all__ = ["MAX_DIM1", "Signatures", "signatures", "weights"]

MAX_DIM1 = 1 << 22  # dim-1 signatures only when dim 1 (trailing dims flattened) is at most this long
_M1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64


def weights(start: int, length: int) -> torch.Tensor:
    """The mixing weights ``w(start) .. w(start + length - 1)`` (odd int64s)."""
    x = torch.arange(start, start + length, dtype=torch.int64) + 1
    x = x * _M1
    x = x ^ (x >> 31)
    x = x * _M2
    x = x ^ (x >> 27)
    return x | 1


@dataclass(frozen=True, slots=True)
class Signatures:
    """``s0`` per dim-0 slice, ``s1`` per dim-1 slice (None for 1-d views, or dim 1 too long)."""

    s0: torch.Tensor
    s1: torch.Tensor | None


def signatures(view: TensorView, block_bytes: int) -> Signatures:
    """Stream ``view`` in row blocks and return its slice signatures (memory: one block, x ~3)."""
    shape = view.shape
    n0 = shape[0]
    cols = 1
    for s in shape[1:]:
        cols *= s
    with_s1 = len(shape) >= 2 and cols <= MAX_DIM1
    s0 = torch.zeros(n0, dtype=torch.int64)
    s1 = torch.zeros(cols, dtype=torch.int64) if with_s1 else None
    wc = weights(0, cols)
    expand = 1 + 16 // max(1, view.metas[0].row_bytes // max(1, cols) or 1)
    step = view.rows_per_block(block_bytes, expand)
    for a in range(0, n0, step):
        b = min(n0, a + step)
        x = bits(view.read_rows(a, b)).reshape(b - a, cols).to(torch.int64)
        s0[a:b] = (x * wc).sum(1)
        if s1 is not None:
            s1 += (x * weights(a, b - a)[:, None]).sum(0)
    return Signatures(s0, s1)
