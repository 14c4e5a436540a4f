"""The proof against the real thing: FSDP2's ``fully_shard`` on a fake process group.

For every rank of the world (one process, the fake process group re-initialized per rank) we build
the TP/EP-local tensor of a global ``arange`` by hand, wrap it as a DTensor parameter, let FSDP2 shard
it, and check that

(a) ``LoadSpec.from_tensor`` on the FSDP2 parameter equals ``LoadSpec.from_placements`` with the
    placements we expect FSDP2 to build (so FSDP2 prepends exactly what normalization assumes), and
(b) the local tensor FSDP2 really keeps equals what ``runs(rank)`` assemble from the global tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from tests.strategies import assemble_local
from workbench import _compat
from workbench.errors import LayoutError
from workbench.layout import InterleavedShard, LoadSpec
from workbench.mesh import MeshSpec

S, R, IS = Shard, Replicate, InterleavedShard

LocalFn = Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]


def SS(dim: int, split_factor: int) -> Any:
    return _compat.make_strided_shard(dim, split_factor)


def run_fsdp2(
    mesh_shape: tuple[int, ...],
    names: tuple[str, ...],
    global_shape: tuple[int, ...],
    *,
    model_dims: tuple[str, ...] | None,
    model_placements: Sequence[Any],
    fsdp_dims: str | tuple[str, ...],
    make_local: LocalFn,
    check: Callable[[int, tuple[int, ...], Any, np.ndarray], None],
) -> None:
    """Shard an ``arange`` tensor with FSDP2 on every rank of ``mesh_shape`` and call ``check``.

    ``check(rank, coordinate, fsdp_param, full)`` runs while the rank's fake process group is alive.
    """
    world = math.prod(mesh_shape)
    full = torch.arange(math.prod(global_shape), dtype=torch.float32).reshape(global_shape)
    for rank in range(world):
        with _compat.fake_process_group(rank, world):
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
            coord = tuple(mesh.get_coordinate())
            local = make_local(full, coord).contiguous()
            if model_dims is None:
                param = nn.Parameter(local.clone())
            else:
                param = nn.Parameter(
                    DTensor.from_local(local, mesh[model_dims], tuple(model_placements), run_check=False,
                                       shape=full.shape, stride=full.stride())
                )
            module = nn.Module()
            module.w = param
            _compat.fully_shard(module, mesh=mesh[fsdp_dims])
            shard_dim = fsdp_dims if isinstance(fsdp_dims, str) else fsdp_dims[-1]
            assert _compat.fsdp_shard_mesh_dims(module) == {shard_dim}  # what Layout.from_model reads
            check(rank, coord, module.w, full.numpy().astype(np.int64))


def assert_matches_fsdp2(
    rank: int, p: Any, full: np.ndarray, mesh: MeshSpec, expected_placements: Sequence[Any]
) -> LoadSpec:
    """(a) and (b) of the module docstring; returns the spec."""
    # the FSDP2 mesh dim is known (Layout.from_model reads it from the module): its cut goes last whatever
    # split factor this torch wrote (2.13 counts interleaved inner cuts, 2.11 does not)
    hint = tuple(n for n in mesh.dim_names if n in ("fsdp", "shard"))
    ours = LoadSpec.from_tensor("w", "w", p, fsdp_mesh_dims=hint)
    expected = LoadSpec.from_placements("w", "w", tuple(p.shape), mesh, expected_placements, fsdp_mesh_dims=hint)
    assert ours == expected, (rank, tuple(p.placements))
    real_local = p.to_local().detach().numpy().astype(np.int64)
    assert np.array_equal(assemble_local(ours, rank, full), real_local), (rank, ours.describe_shards())
    return ours


def rows(local: Any, width: int) -> list[int]:
    return [int(v) // width for v in local[:, 0].tolist()]


# -- expert TP under FSDP2: the 16-row example ----------------------------------------------------
def _expert_tp_local(full: torch.Tensor, coord: tuple[int, ...]) -> torch.Tensor:
    _, e, t = coord
    ep_local = torch.chunk(full, 2, dim=0)[e]  # EP: one expert (gate 4 + up 4 rows) per ep rank
    gate, up = torch.chunk(ep_local, 2, dim=0)  # the F=2 stripes on the rank
    return torch.cat([torch.chunk(gate, 2)[t], torch.chunk(up, 2)[t]])  # ETP: each tp rank halves both


EXPERT_ROWS = {
    (0, 0, 0): [0, 1], (0, 0, 1): [2, 3], (0, 1, 0): [8, 9], (0, 1, 1): [10, 11],
    (1, 0, 0): [4, 5], (1, 0, 1): [6, 7], (1, 1, 0): [12, 13], (1, 1, 1): [14, 15],
}


def test_fsdp2_over_expert_tp() -> None:
    mesh = MeshSpec((2, 2, 2), ("fsdp", "ep", "tp"))
    seen: dict[tuple[int, ...], list[int]] = {}

    def check(rank: int, coord: tuple[int, ...], p: Any, full: np.ndarray) -> None:
        # torch 2.13 writes sf=4 (EP x the interleaved ETP); torch 2.11 leaves the interleaved cut out: sf=2
        assert _compat.is_strided_shard(p.placements[0]) and _compat.strided_split_factor(p.placements[0]) in (2, 4)
        spec = assert_matches_fsdp2(rank, p, full, mesh, (SS(0, 4), S(0), IS(0, 2)))
        assert spec.describe_shards() == "S(0)@ep -> IS(0,2)@tp -> S(0)@fsdp"
        seen[coord] = rows(p.to_local(), 3)

    run_fsdp2((2, 2, 2), ("fsdp", "ep", "tp"), (16, 3), model_dims=("ep", "tp"),
              model_placements=(S(0), IS(0, 2)), fsdp_dims="fsdp", make_local=_expert_tp_local, check=check)
    assert seen == EXPERT_ROWS


def test_fsdp2_over_row_parallel_experts() -> None:
    # w2: EP on dim 0, TP on dim 1 (uneven 5 cols -> 3, 2); FSDP2 on dim 0 after EP -> _StridedShard(0, 2)
    mesh = MeshSpec((2, 2, 2), ("fsdp", "ep", "tp"))

    def local(full: torch.Tensor, coord: tuple[int, ...]) -> torch.Tensor:
        return torch.chunk(torch.chunk(full, 2, dim=0)[coord[1]], 2, dim=1)[coord[2]]

    def check(rank: int, coord: tuple[int, ...], p: Any, full: np.ndarray) -> None:
        spec = assert_matches_fsdp2(rank, p, full, mesh, (SS(0, 2), S(0), S(1)))
        assert spec.describe_shards() == "S(0)@ep -> S(1)@tp -> S(0)@fsdp"

    run_fsdp2((2, 2, 2), ("fsdp", "ep", "tp"), (6, 5), model_dims=("ep", "tp"), model_placements=(S(0), S(1)),
              fsdp_dims="fsdp", make_local=local, check=check)


# -- uneven: FSDP2 chunks the TP-local tensor (pytorch issue 168134) ------------------------------
UNEVEN_ROWS = {
    # tp rank 0 holds rows 0-4, FSDP2 splits them 2,2,1,0; tp rank 1 holds rows 5-8, split 1,1,1,1
    (0, 0): [0, 1], (1, 0): [2, 3], (2, 0): [4], (3, 0): [],
    (0, 1): [5], (1, 1): [6], (2, 1): [7], (3, 1): [8],
}


def test_fsdp2_uneven_tp_chunks_the_tp_local_tensor() -> None:
    mesh = MeshSpec((4, 2), ("fsdp", "tp"))
    seen: dict[tuple[int, ...], list[int]] = {}
    torch_opinion: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def check(rank: int, coord: tuple[int, ...], p: Any, full: np.ndarray) -> None:
        spec = assert_matches_fsdp2(rank, p, full, mesh, (SS(0, 2), S(0)))
        assert spec.local_shape(rank) == tuple(p.to_local().shape)
        seen[coord] = rows(p.to_local(), 2)
        torch_opinion[coord] = _compat.torch_local_shape_and_offset((9, 2), (4, 2), coord, p.placements)

    run_fsdp2((4, 2), ("fsdp", "tp"), (9, 2), model_dims=("tp",), model_placements=(S(0),), fsdp_dims="fsdp",
              make_local=lambda full, c: torch.chunk(full, 2)[c[1]], check=check)
    assert seen == UNEVEN_ROWS
    # pytorch issue 168134: torch's _compute_local_shape_and_global_offset claims (fsdp 3, tp 0) holds
    # row 8, but FSDP2 gives that rank nothing (and row 8 really lives on (fsdp 3, tp 1)). If a torch
    # release fixes the helper, this assertion flips: then drop it and keep the FSDP2 comparison.
    assert torch_opinion[(3, 0)] == ((1, 2), (8, 0))
    assert UNEVEN_ROWS[(3, 0)] == []


# -- HSDP ----------------------------------------------------------------------------------------
def test_hsdp_plain_parameter() -> None:
    # fully_shard on a 2-D (replicate, shard) mesh: 7 rows over 3 shard ranks -> 3,3,1 in each replica
    mesh = MeshSpec((2, 3), ("rep", "fsdp"))

    def check(rank: int, coord: tuple[int, ...], p: Any, full: np.ndarray) -> None:
        spec = assert_matches_fsdp2(rank, p, full, mesh, (R(), S(0)))
        assert spec.replica_groups() == ((0, 1, 2), (3, 4, 5))
        assert spec.coverage().ok

    run_fsdp2((2, 3), ("rep", "fsdp"), (7, 2), model_dims=None, model_placements=(), fsdp_dims=("rep", "fsdp"),
              make_local=lambda full, c: full, check=check)


@pytest.mark.parametrize(("tp_placement", "fsdp_placement", "local_of"), [
    # column-parallel TP on dim 0, uneven (7 rows -> 4, 3; FSDP 2,2 and 2,1): FSDP2 prepends _StridedShard
    (S(0), SS(0, 2), lambda full, t: torch.chunk(full, 2, dim=0)[t]),
    # row-parallel TP on dim 1: FSDP2 keeps a plain Shard(0)
    (S(1), S(0), lambda full, t: torch.chunk(full, 2, dim=1)[t]),
])
def test_hsdp_over_tp(tp_placement: Any, fsdp_placement: Any, local_of: Any) -> None:
    mesh = MeshSpec((2, 2, 2), ("rep", "fsdp", "tp"))

    def check(rank: int, coord: tuple[int, ...], p: Any, full: np.ndarray) -> None:
        spec = assert_matches_fsdp2(rank, p, full, mesh, (R(), fsdp_placement, tp_placement))
        assert spec.replica_groups() == ((0, 1, 2, 3), (4, 5, 6, 7))

    run_fsdp2((2, 2, 2), ("rep", "fsdp", "tp"), (7, 4), model_dims=("tp",), model_placements=(tp_placement,),
              fsdp_dims=("rep", "fsdp"), make_local=lambda full, c: local_of(full, c[2]), check=check)


def test_plain_fsdp_uneven_with_empty_rank() -> None:
    # no TP: 3 rows over 4 FSDP ranks -> 1,1,1,0
    mesh = MeshSpec((4,), ("fsdp",))

    def check(rank: int, coord: tuple[int, ...], p: Any, full: np.ndarray) -> None:
        spec = assert_matches_fsdp2(rank, p, full, mesh, (S(0),))
        assert spec.local_shape(rank) == ((0 if rank == 3 else 1), 5)

    run_fsdp2((4,), ("fsdp",), (3, 5), model_dims=None, model_placements=(), fsdp_dims="fsdp",
              make_local=lambda full, c: full, check=check)


# -- interleave over a size-1 tp mesh dim (ETP=1) ----------------------------------------------------
def _check_interleave_on_size_one_tp_dim(mesh_shape: tuple[int, int, int], rows_total: int) -> None:
    failures: list[str] = []

    def local(full: torch.Tensor, coord: tuple[int, ...]) -> torch.Tensor:
        return torch.chunk(full, mesh_shape[1], dim=0)[coord[1]]  # tp=1: the interleave keeps everything

    def check(rank: int, coord: tuple[int, ...], p: Any, full: np.ndarray) -> None:
        try:
            spec = LoadSpec.from_tensor("w13", "w13", p, fsdp_mesh_dims=("fsdp",))
        except LayoutError as exc:
            failures.append(f"rank {rank}: {exc}")
            return
        assert np.array_equal(assemble_local(spec, rank, full), p.to_local().detach().numpy().astype(np.int64))

    run_fsdp2(mesh_shape, ("fsdp", "ep", "tp"), (rows_total, 1), model_dims=("ep", "tp"),
              model_placements=(S(0), IS(0, 2)), fsdp_dims="fsdp", make_local=local, check=check)
    assert not failures, failures[0]


def test_fsdp2_over_interleave_on_size_one_tp_dim() -> None:
    # EP=2, ETP=1, FSDP=8 on 16 rows: FSDP2 prepends _StridedShard(0, 2), which must go after the
    # size-1 interleave too (each rank holds 1 row, fewer than the F=2 stripes)
    _check_interleave_on_size_one_tp_dim((8, 2, 1), 16)


def test_fsdp2_plain_shard_over_interleave_on_size_one_mesh() -> None:
    # EP=ETP=1, FSDP=2 on 2 rows: split factor 1, so FSDP2's placements are
    # (Shard(0), Shard(0), InterleavedShard(0, 2)) and its plain Shard stacks first; the size-1
    # interleave must then accept the FSDP-local length 1 (FSDP2 really holds row f on fsdp rank f)
    _check_interleave_on_size_one_tp_dim((2, 1, 1), 2)
