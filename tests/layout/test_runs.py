"""Runs: the boxes a rank holds, contiguous both globally and locally, N-D, on any dim."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from torch.distributed.tensor.placement_types import Replicate, Shard

from tests.strategies import assemble_local, global_array
from workbench import _compat
from workbench.layout import InterleavedShard, LoadSpec, Run, compute_runs
from workbench.layout.runs import cut_segments, dim_segments, runs_from_segments
from workbench.mesh import MeshSpec

S, R, IS = Shard, Replicate, InterleavedShard


def SS(dim: int, split_factor: int) -> Any:
    return _compat.make_strided_shard(dim, split_factor)


def rows_held(runs: tuple[Run, ...]) -> list[int]:
    """Global rows (dim 0) a rank holds, in local order."""
    out: list[int] = []
    for run in runs:
        out.extend(range(run.global_offset[0], run.global_offset[0] + run.sizes[0]))
    return out


# -- the 16-row worked example ------------------------------------------------------------------
EP_TP = MeshSpec((2, 2), ("ep", "tp"))
EXPERT_TP = LoadSpec.from_placements("w13", "w13", (16, 4), EP_TP, (S(0), IS(0, 2)))


@pytest.mark.parametrize(("coord", "rows"), [
    ((0, 0), [0, 1, 4, 5]),  # gate rows 0-1 and up rows 0-1 of expert 0
    ((0, 1), [2, 3, 6, 7]),  # gate rows 2-3 and up rows 2-3 of expert 0
    ((1, 0), [8, 9, 12, 13]),  # expert 1, first halves
    ((1, 1), [10, 11, 14, 15]),  # expert 1, second halves
])
def test_expert_tp_rows(coord: tuple[int, int], rows: list[int]) -> None:
    rank = EP_TP.rank_at(coord)
    runs = EXPERT_TP.runs(rank)
    assert rows_held(runs) == rows
    # two runs of 2 full-width rows, at local rows 0 and 2
    assert runs == (
        Run((rows[0], 0), (2, 4), (0, 0)),
        Run((rows[2], 0), (2, 4), (2, 0)),
    )
    assert EXPERT_TP.local_shape(rank) == (4, 4)


FSDP_EP_TP = MeshSpec((2, 2, 2), ("fsdp", "ep", "tp"))
FSDP_EXPERT_TP = LoadSpec.from_placements("w13", "w13", (16, 4), FSDP_EP_TP, (SS(0, 4), S(0), IS(0, 2)))


@pytest.mark.parametrize(("coord", "rows"), [
    ((0, 0, 0), [0, 1]),  # FSDP half 0 of (ep 0, tp 0)'s rows [0,1,4,5]
    ((0, 0, 1), [2, 3]),
    ((0, 1, 0), [8, 9]),
    ((0, 1, 1), [10, 11]),
    ((1, 0, 0), [4, 5]),  # FSDP half 1 of (ep 0, tp 0): not rows 2-3, FSDP cuts the ETP-local tensor
    ((1, 0, 1), [6, 7]),
    ((1, 1, 0), [12, 13]),
    ((1, 1, 1), [14, 15]),
])
def test_expert_tp_under_fsdp_rows(coord: tuple[int, int, int], rows: list[int]) -> None:
    rank = FSDP_EP_TP.rank_at(coord)
    assert FSDP_EXPERT_TP.describe_shards() == "S(0)@ep -> IS(0,2)@tp -> S(0)@fsdp"
    assert FSDP_EXPERT_TP.runs(rank) == (Run((rows[0], 0), (2, 4), (0, 0)),)  # back to a single run


def test_xtuner_case_ep_etp_fsdp_composition() -> None:
    # EP rank 1 keeps [16, 32); ETP rank 1 (F=2) keeps [20, 24) and [28, 32); FSDP half 0 keeps [20, 24)
    spec = LoadSpec.from_placements("w", "w", (32, 2), FSDP_EP_TP, (SS(0, 4), S(0), IS(0, 2)))
    assert spec.runs(FSDP_EP_TP.rank_at((0, 1, 1))) == (Run((20, 0), (4, 2), (0, 0)),)


def test_segments_of_the_docstring_example() -> None:
    assert EXPERT_TP.segments(EP_TP.rank_at((1, 0))) == (((8, 2), (12, 2)), ((0, 4),))


# -- N-D runs, any dim --------------------------------------------------------------------------
RUN_CASES = [
    # (shape, mesh shape, placements, coord, expected runs), one edge per row
    pytest.param(
        (6, 10), (2, 3), (S(0), S(1)), (1, 2), [Run((3, 8), (3, 2), (0, 0))], id="2d-grid-uneven-last-col",
    ),
    pytest.param(
        (4, 8), (2, 2), (S(0), IS(1, 2)), (1, 1), [Run((2, 2), (2, 2), (0, 0)), Run((2, 6), (2, 2), (0, 2))],
        id="interleave-on-dim1",
    ),
    pytest.param(
        (8, 8), (2, 2), (IS(0, 2), IS(1, 2)), (0, 0),
        [
            Run((0, 0), (2, 2), (0, 0)),
            Run((0, 4), (2, 2), (0, 2)),
            Run((4, 0), (2, 2), (2, 0)),
            Run((4, 4), (2, 2), (2, 2)),
        ],
        id="interleave-both-dims-cartesian-product-row-major",
    ),
    pytest.param(
        (12, 1), (3, 2), (SS(0, 2), IS(0, 2)), (1, 0), [Run((2, 0), (1, 1), (0, 0)), Run((6, 0), (1, 1), (1, 0))],
        id="fsdp-chunk-straddles-interleave-boundary",
    ),
    pytest.param(
        (12, 1), (3, 2), (SS(0, 2), IS(0, 2)), (2, 0), [Run((7, 0), (2, 1), (0, 0))],
        id="fsdp-chunk-inside-second-stripe",
    ),
    pytest.param((9, 2), (1,), (IS(0, 3),), (0,), [Run((0, 0), (9, 2), (0, 0))], id="interleave-world-1-merges"),
    pytest.param((3, 2), (4,), (S(0),), (3,), [], id="empty-trailing-rank-no-runs"),
    pytest.param((0, 4), (2,), (S(0),), (0,), [], id="zero-length-dim"),
    pytest.param((3, 5), (2,), (R(),), (1,), [Run((0, 0), (3, 5), (0, 0))], id="replicated-whole-tensor"),
    pytest.param((2, 3, 8), (2,), (S(2),), (1,), [Run((0, 0, 4), (2, 3, 4), (0, 0, 0))], id="3d-last-dim"),
    pytest.param(
        (9, 2), (4, 2), (SS(0, 2), S(0)), (3, 0), [], id="uneven-fsdp-empty-rank-where-torch-says-row-8",
    ),
    pytest.param(
        (9, 2), (4, 2), (SS(0, 2), S(0)), (3, 1), [Run((8, 0), (1, 2), (0, 0))], id="uneven-fsdp-last-row",
    ),
]


@pytest.mark.parametrize(("shape", "mesh_shape", "placements", "coord", "expected"), RUN_CASES)
def test_runs(shape, mesh_shape, placements, coord, expected) -> None:
    mesh = MeshSpec(mesh_shape)
    spec = LoadSpec.from_placements("w", "w", shape, mesh, placements)
    rank = mesh.rank_at(coord)
    assert list(spec.runs(rank)) == expected
    assert compute_runs(shape, mesh, placements, rank) == spec.runs(rank)
    # the runs fill the local tensor exactly: local shape = extent of the local boxes
    local = assemble_local(spec, rank, global_array(shape))
    assert (local >= 0).all()
    assert sum(r.numel for r in expected) == int(np.prod(spec.local_shape(rank)))


def test_scalar_tensor_is_one_empty_run() -> None:
    spec = LoadSpec.from_placements("s", "s", (), MeshSpec((2,)), (R(),))
    assert spec.runs(1) == (Run((), (), ()),)
    assert spec.runs(1)[0].numel == 1
    assert spec.local_shape(1) == ()


def test_compute_runs_with_flattened_mesh_dims() -> None:
    # the toy's embedding: 10 rows over fsdp+ep+tp (8 ranks) -> 2,2,2,2,2,0,0,0
    sizes = [
        sum(r.sizes[0] for r in compute_runs((10, 4), FSDP_EP_TP, (S(0),), rank, mesh_dims=(("fsdp", "ep", "tp"),)))
        for rank in range(8)
    ]
    assert sizes == [2, 2, 2, 2, 2, 0, 0, 0]
    # a tensor on the tp sub-mesh: ranks that differ only on fsdp/ep hold the same rows
    assert compute_runs((4, 2), FSDP_EP_TP, (S(0),), 5, mesh_dims=("tp",)) == (Run((2, 0), (2, 2), (0, 0)),)


# -- segment helpers ------------------------------------------------------------------------------
@pytest.mark.parametrize(("segments", "intervals", "expected"), [
    (((0, 4), (8, 4)), [(2, 6)], ((2, 2), (8, 2))),  # an interval spanning two segments splits
    (((0, 2), (2, 2)), [(0, 4)], ((0, 4),)),  # neighbours contiguous in both spaces merge
    (((0, 4), (8, 4)), [(0, 1), (5, 8)], ((0, 1), (9, 3))),  # several intervals
    (((0, 4),), [], ()),  # nothing kept
    (((10, 3),), [(0, 3)], ((10, 3),)),  # keep all, offset preserved
])
def test_cut_segments(segments, intervals, expected) -> None:
    assert cut_segments(segments, intervals) == expected


def test_dim_segments_and_runs_from_segments() -> None:
    from workbench.layout import ShardDescriptor

    cuts = [(ShardDescriptor(0, "ep"), 2, 1), (ShardDescriptor(0, "tp", 2), 2, 0)]
    assert dim_segments(16, cuts) == ((8, 2), (12, 2))
    assert dim_segments(0, cuts[:1]) == ()
    runs = runs_from_segments((((8, 2), (12, 2)), ((0, 3),)))
    assert runs == (Run((8, 0), (2, 3), (0, 0)), Run((12, 0), (2, 3), (2, 0)))


def test_run_helpers() -> None:
    run = Run((4, 0), (2, 3), (2, 0))
    assert run.numel == 6
    assert run.global_slices() == (slice(4, 6), slice(0, 3))
    assert run.local_slices() == (slice(2, 4), slice(0, 3))
    assert str(run) == "global[4:6, 0:3] -> local[2:4, 0:3]"
