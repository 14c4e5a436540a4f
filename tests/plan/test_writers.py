"""Writer assignment: which rank writes which HF key, balanced by bytes, capped and spread."""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

from tests.run.support import layout_of, spec
from workbench import _compat
from workbench.mesh import MeshSpec
from workbench.plan.policy import SavePolicy
from workbench.plan.save_plan import plan_hf_save
from workbench.plan.writers import assign_writers, key_holders, key_nbytes, writer_pool
from workbench.run.simulated import SimulatedWorld, plan_save

SS = _compat.make_strided_shard


@pytest.mark.parametrize(
    ("ranks", "max_writers", "pool"),
    [
        (range(8), 2, (0, 4)),  # two writers, half a world apart (different hosts)
        (range(8), 3, (0, 2, 5)),
        (range(8), 4, (0, 2, 4, 6)),
        (range(8), None, tuple(range(8))),  # no cap
        (range(8), 8, tuple(range(8))),
        (range(8), 100, tuple(range(8))),  # a cap above the world is no cap
        (range(8), 0, (0,)),  # at least one writer
        ([7, 3, 5, 1], 2, (1, 5)),  # sorted first
        ([4], 3, (4,)),
    ],
)
def test_writer_pool_spreads_writers(ranks, max_writers, pool) -> None:
    assert writer_pool(list(ranks), max_writers) == pool


def loads(assignment: dict[str, int], key_bytes: dict[str, int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for key, rank in assignment.items():
        out[rank] = out.get(rank, 0) + key_bytes[key]
    return out


@pytest.mark.parametrize(
    ("sizes", "world"),
    [
        ([100] * 16, 4),  # equal keys: 4 each
        ([1000, 10, 10, 10, 10, 10, 10, 10], 4),  # one huge key: the others avoid its rank
        ([7, 5, 5, 4, 4, 3, 3, 2, 2, 1], 3),
        ([64, 32, 16, 8, 4, 2, 1, 1], 8),
        (list(range(1, 30)), 5),
    ],
)
def test_assignment_is_balanced_by_bytes(sizes: list[int], world: int) -> None:
    key_bytes = {f"key{i:02d}": b for i, b in enumerate(sizes)}
    everyone = tuple(range(world))
    assignment = assign_writers(dict.fromkeys(key_bytes, everyone), key_bytes)
    assert set(assignment) == set(key_bytes)
    per_rank = loads(assignment, key_bytes)
    busiest, idlest = max(per_rank.values()), min(per_rank.get(r, 0) for r in everyone)
    # largest-first greedy: the busiest writer exceeds the idlest by at most one key
    assert busiest - idlest <= max(sizes)
    assert busiest <= sum(sizes) / world + max(sizes)
    if len(sizes) >= world:
        assert set(per_rank) == set(everyone)  # never all on rank 0


def test_max_writers_caps_and_spreads_the_writers() -> None:
    key_bytes = {f"k{i}": 10 + i for i in range(20)}
    everyone = tuple(range(8))
    assignment = assign_writers(dict.fromkeys(key_bytes, everyone), key_bytes, max_writers=2)
    assert set(assignment.values()) == {0, 4}
    per_rank = loads(assignment, key_bytes)
    assert abs(per_rank[0] - per_rank[4]) <= max(key_bytes.values())


def test_keys_go_only_to_ranks_that_hold_them() -> None:
    holders = {"a": (2, 3), "b": (2, 3), "c": (0, 1), "d": (5,)}
    key_bytes = {"a": 8, "b": 8, "c": 8, "d": 8}
    assignment = assign_writers(holders, key_bytes, world=range(8))
    assert assignment["a"] in (2, 3) and assignment["b"] in (2, 3) and assignment["a"] != assignment["b"]
    assert assignment["c"] in (0, 1) and assignment["d"] == 5
    # a cap whose pool misses every holder of a key falls back to the holders
    capped = assign_writers(holders, key_bytes, max_writers=2, world=range(8))  # pool (0, 4)
    assert capped["c"] == 0 and capped["a"] in (2, 3) and capped["d"] == 5


def test_assignment_does_not_depend_on_dict_order() -> None:
    sizes = [5, 5, 5, 3, 3, 8, 1, 1, 1, 13, 2]
    key_bytes = {f"k{i}": b for i, b in enumerate(sizes)}
    holders = {k: tuple(range(4)) if i % 3 else (1, 2) for i, k in enumerate(key_bytes)}
    reference = assign_writers(holders, key_bytes, max_writers=3)
    shuffler = random.Random(0)
    for _ in range(5):
        order = list(key_bytes)
        shuffler.shuffle(order)
        assert assign_writers({k: holders[k] for k in order}, {k: key_bytes[k] for k in reversed(order)},
                              max_writers=3) == reference


def test_key_holders_and_key_bytes_from_plans() -> None:
    mesh = MeshSpec((2, 2), ("fsdp", "ep"))
    s = spec("w", [f"k{i}" for i in range(4)], (8, 3), mesh, [SS(0, 2), Shard(0)], fused_dim=0)
    plans = {r: (plan_hf_save(s, r, SavePolicy.preserve("ep"), runtime_dtype=torch.bfloat16),) for r in range(4)}
    # ep 0 = ranks 0, 2 hold k0, k1; ep 1 = ranks 1, 3 hold k2, k3
    assert key_holders(plans) == {"k0": (0, 2), "k1": (0, 2), "k2": (1, 3), "k3": (1, 3)}
    assert key_nbytes(plans[1][0]) == {"k2": 2 * 3 * 2, "k3": 2 * 3 * 2}
    full = plan_hf_save(s, 0, runtime_dtype=torch.float32, fp32_keys_pattern="k3", dtype=torch.bfloat16)
    assert key_nbytes(full) == {"k0": 12, "k1": 12, "k2": 12, "k3": 24}


def test_full_save_spreads_writers_over_the_world_and_honours_max_writers() -> None:
    mesh = MeshSpec((2, 4), ("fsdp", "tp"))
    specs = [spec(f"p{i}", f"p{i}.weight", (8, 4 + i), mesh, [Shard(0), Shard(1)]) for i in range(12)]
    layout = layout_of(mesh, *specs)
    writers = plan_save(layout).writers
    assert len(set(writers.values())) == 8
    capped = plan_save(layout, max_writers=3).writers
    assert set(capped.values()) == {0, 2, 5}
    # the simulated save hands every rank exactly its keys
    gen = torch.Generator().manual_seed(0)
    hf = {f"p{i}.weight": torch.randn(8, 4 + i, generator=gen) for i in range(12)}
    world = SimulatedWorld(mesh)
    written = world.save(layout, world.load(layout, hf), max_writers=3)
    assert {r: set(per_rank) for r, per_rank in written.items() if per_rank} == {
        r: {k for k, w in capped.items() if w == r} for r in {0, 2, 5}
    }


def test_preserve_balances_every_ep_groups_keys() -> None:
    # 8 keys over EP=2: ep 0 (ranks 0, 1) holds k0-k3, ep 1 (ranks 2, 3) holds k4-k7, every key 2x2 fp32.
    # Keys rank 0 does not hold get 0 bytes, so all of k4-k7 land on rank 2 and rank 3 writes nothing.
    mesh = MeshSpec((2, 2), ("ep", "fsdp"))
    s = spec("w", [f"k{i}" for i in range(8)], (16, 2), mesh, [SS(0, 2), Shard(0)], mesh_dims=["fsdp", "ep"],
             fused_dim=0)
    writers = plan_save(layout_of(mesh, s), policy=SavePolicy.preserve("ep")).writers
    per_rank = {r: sorted(k for k, w in writers.items() if w == r) for r in range(4)}
    assert [len(per_rank[r]) for r in range(4)] == [2, 2, 2, 2], per_rank
