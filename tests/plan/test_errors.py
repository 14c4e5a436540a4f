"""Every refusal names what is wrong and where: the parameter, the rank (when it matters) and the shapes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from tests.run.support import layout_of, spec
from workbench import _compat
from workbench.errors import LayoutError, PlanError, WorkbenchError
from workbench.layout import InterleavedShard
from workbench.mesh import MeshSpec
from workbench.plan.load_plan import plan_hf_load
from workbench.plan.policy import SavePolicy
from workbench.plan.save_plan import plan_hf_save
from workbench.plan.schedule import schedule_unshard
from workbench.run.executor import unshard
from workbench.run.load_ops import execute_load, reader_from_tensors
from workbench.run.simulated import SimulatedWorld

SS = _compat.make_strided_shard
MESH = MeshSpec((2, 2), ("ep", "tp"))
E4 = [f"e{i}" for i in range(4)]


def uneven_interleave() -> None:
    # 10 rows, F=3 over tp=2: needs a multiple of 6
    spec("experts.w13", "w13", (10, 4), MESH, [Replicate(), InterleavedShard(0, 3)])


def uneven_interleave_after_uneven_cut() -> None:
    # 10 rows over ep=2 -> 5 each; IS(0,2) over tp=2 needs a multiple of 4
    spec("experts.w13", "w13", (10, 4), MESH, [Shard(0), InterleavedShard(0, 2)])


def partial_placement() -> None:
    spec("lm_head", "lm_head", (8, 4), MESH, [Shard(0), Partial()])


def misaligned_preserve() -> None:
    # 3 keys of 4 rows over ep=2: chunk 6 -> rank 2 (ep 1) holds rows [6, 12): the second half of key 1
    s = spec("experts.w2", ["d0", "d1", "d2"], (12, 2), MESH, [Shard(0), Replicate()], fused_dim=0)
    plan_hf_save(s, MESH.rank_at((1, 0)), SavePolicy.preserve("ep"))


def keep_inner_undo_outer() -> None:
    s = spec("experts.w13", E4, (8, 2), MESH, [Shard(0), Shard(0)], fused_dim=0)  # S(0)@ep -> S(0)@tp
    plan_hf_save(s, 0, SavePolicy.gather_only("ep"))


def world_save_wrong_local() -> None:
    layout = layout_of(MESH, spec("mlp.down", "down", (6, 5), MESH, [Shard(0), Shard(1)]))
    world = SimulatedWorld(MESH)
    loaded = world.load(layout, {"down": torch.zeros(6, 5)})
    loaded[3]["mlp.down"] = torch.zeros(3, 3)  # rank 3 = (ep 1, tp 1) holds (3, 2)
    world.save(layout, loaded)


def executor_wrong_local() -> None:
    plan = plan_hf_save(spec("mlp.up", "up", (6, 5), MESH, [Shard(0), Shard(1)]), 2)  # (3, 3)
    next(unshard(schedule_unshard([plan]), [plan], {"mlp.up": torch.zeros(3, 2)}))


def load_wrong_local() -> None:
    plan = plan_hf_load(spec("mlp.gate", "gate", (6, 5), MESH, [Shard(0), Shard(1)]), 1)  # (3, 2)
    execute_load(plan, reader_from_tensors({"gate": torch.zeros(6, 5)}), torch.empty(2, 3))


def checkpoint_key_shape() -> None:
    plan_hf_load(spec("experts.w13", E4, (8, 2), MESH, [Shard(0), Replicate()], fused_dim=0), 0,
                 {"e2": (2, 3)})


ERRORS: list[tuple[Callable[[], None], type, str]] = [
    # uneven interleave: names the parameter, the cut, N, W and F
    (uneven_interleave, LayoutError,
     r"parameter 'experts.w13': shard IS\(0,3\)@tp needs dim 0 length N=10 to be a multiple of W\*F=2\*3=6"),
    # the interleave sees the local length left by the contiguous cut before it
    (uneven_interleave_after_uneven_cut, LayoutError,
     r"parameter 'experts.w13': shard IS\(0,2\)@tp needs dim 0 length N=5 to be a multiple of W\*F=2\*2=4"),
    # Partial: names the parameter and the mesh dim, says what to do
    (partial_placement, LayoutError, r"parameter 'lm_head': placement .* on mesh dim 'tp' is Partial.*Reduce first"),
    # misaligned preserve: parameter, rank, rows and key size
    (misaligned_preserve, PlanError,
     r"parameter 'experts.w2', rank 2: keeping S\(0\)@ep leaves fused-dim rows \[6, 12\) .*each of the 3 keys "
     r"has 4 rows on dim 0"),
    # a policy keeping an inner cut while undoing the outer one on the same dim
    (keep_inner_undo_outer, PlanError,
     r"parameter 'experts.w13': policy gather_only\(ep\) keeps S\(0\)@tp but undoes S\(0\)@ep"),
    # wrong local shapes: parameter, rank, both shapes
    (world_save_wrong_local, PlanError,
     r"parameter 'mlp.down', rank 3: local tensor has shape \(3, 3\), but the plan expects \(3, 2\)"),
    (executor_wrong_local, PlanError,
     r"parameter 'mlp.up', rank 2: local tensor has shape \(3, 2\), but the plan expects \(3, 3\)"),
    (load_wrong_local, PlanError,
     r"parameter 'mlp.gate', rank 1: local tensor has shape \(2, 3\), the plan expects \(3, 2\)"),
    # a checkpoint key of the wrong shape: parameter, key, both shapes
    (checkpoint_key_shape, PlanError,
     r"parameter 'experts.w13': HF key 'e2' has shape \(2, 3\) in the checkpoint, but the layout expects \(2, 2\)"),
]


@pytest.mark.parametrize(("make", "kind", "message"), ERRORS, ids=[e[0].__name__ for e in ERRORS])
def test_error_names_parameter_rank_and_shapes(make: Callable[[], None], kind: type, message: str) -> None:
    with pytest.raises(kind, match=message) as info:
        make()
    assert isinstance(info.value, WorkbenchError)  # every refusal is a ValueError subclass of ours
