"""Round trips through the simulated world: HF tensors -> load into layout A -> save -> load into layout B.

Random layouts (1-3 parameters) on random meshes (1-3 mesh dims of size 1-4) mix TP, EP, expert-TP
interleaves, FSDP2's strided shard, HSDP (Replicate outer), flattened groups, uneven contiguous cuts, keys
fused on dim 0 or dim 1, FP8-style tail padding and six dtypes. HF tensors are random raw bit patterns
(NaNs, infinities, -0.0 included), so every comparison is bitwise. Every loaded local tensor is checked
against an oracle built from plain index arithmetic (tests/run/support.py), padding included.
"""

from __future__ import annotations

import collections

import torch
from hypothesis import event, given, reject, settings
from hypothesis import strategies as st

from tests.run.support import (
    assert_same,
    canonical_tensor,
    geometries,
    hf_checkpoint,
    layouts,
    moe_layouts,
    oracle_dim_indices,
    oracle_kept_output,
    oracle_local,
    padding_mask,
)
from workbench.errors import PlanError
from workbench.layout.model_layout import Layout
from workbench.plan.load_plan import plan_hf_load
from workbench.plan.policy import SavePolicy
from workbench.run.simulated import SimulatedWorld, plan_save

ROUND_TRIP = settings(max_examples=300, deadline=None, derandomize=True)
POLICIES = settings(max_examples=250, deadline=None, derandomize=True)
DTYPES_SAVE = settings(max_examples=80, deadline=None, derandomize=True)


def check_loaded(layout: Layout, hf: dict[str, torch.Tensor], loaded: dict[int, dict[str, torch.Tensor]]) -> None:
    """Every rank's every local equals the oracle; padding elements (no read lands there) are zero."""
    for name, spec in layout.specs.items():
        canonical = canonical_tensor(spec, hf, layout.dtype(name))
        for rank in layout.mesh.all_ranks():
            local = loaded[rank][name]
            assert_same(local, oracle_local(spec, rank, canonical), f"{name} rank {rank}")
            mask = padding_mask(plan_hf_load(spec, rank))
            # the padding the plan leaves unread is exactly the oracle's out-of-visible positions
            beyond = torch.zeros(spec.local_shape(rank), dtype=torch.bool)
            for dim in range(len(spec.global_shape)):
                held = torch.tensor(oracle_dim_indices(spec, rank, dim), dtype=torch.int64)
                shape = [1] * len(spec.global_shape)
                shape[dim] = -1
                beyond |= (held >= spec.visible_shape[dim]).view(shape).expand_as(beyond)
            assert torch.equal(mask, beyond), f"{name} rank {rank}: padding mask"
            assert_same(local[mask], torch.zeros_like(local[mask]), f"{name} rank {rank}: padding is +0")


def check_written_once(written: dict[int, dict[str, torch.Tensor]], hf: dict[str, torch.Tensor]) -> None:
    """The union of what the ranks write holds every HF key exactly once, bit for bit."""
    counts = collections.Counter(k for per_rank in written.values() for k in per_rank)
    assert set(counts) == set(hf), f"missing {set(hf) - set(counts)}, unexpected {set(counts) - set(hf)}"
    assert all(c == 1 for c in counts.values()), {k: c for k, c in counts.items() if c != 1}
    for rank, per_rank in written.items():
        for key, tensor in per_rank.items():
            assert_same(tensor, hf[key], f"{key} written by rank {rank}")


def union(written: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: v for per_rank in written.values() for k, v in per_rank.items()}


@ROUND_TRIP
@given(st.data())
def test_full_save_round_trip_and_reload_into_another_layout(data: st.DataObject) -> None:
    geoms = data.draw(geometries(), label="params")
    layout_a = data.draw(layouts(geoms), label="layout A")
    layout_b = data.draw(layouts(geoms), label="layout B")
    hf = hf_checkpoint(geoms, data.draw(st.integers(0, 2**31 - 1), label="seed"))
    budget = data.draw(st.one_of(st.none(), st.integers(0, 2048)), label="budget")
    max_writers = data.draw(st.one_of(st.none(), st.integers(1, 4)), label="max_writers")

    world_a = SimulatedWorld(layout_a.mesh)
    loaded_a = world_a.load(layout_a, hf)
    check_loaded(layout_a, hf, loaded_a)

    written = world_a.save(layout_a, loaded_a, budget_bytes=budget, max_writers=max_writers)
    check_written_once(written, hf)
    writers = {rank for rank, keys in written.items() if keys}
    if max_writers is not None:
        assert len(writers) <= max_writers

    world_b = SimulatedWorld(layout_b.mesh)
    via_a = world_b.load(layout_b, union(written))
    direct = world_b.load(layout_b, hf)
    for rank in layout_b.mesh.all_ranks():
        for name in layout_b:
            assert_same(via_a[rank][name], direct[rank][name], f"{name} rank {rank} (B via A vs B direct)")
    check_loaded(layout_b, hf, direct)


def _mesh_dim_names(ref: str | tuple[str, ...]) -> tuple[str, ...]:
    return (ref,) if isinstance(ref, str) else ref


def _preserved_rows_misaligned(layout: Layout, mesh_dims: set[str]) -> bool:
    """Independent check that a preserve policy really leaves some rank with a partial HF key."""
    for spec in layout.specs.values():
        if spec.fused_dim is None:
            continue
        fd, ks = spec.fused_dim, spec.key_size
        for rank in layout.mesh.all_ranks():
            held = list(range(spec.global_shape[fd]))
            for d in spec.shards:
                if d.dim != fd or not set(_mesh_dim_names(d.mesh_dim)) & mesh_dims:
                    continue
                world, index = layout.mesh.group_size(d.mesh_dim), layout.mesh.group_rank(rank, d.mesh_dim)
                if d.interleave_factor == 1:
                    chunk = -(-len(held) // world)
                    held = held[chunk * index : chunk * (index + 1)]
                else:
                    run = len(held) // (world * d.interleave_factor)
                    held = [held[(j * world + index) * run + i] for j in range(d.interleave_factor) for i in range(run)]
            rows = {i for i in held if i < spec.visible_shape[fd]}
            keys = {i // ks for i in rows}
            if rows != {i for k in keys for i in range(k * ks, (k + 1) * ks)}:
                return True
    return False


@POLICIES
@given(st.data())
def test_preserve_and_gather_only_round_trips(data: st.DataObject) -> None:
    geoms = data.draw(geometries(), label="params")
    layout = data.draw(layouts(geoms), label="layout")
    hf = hf_checkpoint(geoms, data.draw(st.integers(0, 2**31 - 1), label="seed"))
    mode = data.draw(st.sampled_from(["preserve", "gather_only"]), label="mode")
    names = layout.mesh.dim_names
    if mode == "preserve":  # mostly mesh dims that really cut some fused dim
        pool = sorted({n for s in layout.specs.values() for d in s.shards if d.dim == s.fused_dim
                       for n in _mesh_dim_names(d.mesh_dim)}) or list(names)
        dims = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2, unique=True), label="preserve")
    else:  # mostly leave at least one cutting mesh dim un-gathered
        dims = data.draw(st.lists(st.sampled_from(names), min_size=0, max_size=len(names) - 1 or 1, unique=True),
                         label="gather")
    policy = SavePolicy.preserve(*dims) if mode == "preserve" else SavePolicy.gather_only(*dims)
    budget = data.draw(st.one_of(st.none(), st.integers(0, 512)), label="budget")
    world = SimulatedWorld(layout.mesh)
    loaded = world.load(layout, hf)
    try:
        plan_save(layout, policy=policy)
    except PlanError as exc:
        message = str(exc)
        if "HF key boundaries" in message:  # the refusal must be justified
            assert mode == "preserve" and _preserved_rows_misaligned(layout, set(dims)), message
        else:
            assert "which was applied before it on the same dim" in message, message
        reject()
    written = world.save(layout, loaded, policy=policy, budget_bytes=budget)
    kept = any(p.preserves_shards for p in plan_save(layout, ranks=[0], policy=policy).plans[0])
    event(f"{mode}: {'some cut kept' if kept else 'nothing kept'}")
    if mode == "preserve":
        assert not _preserved_rows_misaligned(layout, set(dims))
        check_written_once(written, hf)
        return
    gathered = set(dims)
    for name, spec in layout.specs.items():
        canonical = canonical_tensor(spec, hf, layout.dtype(name))
        for rank in layout.mesh.all_ranks():
            assert set(written[rank]) == set(layout.specs)
            want = oracle_kept_output(spec, rank, canonical, gathered)
            assert_same(written[rank][name], want, f"{name} rank {rank} under {policy}")


@DTYPES_SAVE
@given(st.data())
def test_save_dtype_and_fp32_patterns(data: st.DataObject) -> None:
    geoms = data.draw(geometries(), label="params")
    layout = data.draw(layouts(geoms, max_ranks=16), label="layout")
    hf = hf_checkpoint(geoms, data.draw(st.integers(0, 2**31 - 1), label="seed"), finite=True)
    dtype = data.draw(st.sampled_from([None, torch.bfloat16, torch.float16, torch.float32]), label="dtype")
    fp32_keys = data.draw(st.sets(st.sampled_from(sorted(hf))), label="fp32 keys")
    patterns = [f"^{k.replace('.', '[.]')}$" for k in sorted(fp32_keys)]
    world = SimulatedWorld(layout.mesh)
    written = union(world.save(layout, world.load(layout, hf), dtype=dtype, fp32_keys_pattern=patterns))
    assert set(written) == set(hf)
    for key, original in hf.items():
        if not original.dtype.is_floating_point:
            want = original  # non-float tensors keep their dtype whatever is asked
        elif key in fp32_keys:
            want = original.to(torch.float32)
        else:
            want = original.to(dtype or original.dtype)
        assert_same(written[key], want, key)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(moe_layouts(), st.integers(0, 2**31 - 1), st.one_of(st.none(), st.integers(0, 1024)))
def test_preserve_ep_round_trip_on_moe_layouts(moe: tuple[Layout, tuple], seed: int, budget: int | None) -> None:
    layout, geoms = moe
    hf = hf_checkpoint(geoms, seed)
    world = SimulatedWorld(layout.mesh)
    policy = SavePolicy.preserve("ep")
    written = world.save(layout, world.load(layout, hf), policy=policy, budget_bytes=budget)
    check_written_once(written, hf)
    ep = layout.mesh.group_size("ep")
    experts = len(layout["fused_w2"].hf_keys)
    for rank, per_rank in written.items():
        ep_rank = layout.mesh.group_rank(rank, "ep")
        for key in per_rank:
            if key == "router":
                continue
            expert = int(key.split(".")[0][1:])
            # an expert key is written by a rank of the EP group that holds that expert
            assert expert // (experts // ep) == ep_rank, (key, rank)
