"""``plan_save_within_writers``: the plan ``save_hf`` runs under ``max_writers``, whose every writer is an allowed
rank; the allowed ranks are ``writer_pool``'s (spread over the world, rank 0 first)."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard

import workbench as wb
from workbench.errors import PlanError
from workbench.plan.save_set import plan_save, plan_save_within_writers

MESH = wb.MeshSpec((2, 2), ("ep", "fsdp"))  # ep coordinate = rank // 2; experts: 2 keys per EP rank, columns over fsdp
EXPERT_KEYS = [f"experts.{e}.weight" for e in range(4)]


def layout() -> wb.Layout:
    specs = {
        "experts": wb.LoadSpec.from_placements("experts", EXPERT_KEYS, (16, 4), MESH, [Shard(0), Shard(1)],
                                               fused_dim=0),
        "norm": wb.LoadSpec.from_placements("norm", "norm.weight", (4,), MESH, [Replicate(), Replicate()]),
    }
    return wb.Layout(MESH, specs, {"experts": "bfloat16", "norm": "float32"})


def test_minimal_keeps_its_plan_when_the_allowed_writers_hold_every_key() -> None:
    # 2 writers: ranks 0 and 2, one per EP group, so each group's experts have an allowed holder
    plan_set = plan_save_within_writers(layout(), policy=wb.SavePolicy.minimal(), max_writers=2)
    assert plan_set.policy == wb.SavePolicy.minimal()
    assert set(plan_set.writers.values()) <= {0, 2}
    assert {plan_set.writers[k] for k in EXPERT_KEYS[2:]} == {2}  # experts 2-3 live on ep 1: ranks 2, 3


def test_minimal_gathers_as_full_when_no_allowed_writer_holds_a_kept_key() -> None:
    plain = plan_save(layout(), policy=wb.SavePolicy.minimal(), max_writers=1)
    assert {plain.writers[k] for k in EXPERT_KEYS[2:]} == {2, 3}  # plan_save alone: holders outside the pool (0,)
    plan_set = plan_save_within_writers(layout(), policy=wb.SavePolicy.minimal(), max_writers=1)
    assert plan_set.policy == wb.SavePolicy.full()
    assert set(plan_set.writers.values()) == {0}
    assert set(plan_set.writers) == set(plain.writers)  # the same keys: the same checkpoint


def test_preserve_refuses_a_key_no_allowed_writer_holds() -> None:
    with pytest.raises(PlanError) as info:
        plan_save_within_writers(layout(), policy=wb.SavePolicy.preserve("ep"), max_writers=1)
    message = str(info.value)
    assert "max_writers=1" in message and "[0]" in message
    assert "'experts.2.weight'" in message and "[2, 3]" in message


@pytest.mark.parametrize("max_writers", [None, 4, 9])
def test_no_cap_changes_nothing(max_writers) -> None:
    for policy in (wb.SavePolicy.minimal(), wb.SavePolicy.preserve("ep"), wb.SavePolicy.full()):
        capped = plan_save_within_writers(layout(), policy=policy, max_writers=max_writers)
        assert capped is plan_save(layout(), policy=policy, max_writers=max_writers)  # the cached plan itself
