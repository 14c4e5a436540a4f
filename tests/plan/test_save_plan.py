"""HF save plans: steps per policy, output shapes, covered keys, key alignment, save dtypes."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from tests.run.support import layout_of, spec
from workbench import _compat
from workbench.errors import PlanError
from workbench.layout import InterleavedShard
from workbench.mesh import MeshSpec
from workbench.plan.policy import SavePolicy
from workbench.plan.save_plan import plan_hf_save, save_dtypes
from workbench.run.simulated import SimulatedWorld

SS = _compat.make_strided_shard
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def gpt_oss_like() -> tuple[MeshSpec, object]:
    """(16, 3) on (fsdp=2, ep=2, etp=2) with [SS(0,4), S(0), IS(0,2)] = S(0)@ep -> IS(0,2)@etp -> S(0)@fsdp;
    8 keys of 2 rows (2 experts x gate/up x ... as 8 stripes)."""
    mesh = MeshSpec((2, 2, 2), ("fsdp", "ep", "etp"))
    return mesh, spec("w13", keys(8), (16, 3), mesh, [SS(0, 4), Shard(0), InterleavedShard(0, 2)], fused_dim=0)


# -- steps per policy ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("policy", "pending", "kept", "runtime_out", "hf_keys"),
    [
        # full: undo every cut, innermost first
        (SavePolicy.full(), ["S(0)@fsdp", "IS(0,2)@etp", "S(0)@ep"], [], (16, 3), tuple(keys(8))),
        # preserve EP: EP stays, FSDP then ETP are undone -> EP 1's contiguous half, keys k4..k7
        (SavePolicy.preserve("ep"), ["S(0)@fsdp", "IS(0,2)@etp"], ["S(0)@ep"], (8, 3), ("k4", "k5", "k6", "k7")),
        # gather only FSDP: EP and ETP stay (runtime layout); the key list is informational
        (SavePolicy.gather_only("fsdp"), ["S(0)@fsdp"], ["S(0)@ep", "IS(0,2)@etp"], (4, 3), tuple(keys(8))),
        # gather only FSDP and ETP
        (SavePolicy.gather_only("fsdp", "etp"), ["S(0)@fsdp", "IS(0,2)@etp"], ["S(0)@ep"], (8, 3), tuple(keys(8))),
    ],
)
def test_steps_and_shapes_per_policy(policy, pending, kept, runtime_out, hf_keys) -> None:
    mesh, s = gpt_oss_like()
    rank = mesh.rank_at((1, 1, 0))
    plan = plan_hf_save(s, rank, policy)
    assert [str(st.descriptor) for st in plan.steps] == ["S(0)@ep", "IS(0,2)@etp", "S(0)@fsdp"]
    assert [st.shape_before for st in plan.steps] == [(16, 3), (8, 3), (4, 3)]
    assert [(st.world, st.group_rank) for st in plan.steps] == [(2, 1), (2, 0), (2, 1)]
    assert [str(st.descriptor) for st in plan.pending] == pending
    assert [str(st.descriptor) for st in plan.steps if st.preserved] == kept
    assert plan.preserves_shards == bool(kept)
    assert plan.local_shape == (2, 3)
    assert plan.runtime_output_shape == plan.output_shape == runtime_out
    assert plan.hf_keys == hf_keys and plan.fused_dim == 0
    assert plan.policy == policy and plan.rank == rank


def test_cuts_over_a_single_rank_group_are_not_gathered() -> None:
    mesh = MeshSpec((2, 1), ("fsdp", "tp"))
    s = spec("w", "w", (6, 4), mesh, [Shard(0), Shard(1)])
    plan = plan_hf_save(s, 1)
    assert [str(st.descriptor) for st in plan.steps] == ["S(0)@fsdp", "S(1)@tp"]
    assert [str(st.descriptor) for st in plan.pending] == ["S(0)@fsdp"]


@pytest.mark.parametrize(
    ("policy", "rank", "runtime_out", "output"),
    [
        # full: runtime (10, 6) with FP8 padding, checkpoint-visible (9, 5)
        (SavePolicy.full(), 0, (10, 6), (9, 5)),
        # keep the dim-1 cut over tp (W=2, chunk 3): tp 0 holds columns [0,3), all visible
        (SavePolicy.gather_only("fsdp"), 0, (10, 3), (9, 3)),
        # tp 1 holds columns [3,6), of which only [3,5) are visible
        (SavePolicy.gather_only("fsdp"), 1, (10, 3), (9, 2)),
    ],
)
def test_fp8_tail_padding_is_trimmed_once_at_the_end(policy, rank, runtime_out, output) -> None:
    mesh = MeshSpec((2, 2), ("tp", "fsdp"))  # tp outer so the kept tp cut comes first in forward order
    s = spec("w", "w", (10, 6), mesh, [Shard(1), Shard(0)], origin_shape=(9, 5))
    plan = plan_hf_save(s, mesh.rank_at((rank, 0)), policy)
    assert plan.runtime_output_shape == runtime_out and plan.output_shape == output


# -- preserve: covered keys and key alignment ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("ep", "rank", "expected_keys", "rows"),
    [
        (3, 0, ("k0", "k1"), 40),  # 6 keys of 20 rows over EP=3: 2 keys per rank
        (3, 1, ("k2", "k3"), 40),
        (6, 5, ("k5",), 20),  # EP=6: one key each
        (2, 1, ("k3", "k4", "k5"), 60),
        (1, 0, tuple(keys(6)), 120),  # EP of one: every key
    ],
)
def test_preserved_fused_shard_exposes_its_local_keys(ep, rank, expected_keys, rows) -> None:
    mesh = MeshSpec((ep,), ("ep",))
    s = spec("experts", keys(6), (120, 3), mesh, [Shard(0)], fused_dim=0)
    plan = plan_hf_save(s, rank, SavePolicy.preserve("ep"))
    assert plan.hf_keys == expected_keys
    assert plan.runtime_output_shape == plan.output_shape == (rows, 3)
    assert plan.preserves_shards
    assert plan.pending == ()


def test_preserve_does_nothing_to_a_single_key_tensor() -> None:
    mesh = MeshSpec((2,), ("ep",))
    plan = plan_hf_save(spec("router", "router", (4, 3), mesh, [Shard(0)]), 1, SavePolicy.preserve("ep"))
    assert not plan.preserves_shards and plan.hf_keys == ("router",) and plan.output_shape == (4, 3)


def test_preserved_interleave_covers_separate_keys() -> None:
    # 4 keys of 2 rows, IS(0,2) over etp=2 kept: etp 1 holds rows [2,4) and [6,8) = keys k1 and k3
    mesh = MeshSpec((2,), ("etp",))
    s = spec("w", keys(4), (8, 1), mesh, [InterleavedShard(0, 2)], fused_dim=0)
    plan = plan_hf_save(s, 1, SavePolicy.preserve("etp"))
    assert plan.hf_keys == ("k1", "k3") and plan.output_shape == (4, 1)


def test_preserved_range_with_padding_only_covers_no_key() -> None:
    # 3 keys of 4 rows (visible 12) in (16, 2), EP=4: ranks 0-2 one key each, rank 3 holds padding only
    mesh = MeshSpec((4,), ("ep",))
    s = spec("w", keys(3), (16, 2), mesh, [Shard(0)], fused_dim=0, origin_shape=(12, 2))
    assert [plan_hf_save(s, r, SavePolicy.preserve("ep")).hf_keys for r in range(4)] == [("k0",), ("k1",), ("k2",), ()]
    last = plan_hf_save(s, 3, SavePolicy.preserve("ep"))
    assert last.runtime_output_shape == (4, 2) and last.output_shape == (0, 2)


@pytest.mark.parametrize(
    ("nkeys", "rows", "global_rows", "ep", "rank", "message"),
    [
        # 4 keys of 3 rows over EP=8 (chunk 2): rank 1 holds rows [2, 4), half of two keys
        (4, 12, 12, 8, 1, r"parameter 'experts', rank 1: keeping S\(0\)@ep leaves fused-dim rows \[2, 4\) on this "
                          r"rank, which do not fall on HF key boundaries \(each of the 4 keys has 3 rows on dim 0\)"),
        # 3 keys of 3 rows over EP=2 (chunk 5): rank 0 holds [0, 5)
        (3, 9, 9, 2, 0, r"parameter 'experts', rank 0: .* rows \[0, 5\) .*each of the 3 keys has 3 rows"),
        # FP8 padding shifts the chunks: 4 keys of 5 rows, runtime 24 rows, EP=4 (chunk 6): rank 2 holds [12, 18)
        (4, 20, 24, 4, 2, r"parameter 'experts', rank 2: .* rows \[12, 18\) .*each of the 4 keys has 5 rows"),
    ],
)
def test_misaligned_preserve_names_parameter_rank_rows_and_key_size(nkeys, rows, global_rows, ep, rank, message):
    mesh = MeshSpec((ep,), ("ep",))
    s = spec("experts", keys(nkeys), (global_rows, 2), mesh, [Shard(0)], fused_dim=0, origin_shape=(rows, 2))
    with pytest.raises(PlanError, match=message):
        plan_hf_save(s, rank, SavePolicy.preserve("ep"))


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        # keeping FSDP's inner cut while gathering EP's outer cut of the same dim
        (SavePolicy.gather_only("ep"), r"parameter 'w': policy gather_only\(ep\) keeps S\(0\)@fsdp but undoes "
                                       r"S\(0\)@ep, which was applied before it on the same dim"),
        (SavePolicy.preserve("fsdp"), r"parameter 'w': policy preserve\(fsdp\) keeps S\(0\)@fsdp but undoes S\(0\)@ep"),
    ],
)
def test_keeping_an_inner_cut_while_undoing_an_outer_one_is_refused(policy, message) -> None:
    mesh = MeshSpec((2, 2), ("fsdp", "ep"))
    s = spec("w", keys(4), (8, 2), mesh, [SS(0, 2), Shard(0)], fused_dim=0)  # S(0)@ep -> S(0)@fsdp
    with pytest.raises(PlanError, match=message):
        plan_hf_save(s, 0, policy)
    # the other way round is fine: keep the outer EP cut, gather the inner FSDP cut
    assert plan_hf_save(s, 0, SavePolicy.gather_only("fsdp")).runtime_output_shape == (4, 2)


def test_preserving_a_one_rank_ep_group_is_the_identity() -> None:
    # EP disabled (size 1) but the RL code still asks for preserve("ep"); FSDP's Shard(0) comes first in forward
    # order. Keeping a cut over one rank changes nothing, so this is a full save of the FSDP cut.
    mesh = MeshSpec((2, 1), ("fsdp", "ep"))
    s = spec("w", keys(2), (4, 2), mesh, [Shard(0), Shard(0)], fused_dim=0)  # S(0)@fsdp -> S(0)@ep
    plan = plan_hf_save(s, 0, SavePolicy.preserve("ep"))
    assert plan.hf_keys == ("k0", "k1") and plan.output_shape == (4, 2)


# -- save dtypes --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hf_keys", "runtime", "dtype", "patterns", "key_dtypes", "gather"),
    [
        # only the 2nd key of a fused tensor matches: that key is float32, and the gather must be float32
        (("l.gate", "l.norm"), BF16, None, [r"\.norm$"], (BF16, F32), F32),
        # only the 1st key matches
        (("l.norm", "l.gate"), BF16, None, [r"\.norm$"], (F32, BF16), F32),
        # nothing matches: the requested dtype
        (("l.gate", "l.up"), F32, BF16, [r"\.norm$"], (BF16, BF16), BF16),
        # no dtype requested: the runtime dtype
        (("l.gate",), F16, None, None, (F16,), F16),
        # one pattern given as a plain string
        (("a.bias", "a.w"), BF16, F16, r"bias", (F32, F16), F32),
        # a float64 tensor with one float32 key: a float32 gather would round the other key, gather float64
        (("l.gate", "l.up"), torch.float64, None, r"gate", (F32, torch.float64), torch.float64),
        (("l.gate", "l.up"), torch.float64, BF16, r"gate", (F32, BF16), torch.float64),
        # every key in one dtype: gather in it (a float64 tensor saved in float32 sends half the bytes)
        (("l.gate", "l.up"), torch.float64, F32, None, (F32, F32), F32),
        # an unescaped dot is a wildcard (re.search semantics): "l.norm" matches "l_norm"
        (("l_norm",), BF16, None, ["l.norm"], (F32,), F32),
        # non-float tensors keep their dtype whatever is asked
        (("steps",), torch.int64, BF16, [r"steps"], (torch.int64,), torch.int64),
        (("mask",), torch.bool, F32, None, (torch.bool,), torch.bool),
    ],
)
def test_fp32_patterns_check_every_key(hf_keys, runtime, dtype, patterns, key_dtypes, gather) -> None:
    assert save_dtypes(hf_keys, runtime, dtype=dtype, fp32_keys_pattern=patterns) == key_dtypes
    mesh = MeshSpec((2,), ("fsdp",))
    fused = {"fused_dim": 0} if len(hf_keys) > 1 else {}
    s = spec("p", hf_keys, (2 * len(hf_keys), 3), mesh, [Shard(0)], **fused)
    plan = plan_hf_save(s, 0, runtime_dtype=runtime, dtype=dtype, fp32_keys_pattern=patterns)
    assert plan.key_dtypes == key_dtypes and plan.gather_dtype == gather


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.uint8])
def test_a_cast_into_anything_but_a_wide_floating_dtype_is_refused(dtype: torch.dtype) -> None:
    # a cast into int8 truncates, into bool gives True, into float8 drops what no scale keeps: never silently
    with pytest.raises(PlanError, match=rf"dtype={dtype}: a save casts floating keys into a floating dtype of 16"):
        save_dtypes(("a.weight",), F32, dtype=dtype)


@pytest.mark.parametrize(
    ("dtype", "patterns", "how"),
    [(BF16, None, "dtype=torch.bfloat16"), (F32, None, "dtype=torch.float32"),
     (None, [r"weight$"], "fp32_keys_pattern, which matches it,")],
)
def test_a_cast_of_a_float8_key_is_refused_naming_the_key(dtype, patterns, how) -> None:
    # its raw float8 values are not the weights: without its block scales, a wider dtype writes wrong numbers
    with pytest.raises(PlanError) as info:
        save_dtypes(("l.up", "l.weight"), torch.float8_e4m3fn, dtype=dtype, fp32_keys_pattern=patterns)
    message = str(info.value)
    first = "l.weight" if patterns else "l.up"  # the first key the cast would change
    assert message.startswith(f"HF key '{first}' is float8_e4m3fn: {how} would write its raw float8 values"), message
    assert "dequantized_state" in message


def test_a_float8_key_left_as_it_is_saves_as_float8() -> None:
    fp8 = torch.float8_e4m3fn
    assert save_dtypes(("l.weight",), fp8) == (fp8,)
    assert save_dtypes(("l.weight",), fp8, fp32_keys_pattern=[r"norm"]) == (fp8,)


def test_fp32_key_of_a_fused_tensor_is_written_float32_and_exact() -> None:
    mesh = MeshSpec((2,), ("fsdp",))
    s = spec("p", ["l.gate", "l.norm"], (4, 3), mesh, [Shard(0)], fused_dim=0)
    layout = layout_of(mesh, s, dtypes={"p": "bfloat16"})
    gen = torch.Generator().manual_seed(0)
    hf = {"l.gate": torch.randn(2, 3, generator=gen).to(BF16), "l.norm": torch.randn(2, 3, generator=gen).to(BF16)}
    world = SimulatedWorld(mesh)
    written = world.save(layout, world.load(layout, hf), fp32_keys_pattern=[r"\.norm$"])
    merged = {k: v for per_rank in written.values() for k, v in per_rank.items()}
    assert merged["l.gate"].dtype == BF16 and torch.equal(merged["l.gate"], hf["l.gate"])
    assert merged["l.norm"].dtype == F32 and torch.equal(merged["l.norm"], hf["l.norm"].to(F32))


def test_non_float_tensor_saved_with_a_float_dtype_keeps_its_values_and_dtype() -> None:
    mesh = MeshSpec((3,), ("fsdp",))
    layout = layout_of(mesh, spec("ids", "ids", (7,), mesh, [Shard(0)]), dtypes={"ids": "int64"})
    ids = torch.tensor([2**40 + 1, -3, 5, 2**62, 0, -(2**50), 9])  # not representable in bf16
    world = SimulatedWorld(mesh)
    written = world.save(layout, world.load(layout, {"ids": ids}), dtype=BF16)
    (out,) = [t["ids"] for t in written.values() if t]
    assert out.dtype == torch.int64 and torch.equal(out, ids)


def test_preserve_with_an_fp32_pattern_matching_one_ep_ranks_keys() -> None:
    # Under preserve("ep") each EP rank covers its own experts' keys; a pattern matching a key of EP rank 1 only
    # makes its FSDP group gather in float32 while EP rank 0's group gathers in bf16. The two FSDP groups never
    # talk to each other, so nothing can hang, yet plan_save refuses ("would issue different collectives").
    mesh = MeshSpec((2, 2), ("fsdp", "ep"))
    s = spec("experts", keys(4, "e"), (8, 2), mesh, [SS(0, 2), Shard(0)], fused_dim=0)
    layout = layout_of(mesh, s, spec("other", "other", (4, 2), mesh, [Shard(0), Replicate()]),
                       dtypes={"experts": "bfloat16", "other": "bfloat16"})
    gen = torch.Generator().manual_seed(0)
    hf = {k: torch.randn(2, 2, generator=gen).to(BF16) for k in keys(4, "e")}
    hf["other"] = torch.randn(4, 2, generator=gen).to(BF16)
    world = SimulatedWorld(mesh)
    written = world.save(layout, world.load(layout, hf), policy=SavePolicy.preserve("ep"), fp32_keys_pattern=[r"^e3$"])
    merged = {k: v for per_rank in written.values() for k, v in per_rank.items()}
    assert merged["e3"].dtype == F32 and merged["e0"].dtype == BF16
