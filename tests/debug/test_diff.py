"""diff_checkpoints on a generated corpus: one broken copy per transform, kind and transform asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.debug.corpus import broken, model, write
from workbench.debug import diff_checkpoints
from workbench.layout.layout_file import load_layout

ROOT = Path(__file__).resolve().parents[2]
EMB = "model.embed_tokens.weight"
GU = "model.layers.0.mlp.gate_up_proj.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"
OPROJ = "model.layers.0.self_attn.o_proj.weight"
NORM = "model.norm.weight"
HEAD = "lm_head.weight"


def _set(key, fn):
    def edit(t):
        t[key] = fn(t[key])

    return edit


def _rows(idx):
    return lambda x: x[torch.tensor(idx)]


# (id, edit, key, kind, words the transform must contain). Row orders are written out by hand.
CASES = [
    # 16 rows, IS(0,2) over 2 ranks (runs of 4): rank 0 holds [0:4, 8:12], rank 1 [4:8, 12:16]; gathered contiguous
    ("interleave_as_contiguous", _set(EMB, _rows([*range(0, 4), *range(8, 12), *range(4, 8), *range(12, 16)])),
     EMB, "permuted", "interleaved shard gathered as contiguous"),
    # contiguous halves [0:8] [8:16] put back as if interleaved with F=2 (runs of 4): [0:4, 8:12, 4:8, 12:16] read back
    ("contiguous_as_interleaved", _set(HEAD, _rows([*range(0, 6), *range(12, 18), *range(6, 12), *range(18, 24)])),
     HEAD, "permuted", "interleave"),
    # 4 shards of 6 rows in reverse rank order
    ("rank_order", _set(HEAD, _rows([*range(18, 24), *range(12, 18), *range(6, 12), *range(0, 6)])),
     HEAD, "permuted", "rank order"),
    ("gate_up_swapped", _set(GU, _rows([*range(6, 12), *range(0, 6)])), GU, "permuted", "gate/up halves swapped"),
    ("transposed", _set(DOWN, lambda x: x.T.contiguous()), DOWN, "permuted", "transposed"),
    ("transposed_square", _set(OPROJ, lambda x: x.T.contiguous()), OPROJ, "permuted", "transposed"),
    ("replicated_concat", _set(NORM, lambda x: torch.cat([x, x, x, x])), NORM, "replicated_concat", "4 times"),
    ("partial_shard", _set(HEAD, lambda x: x[12:18].clone()), HEAD, "partial_shard", "rank 2"),
    ("padding_not_trimmed", _set(EMB, lambda x: torch.cat([x, torch.zeros(4, 8, dtype=x.dtype)])), EMB,
     "padding_not_trimmed", "4 padding"),
    ("padding_dim1", _set(DOWN, lambda x: torch.cat([x, torch.zeros(6, 2, dtype=x.dtype)], 1)), DOWN,
     "padding_not_trimmed", "dim 1"),
    ("dtype_cast", _set(NORM, lambda x: x.to(torch.bfloat16)), NORM, "dtype_mismatch", "cast to bfloat16"),
    # same dtype on both sides: not a dtype mismatch, the values lost precision (issue 22.4)
    ("dtype_round_trip", _set(NORM, lambda x: x.to(torch.bfloat16).float()), NORM, "precision_lost",
     "round trip through bfloat16"),
    ("value_mismatch", _set(OPROJ, lambda x: x.index_fill(0, torch.tensor([3]), 2.0)), OPROJ, "value_mismatch",
     None),
    ("shape_mismatch", _set(OPROJ, lambda x: torch.ones(8, 5, dtype=x.dtype)), OPROJ, "shape_mismatch", None),
    ("missing_key", lambda t: t.pop(DOWN), DOWN, "missing_key", None),
    ("unexpected_key", lambda t: t.__setitem__("model.extra.bias", torch.zeros(3)), "model.extra.bias",
     "unexpected_key", None),
    ("renamed_prefix", lambda t: t.update({"base." + k: t.pop(k) for k in list(t)}), "base." + EMB,
     "renamed_key", "prefix '' -> 'base.'"),
    ("renamed_suffix", lambda t: t.__setitem__(NORM.replace("weight", "scale"), t.pop(NORM)),
     NORM.replace("weight", "scale"), "renamed_key", "weight"),
    # the experts' gate and up keys swapped (each key holds the other's tensor)
    ("keys_swapped", lambda t: t.update({
        "model.layers.0.mlp.experts.0.gate_proj.weight": t["model.layers.0.mlp.experts.0.up_proj.weight"],
        "model.layers.0.mlp.experts.0.up_proj.weight": t["model.layers.0.mlp.experts.0.gate_proj.weight"]}),
     "model.layers.0.mlp.experts.0.gate_proj.weight", "misplaced_tensor",
     "gate/up swapped with model.layers.0.mlp.experts.0.up_proj.weight"),
    # columns: two shards of dim 1 in reverse order (row-parallel weight gathered in the wrong order)
    ("rank_order_dim1", _set(DOWN, lambda x: torch.cat([x[:, 5:], x[:, :5]], 1)), DOWN, "permuted",
     "rank order reversed (S(1) over 2 ranks)"),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("ref") / "good", model())


@pytest.mark.parametrize(("name", "edit", "key", "kind", "words"), CASES, ids=[c[0] for c in CASES])
def test_each_transform_is_named(reference, tmp_path, name, edit, key, kind, words) -> None:
    report = diff_checkpoints(reference, broken(tmp_path, name, edit), block_bytes=64)
    about = [f for f in report.findings if f.key == key]
    assert about, f"{name}: no finding about {key}: {report.to_text()}"
    finding = about[0]
    assert finding.kind == kind, report.to_text()
    if words is not None:
        assert words in (finding.transform or ""), report.to_text()
    assert finding.hint
    # renames report every key; swapped keys report both partners
    allowed = ("renamed_key", kind if name == "keys_swapped" else "")
    others = [f for f in report.findings if f.key != key and f.kind not in allowed]
    assert not others, report.to_text()
    assert report.exit_status == 1


def test_value_mismatch_evidence(reference, tmp_path) -> None:
    bad = broken(tmp_path, "v", _set(OPROJ, lambda x: x.index_fill(0, torch.tensor([3]), 2.0)))
    (finding,) = diff_checkpoints(reference, bad).findings
    original = model()[OPROJ][3].float()
    assert finding.evidence["differing_elements"] == int((original != 2.0).sum())
    assert finding.evidence["max_abs_diff"] == pytest.approx(float((original - 2.0).abs().max()))
    assert finding.evidence["first_differing_index"] == 3 * 8 + int(torch.nonzero(original != 2.0)[0])


def test_all_zero_tensor_is_called_out(reference, tmp_path) -> None:
    bad = broken(tmp_path, "z", _set(OPROJ, torch.zeros_like))
    (finding,) = diff_checkpoints(reference, bad).findings
    assert finding.kind == "value_mismatch" and finding.evidence["actual_all_zero"] is True


@pytest.mark.parametrize("block", [64, 1 << 20])
def test_healthy_pairs_have_no_finding(reference, tmp_path, block) -> None:
    # same tensors, written again into differently sized files: a different layout on disk, same checkpoint
    other = write(tmp_path / "resharded", model(), max_shard_bytes=200)
    assert len(list(other.glob("*.safetensors"))) > 1
    for a, b in ((reference, reference), (reference, other), (other, reference)):
        report = diff_checkpoints(a, b, block_bytes=block)
        assert report.findings == () and report.ok and report.exit_status == 0, report.to_text()
        assert report.stats["equal"] == len(model())


def test_unreadable_side_is_status_2(reference, tmp_path) -> None:
    report = diff_checkpoints(reference, tmp_path / "nothing-here")
    assert not report.readable and report.exit_status == 2
    assert "does not exist" in report.stats["error"]


# The toy expert-TP layout: fused_w1w3 = [gate0, up0, gate1, up1] (4 rows each), S(0)@ep then IS(0,2)@tp.
# Each EP half (8 rows) holds tp rank 0's rows [0,1,4,5] and tp rank 1's [2,3,6,7]; gathering the two tp shards
# as if contiguous gives, per EP half, rows [0,1,4,5,2,3,6,7]: gate0 then gets up0's first rows.
TOY_KEYS = [f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(2) for p in ("gate", "up")]
TOY_BAD_ROWS = [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]


def _toy(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(16, 4, generator=g).bfloat16()
    return {k: fused[4 * i : 4 * i + 4].clone() for i, k in enumerate(TOY_KEYS)} | {
        "model.norm.weight": torch.randn(4, generator=g)
    }


def test_layout_names_cross_key_interleave_bug(tmp_path) -> None:
    good = _toy(1)
    fused = torch.cat([good[k] for k in TOY_KEYS])[torch.tensor(TOY_BAD_ROWS)]
    bad = dict(good) | {k: fused[4 * i : 4 * i + 4].clone() for i, k in enumerate(TOY_KEYS)}
    write(tmp_path / "good", good)
    write(tmp_path / "bad", bad)
    layout = load_layout(ROOT / "sample_meshes" / "toy_expert_tp.toml")
    report = diff_checkpoints(tmp_path / "good", tmp_path / "bad", layout=layout)
    (finding,) = report.findings
    assert finding.kind == "permuted" and finding.key == "model.layers.0.mlp.experts.fused_w1w3"
    assert (
        finding.transform
    ) == "interleaved shard gathered as contiguous (IS(0,2)@tp over 2 ranks inside each of 2 outer shards)"
    assert finding.evidence["hf_keys"] == TOY_KEYS
    # without the layout each key is judged alone: the keys' rows moved across keys, so values differ per key
    plain = diff_checkpoints(tmp_path / "good", tmp_path / "bad")
    assert {f.key for f in plain.findings} == set(TOY_KEYS)


def _experts(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight": torch.randn(4, 6, generator=g).bfloat16()
            for i in range(2) for e in range(4) for p in ("gate", "up", "down")}


def test_swap_found_across_files_and_parents(tmp_path) -> None:
    # issue 22.2: two experts' down_proj swapped, bit-exact, stored in two different files
    a, b = "model.layers.0.mlp.experts.1.down_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"
    good = _experts()
    bad = dict(good) | {a: good[b], b: good[a]}
    ref = write(tmp_path / "ref", good, max_shard_bytes=200)
    ck = write(tmp_path / "bad", bad, max_shard_bytes=200)
    weight_map = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map[a] != weight_map[b]
    report = diff_checkpoints(ref, ck)
    assert [(f.kind, f.key) for f in report.findings] == [("misplaced_tensor", a), ("misplaced_tensor", b)]
    assert report.by_key(a)[0].transform == f"swapped with {b} (each holds the other's tensor)"
    assert len(report.groups()) == 1  # one fix, said once


def test_a_copy_and_fused_halves_in_the_wrong_slot(tmp_path) -> None:
    g = torch.Generator().manual_seed(4)
    good = {f"model.layers.0.mlp.experts.{e}.gate_up_proj.weight": torch.randn(8, 3, generator=g).bfloat16()
            for e in range(3)} | {"model.norm.weight": torch.randn(3, generator=g)}
    e0, e1, e2 = (f"model.layers.0.mlp.experts.{e}.gate_up_proj.weight" for e in range(3))
    bad = dict(good)
    bad[e0] = torch.cat([good[e0][:4], good[e1][:4]])  # expert 0's up slot holds expert 1's gate
    bad[e2] = good[e1].clone()  # expert 2 written with expert 1's tensor
    report = diff_checkpoints(write(tmp_path / "ref", good), write(tmp_path / "bad", bad))
    kinds = {f.key: (f.kind, f.transform) for f in report.findings}
    assert kinds[e0] == ("misplaced_tensor", f"rows 0:4 hold rows 0:4 of {e0}; rows 4:8 hold rows 0:4 of {e1}")
    assert kinds[e2] == ("misplaced_tensor", f"holds a copy of {e1}'s tensor (which {e1} holds too)")
    assert set(kinds) == {e0, e2}


@pytest.mark.parametrize(("n", "start", "length", "expected"), [
    # torch's chunk rule, by hand: 24 over 4 -> 6,6,6,6; 10 over 3 -> 4,4,2; 10 over 4 -> 3,3,3,1; 10 over 6 -> 2x5,0
    (24, 12, 6, (2, 4)), (10, 8, 2, (2, 3)), (10, 9, 1, (3, 4)), (10, 4, 2, (2, 5)), (10, 0, 5, (0, 2)),
    (24, 0, 7, None), (10, 1, 3, None), (10, 6, 4, None), (128, 0, 61, None), (10, 0, 10, None),
])
def test_chunk_shard_follows_torchs_chunk_rule(n, start, length, expected) -> None:
    from workbench.debug.transforms import chunk_shard
    from workbench.layout.chunking import chunk_interval

    assert chunk_shard(n, start, length) == expected
    if expected is not None:
        rank, world = expected
        assert chunk_interval(n, world, rank) == (start, start + length)


def test_first_rows_no_split_gives_are_a_shape_mismatch(tmp_path) -> None:
    # issue 22.3: 7 of 24 rows is no rank's shard under any world size (24 over W: chunks 12, 8, 6, 5, 4, 3, ...)
    ref = write(tmp_path / "ref", model())
    report = diff_checkpoints(ref, broken(tmp_path, "first7", _set(HEAD, lambda x: x[:7].clone())))
    (finding,) = report.findings
    assert finding.kind == "shape_mismatch" and finding.transform.startswith("equals rows 0:7 of the expected")
    assert finding.evidence["verified"] == "bit for bit"
    # 8 rows at 16: rank 2's chunk of 3 (8, 8, 8)
    (finding,) = diff_checkpoints(ref, broken(tmp_path, "r2", _set(HEAD, lambda x: x[16:].clone()))).findings
    assert finding.kind == "partial_shard" and "rank 2's contiguous shard of 3" in finding.transform


def test_round_trip_keeps_both_dtypes_honest(tmp_path) -> None:
    # issue 22.4: float32 both sides, values rounded through bf16: precision_lost, and the evidence says so
    ref = write(tmp_path / "ref", model())
    bad = broken(tmp_path, "rt", _set(NORM, lambda x: x.bfloat16().float()))
    (finding,) = diff_checkpoints(ref, bad).findings
    assert finding.kind == "precision_lost"
    assert finding.evidence["expected_dtype"] == finding.evidence["actual_dtype"] == "float32"
    assert "rounded to bfloat16" in finding.hint


def test_experts_shifted_by_one_are_called_shifted_not_copies(tmp_path) -> None:
    # expert i holds expert i+1's tensor (mod 3): no tensor appears twice, so "a copy (which ... holds too)" was wrong
    good = {k: v for k, v in _experts().items() if ".layers.0." in k and "down_proj" in k and ".experts.3." not in k}
    keys = sorted(good)
    bad = {keys[i]: good[keys[(i + 1) % 3]] for i in range(3)}
    report = diff_checkpoints(write(tmp_path / "ref", good), write(tmp_path / "bad", bad))
    assert [f.kind for f in report.findings] == ["misplaced_tensor"] * 3
    for i, key in enumerate(keys):
        (finding,) = report.by_key(key)
        held = keys[(i + 1) % 3]
        assert finding.transform == f"holds {held}'s tensor, while {held} holds yet another one"
        assert "the keys are shifted" in finding.hint and "copy" not in finding.transform


def test_nan_and_inf_are_named_not_hidden_by_max_abs_diff(reference, tmp_path) -> None:
    bad = broken(tmp_path, "n", _set(NORM, lambda x: x.index_fill(0, torch.tensor([1, 2]), float("nan"))
                                     .index_fill(0, torch.tensor([5]), float("inf"))))
    (finding,) = diff_checkpoints(reference, bad).findings
    assert finding.kind == "value_mismatch" and finding.evidence["max_abs_diff"] == 0.0
    assert finding.evidence["actual_nan"] == 2 and finding.evidence["actual_inf"] == 1
    assert "2 NaN and 1 infinite values where the reference is finite" in finding.hint


def test_a_dtype_mismatch_says_which_way_the_cast_goes_and_never_guesses_values(tmp_path) -> None:
    g = torch.Generator().manual_seed(7)
    master = torch.randn(8, 6, generator=g)
    ref = write(tmp_path / "ref", {"w": master.bfloat16(), "v": master.bfloat16()})
    # the fp32 master weights saved where bf16 is expected: cast down they are the reference bit for bit
    ck = write(tmp_path / "ck", {"w": master, "v": master.bfloat16().t().contiguous().float()})
    report = diff_checkpoints(ref, ck)
    (w,) = report.by_key("w")
    assert w.kind == "dtype_mismatch" and w.transform == "the reference is this cast to bfloat16"
    assert w.evidence["verified"] == "bit for bit" and "master weights" in w.hint
    (v,) = report.by_key("v")  # transposed and cast: the shapes differ, so nothing is said about the values
    assert v.kind == "dtype_mismatch" and "shaped [6, 8] where [8, 6] is expected" in v.hint
    assert "values were not compared" in v.hint and "differ beyond a cast" not in v.hint


def test_a_fused_key_is_its_two_expected_keys_not_one_to_drop(tmp_path) -> None:
    # gate and up saved fused (gate_up_proj = cat([gate, up])) where the reference has them apart: the old report
    # said "missing" twice ("re-save with it") and "unexpected: drop it or map it", which would throw the weights away
    good = {k: v for k, v in _experts().items() if ".layers.0." in k and ".experts.0." in k}
    gate, up, down = (f"model.layers.0.mlp.experts.0.{p}_proj.weight" for p in ("gate", "up", "down"))
    fused = "model.layers.0.mlp.experts.0.gate_up_proj.weight"
    bad = {down: good[down], fused: torch.cat([good[gate], good[up]])}
    report = diff_checkpoints(write(tmp_path / "ref", good), write(tmp_path / "bad", bad))
    (finding,) = report.findings
    assert (finding.kind, finding.key) == ("renamed_key", fused)
    assert finding.evidence["expected_keys"] == [gate, up] and finding.evidence["verified"] == "by content hash"
    assert "split it into its keys" in finding.hint and "drop" not in finding.hint
    swapped = {down: good[down], fused: torch.cat([good[up], good[gate]])}  # up first: the order is named
    (finding,) = diff_checkpoints(tmp_path / "ref", write(tmp_path / "swapped", swapped)).findings
    assert finding.evidence["expected_keys"] == [up, gate]
    other = {down: good[down], fused: torch.cat([good[gate], good[gate] + 1])}  # not the two keys: no such claim
    kinds = sorted(f.kind for f in diff_checkpoints(tmp_path / "ref", write(tmp_path / "other", other)).findings)
    assert kinds == ["missing_key", "missing_key", "unexpected_key"]


@pytest.mark.parametrize("shape", [(4, 8, 6), (3, 5, 5), (2, 3, 4, 6)], ids=["stacked", "square", "4d"])
def test_stacked_slices_stored_transposed_are_named(tmp_path, shape) -> None:
    # stacked experts saved [E, in, out] where [E, out, in] is expected: each slice along dim 0 transposed (the old
    # report: "no replication, shard, padding or transpose explains the shapes")
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    report = diff_checkpoints(write(tmp_path / "ref", {"experts.w": w}),
                              write(tmp_path / "bad", {"experts.w": w.transpose(-1, -2).contiguous()}))
    (finding,) = report.findings
    assert finding.kind == "permuted" and finding.transform == "last two dims transposed"
    assert finding.evidence["verified"] == "bit for bit"
    off = w.transpose(-1, -2).contiguous()
    off.view(-1)[0] += 1  # one element off: no transform holds
    (finding,) = diff_checkpoints(tmp_path / "ref", write(tmp_path / "off", {"experts.w": off})).findings
    assert finding.transform != "last two dims transposed"


def test_reorders_of_a_3d_tensors_trailing_dims_are_named(tmp_path) -> None:
    # stacked experts [E, H, 2I]: the old check indexed the stored 3-d tensor with a mask over its trailing dims
    # flattened (as the signatures count them) and crashed with IndexError (exit 3)
    key = "model.layers.0.mlp.experts.gate_up_proj"
    w = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(5)).bfloat16()
    gate, up = w.chunk(2, dim=2)
    ranks_concatenated = torch.cat([gate[..., :4], up[..., :4], gate[..., 4:], up[..., 4:]], dim=2)  # IS(2,2), tp=2
    ref = write(tmp_path / "ref", {key: w})
    (finding,) = diff_checkpoints(ref, write(tmp_path / "last", {key: ranks_concatenated})).findings
    assert finding.kind == "permuted" and finding.evidence["verified"] == "bit for bit"
    assert finding.transform == "interleaved shard gathered as contiguous (IS(2,2) over 2 ranks)"
    assert (finding.evidence["dim"], finding.evidence["order"]) == (2, [0, 2, 1, 3])
    down = "model.layers.0.mlp.experts.down_proj"
    reversed_rows = torch.cat([w[:, 4:], w[:, :4]], dim=1)  # dim 1 in reverse rank order over 2
    ref = write(tmp_path / "ref_down", {down: w})
    (finding,) = diff_checkpoints(ref, write(tmp_path / "dim1", {down: reversed_rows})).findings
    assert finding.kind == "permuted" and finding.transform == "rank order reversed (S(1) over 2 ranks)"
    assert (finding.evidence["dim"], finding.evidence["order"]) == (1, [1, 0])
    moved = w.clone()  # two trailing slices swapped in every expert: no named transform, recovered, never a crash
    moved[:, 0, 0], moved[:, 1, 3] = w[:, 1, 3], w[:, 0, 0]
    (finding,) = diff_checkpoints(ref, write(tmp_path / "any", {down: moved})).findings
    assert finding.kind == "permuted" and finding.evidence["verified"] == "bit for bit"
    assert finding.transform.startswith("slices reordered on dims 1-2 flattened in blocks of 1")


def test_a_value_change_in_a_3d_tensor_builds_no_map_of_its_trailing_dims(tmp_path, monkeypatch) -> None:
    # each candidate reorder of dims 1.. was expanded into a map of every trailing element before its signature was
    # checked: a diff of one changed value in stacked experts took 25-57x as long (minutes per key at GPT-OSS sizes)
    from workbench.debug import analyze

    built = []
    real = analyze.on_dim
    monkeypatch.setattr(analyze, "on_dim", lambda *a, **k: built.append(a[0].transform) or real(*a, **k))
    key = "model.layers.0.mlp.experts.gate_up_proj"
    w = torch.randn(4, 24, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    changed = w.clone()
    changed[3, 5, 7] += 1
    (finding,) = diff_checkpoints(write(tmp_path / "ref", {key: w}), write(tmp_path / "act", {key: changed})).findings
    assert finding.kind == "value_mismatch" and built == []
    gate, up = w.chunk(2, dim=2)  # a real reorder still builds the one map that holds, and is named
    swapped = torch.cat([up, gate], dim=2)
    (finding,) = diff_checkpoints(write(tmp_path / "ref2", {key: w}), write(tmp_path / "sw", {key: swapped})).findings
    assert finding.kind == "permuted" and finding.evidence["dim"] == 2 and 1 <= len(built) <= 3, built


@pytest.mark.parametrize("stored", [(1,), (24,), (4, 6)], ids=["scalar_as_1", "flattened", "viewed"])
def test_the_same_bytes_in_another_shape_are_a_reshape_never_a_reorder(tmp_path, stored) -> None:
    # a scalar saved as [1] was "slices reordered on dim 0 ... block order [0]" (the identity), a flattened or
    # re-viewed matrix "no replication, shard, padding or transpose explains the shapes"
    g = torch.Generator().manual_seed(4)
    good = torch.tensor(1.5) if stored == (1,) else torch.randn(6, 4, generator=g)
    ref = write(tmp_path / "ref", {"w": good})
    (finding,) = diff_checkpoints(ref, write(tmp_path / "bad", {"w": good.reshape(stored)})).findings
    assert finding.kind == "shape_mismatch" and finding.transform == "same bytes, stored with another shape"
    assert finding.evidence["actual_shape"] == list(stored) and finding.evidence["verified"] == "bit for bit"
    assert f"save it with shape {list(good.shape)}" in finding.hint and "shards" not in finding.hint
    off = good.reshape(stored).clone()
    off.view(-1)[0] += 1  # other values too: no reshape claimed, and never an identity order
    (finding,) = diff_checkpoints(ref, write(tmp_path / "off", {"w": off})).findings
    assert finding.transform != "same bytes, stored with another shape" and "order" not in finding.evidence


@pytest.mark.parametrize("rows", [(16, 8, 8), (8, 8, 8)], ids=["gqa", "mha"])
def test_q_k_v_fused_under_one_key_are_named_not_dropped(tmp_path, rows) -> None:
    # q, k, v saved as one qkv_proj: only two equal halves were tried, so the report said 3 missing keys and one
    # unexpected key to "drop it"
    g = torch.Generator().manual_seed(6)
    q, k, v = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    fused = "model.layers.0.self_attn.qkv_proj.weight"
    good = {name: torch.randn(r, 8, generator=g).bfloat16() for name, r in zip((q, k, v), rows)}
    ref = write(tmp_path / "ref", good)
    for name, order in (("qkv", (q, k, v)), ("kqv", (k, q, v)), ("vkq", (v, k, q))):
        bad = write(tmp_path / name, {fused: torch.cat([good[p] for p in order])})
        (finding,) = diff_checkpoints(ref, bad).findings
        assert (finding.kind, finding.key) == ("renamed_key", fused), finding
        assert finding.evidence["expected_keys"] == list(order) and "three expected keys" in finding.hint
        assert finding.evidence["verified"] == "by content hash" and "drop" not in finding.hint
    other = write(tmp_path / "other", {fused: torch.cat([good[q], good[k], good[v] + 1])})  # not their bytes
    report = diff_checkpoints(ref, other)
    (unexpected,) = [f for f in report.findings if f.kind == "unexpected_key"]
    assert f"{q}, {k} and {v} fused on dim 0" in unexpected.hint and "do not drop it" in unexpected.hint
    missing = [f for f in report.findings if f.kind == "missing_key"]
    assert len(missing) == 3 and all(f"part of {fused}" in f.hint for f in missing)
    cast = write(tmp_path / "cast", {fused: torch.cat([good[q], good[k], good[v]]).float()})  # fused and upcast
    report = diff_checkpoints(ref, cast)  # never compared: the hints must not say the bytes differ
    (unexpected,) = [f for f in report.findings if f.kind == "unexpected_key"]
    assert "stored as F32 where BF16 is expected" in unexpected.hint and "other bytes" not in unexpected.hint
    missing = [f for f in report.findings if f.kind == "missing_key"]
    assert len(missing) == 3 and all("the bytes were not compared" in f.hint for f in missing)
