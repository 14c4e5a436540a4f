"""HF load plans: what each rank reads (exactly what it owns), where it lands, padding, adapters."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Replicate, Shard

from tests.run.support import (
    assert_same,
    canonical_tensor,
    geometries,
    layout_of,
    layouts,
    oracle_dim_indices,
    oracle_local,
    random_tensor,
    spec,
)
from workbench import _compat
from workbench.errors import PlanError
from workbench.layout import InterleavedShard
from workbench.mesh import MeshSpec
from workbench.plan.load_plan import KeyRead, expected_key_shape, plan_hf_load
from workbench.run.load_ops import execute_load, reader_from_tensors
from workbench.run.simulated import SimulatedWorld

SS = _compat.make_strided_shard


def keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def recording_reader(hf: dict[str, torch.Tensor], log: list):
    """A reader that records every request (key, index or None for the whole key)."""
    inner = reader_from_tensors(hf)

    def read(key, index):
        log.append((key, index))
        return inner(key, index)

    return read


def fused_hf(n: int, rows: int, cols: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``n`` keys of (rows, cols) numbered so that the fused tensor is arange(n*rows*cols)."""
    full = torch.arange(n * rows * cols, dtype=torch.float32).reshape(n * rows, cols)
    return {f"k{i}": full[i * rows : (i + 1) * rows].clone() for i in range(n)}, full


# -- exact reads ----------------------------------------------------------------------------------------
def test_interleaved_rank_reads_two_separate_stripes_and_skips_the_keys_between() -> None:
    # 4 keys of 5 rows, (20, 2), one interleave F=2 over 2 ranks: run 5; rank 0 holds runs 0 and 2 = keys 0, 2
    mesh = MeshSpec((2,), ("tp",))
    s = spec("w", keys(4), (20, 2), mesh, [InterleavedShard(0, 2)], fused_dim=0)
    hf, full = fused_hf(4, 5, 2)
    plan = plan_hf_load(s, 0)
    assert plan.reads == (
        KeyRead("k0", (0, 0), (5, 2), (0, 0)),
        KeyRead("k2", (0, 0), (5, 2), (5, 0)),
    )
    assert plan.hf_keys == ("k0", "k2") and plan.numel_read == 20 and not plan.zero_fill
    out = execute_load(plan, reader_from_tensors(hf), torch.full((10, 2), -1.0))
    assert torch.equal(out, torch.cat([full[0:5], full[10:15]]))
    assert plan_hf_load(s, 1).hf_keys == ("k1", "k3")


def test_interleave_runs_that_straddle_keys_read_only_the_needed_rows() -> None:
    # 3 keys of 4 rows, (12, 1), F=2 over 2 ranks: run 3; rank 0 holds rows [0,3) and [6,9)
    mesh = MeshSpec((2,), ("tp",))
    s = spec("w", keys(3), (12, 1), mesh, [InterleavedShard(0, 2)], fused_dim=0)
    plan = plan_hf_load(s, 0)
    assert plan.reads == (
        KeyRead("k0", (0, 0), (3, 1), (0, 0)),  # rows 0-2
        KeyRead("k1", (2, 0), (2, 1), (3, 0)),  # rows 6-7 = k1 rows 2-3
        KeyRead("k2", (0, 0), (1, 1), (5, 0)),  # row 8 = k2 row 0
    )
    hf, full = fused_hf(3, 4, 1)
    log: list = []
    out = execute_load(plan, recording_reader(hf, log), torch.empty(6, 1))
    assert torch.equal(out, full[[0, 1, 2, 6, 7, 8]])
    assert [(k, idx) for k, idx in log] == [
        ("k0", (slice(0, 3), slice(0, 1))), ("k1", (slice(2, 4), slice(0, 1))), ("k2", (slice(0, 1), slice(0, 1)))
    ]


def test_contiguous_cut_on_dim_1_reads_a_column_slice() -> None:
    # (6, 10) over 3 ranks on dim 1: chunk 4 -> rank 1 holds columns [4, 8)
    mesh = MeshSpec((3,), ("tp",))
    s = spec("w", "w.weight", (6, 10), mesh, [Shard(1)])
    full = torch.arange(60.0).reshape(6, 10)
    plan = plan_hf_load(s, 1)
    assert plan.reads == (KeyRead("w.weight", (0, 4), (6, 4), (0, 0)),)
    assert torch.equal(execute_load(plan, reader_from_tensors({"w.weight": full}), torch.empty(6, 4)), full[:, 4:8])
    # rank 2 holds the short tail [8, 10)
    assert plan_hf_load(s, 2).reads == (KeyRead("w.weight", (0, 8), (6, 2), (0, 0)),)


def test_fused_on_dim_1_reads_each_key_in_its_own_coordinates() -> None:
    # keys q, k, v of (4, 3) fused on dim 1 -> (4, 9); 2 ranks on dim 1: chunk 5 -> rank 0 [0,5), rank 1 [5,9)
    mesh = MeshSpec((2,), ("tp",))
    s = spec("qkv", ["q", "k", "v"], (4, 9), mesh, [Shard(1)], fused_dim=1)
    assert expected_key_shape(s) == (4, 3)
    assert plan_hf_load(s, 0).reads == (
        KeyRead("q", (0, 0), (4, 3), (0, 0)),
        KeyRead("k", (0, 0), (4, 2), (0, 3)),
    )
    assert plan_hf_load(s, 1).reads == (
        KeyRead("k", (0, 2), (4, 1), (0, 0)),
        KeyRead("v", (0, 0), (4, 3), (0, 1)),
    )
    hf = {k: torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i, k in enumerate("qkv")}
    full = torch.cat([hf["q"], hf["k"], hf["v"]], dim=1)
    for rank, cols in ((0, slice(0, 5)), (1, slice(5, 9))):
        plan = plan_hf_load(s, rank)
        assert torch.equal(execute_load(plan, reader_from_tensors(hf), torch.empty(plan.target_shape)), full[:, cols])


def test_ep_etp_fsdp_composition_maps_back_to_global_rows() -> None:
    # (48, 2) on (fsdp=2, ep=2, etp=2) with [SS(0,4), S(0), IS(0,2)]: EP 1 -> [24,48); ETP 1 (run 6) -> [30,36)
    # and [42,48); FSDP 0 takes the first 6 local rows -> [30,36), FSDP 1 the rest -> [42,48); likewise
    # (fsdp=1, ep=0, etp=0) holds [12,18), the second half of runs 0 and 2
    mesh = MeshSpec((2, 2, 2), ("fsdp", "ep", "etp"))
    s = spec("w", "w", (48, 2), mesh, [SS(0, 4), Shard(0), InterleavedShard(0, 2)])
    full = torch.arange(96.0).reshape(48, 2)
    for coord, rows in (((0, 1, 1), range(30, 36)), ((1, 1, 1), range(42, 48)), ((1, 0, 0), range(12, 18))):
        rank = mesh.rank_at(coord)
        plan = plan_hf_load(s, rank)
        out = execute_load(plan, reader_from_tensors({"w": full}), torch.empty(plan.target_shape))
        assert torch.equal(out, full[list(rows)]), coord


# -- padding ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("world", "rank", "reads", "target", "copied_rows"),
    [
        # 3 keys of 4 rows (visible 12) in a (15, 2) runtime tensor, 2 ranks: chunk 8; rank 1 holds [8, 15):
        # k2 whole (rows 8-11), then 3 rows of padding
        (2, 1, [KeyRead("k2", (0, 0), (4, 2), (0, 0))], (7, 2), 4),
        # 4 ranks: chunk 4; rank 2 holds [8, 12) = k2 exactly, no padding
        (4, 2, [KeyRead("k2", (0, 0), (4, 2), (0, 0))], (4, 2), 4),
        # rank 3 holds [12, 15): padding only, reads nothing
        (4, 3, [], (3, 2), 0),
        # 8 ranks: chunk 2; rank 7 holds [14, 15): padding only
        (8, 7, [], (1, 2), 0),
    ],
)
def test_origin_shape_padding_is_zeroed_and_never_read(world, rank, reads, target, copied_rows) -> None:
    mesh = MeshSpec((world,), ("fsdp",))
    s = spec("w", keys(3), (15, 2), mesh, [Shard(0)], fused_dim=0, origin_shape=(12, 2))
    plan = plan_hf_load(s, rank)
    assert list(plan.reads) == reads and plan.target_shape == target
    assert plan.zero_fill == (copied_rows < target[0])
    hf, full = fused_hf(3, 4, 2)
    out = execute_load(plan, reader_from_tensors(hf), torch.full(target, -1.0))
    start = min(math.ceil(15 / world) * rank, 15)
    assert torch.equal(out[:copied_rows], full[start : start + copied_rows])
    assert torch.equal(out[copied_rows:], torch.zeros(target[0] - copied_rows, 2))


def test_zero_size_shard_is_a_valid_empty_plan() -> None:
    # (1, 1, 6) over 2 ranks on dim 0: rank 1 holds nothing
    mesh = MeshSpec((2,), ("fsdp",))
    s = spec("w", "w", (1, 1, 6), mesh, [Shard(0)])
    plan = plan_hf_load(s, 1)
    assert plan.target_shape == (0, 1, 6) and plan.reads == () and plan.hf_keys == () and plan.numel_read == 0
    out = execute_load(plan, reader_from_tensors({}), torch.empty(0, 1, 6))
    assert out.numel() == 0


# -- every rank reads exactly what it owns (random layouts) -------------------------------------------------
@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.data())
def test_reads_are_exactly_the_owned_visible_elements(data: st.DataObject) -> None:
    geoms = data.draw(geometries(), label="params")
    layout = data.draw(layouts(geoms, max_ranks=27), label="layout")
    for name, s in layout.specs.items():
        ks = expected_key_shape(s)
        per_group_reads = {g: 0 for g in s.replica_groups()}
        for rank in layout.mesh.all_ranks():
            plan = plan_hf_load(s, rank)
            assert plan.target_shape == s.local_shape(rank) and plan.key_shape == ks
            visible = [sum(1 for i in oracle_dim_indices(s, rank, d) if i < s.visible_shape[d])
                       for d in range(len(s.global_shape))]
            assert plan.numel_read == math.prod(visible)  # nothing more than owned, nothing less
            assert plan.zero_fill == (plan.numel_read < math.prod(plan.target_shape))
            for r in plan.reads:
                assert r.numel > 0
                assert all(o >= 0 and o + n <= k for o, n, k in zip(r.key_offset, r.sizes, ks)), r
            for g in per_group_reads:
                if rank in g:
                    per_group_reads[g] += plan.numel_read
        # each replica group reads the checkpoint exactly once
        assert set(per_group_reads.values()) <= {math.prod(s.visible_shape)}, name


# -- canonical adapters run before slicing ----------------------------------------------------------------
def gpt_oss_pack(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[E, I, H] gate and up -> GPT-OSS's packed [E, H, 2I] with gate/up interleaved column-wise."""
    return torch.stack([gate.transpose(1, 2), up.transpose(1, 2)], dim=-1).flatten(-2)


def gpt_oss_adapter(key: str, packed: torch.Tensor) -> torch.Tensor:
    """Packed [E, H, 2I] -> canonical [E*2I, H]: per expert its I gate rows, then its I up rows."""
    e, h, two_i = packed.shape
    return packed.view(e, h, two_i // 2, 2).permute(0, 3, 2, 1).reshape(e * two_i, h)


@pytest.mark.parametrize(
    ("ep", "etp", "experts", "inter", "hidden"),
    [
        (2, 2, 4, 4, 3),  # 2 local experts -> 4 stripes per rank, each split over 2 ETP ranks
        (1, 2, 2, 2, 5),  # no EP, ETP only
        (4, 1, 4, 3, 2),  # EP only (the interleave over one rank is the identity)
        (2, 3, 2, 6, 1),  # ETP of 3
    ],
)
def test_gpt_oss_packed_key_is_canonicalized_before_the_expert_tp_slice(ep, etp, experts, inter, hidden) -> None:
    mesh = MeshSpec((ep, etp), ("ep", "etp"))
    local = experts // ep
    s = spec("experts.gate_up", "experts.gate_up_proj", (experts * 2 * inter, hidden), mesh,
             [Shard(0), InterleavedShard(0, 2 * local)])
    gen = torch.Generator().manual_seed(7)
    gate, up = torch.randn(experts, inter, hidden, generator=gen), torch.randn(experts, inter, hidden, generator=gen)
    packed = gpt_oss_pack(gate, up)
    canonical = torch.cat([torch.cat([gate[e], up[e]]) for e in range(experts)])  # built without the adapter
    assert tuple(gpt_oss_adapter("x", packed).shape) == expected_key_shape(s)
    calls: list[tuple[str, tuple[int, ...]]] = []

    def adapter(key: str, tensor: torch.Tensor) -> torch.Tensor:
        calls.append((key, tuple(tensor.shape)))
        return gpt_oss_adapter(key, tensor)

    for rank in mesh.all_ranks():
        calls.clear()
        log: list = []
        plan = plan_hf_load(s, rank)
        read = recording_reader({"experts.gate_up_proj": packed}, log)
        out = execute_load(plan, read, torch.empty(plan.target_shape), {"experts.gate_up_proj": adapter})
        assert_same(out, oracle_local(s, rank, canonical), f"rank {rank}")
        # the adapter sees the whole packed key, once, however many stripes the rank reads from it
        assert calls == [("experts.gate_up_proj", (experts, hidden, 2 * inter))]
        assert log == [("experts.gate_up_proj", None)]
    # the simulated world does the same (and does not hold the packed key shape against the canonical one)
    layout = layout_of(mesh, s)
    loaded = SimulatedWorld(mesh).load(layout, {"experts.gate_up_proj": packed},
                                       adapters={"experts.gate_up_proj": gpt_oss_adapter})
    for rank in mesh.all_ranks():
        assert_same(loaded[rank]["experts.gate_up"], oracle_local(s, rank, canonical))


def test_small_packed_key_lands_on_rows_0_2_4_6() -> None:
    # packed (2, 3, 4) -> canonical permute(0, 2, 1).reshape(8, 3); F=4 over 2 ranks: run 1
    mesh = MeshSpec((2,), ("etp",))
    s = spec("w", "packed", (8, 3), mesh, [InterleavedShard(0, 4)])
    packed = torch.arange(24.0).reshape(2, 3, 4)
    canonical = packed.permute(0, 2, 1).reshape(8, 3)
    adapters = {"packed": lambda key, t: t.permute(0, 2, 1).reshape(8, 3)}
    for rank, rows in ((0, [0, 2, 4, 6]), (1, [1, 3, 5, 7])):
        out = execute_load(plan_hf_load(s, rank), reader_from_tensors({"packed": packed}), torch.empty(4, 3), adapters)
        assert torch.equal(out, canonical[rows])


def test_per_key_adapters_on_fused_keys() -> None:
    # GLM-style: keys gate and up are stored transposed (H, I); canonical per key (I, H), fused on dim 0
    mesh = MeshSpec((2,), ("etp",))
    s = spec("w13", ["gate", "up"], (8, 3), mesh, [InterleavedShard(0, 2)], fused_dim=0)
    gen = torch.Generator().manual_seed(3)
    hf = {"gate": torch.randn(3, 4, generator=gen), "up": torch.randn(3, 4, generator=gen)}
    adapters = {k: (lambda key, t: t.T) for k in hf}
    canonical = torch.cat([hf["gate"].T, hf["up"].T])
    for rank, rows in ((0, [0, 1, 4, 5]), (1, [2, 3, 6, 7])):
        out = execute_load(plan_hf_load(s, rank), reader_from_tensors(hf), torch.empty(4, 3), adapters)
        assert torch.equal(out, canonical[rows])


def test_adapter_returning_the_wrong_shape_is_named() -> None:
    mesh = MeshSpec((2,), ("etp",))
    s = spec("w", "packed", (8, 3), mesh, [Shard(0)])
    plan = plan_hf_load(s, 0)
    with pytest.raises(PlanError, match=r"parameter 'w': adapter for 'packed' returned shape \(3, 8\), .* \(8, 3\)"):
        execute_load(plan, reader_from_tensors({"packed": torch.zeros(8, 3)}), torch.empty(4, 3),
                     {"packed": lambda key, t: t.T})


# -- checks against the checkpoint ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key_shapes", "message"),
    [
        # the second key is one row short
        ({"k0": (4, 2), "k1": (3, 2)}, r"parameter 'w': HF key 'k1' has shape \(3, 2\) in the checkpoint, but the "
                                        r"layout expects \(4, 2\)"),
        # a transposed key
        ({"k0": (2, 4)}, r"HF key 'k0' has shape \(2, 4\) .* expects \(4, 2\) \(global_shape \(10, 2\), "
                         r"origin_shape \(8, 2\), 2 keys fused on dim 0\)"),
    ],
)
def test_key_shape_mismatch_names_key_and_shapes(key_shapes, message) -> None:
    mesh = MeshSpec((2,), ("fsdp",))
    s = spec("w", keys(2), (10, 2), mesh, [Shard(0)], fused_dim=0, origin_shape=(8, 2))
    with pytest.raises(PlanError, match=message):
        plan_hf_load(s, 0, key_shapes)
    assert plan_hf_load(s, 0, {"k0": (4, 2), "k1": (4, 2), "other": (1,)}).key_shape == (4, 2)


def test_a_key_smaller_than_the_layout_says_is_caught_at_execution() -> None:
    mesh = MeshSpec((2,), ("fsdp",))
    s = spec("w", "w", (8, 2), mesh, [Shard(0)])
    plan = plan_hf_load(s, 1)  # rows [4, 8)
    with pytest.raises(PlanError, match=r"parameter 'w': HF key 'w' gave a slice of shape \(2, 2\)"):
        execute_load(plan, reader_from_tensors({"w": torch.zeros(6, 2)}), torch.empty(4, 2))


def test_replicated_tensor_every_rank_reads_everything() -> None:
    mesh = MeshSpec((2, 2), ("dp", "tp"))
    s = spec("norm", "norm.weight", (5,), mesh, [Replicate(), Replicate()])
    x = random_tensor((5,), torch.bfloat16, torch.Generator().manual_seed(1))
    for rank in mesh.all_ranks():
        plan = plan_hf_load(s, rank)
        assert plan.reads == (KeyRead("norm.weight", (0,), (5,), (0,)),)
        out = execute_load(plan, reader_from_tensors({"norm.weight": x}), torch.empty(5, dtype=torch.bfloat16))
        assert_same(out, x)
    assert canonical_tensor(s, {"norm.weight": x}, torch.bfloat16).shape == (5,)


def test_an_adapter_of_another_dtype_is_refused_unless_cast() -> None:
    """The checkpoint check cannot see an adapter's output dtype: without cast, a bf16 canonical key is not copied
    silently into a float32 tensor."""
    import pytest

    mesh = MeshSpec((2,), ("etp",))
    s = spec("w", "packed", (8, 3), mesh, [InterleavedShard(0, 4)])
    packed = torch.arange(24.0).reshape(2, 3, 4)
    adapters = {"packed": lambda key, t: t.permute(0, 2, 1).reshape(8, 3).to(torch.bfloat16)}
    plan = plan_hf_load(s, 1)
    with pytest.raises(PlanError, match=r"'w', rank 1: adapter for 'packed' returned torch.bfloat16, the model's "
                                        r"tensor is torch.float32 \(pass cast=True"):
        execute_load(plan, reader_from_tensors({"packed": packed}), torch.empty(4, 3), adapters, cast=False)
    out = execute_load(plan, reader_from_tensors({"packed": packed}), torch.empty(4, 3), adapters, cast=True)
    assert torch.equal(out, packed.permute(0, 2, 1).reshape(8, 3)[[1, 3, 5, 7]])
