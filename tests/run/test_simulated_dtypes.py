"""SimulatedWorld with a layout that gives no dtypes (built from LoadSpecs): the real tensors' dtypes are used, never
float32; and under ``max_writers`` it writes what ``save_hf`` writes (every key by an allowed writer)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import workbench as wb
from tests.run.support import assert_same
from workbench.errors import LayoutError, PlanError
from workbench.run.simulated import SimulatedWorld

MESH = wb.MeshSpec((2,), ("fsdp",))


def _layout() -> wb.Layout:
    specs = {"w": wb.LoadSpec.from_placements("w", ["w"], (4, 3), MESH, [Shard(0)]),
             "n": wb.LoadSpec.from_placements("n", ["n"], (3,), MESH, [Replicate()])}
    return wb.Layout(MESH, specs)  # no dtypes


def _hf() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(12).reshape(4, 3).to(torch.bfloat16), "n": torch.tensor([1.5, -2.0, 3.25]).half()}


def _locals() -> dict[int, dict[str, torch.Tensor]]:
    w, n = _hf()["w"], _hf()["n"]
    return {r: {"w": w[2 * r:2 * r + 2].clone(), "n": n.clone()} for r in range(2)}  # torch.chunk of 4 rows over 2


@pytest.mark.parametrize("policy", [wb.SavePolicy.full(), wb.SavePolicy.minimal()])
def test_save_writes_each_tensor_in_its_own_dtype(policy) -> None:
    written = SimulatedWorld(MESH).save(_layout(), _locals(), policy=policy)
    out = {k: v for per_rank in written.values() for k, v in per_rank.items()}
    assert out.keys() == {"w", "n"}
    for key, want in _hf().items():
        assert_same(out[key], want, key)  # was float32 for both


def test_save_keeps_fp32_patterns_and_explicit_casts() -> None:
    written = SimulatedWorld(MESH).save(_layout(), _locals(), policy=wb.SavePolicy.full(), fp32_keys_pattern="^n$")
    out = {k: v for per_rank in written.values() for k, v in per_rank.items()}
    assert out["n"].dtype == torch.float32 and out["w"].dtype == torch.bfloat16


def test_load_makes_local_tensors_of_the_checkpoint_dtype() -> None:
    loaded = SimulatedWorld(MESH).load(_layout(), _hf())
    for rank, want in _locals().items():
        for name in ("w", "n"):
            assert_same(loaded[rank][name], want[name], f"rank {rank} {name}")  # were float32 copies


def test_ranks_that_hold_a_parameter_in_different_dtypes_are_refused() -> None:
    locals_ = _locals()
    locals_[1]["n"] = locals_[1]["n"].float()
    with pytest.raises(PlanError, match=r"parameter 'n' is float16 on rank 0 but float32 on rank 1"):
        SimulatedWorld(MESH).save(_layout(), locals_)
    del locals_[1]
    with pytest.raises(PlanError, match=r"no local tensors for rank 1 of"):
        SimulatedWorld(MESH).save(_layout(), locals_)


def test_a_given_dtype_that_disagrees_with_the_tensors_is_refused() -> None:
    layout = wb.Layout(MESH, _layout().specs, {"w": "float32"})
    with pytest.raises(LayoutError, match=r"'w': the layout says float32, the tensor is bfloat16"):
        SimulatedWorld(MESH).save(layout, _locals())


def test_max_writers_gives_every_key_to_an_allowed_writer() -> None:
    # experts over ep (kept whole by minimal) and columns over fsdp; max_writers=1 lets only rank 0 write, which
    # holds none of experts 2-3: save_hf then gathers as full, and so must the simulation
    mesh = wb.MeshSpec((2, 2), ("ep", "fsdp"))
    keys = [f"experts.{e}.weight" for e in range(4)]
    spec = wb.LoadSpec.from_placements("experts", keys, (16, 4), mesh, [Shard(0), Shard(1)], fused_dim=0)
    layout = wb.Layout(mesh, {"experts": spec})
    full = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    locals_ = {r: {"experts": full[8 * (r // 2):8 * (r // 2) + 8, 2 * (r % 2):2 * (r % 2) + 2].clone()}
               for r in range(4)}
    written = SimulatedWorld(mesh).save(layout, locals_, policy=wb.SavePolicy.minimal(), max_writers=1)
    assert {r for r, keys_ in written.items() if keys_} == {0}  # plan_save alone gave experts 2-3 to ranks 2, 3
    for e, key in enumerate(keys):
        assert torch.equal(written[0][key], full[4 * e:4 * e + 4]), key
