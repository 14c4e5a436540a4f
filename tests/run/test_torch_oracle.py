"""Cross-check against torch itself: DTensor.full_tensor() under LocalTensorMode on small meshes.

LocalTensorMode (torch.distributed._local_tensor, reached through workbench._compat) runs every rank of a
fake process group in this one process; ``full_tensor()`` then runs torch's own redistribute (its
all-gathers, its unpadding, its strided-shard reassembly). For each layout below, the locals are given to
both torch and SimulatedWorld.save; both must rebuild the original tensor. For plain Shard/Replicate
layouts the locals come from torch's ``distribute_tensor``, so the load side is checked against torch too.

_StridedShard rows are even only: for uneven strided shards torch's literal semantics differ from what
FSDP2 stores (pytorch issue 168134), and workbench follows FSDP2.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from tests.run.support import assert_same, layout_of, random_tensor, spec
from workbench import _compat
from workbench.mesh import MeshSpec
from workbench.run.simulated import SimulatedWorld

if _compat.local_tensor_mode(1) is None:  # pragma: no cover - depends on the torch build
    pytest.skip("this torch has no torch.distributed._local_tensor.LocalTensorMode", allow_module_level=True)

from torch.distributed._local_tensor import LocalTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

SS = _compat.make_strided_shard

CASES = [
    # (mesh shape, global shape, placements, dtype)
    ((4,), (10, 3), (Shard(0),), torch.float32),  # uneven rows 3,3,3,1
    ((4,), (3, 5), (Shard(1),), torch.bfloat16),  # uneven columns 2,2,1,0 (an empty rank)
    ((3,), (2, 2), (Shard(0),), torch.int64),  # 1,1,0: one rank holds nothing
    ((2, 2), (6, 5), (Shard(0), Shard(1)), torch.float16),  # 2-D: rows over m0, uneven columns over m1
    ((2, 2), (7, 4), (Replicate(), Shard(0)), torch.float32),  # HSDP: replicate outer, uneven shard inner
    ((2, 2), (5, 3), (Shard(0), Shard(0)), torch.float32),  # the same dim cut twice, uneven (3,2 -> 2,1,1,1)
    ((2, 2), (8, 3), (SS(0, 2), Shard(0)), torch.bfloat16),  # FSDP2 over TP: TP first, FSDP chunks it
    ((2, 3), (12, 2), (SS(0, 3), Shard(0)), torch.float32),  # FSDP2 over TP with W_tp=3
    ((2, 2, 2), (16, 3), (SS(0, 4), Shard(0), Shard(0)), torch.float32),  # FSDP2 over EP x TP on one dim
    ((2, 2, 2), (8, 4), (SS(1, 2), Shard(0), Shard(1)), torch.bfloat16),  # FSDP2 on dim 1 over TP(dim 1), EP(dim 0)
]


def _torch_full(mesh_shape: tuple[int, ...], placements: tuple[Any, ...], locals_by_rank: dict[int, torch.Tensor],
                global_shape: tuple[int, ...], full: torch.Tensor | None) -> tuple[dict[int, torch.Tensor], ...]:
    """(torch's full_tensor() per rank from our locals, torch's distribute_tensor locals or {})."""
    world = math.prod(mesh_shape)
    names = tuple(f"m{i}" for i in range(len(mesh_shape)))
    stride = tuple(math.prod(global_shape[i + 1 :]) for i in range(len(global_shape)))
    with _compat.fake_process_group(0, world), _compat.local_tensor_mode(world):
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        local = LocalTensor({r: t.clone() for r, t in locals_by_rank.items()})
        dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(global_shape), stride=stride)
        rebuilt = dt.full_tensor()
        gathered = {r: rebuilt._local_tensors[r].clone() for r in range(world)}
        distributed = {}
        if full is not None:
            shards = distribute_tensor(full, mesh, placements)._local_tensor
            distributed = {r: shards._local_tensors[r].clone() for r in range(world)}
    return gathered, distributed


@pytest.mark.parametrize(("mesh_shape", "global_shape", "placements", "dtype"), CASES)
def test_simulated_save_matches_torch_full_tensor(mesh_shape, global_shape, placements, dtype) -> None:
    mesh = MeshSpec(mesh_shape, tuple(f"m{i}" for i in range(len(mesh_shape))))
    layout = layout_of(mesh, spec("w", "w.weight", global_shape, mesh, placements),
                       dtypes={"w": str(dtype).removeprefix("torch.")})
    full = random_tensor(global_shape, dtype, torch.Generator().manual_seed(sum(global_shape)))
    world = SimulatedWorld(mesh)
    ours = {r: t["w"] for r, t in world.load(layout, {"w.weight": full}).items()}
    plain = not any(_compat.is_strided_shard(p) for p in placements)
    torch_full, torch_locals = _torch_full(mesh_shape, placements, ours, global_shape, full if plain else None)
    for rank, local in torch_locals.items():  # torch's own sharding agrees with our load plans
        assert_same(ours[rank], local, f"rank {rank} local vs distribute_tensor")
    written = world.save(layout, {r: {"w": t} for r, t in ours.items()})
    (saved,) = [t["w.weight"] for t in written.values() if t]
    for rank, rebuilt in torch_full.items():
        assert_same(rebuilt, full, f"torch full_tensor on rank {rank}")
    assert_same(saved, full, "SimulatedWorld save")
