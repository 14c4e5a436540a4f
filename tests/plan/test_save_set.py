"""plan_save: geometry sharing gives exactly what planning every rank and parameter gives; the plan cache."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Shard

from tests.run.support import geometries, layout_of, layouts, moe_layouts, spec
from tests.strategies import fsdp_layouts
from workbench import _compat, load_layout
from workbench.errors import PlanError
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec
from workbench.plan.policy import SavePolicy
from workbench.plan.save_plan import plan_hf_save, save_dtypes
from workbench.plan.save_set import (
    SavePlanSet,
    clear_plan_cache,
    layout_fingerprint,
    plan_cache_info,
    plan_save,
    save_key_holders,
    saved_layout,
)
from workbench.plan.schedule import schedule_unshard
from workbench.plan.writers import assign_writers, key_holders

SAMPLES = Path(__file__).resolve().parents[2] / "sample_meshes"
SS = _compat.make_strided_shard


# -- the slow path plan_save replaced: every rank, every parameter, planned from scratch ---------------------
def slow_plans(layout: Layout, rank: int, policy: SavePolicy, **options) -> tuple:
    return tuple(plan_hf_save(s, rank, policy, runtime_dtype=layout.dtype(n), **options)
                 for n, s in layout.specs.items())


def slow_key_bytes(layout: Layout, **options) -> dict[str, int]:
    out = {}
    for name, s in layout.specs.items():
        shape = list(s.origin_shape or s.global_shape)
        if s.fused_dim is not None:
            shape[s.fused_dim] //= len(s.hf_keys)
        for key, d in zip(s.hf_keys, save_dtypes(s.hf_keys, layout.dtype(name), **options)):
            out[key] = math.prod(shape) * d.itemsize
    return out


def slow_writers(layout: Layout, policy: SavePolicy, max_writers: int | None, **options) -> dict[str, int]:
    """The writer map as plan_save computed it before geometry sharing: holders from every rank's plans."""
    if policy.mode == "gather_only":
        return {}
    everyone = layout.mesh.all_ranks()
    sizes = slow_key_bytes(layout, **options)
    if policy.mode == "full":
        holders = dict.fromkeys(sizes, everyone)
    else:
        holders = key_holders({r: slow_plans(layout, r, policy, **options) for r in everyone})
    return assign_writers(holders, sizes, max_writers=max_writers, world=everyone)


def assert_same_as_slow_path(layout: Layout, policy: SavePolicy, *, max_writers: int | None = None,
                             ranks: tuple[int, ...] = (), budget: int | None = None, **options) -> SavePlanSet:
    """plan_save's writers (same keys, ranks and order), plans and schedules equal the slow path's; or both
    raise the same PlanError."""
    try:  # the requested ranks first, then every rank in mesh order, as plan_save did
        for r in ranks:
            slow_plans(layout, r, policy, **options)
        want = slow_writers(layout, policy, max_writers, **options)
    except PlanError as exc:
        with pytest.raises(PlanError) as got:
            plan_save(layout, ranks=ranks or None, policy=policy, max_writers=max_writers, cache=False,
                      **_opts(options))
        assert str(got.value) == str(exc)
        return None  # type: ignore[return-value]
    fast = plan_save(layout, ranks=ranks or None, policy=policy, max_writers=max_writers, budget_bytes=budget,
                     cache=False, **_opts(options))
    assert list(fast.writers.items()) == list(want.items())
    runtime = {n: layout.dtype(n) for n in layout}
    for r in ranks:
        plans = slow_plans(layout, r, policy, **options)
        assert fast.plans[r] == plans, r
        assert fast.schedules[r].structure() == schedule_unshard(plans, runtime, budget).structure(), r
    assert fast.key_bytes == slow_key_bytes(layout, **options)
    return fast


def _opts(options: dict) -> dict:
    return {"dtype": options.get("dtype"), "fp32_keys_pattern": options.get("fp32_keys_pattern")}


def with_copies(layout: Layout, copies: int, rank_array: tuple[int, ...] | None = None) -> Layout:
    """The layout plus ``copies`` renamed clones of every parameter (same geometry, other keys): the layers of
    a model, which plan_save plans once per geometry. ``rank_array``: put it on a mesh of that rank order."""
    mesh = layout.mesh if rank_array is None else MeshSpec(layout.mesh.shape, layout.mesh.dim_names, rank_array)
    specs = {}
    dtypes = dict(layout.dtypes)
    for c in range(-1, copies):
        for name, s in layout.specs.items():
            new = name if c < 0 else f"c{c}.{name}"
            specs[new] = LoadSpec(name=new, hf_keys=tuple(k if c < 0 else f"c{c}.{k}" for k in s.hf_keys),
                                  global_shape=s.global_shape, mesh=mesh, shards=s.shards, fused_dim=s.fused_dim,
                                  origin_shape=s.origin_shape)
            if name in layout.dtypes:
                dtypes[new] = layout.dtypes[name]
    return Layout(mesh, specs, dtypes, name=layout.name)


# -- equivalence on the samples -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "policy", "max_writers"),
    [
        ("toy_expert_tp", SavePolicy.minimal(), None),  # EP kept, ETP gathered: 4 holders per expert key
        ("toy_expert_tp", SavePolicy.preserve("ep"), 3),
        ("llama3_8b", SavePolicy.minimal(), None),  # nothing fused across ranks: every rank holds every key
        ("qwen3_30b_a3b", SavePolicy.minimal(), 5),  # 128 experts over EP=8, writers capped
        ("gpt_oss_120b", SavePolicy.preserve("ep"), None),
    ],
)
def test_sample_writers_equal_the_every_rank_path(name: str, policy: SavePolicy, max_writers) -> None:
    layout = load_layout(SAMPLES / f"{name}.toml")
    assert_same_as_slow_path(layout, policy, max_writers=max_writers, ranks=(0, layout.mesh.size - 1),
                             budget=1 << 30)


# -- equivalence on random layouts ---------------------------------------------------------------------------
POLICIES = st.sampled_from([SavePolicy.minimal(), SavePolicy.full(), SavePolicy.preserve("m1"),
                            SavePolicy.preserve("m0"), SavePolicy.gather_only("m0")])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_layouts_equal_the_every_rank_path(data: st.DataObject) -> None:
    layout = data.draw(layouts(data.draw(geometries(), label="params"), max_ranks=24), label="layout")
    rank_array = data.draw(st.one_of(st.none(), st.permutations(range(layout.mesh.size)).map(tuple)), label="ranks")
    layout = with_copies(layout, data.draw(st.integers(0, 2), label="copies"), rank_array)
    policy = data.draw(POLICIES, label="policy")
    if policy.mesh_dims and policy.mesh_dims[0] not in layout.mesh.dim_names:
        policy = SavePolicy.minimal()
    pattern = data.draw(st.sampled_from([None, r"k1$", r"^c0\."]), label="fp32 pattern")
    rank = data.draw(st.integers(0, layout.mesh.size - 1), label="rank")
    assert_same_as_slow_path(layout, policy, max_writers=data.draw(st.sampled_from([None, 1, 2, 5])),
                             ranks=(rank,), dtype=data.draw(st.sampled_from([None, torch.bfloat16])),
                             fp32_keys_pattern=pattern)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe=moe_layouts(), copies=st.integers(0, 2), policy=st.sampled_from(
    [SavePolicy.minimal(), SavePolicy.preserve("ep"), SavePolicy.full()]), max_writers=st.sampled_from([None, 3]))
def test_moe_layouts_equal_the_every_rank_path(moe, copies: int, policy: SavePolicy, max_writers) -> None:
    layout = with_copies(moe[0], copies)
    assert_same_as_slow_path(layout, policy, max_writers=max_writers, ranks=(0, layout.mesh.size - 1),
                             fp32_keys_pattern=r"e1\.up")


@settings(max_examples=30, deadline=None)
@given(fsdp=fsdp_layouts(max_mesh_size=4, max_len=12), copies=st.integers(0, 2))
def test_fsdp_layouts_equal_the_every_rank_path(fsdp, copies: int) -> None:
    layout = with_copies(layout_of(fsdp.mesh, fsdp.spec()), copies)
    for policy in (SavePolicy.minimal(), SavePolicy.full()):
        assert_same_as_slow_path(layout, policy, ranks=(fsdp.mesh.size - 1,))


@pytest.mark.parametrize(
    ("ranks", "named"),
    [
        (None, 0),  # row-major mesh: rank 0 = (fsdp 0, ep 0) holds rows [0, 2) of 3-row keys
        ((7, 6, 5, 4, 3, 2, 1, 0), 7),  # reversed rank array: (fsdp 0, ep 0) is rank 7, the first in mesh order
    ],
)
def test_misaligned_preserve_names_the_first_failing_rank_in_mesh_order(ranks, named: int) -> None:
    # 2 keys of 3 rows over ep=4 (chunks of 2 rows): ep 0, 1 and 2 cut a key, ep 3 holds nothing
    mesh = MeshSpec((2, 4), ("fsdp", "ep"), ranks=ranks)
    bad = spec("w", ["k0", "k1"], (6, 2), mesh, [Shard(1), Shard(0)], fused_dim=0)
    good = spec("v", "v", (4, 2), mesh, [Shard(0), Shard(1)])
    layout = layout_of(mesh, good, bad)
    with pytest.raises(PlanError, match=rf"parameter 'w', rank {named}: keeping S\(0\)@ep"):
        save_key_holders(layout, SavePolicy.preserve("ep"))
    empty = mesh.rank_at((0, 3))  # ep 3 holds no row: its own plan is fine, the writer map is not
    assert_same_as_slow_path(layout, SavePolicy.preserve("ep"), ranks=(empty,))  # same message as the slow path


@pytest.mark.parametrize("reverse", [False, True])
def test_holders_equal_every_rank_plans_and_are_interned(reverse: bool) -> None:
    toy = load_layout(SAMPLES / "toy_expert_tp.toml")
    layout = with_copies(toy, 1, tuple(reversed(toy.mesh.all_ranks())) if reverse else None)
    holders = save_key_holders(layout, SavePolicy.minimal())
    everyone = layout.mesh.all_ranks()
    want = key_holders({r: slow_plans(layout, r, SavePolicy.minimal()) for r in everyone})
    assert list(holders.items()) == list(want.items())  # ranks ascending, keys in the same order
    by_value: dict[tuple[int, ...], tuple[int, ...]] = {}
    for ranks in holders.values():
        assert by_value.setdefault(ranks, ranks) is ranks  # equal holder sets are one tuple


# -- the cache ---------------------------------------------------------------------------------------------
def test_repeat_plan_is_served_from_the_cache_and_keyed_on_every_option() -> None:
    clear_plan_cache()
    layout = load_layout(SAMPLES / "toy_expert_tp.toml")
    first = plan_save(layout, ranks=[3], policy=SavePolicy.minimal(), budget_bytes=256)
    assert plan_save(layout, ranks=[3], policy=SavePolicy.minimal(), budget_bytes=256) is first
    # an equal layout built again (another object) hits too: the key is the fingerprint, not the object
    assert plan_save(load_layout(SAMPLES / "toy_expert_tp.toml"), ranks=[3], policy=SavePolicy.minimal(),
                     budget_bytes=256) is first
    info = plan_cache_info()
    assert (info.hits, info.misses, info.size) == (2, 1, 1)
    variants = [
        {"ranks": [2]}, {"policy": SavePolicy.full()}, {"budget_bytes": 512}, {"dtype": torch.float32},
        {"fp32_keys_pattern": "gate"}, {"max_writers": 2},
    ]
    base = {"ranks": [3], "policy": SavePolicy.minimal(), "budget_bytes": 256}
    for change in variants:
        other = plan_save(layout, **{**base, **change})
        assert other is not first, change
        fresh = plan_save(layout, **{**base, **change}, cache=False)
        assert other.writers == fresh.writers and other.schedules == fresh.schedules, change
    assert plan_cache_info().size == 1 + len(variants)


def test_cache_never_serves_another_layout() -> None:
    clear_plan_cache()
    mesh = MeshSpec((2, 2), ("fsdp", "ep"))
    a = layout_of(mesh, spec("w", [f"k{i}" for i in range(4)], (8, 2), mesh, [SS(0, 2), Shard(0)], fused_dim=0))
    b = layout_of(mesh, spec("w", [f"k{i}" for i in range(4)], (8, 3), mesh, [SS(0, 2), Shard(0)], fused_dim=0))
    permuted = MeshSpec((2, 2), ("fsdp", "ep"), ranks=(0, 2, 1, 3))  # same names and shape, other rank order
    c = layout_of(permuted, *(LoadSpec(name=s.name, hf_keys=s.hf_keys, global_shape=s.global_shape, mesh=permuted,
                                       shards=s.shards, fused_dim=s.fused_dim) for s in a.specs.values()))
    d = Layout(mesh, dict(a.specs), {"w": "bfloat16"}, name="test")  # same specs, other dtype
    for ranks in (None, [1]):
        for layout in (a, b, c, d):
            got = plan_save(layout, ranks=ranks, policy=SavePolicy.minimal())
            fresh = plan_save(layout, ranks=ranks, policy=SavePolicy.minimal(), cache=False)
            assert got.writers == fresh.writers and dict(got.schedules) == dict(fresh.schedules)
            assert {r: got.plans[r] for r in got.plans} == {r: fresh.plans[r] for r in fresh.plans}
    assert plan_cache_info().size == 8
    # a layout whose dict was changed in place after its first plan is fingerprinted again
    specs = dict(a.specs)
    e = layout_of(mesh, *specs.values())
    plan_save(e, policy=SavePolicy.full())
    e.specs["w"] = b.specs["w"]  # type: ignore[index]  # mutating a Layout is not supported, but never stale
    assert plan_save(e, policy=SavePolicy.full()).plans[0][0].local_shape == (2, 3)
    assert layout_fingerprint(e) == e.fingerprint() != a.fingerprint()


def test_cache_is_bounded_lru() -> None:
    clear_plan_cache()
    layout = load_layout(SAMPLES / "toy_expert_tp.toml")
    maxsize = plan_cache_info().maxsize
    sets = [plan_save(layout, ranks=[0], budget_bytes=100 + i) for i in range(maxsize + 3)]
    info = plan_cache_info()
    assert info.size == maxsize
    assert plan_save(layout, ranks=[0], budget_bytes=100 + maxsize + 2) is sets[-1]  # newest kept
    assert plan_save(layout, ranks=[0], budget_bytes=100) is not sets[0]  # oldest evicted
    clear_plan_cache()
    assert plan_cache_info().size == 0


def test_plan_set_carries_the_file_plan_inputs() -> None:
    layout = load_layout(SAMPLES / "toy_expert_tp.toml")
    plan_set = plan_save(layout, ranks=[1], policy=SavePolicy.minimal(), dtype=torch.bfloat16,
                         fp32_keys_pattern="gate", cache=False)
    assert set(plan_set.key_meta) == set(layout.hf_keys) == set(plan_set.writers)
    assert plan_set.key_bytes == slow_key_bytes(layout, dtype=torch.bfloat16, fp32_keys_pattern="gate")
    assert {d for k, (d, _) in plan_set.key_meta.items() if "gate" in k} == {torch.float32}


def test_the_saved_layout_gives_each_parameter_the_dtype_its_keys_are_written_in() -> None:
    mesh = MeshSpec((2,), ("fsdp",))
    layout = layout_of(mesh, spec("gate_up", ["gate", "up"], (8, 4), mesh, [Shard(0)], fused_dim=0),
                       spec("norm", "norm", (4,), mesh, [Shard(0)]), spec("proj", "proj", (4, 4), mesh, [Shard(0)]),
                       dtypes={"gate_up": "bfloat16", "norm": "bfloat16", "proj": "bfloat16"})
    unchanged = plan_save(layout, ranks=[0], cache=False).key_meta
    assert saved_layout(layout, unchanged) is layout
    # "gate" alone in float32: its fused parameter has no single dtype on disk; "norm" is float32 there
    meta = plan_save(layout, ranks=[0], fp32_keys_pattern=["gate", "norm"], cache=False).key_meta
    saved = saved_layout(layout, meta)
    assert saved.dtypes == {"norm": "float32", "proj": "bfloat16"}
    assert saved.specs == layout.specs and saved.fingerprint() != layout.fingerprint()
    assert saved_layout(layout, meta) is saved  # a repeat save: the same object, its fingerprint remembered
