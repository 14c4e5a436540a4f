"""Coverage proof: every element of a tensor is held exactly once in every replica group.

The check is exact and independent of how the boxes were derived: per replica group, the boxes'
boundaries are compressed into a grid and a difference array counts how often each grid cell is held.
A cell held zero times is a hole, one held more than once an overlap.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Box", "CoverageReport", "check_coverage"]

_MAX_REPORTED = 8


@dataclass(frozen=True, slots=True)
class Box:
    """A box of the global tensor, with the ranks that hold it (for overlaps) or none (holes)."""

    global_offset: tuple[int, ...]
    sizes: tuple[int, ...]
    ranks: tuple[int, ...] = ()
    replica_group: int = 0

    def __str__(self) -> str:
        where = "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.global_offset, self.sizes)) + "]"
        held = f" held by ranks {list(self.ranks)}" if self.ranks else ""
        return f"{where}{held} (replica group {self.replica_group})"


@dataclass(frozen=True, slots=True)
class CoverageReport:
    """The verdict of a coverage check: ``ok`` iff no hole and no overlap in any replica group."""

    name: str
    global_shape: tuple[int, ...]
    replica_groups: int
    ranks: int
    holes: tuple[Box, ...]
    overlaps: tuple[Box, ...]
    hole_elements: int
    overlap_elements: int

    @property
    def ok(self) -> bool:
        """True when every element is held exactly once per replica group."""
        return not self.hole_elements and not self.overlap_elements

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return (
                f"exact: {self.ranks} ranks hold every element of {self.name} {self.global_shape} exactly "
                f"once in each of {self.replica_groups} replica group(s)"
            )
        lines = [
            f"NOT exact: {self.name} {self.global_shape}: {self.hole_elements} elements held by no rank, "
            f"{self.overlap_elements} elements held more than once"
        ]
        lines += [f"  hole {b}" for b in self.holes]
        lines += [f"  overlap {b}" for b in self.overlaps]
        return "\n".join(lines)

    def __repr__(self) -> str:
        verdict = "exact" if self.ok else f"holes={self.hole_elements}, overlaps={self.overlap_elements}"
        return f"CoverageReport({self.name!r}, {verdict}, replica_groups={self.replica_groups})"


def check_coverage(
    name: str,
    global_shape: Sequence[int],
    boxes_by_rank: Mapping[int, Sequence[tuple[Sequence[int], Sequence[int]]]],
    replica_groups: Sequence[Sequence[int]],
) -> CoverageReport:
    """Check that each replica group's ranks hold every element of ``global_shape`` exactly once.

    Args:
        name: what is checked, for the report.
        global_shape: the full tensor's shape.
        boxes_by_rank: per rank, its boxes as ``(global_offset, sizes)``.
        replica_groups: disjoint lists of ranks that must each cover the tensor once.
    """
    shape = tuple(int(s) for s in global_shape)
    holes: list[Box] = []
    overlaps: list[Box] = []
    hole_elements = overlap_elements = 0
    for group_id, group in enumerate(replica_groups):
        boxes = [
            (tuple(o), tuple(s), r) for r in group for o, s in boxes_by_rank.get(r, ()) if all(x > 0 for x in s)
        ]
        h, o, h_boxes, o_boxes = _check_group(shape, boxes, group_id)
        hole_elements += h
        overlap_elements += o
        holes.extend(h_boxes[: _MAX_REPORTED - len(holes)])
        overlaps.extend(o_boxes[: _MAX_REPORTED - len(overlaps)])
    return CoverageReport(
        name,
        shape,
        len(replica_groups),
        sum(len(g) for g in replica_groups),
        tuple(holes),
        tuple(overlaps),
        hole_elements,
        overlap_elements,
    )


def _check_group(
    shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...], int]], group_id: int
) -> tuple[int, int, list[Box], list[Box]]:
    if any(s == 0 for s in shape):
        return 0, 0, [], []
    if not shape:  # a scalar: held once per replica group
        held = [r for _, _, r in boxes]
        if not held:
            return 1, 0, [Box((), (), (), group_id)], []
        if len(held) > 1:
            return 0, len(held) - 1, [], [Box((), (), tuple(held), group_id)]
        return 0, 0, [], []
    ndim = len(shape)
    cuts = [sorted({0, n} | {o[d] for o, _, _ in boxes} | {o[d] + s[d] for o, s, _ in boxes}) for d, n in
            enumerate(shape)]
    if boxes:
        offsets = np.array([o for o, _, _ in boxes], dtype=np.int64).reshape(len(boxes), ndim)
        stops = offsets + np.array([s for _, s, _ in boxes], dtype=np.int64).reshape(len(boxes), ndim)
        lo = np.stack([np.searchsorted(np.asarray(cuts[d]), offsets[:, d]) for d in range(ndim)], axis=1)
        hi = np.stack([np.searchsorted(np.asarray(cuts[d]), stops[:, d]) for d in range(ndim)], axis=1)
    diff = np.zeros([len(c) for c in cuts], dtype=np.int64)
    for corner in itertools.product((0, 1), repeat=ndim):
        if not boxes:
            break
        index = np.where(np.array(corner, dtype=bool), hi, lo)
        np.add.at(diff, tuple(index.T), -1 if sum(corner) % 2 else 1)
    counts = diff
    for axis in range(ndim):
        counts = np.cumsum(counts, axis=axis)
    counts = counts[tuple(slice(0, len(c) - 1) for c in cuts)]
    widths = [np.diff(np.array(c)) for c in cuts]
    volume = widths[0]
    for w in widths[1:]:
        volume = np.multiply.outer(volume, w)
    hole_elements = int(volume[counts == 0].sum())
    overlap_elements = int((volume * np.maximum(counts - 1, 0)).sum())

    def as_box(cell: tuple[int, ...], with_ranks: bool) -> Box:
        offset = tuple(int(cuts[d][c]) for d, c in enumerate(cell))
        sizes = tuple(int(cuts[d][c + 1] - cuts[d][c]) for d, c in enumerate(cell))
        ranks: tuple[int, ...] = ()
        if with_ranks:
            ranks = tuple(
                sorted({r for o, s, r in boxes if all(o[d] <= offset[d] < o[d] + s[d] for d in range(ndim))})
            )
        return Box(offset, sizes, ranks, group_id)

    hole_boxes = [as_box(tuple(c), False) for c in np.argwhere(counts == 0)[:_MAX_REPORTED]]
    overlap_boxes = [as_box(tuple(c), True) for c in np.argwhere(counts > 1)[:_MAX_REPORTED]]
    return hole_elements, overlap_elements, hole_boxes, overlap_boxes
