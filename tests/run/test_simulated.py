"""SimulatedWorld end to end: who writes what, policies on real-shaped layouts, errors, known bugs."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from tests.run.support import assert_same, layout_of, random_tensor, spec
from workbench import _compat, load_layout
from workbench.errors import PlanError
from workbench.layout import InterleavedShard
from workbench.mesh import MeshSpec
from workbench.plan.policy import SavePolicy
from workbench.run.simulated import SimulatedWorld, plan_save

SS = _compat.make_strided_shard


def random_hf(layout, seed: int = 0) -> dict[str, torch.Tensor]:
    from workbench.plan.load_plan import expected_key_shape

    gen = torch.Generator().manual_seed(seed)
    return {k: random_tensor(expected_key_shape(s), layout.dtype(n), gen) for n, s in layout.specs.items()
            for k in s.hf_keys}


def merged(written: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    counts = collections.Counter(k for per_rank in written.values() for k in per_rank)
    assert all(c == 1 for c in counts.values()), counts
    return {k: v for per_rank in written.values() for k, v in per_rank.items()}


def test_toy_sample_round_trips_under_every_policy() -> None:
    layout = load_layout("sample_meshes/toy_expert_tp.toml")
    hf = random_hf(layout)
    world = SimulatedWorld(layout.mesh)
    loaded = world.load(layout, hf)
    for policy in (SavePolicy.full(), SavePolicy.preserve("ep")):
        for budget in (None, 0, 64):
            out = merged(world.save(layout, loaded, policy=policy, budget_bytes=budget))
            assert set(out) == set(hf)
            for key, tensor in out.items():
                assert_same(tensor, hf[key], f"{key} under {policy}, budget {budget}")


def test_gather_only_output_is_keyed_by_parameter_on_every_rank() -> None:
    mesh = MeshSpec((2, 2), ("fsdp", "ep"))
    s = spec("experts", ["e0", "e1", "e2", "e3"], (8, 2), mesh, [SS(0, 2), Shard(0)], fused_dim=0)
    layout = layout_of(mesh, s)
    full = torch.arange(16.0).reshape(8, 2)
    hf = {f"e{i}": full[2 * i : 2 * i + 2] for i in range(4)}
    world = SimulatedWorld(mesh)
    out = world.save(layout, world.load(layout, hf), policy=SavePolicy.gather_only("fsdp"))
    for rank in mesh.all_ranks():
        ep = mesh.group_rank(rank, "ep")
        assert list(out[rank]) == ["experts"]
        assert torch.equal(out[rank]["experts"], full[4 * ep : 4 * ep + 4])


@pytest.mark.parametrize("policy", [SavePolicy.full(), SavePolicy.preserve("tp")])
def test_custom_rank_order_round_trips(policy: SavePolicy) -> None:
    # a DeviceMesh over a permutation of the world: group membership follows the rank array, not rank numbers
    mesh = MeshSpec((2, 3), ("fsdp", "tp"), ranks=(5, 3, 1, 0, 2, 4))
    layout = layout_of(
        mesh,
        spec("w", ["a", "b", "c"], (9, 4), mesh, [SS(0, 3), Shard(0)], fused_dim=0),
        spec("v", "v", (5, 7), mesh, [Shard(1), Shard(0)]),
    )
    hf = random_hf(layout, seed=3)
    world = SimulatedWorld(mesh)
    loaded = world.load(layout, hf)
    assert torch.equal(loaded[5]["w"], hf["a"][:2])  # rank 5 = (fsdp 0, tp 0): rows [0, 2)
    out = merged(world.save(layout, loaded, policy=policy, budget_bytes=50))
    assert set(out) == set(hf)
    for key, tensor in out.items():
        assert_same(tensor, hf[key], key)


def test_writers_hold_only_their_own_keys() -> None:
    mesh = MeshSpec((4,), ("fsdp",))
    layout = layout_of(mesh, *(spec(f"p{i}", f"p{i}", (6, 2), mesh, [Shard(0)]) for i in range(8)))
    plan_set = plan_save(layout)
    world = SimulatedWorld(mesh)
    written = world.save(layout, world.load(layout, random_hf(layout)))
    for rank, per_rank in written.items():
        assert set(per_rank) == {k for k, w in plan_set.writers.items() if w == rank}
        assert len(per_rank) == 2  # 8 equal keys over 4 ranks


@pytest.mark.parametrize(
    ("global_rows", "origin_rows", "ep"),
    [
        (3, 3, 4),  # 3 keys of 1 row over EP=4 (chunk 1): rank 3 holds nothing
        (16, 12, 4),  # 3 keys of 4 rows padded to 16 over EP=4: rank 3 holds padding only
    ],
)
def test_preserve_with_a_rank_holding_no_key(global_rows: int, origin_rows: int, ep: int) -> None:
    mesh = MeshSpec((ep,), ("ep",))
    s = spec("experts", ["k0", "k1", "k2"], (global_rows, 2), mesh, [Shard(0)], fused_dim=0,
             origin_shape=(origin_rows, 2))
    layout = layout_of(mesh, s)
    hf = random_hf(layout)
    world = SimulatedWorld(mesh)
    # expected: ranks 0-2 write one key each, rank 3 writes nothing
    # got: RuntimeError "chunk expects `chunks` to be greater than 0, got: 0" from split_keys on rank 3
    written = world.save(layout, world.load(layout, hf), policy=SavePolicy.preserve("ep"))
    assert {r: list(per_rank) for r, per_rank in written.items()} == {0: ["k0"], 1: ["k1"], 2: ["k2"], 3: []}


@pytest.mark.parametrize(
    ("shape", "rank", "cols"),
    [
        # Llama's o_proj/down_proj ["S(0)", "S(1)"]: FSDP Shard(0) then TP Shard(1); layer-wise weight transfer
        # gathers FSDP and keeps TP. Rank 1 = (fsdp 0, tp 1) should get every row of columns [2, 4).
        ((4, 4), 1, slice(2, 4)),
        # uneven FSDP rows (3 + 2): rank 2 = (fsdp 1, tp 0) should get every row of columns [0, 3)
        ((5, 6), 2, slice(0, 3)),
    ],
)
def test_gather_only_with_a_kept_cut_applied_after_a_gathered_one(shape, rank, cols) -> None:
    mesh = MeshSpec((2, 2), ("fsdp", "tp"))
    s = spec("o_proj", "o_proj.weight", shape, mesh, [Shard(0), Shard(1)])
    assert s.describe_shards() == "S(0)@fsdp -> S(1)@tp"
    layout = layout_of(mesh, s)
    full = torch.arange(float(shape[0] * shape[1])).reshape(shape)
    world = SimulatedWorld(mesh)
    # got: PlanError "after unsharding the tensor has shape (4, 4), expected (4, 2)": the FSDP step's
    # shape_before is (4, 4) (taken before the TP cut), so the (2, 2) local is zero-padded to (2, 4) and sent
    out = world.save(layout, world.load(layout, {"o_proj.weight": full}), policy=SavePolicy.gather_only("fsdp"))
    assert torch.equal(out[rank]["o_proj"], full[:, cols])


def test_preserve_with_a_kept_fused_cut_applied_after_a_gathered_one() -> None:
    # keys k0, k1 fused on dim 0; TP cuts dim 1 first, EP cuts dim 0 after it. preserve("ep") gathers TP and
    # keeps EP: EP rank e should write key k<e> whole.
    mesh = MeshSpec((2, 2), ("tp", "ep"))
    s = spec("w", ["k0", "k1"], (4, 4), mesh, [Shard(1), Shard(0)], fused_dim=0)
    assert s.describe_shards() == "S(1)@tp -> S(0)@ep"
    layout = layout_of(mesh, s)
    full = torch.arange(16.0).reshape(4, 4)
    hf = {"k0": full[:2], "k1": full[2:]}
    world = SimulatedWorld(mesh)
    # got: PlanError "parameter 'w', rank 0: after unsharding the tensor has shape (4, 4), expected (2, 4)"
    out = merged(world.save(layout, world.load(layout, hf), policy=SavePolicy.preserve("ep")))
    assert torch.equal(out["k0"], hf["k0"]) and torch.equal(out["k1"], hf["k1"])


# -- errors ---------------------------------------------------------------------------------------------------
def _tiny() -> tuple[MeshSpec, object]:
    mesh = MeshSpec((2, 2), ("fsdp", "tp"))
    return mesh, layout_of(mesh, spec("attn.qkv", "qkv", (5, 4), mesh, [SS(0, 2), Shard(0)]),
                           spec("norm", "norm", (4,), mesh, [Shard(0), Replicate()]))


def test_save_with_a_wrong_local_shape_names_parameter_rank_and_shapes() -> None:
    mesh, layout = _tiny()
    world = SimulatedWorld(mesh)
    loaded = world.load(layout, random_hf(layout))
    assert tuple(loaded[1]["attn.qkv"].shape) == (1, 4)  # TP 1 holds rows [3,5); FSDP 0 of those: row 3
    loaded[1]["attn.qkv"] = torch.zeros(2, 4)
    with pytest.raises(PlanError, match=r"parameter 'attn.qkv', rank 1: local tensor has shape \(2, 4\), but the "
                                        r"plan expects \(1, 4\)"):
        world.save(layout, loaded)


def test_load_and_save_check_the_mesh_and_the_keys() -> None:
    mesh, layout = _tiny()
    other = SimulatedWorld(MeshSpec((4,), ("fsdp",)))
    with pytest.raises(PlanError, match=r"layout 'test' is on MeshSpec\(fsdp=2, tp=2\), this world is "
                                        r"MeshSpec\(fsdp=4\)"):
        other.load(layout, random_hf(layout))
    hf = random_hf(layout)
    del hf["norm"]
    with pytest.raises(PlanError, match=r"1 HF key\(s\) of 'test' are missing, e.g. \['norm'\]"):
        SimulatedWorld(mesh).load(layout, hf)
    hf = random_hf(layout)
    hf["norm"] = torch.zeros(5)
    with pytest.raises(PlanError, match=r"parameter 'norm': HF key 'norm' has shape \(5,\) in the checkpoint, but "
                                        r"the layout expects \(4,\)"):
        SimulatedWorld(mesh).load(layout, hf)


def test_interleaved_layout_loads_exactly() -> None:
    # (fsdp=2, ep=2, tp=2) toy: every rank's rows match the InterleavedShard docstring example
    mesh = MeshSpec((2, 2), ("ep", "tp"))
    layout = layout_of(mesh, spec("w13", "w13", (16, 1), mesh, [Shard(0), InterleavedShard(0, 2)]))
    loaded = SimulatedWorld(mesh).load(layout, {"w13": torch.arange(16.0).reshape(16, 1)})
    rows = {r: loaded[r]["w13"].flatten().tolist() for r in mesh.all_ranks()}
    assert rows == {0: [0, 1, 4, 5], 1: [2, 3, 6, 7], 2: [8, 9, 12, 13], 3: [10, 11, 14, 15]}


def test_a_schedule_that_would_hang_is_reported_as_a_deadlock() -> None:
    # rank 1 believes the tensor is replicated (no gather at all), so its fsdp peer waits forever
    from workbench.layout import LoadSpec
    from workbench.layout.model_layout import Layout

    mesh = MeshSpec((2,), ("fsdp",))
    sharded = Layout(mesh, {"w": LoadSpec.from_placements("w", "w", (4, 2), mesh, [Shard(0)])})
    replicated = Layout(mesh, {"w": LoadSpec.from_placements("w", "w", (4, 2), mesh, [Replicate()])})
    plan_set = plan_save(sharded)
    lonely = plan_save(replicated, ranks=[1])
    plan_set.plans._values[1] = lonely.plans[1]
    plan_set.schedules[1] = lonely.schedules[1]
    world = SimulatedWorld(mesh)
    locals_by_rank = {0: {"w": torch.zeros(2, 2)}, 1: {"w": torch.zeros(4, 2)}}
    with pytest.raises(PlanError, match=r"would deadlock: 1 rank\(s\) wait .*rank 0 on wave 0 round 0  fsdp"):
        world.run_save(plan_set, locals_by_rank)


def test_planning_lives_in_plan_and_run_simulated_re_exports_it() -> None:
    # io/hf/save.py and older callers import plan_save, SavePlanSet, key_meta and key_sizes from here
    from workbench.plan import save_set
    from workbench.run import simulated

    for name in ("plan_save", "SavePlanSet", "key_meta", "key_sizes"):
        assert getattr(simulated, name) is getattr(save_set, name), name
        assert getattr(simulated, name).__module__ == "workbench.plan.save_set", name
