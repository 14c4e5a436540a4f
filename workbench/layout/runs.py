"""Segments and runs: which global boxes a rank holds, and where they sit in its local tensor.

Ownership along one tensor dim is an ordered list of *segments* ``(global_start, length)`` in local
order. Each descriptor on that dim picks intervals of the current local dim and maps them back through
the segments. Segments stay in ascending global order, so elements past a tail boundary (FP8 padding)
always form a suffix of the local dim. A rank's N-D ownership is the Cartesian product of its per-dim
segments: every product cell is a ``Run``, a box contiguous both globally and locally.

Example, 16 rows on (ep=2, tp=2) with ``S(0)@ep -> IS(0,2)@tp``, rank (ep=1, tp=0):
segments ``((8, 2), (12, 2))``, runs ``Run((8, 0), (2, 3), (0, 0))`` and ``Run((12, 0), (2, 3), (2, 0))``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from workbench.layout.descriptors import ShardDescriptor

__all__ = [
    "Run", "Segment", "cached_dim_segments", "cut_segments", "dim_segments", "runs_from_segments"
]

Segment = tuple[int, int]  # (global_start, length), in local order


@dataclass(frozen=True, slots=True)
class Run:
    """A box held by one rank: ``sizes`` elements at ``global_offset`` in the global tensor and at
    ``local_offset`` in the rank's local tensor (contiguous in both)."""

    global_offset: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offset: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements in the box."""
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def global_slices(self) -> tuple[slice, ...]:
        """Index of the box in the global tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.global_offset, self.sizes))

    def local_slices(self) -> tuple[slice, ...]:
        """Index of the box in the local tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.local_offset, self.sizes))

    def __str__(self) -> str:
        return f"global{_fmt(self.global_offset, self.sizes)} -> local{_fmt(self.local_offset, self.sizes)}"


def _fmt(offset: Sequence[int], sizes: Sequence[int]) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offset, sizes)) + "]"


def cut_segments(segments: Sequence[Segment], intervals: Sequence[tuple[int, int]]) -> tuple[Segment, ...]:
    """Segments kept when ``intervals`` (in current local coordinates, ascending) are cut out of
    ``segments``; neighbours contiguous in both spaces merge."""
    out: list[Segment] = []
    for a, b in intervals:
        pos = 0
        for g, n in segments:
            lo, hi = max(a, pos), min(b, pos + n)
            if lo < hi:
                start, length = g + lo - pos, hi - lo
                if out and out[-1][0] + out[-1][1] == start:
                    out[-1] = (out[-1][0], out[-1][1] + length)
                else:
                    out.append((start, length))
            pos += n
            if pos >= b:
                break
    return tuple(out)


def dim_segments(
    length: int,
    cuts: Sequence[tuple[ShardDescriptor, int, int]],
    *,
    what: str = "tensor",
) -> tuple[Segment, ...]:
    """Segments of one tensor dim of ``length`` after ``cuts``, each ``(descriptor, world, group_rank)``."""
    segments: tuple[Segment, ...] = ((0, length),) if length else ()
    for descriptor, world, index in cuts:
        current = sum(n for _, n in segments)
        segments = cut_segments(segments, descriptor.local_intervals(current, world, index, what=what))
    return segments


@functools.lru_cache(maxsize=65536)
def cached_dim_segments(length: int, cuts: tuple[tuple[ShardDescriptor, int, int], ...]) -> tuple[Segment, ...]:
    """``dim_segments`` memoized on its (hashable) inputs: layers of a model share their geometry."""
    return dim_segments(length, cuts)


@functools.lru_cache(maxsize=65536)
def runs_from_segments(segments: tuple[tuple[Segment, ...], ...]) -> tuple[Run, ...]:
    """The Cartesian product of per-dim segments, as runs in local row-major order (memoized)."""
    per_dim = []
    for dim_segs in segments:
        local, cells = 0, []
        for g, n in dim_segs:
            cells.append((g, n, local))
            local += n
        per_dim.append(cells)
    return tuple(
        Run(tuple(c[0] for c in combo), tuple(c[1] for c in combo), tuple(c[2] for c in combo))
        for combo in itertools.product(*per_dim)
    )
