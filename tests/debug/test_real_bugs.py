"""Realistic bugs of a sharded MoE save (fsdp=2 x ep=2 x etp=2, fused experts, as ``build_qwen3_moe`` lays them out),
each built by hand from the layout's own shards: the cause a finding names must be one this layout can produce."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.debug.corpus import write
from workbench.debug import diagnose, diff_checkpoints
from workbench.layout.layout_file import load_layout

EXPERTS, INTER, HIDDEN = 4, 8, 16
W1W3 = "layers.0.mlp.experts.fused_w1w3"
PREFIX = "model.layers.0.mlp.experts"
LAYOUT = f"""name = "qwen3-moe-etp"
[mesh]
shape = [2, 2, 2]
dim_names = ["fsdp", "ep", "etp"]
[[param]]
name = "{W1W3}"
hf_keys = ["{PREFIX}.{{experts}}.gate_proj.weight", "{PREFIX}.{{experts}}.up_proj.weight"]
keys_for = {{ experts = {EXPERTS} }}
global_shape = [{EXPERTS * 2 * INTER}, {HIDDEN}]
fused_dim = 0
mesh_dims = ["ep", "etp", "fsdp"]
placements = ["S(0)", "IS(0,4)", "S(0)"]
dtype = "bfloat16"
[[param]]
name = "layers.0.mlp.experts.fused_w2"
hf_keys = ["{PREFIX}.{{experts}}.down_proj.weight"]
keys_for = {{ experts = {EXPERTS} }}
global_shape = [{EXPERTS * HIDDEN}, {INTER}]
fused_dim = 0
mesh_dims = ["ep", "etp", "fsdp"]
placements = ["S(0)", "S(1)", "S(0)"]
dtype = "bfloat16"
"""


def _experts(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(EXPERTS):
        for proj, shape in (("gate", (INTER, HIDDEN)), ("up", (INTER, HIDDEN)), ("down", (HIDDEN, INTER))):
            out[f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight"] = torch.randn(*shape, generator=g).bfloat16()
    return out


def _layout(tmp_path: Path):
    path = tmp_path / "layout.toml"
    path.write_text(LAYOUT)
    return path, load_layout(path)


def _fsdp_reversed(layout, full: torch.Tensor) -> torch.Tensor:
    """``full`` gathered with each (ep, etp) slot's two FSDP shards in reverse order, from the layout's own runs."""
    spec, mesh = layout.specs[W1W3], layout.mesh
    out = torch.empty_like(full)
    for rank in mesh.all_ranks():
        fsdp, ep, etp = mesh.coordinate(rank)
        partner = mesh.all_ranks()[((1 - fsdp) * 2 + ep) * 2 + etp]
        local = torch.empty(spec.local_shape(rank), dtype=full.dtype)
        for run in spec.runs(rank):
            local[run.local_slices()] = full[run.global_slices()]
        for run in spec.runs(partner):
            out[run.global_slices()] = local[run.local_slices()]
    return out


def test_a_gate_up_swap_under_expert_tp_is_not_blamed_on_an_fsdp_order_this_layout_cannot_make(tmp_path) -> None:
    _, layout = _layout(tmp_path)
    good = _experts()
    keys = layout.specs[W1W3].hf_keys
    full = torch.cat([good[k] for k in keys])
    swapped = {k: good[k.replace("gate_proj", "up_proj") if "gate_proj" in k else k.replace("up_proj", "gate_proj")]
               if k in keys else v for k, v in good.items()}
    # what this layout's FSDP shards in reverse order really give: other bytes than the swap
    reversed_fsdp = _fsdp_reversed(layout, full)
    assert not torch.equal(reversed_fsdp, torch.cat([swapped[k] for k in keys]))
    report = diff_checkpoints(write(tmp_path / "ref", good), write(tmp_path / "bad", swapped), layout=layout)
    (finding,) = report.by_key(W1W3)
    assert finding.kind == "permuted", report.to_text()
    assert "gate/up halves swapped" in finding.transform, report.to_text()
    assert "fsdp" not in finding.transform and "fsdp" not in finding.hint, report.to_text()


def test_a_transposed_expert_down_proj_is_not_told_to_stay_untransposed(tmp_path) -> None:
    # every expert's down_proj [H, I] saved as [I, H]; ep and fsdp cut fused_w2 only between whole keys, so the shape
    # is no "shards of a dim-0 cut joined on dim 1": the layout alone cannot rule the transpose out
    path, _ = _layout(tmp_path)
    bad = {k: v.T.contiguous() if "down_proj" in k else v for k, v in _experts().items()}
    report = diagnose(write(tmp_path / "bad", bad), path)
    findings = report.by_key("model.layers.0.mlp.experts.0.down_proj.weight")
    assert findings, report.to_text()
    for f in findings:
        assert "S(0)@ep" not in (f.transform or "") and "S(0)@fsdp" not in (f.transform or ""), report.to_text()
        assert "do not transpose" not in f.hint, report.to_text()
        assert "transpose" in f.hint, report.to_text()


def test_a_stale_key_map_that_saved_stacked_or_fused_experts_is_told_to_split_them_not_to_drop_them(tmp_path) -> None:
    # the runtime's tensors kept under their own names: gate/up stacked per expert [E, 2I, H] (each slice gate then
    # up), down fused flat [E * H, I] in reverse expert order; every byte of the missing keys is there
    good = {**_experts(), "model.norm.weight": torch.ones(HIDDEN)}
    gate_up = [k for e in range(EXPERTS) for k in (f"{PREFIX}.{e}.gate_proj.weight", f"{PREFIX}.{e}.up_proj.weight")]
    down = [f"{PREFIX}.{e}.down_proj.weight" for e in reversed(range(EXPERTS))]
    bad = {"model.norm.weight": good["model.norm.weight"],
           f"{PREFIX}.gate_up_proj": torch.stack([torch.cat([good[gate_up[2 * e]], good[gate_up[2 * e + 1]]])
                                                  for e in range(EXPERTS)]),
           f"{PREFIX}.fused_w2": torch.cat([good[k] for k in down])}
    report = diagnose(write(tmp_path / "bad", bad), write(tmp_path / "ref", good))
    assert {f.kind for f in report.findings} == {"renamed_key"}, report.to_text()
    (stacked,) = report.by_key(f"{PREFIX}.gate_up_proj")
    assert stacked.evidence["expected_keys"] == gate_up, report.to_text()
    assert "stacked on a new dim 0" in stacked.transform and "drop it or map it" not in stacked.hint, report.to_text()
    assert "stale" in stacked.hint and "split" in stacked.hint, report.to_text()
    (fused,) = report.by_key(f"{PREFIX}.fused_w2")
    assert fused.evidence["expected_keys"] == down, report.to_text()
    assert "concatenated on dim 0" in fused.transform and "[3, 2, 1, 0]" in fused.transform, report.to_text()


def _one_file_from_an_older_save(tmp_path: Path, frozen: int) -> tuple[Path, Path, str, list[str]]:
    """The reference in several files, and a copy whose second file comes from an earlier save (same keys, other
    values but for its first ``frozen`` keys): ``(reference, copy, that file, its keys)``."""
    good, older = _experts(seed=0), _experts(seed=1)
    ref = write(tmp_path / "ref", good, max_shard_bytes=1024)
    bad = write(tmp_path / "bad", good, max_shard_bytes=1024)
    weight_map = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    stale = sorted(set(weight_map.values()))[1]
    keys = sorted(k for k, f in weight_map.items() if f == stale)
    assert len(keys) >= 2 + frozen and len(set(weight_map.values())) >= 3
    save_file({k: good[k] if i < frozen else older[k] for i, k in enumerate(keys)}, bad / stale,
              metadata={"format": "pt"})
    return ref, bad, stale, keys


def test_the_keys_of_one_data_file_from_an_older_save_are_named_by_that_file(tmp_path) -> None:
    # every key of that file differs, every other file's keys are equal
    ref, bad, stale, keys = _one_file_from_an_older_save(tmp_path, frozen=0)
    report = diagnose(bad, ref)
    assert sorted(f.key for f in report.findings) == keys, report.to_text()
    for f in report.findings:
        assert f.kind == "value_mismatch" and f.evidence["file"] == stale, report.to_text()
        assert stale in f.hint and "another save" in f.hint and "another step" not in f.hint, report.to_text()


def test_an_older_file_whose_frozen_keys_did_not_change_is_still_named(tmp_path) -> None:
    ref, bad, stale, keys = _one_file_from_an_older_save(tmp_path, frozen=1)
    report = diagnose(bad, ref)
    assert sorted(f.key for f in report.findings) == keys[1:], report.to_text()
    for f in report.findings:
        assert f.evidence["file"] == stale and f.evidence["file_keys"] == len(keys), report.to_text()
        assert f"{len(keys) - 1} of its {len(keys)}" in f.hint and "another save" in f.hint, report.to_text()


def test_an_index_that_maps_one_key_to_the_wrong_file_is_one_entry_to_fix_not_a_resave(tmp_path) -> None:
    good = _experts()
    ref = write(tmp_path / "ref", good, max_shard_bytes=1024)
    bad = write(tmp_path / "bad", good, max_shard_bytes=1024)
    index = bad / "model.safetensors.index.json"
    body = json.loads(index.read_text())
    key = f"{PREFIX}.2.up_proj.weight"
    holder = body["weight_map"][key]
    wrong = next(f for f in sorted(set(body["weight_map"].values())) if f != holder)
    body["weight_map"][key] = wrong
    index.write_text(json.dumps(body))
    report = diagnose(bad, ref)
    (finding,) = report.findings
    assert finding.kind == "index_inconsistent" and finding.key == key, report.to_text()
    assert finding.evidence["file"] == wrong and finding.evidence["found_in"] == holder, report.to_text()
    assert f"maps {key} to {wrong} but it is in {holder}" in finding.hint, report.to_text()
    assert "re-save" not in finding.hint and "different saves" not in finding.hint, report.to_text()
    assert report.stats["equal"] == len(good), report.to_text()  # the key's values are compared from where it is


def test_against_a_layout_a_stale_key_map_s_stacked_experts_are_not_a_key_to_drop(tmp_path) -> None:
    path, _ = _layout(tmp_path)
    good = _experts()
    bad = {f"{PREFIX}.gate_up_proj": torch.stack([torch.cat([good[f"{PREFIX}.{e}.gate_proj.weight"],
                                                             good[f"{PREFIX}.{e}.up_proj.weight"]])
                                                  for e in range(EXPERTS)]),
           f"{PREFIX}.down_proj": torch.stack([good[f"{PREFIX}.{e}.down_proj.weight"] for e in range(EXPERTS)])}
    report = diagnose(write(tmp_path / "bad", bad), path)
    for key, proj in ((f"{PREFIX}.gate_up_proj", "gate_proj"), (f"{PREFIX}.down_proj", "down_proj")):
        (finding,) = report.by_key(key)
        assert "stale" in finding.hint and "do not drop it" in finding.hint, report.to_text()
        assert f"{PREFIX}.{{0..3}}.{proj}.weight" in finding.hint, report.to_text()
    for f in report.findings:
        if f.kind == "missing_key":
            assert "re-save with it" not in f.hint, report.to_text()


def _tied(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(32, HIDDEN, generator=g).bfloat16()
    return {**_experts(seed), "model.embed_tokens.weight": embed, "lm_head.weight": embed.clone()}


def test_a_tie_broken_at_save_names_the_key_that_still_equals_the_reference(tmp_path) -> None:
    # the reference ties lm_head to embed_tokens (equal values); the save wrote lm_head from a stale copy
    good = _tied()
    bad = {**good, "lm_head.weight": (good["lm_head.weight"].float() + 0.01).bfloat16()}
    report = diagnose(write(tmp_path / "bad", bad), write(tmp_path / "ref", good))
    (finding,) = report.findings
    assert finding.key == "lm_head.weight" and finding.kind == "value_mismatch", report.to_text()
    assert finding.evidence["tied_to"] == "model.embed_tokens.weight", report.to_text()
    assert finding.evidence["tie"] == "broken: model.embed_tokens.weight equals the reference", report.to_text()
    assert "tie was broken" in finding.hint and "model.embed_tokens.weight still equals" in finding.hint, \
        report.to_text()
    assert "another run" not in finding.hint, report.to_text()


def test_a_tie_broken_with_both_keys_changed_says_neither_equals_the_reference(tmp_path) -> None:
    good = _tied()
    bad = {**good, "lm_head.weight": (good["lm_head.weight"].float() + 0.01).bfloat16(),
           "model.embed_tokens.weight": (good["lm_head.weight"].float() - 0.01).bfloat16()}
    report = diagnose(write(tmp_path / "bad", bad), write(tmp_path / "ref", good))
    assert sorted(f.key for f in report.findings) == ["lm_head.weight", "model.embed_tokens.weight"], \
        report.to_text()
    for f in report.findings:
        assert f.evidence["tie"] == "broken: neither key equals the reference", report.to_text()
        assert "tie was broken" in f.hint, report.to_text()
    moved = (good["lm_head.weight"].float() + 0.01).bfloat16()  # both keys moved together: still tied, no broken tie
    together = {**good, "lm_head.weight": moved, "model.embed_tokens.weight": moved.clone()}
    report = diagnose(write(tmp_path / "together", together), tmp_path / "ref")
    assert len(report.findings) == 2, report.to_text()
    for f in report.findings:
        assert "tie" not in f.evidence and "tie was broken" not in f.hint, report.to_text()



def test_the_reference_s_own_layout_file_names_the_ranks_when_the_checkpoint_carries_none(tmp_path) -> None:
    # the reference was saved with its layout (workbench_layout.toml), the broken copy by hand without one: the
    # reference's layout gives the fused analysis and the ranks whose shards differ
    good = _experts()
    ref = write(tmp_path / "ref", good)
    (ref / "workbench_layout.toml").write_text(LAYOUT)
    bad = dict(good)
    key = f"{PREFIX}.0.down_proj.weight"
    bad[key] = good[key].clone()
    bad[key][:, 4:] = 0  # the columns etp=1 holds (S(1)@etp) never written; of ep=0's experts 0 and 1, fsdp=0 holds 0
    swapped = {k: good[k.replace("gate_proj", "up_proj") if "gate_proj" in k else k.replace("up_proj", "gate_proj")]
               for k in good if "gate_proj" in k or "up_proj" in k}
    report = diagnose(write(tmp_path / "bad", {**bad, **swapped}), ref)
    assert "the reference's workbench_layout.toml" in report.stats["layout_file"], report.to_text()
    (fused,) = report.by_key(W1W3)
    assert fused.kind == "permuted" and "gate/up halves swapped" in fused.transform, report.to_text()
    (down,) = report.by_key(key)
    layout = load_layout(ref / "workbench_layout.toml")
    holders = [r for r in layout.mesh.all_ranks() if layout.mesh.coordinate(r) == (0, 0, 1)]
    assert down.evidence["differing_ranks"] == holders, report.to_text()
    assert "etp=1" in down.evidence["written_from"], report.to_text()


def test_a_fused_key_whose_parts_are_not_in_the_layout_s_fused_order_is_named(tmp_path) -> None:
    # a converter fused each expert as [up; gate] (and stacked them) where the layout's fused_w1w3 has gate then up
    _, layout = _layout(tmp_path)
    good = _experts()
    ref = write(tmp_path / "ref", good)
    rest = {k: v for k, v in good.items() if "gate_proj" not in k and "up_proj" not in k}
    gate, up = (lambda e: f"{PREFIX}.{e}.gate_proj.weight"), (lambda e: f"{PREFIX}.{e}.up_proj.weight")
    per_expert = {**rest, **{f"{PREFIX}.{e}.gate_up_proj.weight": torch.cat([good[up(e)], good[gate(e)]])
                             for e in range(EXPERTS)}}
    report = diagnose(write(tmp_path / "fused", per_expert), ref, layout=layout)
    assert report.kinds() == {"renamed_key": EXPERTS}, report.to_text()
    for e in range(EXPERTS):
        (f,) = report.by_key(f"{PREFIX}.{e}.gate_up_proj.weight")
        assert f.evidence["layout_order"] == [gate(e), up(e)] and f.evidence["parameter"] == W1W3, report.to_text()
        assert f.evidence["order_vs_layout"] == f"gate/up swapped: {up(e)} before {gate(e)}", report.to_text()
        assert "gate and up swapped (up before gate)" in f.hint and "fix the fused order" in f.hint, report.to_text()
    stacked = {**rest, f"{PREFIX}.gate_up_proj": torch.stack([torch.cat([good[up(e)], good[gate(e)]])
                                                             for e in range(EXPERTS)])}
    (f,) = diagnose(write(tmp_path / "stacked", stacked), ref, layout=layout).findings
    assert f.evidence["order_vs_layout"].startswith(f"gate/up swapped in each of {EXPERTS} pairs"), f
    # in the layout's order, or with no layout: nothing said of the order
    right = {**rest, f"{PREFIX}.gate_up_proj": torch.stack([torch.cat([good[gate(e)], good[up(e)]])
                                                           for e in range(EXPERTS)])}
    for report in (diagnose(write(tmp_path / "right", right), ref, layout=layout),
                   diagnose(tmp_path / "stacked", ref)):
        (f,) = report.findings
        assert "layout_order" not in f.evidence and "fused order" not in f.hint, report.to_text()


def test_a_stale_key_map_s_keys_joined_on_a_dim_other_than_0_are_named_with_that_dim(tmp_path) -> None:
    # gate and up of each expert concatenated on dim 1 ([I, 2H]); the experts' down_proj stacked on a new dim 1
    # ([H, E, I]); and in a second save the experts stacked on dim 0 with each slice [gate | up] on its dim 1
    good = _experts()
    ref = write(tmp_path / "ref", good)
    gate, up = (lambda e: f"{PREFIX}.{e}.gate_proj.weight"), (lambda e: f"{PREFIX}.{e}.up_proj.weight")
    down = [f"{PREFIX}.{e}.down_proj.weight" for e in range(EXPERTS)]
    bad = {**{f"{PREFIX}.{e}.gate_up_proj.weight": torch.cat([good[gate(e)], good[up(e)]], dim=1)
              for e in range(EXPERTS)},
           f"{PREFIX}.down_proj": torch.stack([good[k] for k in down], dim=1)}
    report = diagnose(write(tmp_path / "bad", bad), ref)
    assert report.kinds() == {"renamed_key": EXPERTS + 1}, report.to_text()
    for e in range(EXPERTS):
        (f,) = report.by_key(f"{PREFIX}.{e}.gate_up_proj.weight")
        assert f.evidence["expected_keys"] == [gate(e), up(e)], report.to_text()
        assert "concatenated on dim 1" in f.transform and "do not drop it" in f.hint, report.to_text()
    (f,) = report.by_key(f"{PREFIX}.down_proj")
    assert f.evidence["expected_keys"] == down and "stacked on a new dim 1" in f.transform, report.to_text()
    stacked = {f"{PREFIX}.gate_up_proj": torch.stack([torch.cat([good[gate(e)], good[up(e)]], dim=1)
                                                     for e in range(EXPERTS)]),
               **{k: good[k] for k in down}}
    report = diagnose(write(tmp_path / "stacked", stacked), ref)
    (f,) = report.findings
    assert f.evidence["expected_keys"] == [k for e in range(EXPERTS) for k in (gate(e), up(e))], report.to_text()
    assert "stacked on a new dim 0" in f.transform and "concatenated on dim 1" in f.transform, report.to_text()


def _no_drop_advice(report, key: str, parts: list[str], words: str) -> None:
    """``key`` is named, by shape, as ``parts`` ``words`` (a key to split, not to drop); each part names ``key``."""
    (finding,) = report.by_key(key)
    assert finding.kind == "unexpected_key" and words in finding.hint, report.to_text()
    assert "stale" in finding.hint and "split it" in finding.hint, report.to_text()
    assert "do not drop it" in finding.hint and "add it to the key map" not in finding.hint, report.to_text()
    for part in parts:
        (missing,) = report.by_key(part)
        assert missing.kind == "missing_key" and f"of {key} ({words}" in missing.hint, report.to_text()
        assert "re-save with it" not in missing.hint, report.to_text()


def _plain_layout(shapes: dict[str, tuple[int, ...]]):
    """A one-rank layout (bfloat16) of one parameter per key, each key its own parameter."""
    from torch.distributed.tensor import Replicate

    import workbench as wb

    mesh = wb.MeshSpec((1,), ("dp",))
    specs = {k: wb.LoadSpec.from_placements(k, k, shape, mesh, [Replicate()]) for k, shape in shapes.items()}
    return wb.Layout(mesh, specs, dict.fromkeys(specs, "bfloat16"), name="conv1d")


def test_against_a_layout_unequal_q_k_v_joined_on_dim_1_are_named_by_shape(tmp_path) -> None:
    # a GPT-2-style Conv1D layout ([in, out]): q [H, Hq], k and v [H, Hk] saved as one [H, Hq+2Hk] key joined on
    # dim 1; by shape only the dim-0 join was tried, so the key got "add it to the key map, or drop it"
    hidden, hq, hk = 16, 16, 8
    attn = "model.layers.0.self_attn"
    q, k, v, o = (f"{attn}.{p}_proj.weight" for p in ("q", "k", "v", "o"))
    layout = _plain_layout({q: (hidden, hq), k: (hidden, hk), v: (hidden, hk), o: (hq, hidden)})
    g = torch.Generator().manual_seed(0)
    tensors = {key: torch.randn(*layout.specs[key].global_shape, generator=g).bfloat16() for key in (q, k, v, o)}
    qkv = f"{attn}.qkv_proj.weight"
    joined = torch.cat([tensors[q], tensors[k], tensors[v]], dim=1)
    (tmp_path / "joined").mkdir()
    save_file({qkv: joined, o: tensors[o]}, str(tmp_path / "joined" / "model.safetensors"))
    report = diagnose(tmp_path / "joined", layout)
    assert report.kinds() == {"missing_key": 3, "unexpected_key": 1}, report.to_text()
    _no_drop_advice(report, qkv, [q, k, v], "joined on dim 1")
    assert f"{q}, {k} and {v} joined on dim 1" in report.by_key(qkv)[0].hint, report.to_text()
    # the same elements in a shape no join makes (the joined key transposed): the plain hints, no parts named
    (tmp_path / "transposed").mkdir()
    save_file({qkv: joined.T.contiguous(), o: tensors[o]}, str(tmp_path / "transposed" / "model.safetensors"))
    report = diagnose(tmp_path / "transposed", layout)
    (finding,) = report.by_key(qkv)
    assert "add it to the key map, or drop it" in finding.hint and "joined" not in finding.hint, report.to_text()
    for part in (q, k, v):
        assert "re-save with it" in report.by_key(part)[0].hint, report.to_text()


def test_against_a_layout_gate_and_up_joined_on_dim_1_are_named_by_shape(tmp_path) -> None:
    # each expert's gate and up [I, H] saved as one [I, 2H] key joined on dim 1
    path, _ = _layout(tmp_path)
    good = _experts()
    gate, up = (lambda e: f"{PREFIX}.{e}.gate_proj.weight"), (lambda e: f"{PREFIX}.{e}.up_proj.weight")
    bad = {k: t for k, t in good.items() if "down_proj" in k}
    bad.update({f"{PREFIX}.{e}.gate_up_proj.weight": torch.cat([good[gate(e)], good[up(e)]], dim=1)
                for e in range(EXPERTS)})
    (tmp_path / "bad").mkdir()
    save_file(bad, str(tmp_path / "bad" / "model.safetensors"))
    report = diagnose(tmp_path / "bad", path)
    assert report.kinds() == {"missing_key": 2 * EXPERTS, "unexpected_key": EXPERTS}, report.to_text()
    for e in range(EXPERTS):
        fused = f"{PREFIX}.{e}.gate_up_proj.weight"
        _no_drop_advice(report, fused, [gate(e), up(e)], "joined on dim 1")
        assert f"{gate(e)} and {up(e)} joined on dim 1" in report.by_key(fused)[0].hint, report.to_text()


def test_against_a_layout_experts_stacked_on_a_new_dim_1_are_named_by_shape(tmp_path) -> None:
    # the experts' down_proj [H, I] saved as one [H, E, I] key (E < H): it was called stacked "on dim 0"
    path, _ = _layout(tmp_path)
    good = _experts()
    down = [f"{PREFIX}.{e}.down_proj.weight" for e in range(EXPERTS)]
    bad = {k: t for k, t in good.items() if "down_proj" not in k}
    bad[f"{PREFIX}.down_proj"] = torch.stack([good[k] for k in down], dim=1)
    (tmp_path / "bad").mkdir()
    save_file(bad, str(tmp_path / "bad" / "model.safetensors"))
    report = diagnose(tmp_path / "bad", path)
    assert report.kinds() == {"missing_key": EXPERTS, "unexpected_key": 1}, report.to_text()
    _no_drop_advice(report, f"{PREFIX}.down_proj", down, "stacked on a new dim 1")
    hint = report.by_key(f"{PREFIX}.down_proj")[0].hint
    assert f"{PREFIX}.{{0..3}}.down_proj.weight stacked on a new dim 1" in hint and "dim 0" not in hint, hint
