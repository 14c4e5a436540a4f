"""Coverage proof: every element held exactly once per replica group, or the exact holes and overlaps."""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.tensor.placement_types import Replicate, Shard

from workbench import _compat
from workbench.layout import Box, InterleavedShard, LoadSpec, check_coverage
from workbench.mesh import MeshSpec

S, R, IS = Shard, Replicate, InterleavedShard


def SS(dim: int, split_factor: int) -> Any:
    return _compat.make_strided_shard(dim, split_factor)


FSDP_EP_TP = MeshSpec((2, 2, 2), ("fsdp", "ep", "tp"))
TOY = LoadSpec.from_placements("w13", "w13", (16, 4), FSDP_EP_TP, (SS(0, 4), S(0), IS(0, 2)))


def boxes_of(spec: LoadSpec) -> dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    return {rank: [(r.global_offset, r.sizes) for r in spec.runs(rank)] for rank in spec.mesh.all_ranks()}


@pytest.mark.parametrize(("spec", "groups"), [
    (TOY, 1),  # interleave + FSDP: one replica group
    (LoadSpec.from_placements("e", "e", (10, 4), FSDP_EP_TP, (S(0),), mesh_dims=(("fsdp", "ep", "tp"),)), 1),
    (LoadSpec.from_placements("n", "n", (7,), FSDP_EP_TP, (R(), R(), R())), 8),  # replicated norm: 8 copies
    (LoadSpec.from_placements("q", "q", (9, 2), MeshSpec((4, 2)), (SS(0, 2), S(0))), 1),  # uneven FSDP, empty rank
    (LoadSpec.from_placements("z", "z", (0, 3), MeshSpec((2,)), (S(0),)), 1),  # zero elements
    (LoadSpec.from_placements("s", "s", (), MeshSpec((3,)), (R(),)), 3),  # scalar on every rank
])
def test_real_layouts_are_exact(spec: LoadSpec, groups: int) -> None:
    report = spec.coverage()
    assert report.ok and bool(report)
    assert (report.holes, report.overlaps, report.hole_elements, report.overlap_elements) == ((), (), 0, 0)
    assert report.replica_groups == groups
    assert report.ranks == spec.mesh.size
    assert str(report).startswith("exact: ")
    assert repr(report) == f"CoverageReport({spec.name!r}, exact, replica_groups={groups})"


def test_planted_hole() -> None:
    boxes = boxes_of(TOY)
    boxes[5] = []  # rank 5 = (fsdp 1, ep 0, tp 1) held rows 6-7
    report = check_coverage("w13", (16, 4), boxes, [tuple(range(8))])
    assert not report.ok and not bool(report)
    assert report.hole_elements == 8 and report.overlap_elements == 0
    assert report.holes == (Box((6, 0), (2, 4), (), 0),)
    assert "NOT exact" in str(report) and "8 elements held by no rank" in str(report)
    assert "hole [6:8, 0:4] (replica group 0)" in str(report)
    assert repr(report) == "CoverageReport('w13', holes=8, overlaps=0, replica_groups=1)"


def test_planted_overlap() -> None:
    boxes = boxes_of(TOY)
    boxes[2] = boxes[2] + boxes[7]  # rank 2 also claims rank 7's rows 14-15
    report = check_coverage("w13", (16, 4), boxes, [tuple(range(8))])
    assert report.hole_elements == 0 and report.overlap_elements == 8
    assert report.overlaps == (Box((14, 0), (2, 4), (2, 7), 0),)
    assert "overlap [14:16, 0:4] held by ranks [2, 7] (replica group 0)" in str(report)


def test_hole_and_overlap_are_reported_in_their_replica_group() -> None:
    # HSDP (rep=2, fsdp=4): 8 rows, 2 per fsdp rank; group 1 = ranks 4..7
    spec = LoadSpec.from_placements("w", "w", (8, 2), MeshSpec((2, 4), ("rep", "fsdp")), (R(), S(0)))
    boxes = boxes_of(spec)
    boxes[4] = boxes[4] + boxes[5]  # rank 4 also claims rank 5's rows 2-3 ...
    boxes[5] = [((3, 0), (1, 2))]  # ... and rank 5 keeps only row 3
    boxes[1] = []  # group 0 loses rows 2-3
    report = check_coverage("w", (8, 2), boxes, spec.replica_groups())
    assert report.overlap_elements == 2  # row 3, twice in group 1
    assert report.overlaps == (Box((3, 0), (1, 2), (4, 5), 1),)
    assert report.hole_elements == 4  # rows 2-3 in group 0
    assert report.holes == (Box((2, 0), (2, 2), (), 0),)


def test_boxes_held_in_another_group_do_not_count() -> None:
    # the same full copy in two replica groups is fine; missing it in one group is a hole there only
    full = [((0, 0), (4, 4))]
    assert check_coverage("t", (4, 4), {0: full, 1: full}, [(0,), (1,)]).ok
    report = check_coverage("t", (4, 4), {0: full}, [(0,), (1,)])
    assert report.hole_elements == 16
    assert report.holes == (Box((0, 0), (4, 4), (), 1),)


def test_empty_boxes_are_ignored_and_scalars_count_once() -> None:
    assert check_coverage("t", (4,), {0: [((0,), (4,))], 1: [((4,), (0,))]}, [(0, 1)]).ok
    assert check_coverage("s", (), {0: [((), ())]}, [(0,)]).ok
    hole = check_coverage("s", (), {}, [(0,)])
    assert hole.hole_elements == 1 and hole.holes == (Box((), (), (), 0),)
    twice = check_coverage("s", (), {0: [((), ())], 1: [((), ())]}, [(0, 1)])
    assert twice.overlap_elements == 1 and twice.overlaps == (Box((), (), (0, 1), 0),)


def test_report_lists_at_most_eight_boxes_but_counts_everything() -> None:
    # 20 single-row holes (every other row of 40)
    boxes = {0: [((2 * i, 0), (1, 3)) for i in range(20)]}
    report = check_coverage("t", (40, 3), boxes, [(0,)])
    assert report.hole_elements == 20 * 3
    assert len(report.holes) == 8


def test_three_d_overlap_volume() -> None:
    boxes = {0: [((0, 0, 0), (2, 3, 4))], 1: [((1, 1, 1), (1, 2, 3))]}
    report = check_coverage("t", (2, 3, 4), boxes, [(0, 1)])
    assert report.overlap_elements == 1 * 2 * 3
    assert report.hole_elements == 0
    assert all(b.ranks == (0, 1) for b in report.overlaps)
