"""diagnose against a reference, a Layout (TOML) and a state dict; the CLI's exit statuses and JSON."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.debug.corpus import broken, model, write
from workbench.debug import Finding, Report, diagnose
from workbench.debug.cli import register
from workbench.layout.layout_file import load_layout

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "sample_meshes" / "toy_expert_tp.toml"


def _toy_tensors() -> dict[str, torch.Tensor]:
    """The toy layout's HF keys at their checkpoint shapes and dtypes (from the TOML file, read by eye)."""
    g = torch.Generator().manual_seed(3)
    out = {"model.embed_tokens.weight": torch.randn(10, 4, generator=g).bfloat16(),
           "model.layers.0.self_attn.q_proj.weight": torch.randn(6, 4, generator=g).bfloat16()}
    for e in range(2):
        for p in ("gate", "up"):
            out[f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"] = torch.randn(4, 4, generator=g).bfloat16()
        out[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = torch.randn(4, 4, generator=g).bfloat16()
    out["model.norm.weight"] = torch.randn(4, generator=g)
    return out


def test_against_layout(tmp_path) -> None:
    layout = load_layout(TOY)
    good = write(tmp_path / "good", _toy_tensors())
    assert diagnose(good, layout).findings == ()
    assert diagnose(good, str(TOY)).ok
    bad = _toy_tensors()
    bad["model.embed_tokens.weight"] = bad["model.embed_tokens.weight"][:2].clone()  # one of 8 ranks: 2 rows
    bad["model.norm.weight"] = torch.cat([bad["model.norm.weight"]] * 2)  # 2 replica groups concatenated
    del bad["model.layers.0.self_attn.q_proj.weight"]
    bad["model.layers.0.mlp.experts.0.down_proj.weight"] = bad["model.layers.0.mlp.experts.0.down_proj.weight"].float()
    report = diagnose(write(tmp_path / "bad", bad), layout)
    kinds = {f.key: f.kind for f in report.findings}
    assert kinds == {
        "model.embed_tokens.weight": "partial_shard",
        "model.norm.weight": "replicated_concat",
        "model.layers.0.self_attn.q_proj.weight": "missing_key",
        "model.layers.0.mlp.experts.0.down_proj.weight": "dtype_mismatch",
    }, report.to_text()
    embed = report.by_key("model.embed_tokens.weight")[0]
    assert "S(0)@fsdp+ep+tp" in embed.transform and "shapes only" in embed.evidence["verified"]


def test_against_reference_and_state_dict(tmp_path) -> None:
    ref = write(tmp_path / "ref", model())
    bad = broken(tmp_path, "bad", lambda t: t.__setitem__("model.norm.weight", torch.cat([t["model.norm.weight"]] * 2)))
    for expected in (ref, str(ref), model(), torch.nn.Module()):
        report = diagnose(bad, expected)
        if isinstance(expected, torch.nn.Module):  # an empty module expects nothing: every key is unexpected
            assert {f.kind for f in report.findings} == {"unexpected_key"}
            continue
        assert [(f.kind, f.key) for f in report.findings] == [("replicated_concat", "model.norm.weight")]
    assert diagnose(ref, model()).ok
    with pytest.raises(TypeError, match="expected must be"):
        diagnose(ref, 42)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return args.func(args)


def test_cli_exit_statuses_and_json(tmp_path, capsys) -> None:
    ref = write(tmp_path / "ref", model())
    bad = broken(tmp_path, "bad", lambda t: t.pop("lm_head.weight"))
    assert _run(["inspect", str(ref)]) == 0
    assert _run(["diff", str(ref), str(ref)]) == 0
    capsys.readouterr()
    assert _run(["diff", str(ref), str(bad), "--json"]) == 1
    body = json.loads(capsys.readouterr().out)
    assert body["findings"][0]["kind"] == "missing_key" and body["findings"][0]["key"] == "lm_head.weight"
    assert _run(["diagnose", str(bad), "--expected", str(ref)]) == 1
    assert _run(["diagnose", str(tmp_path / "none"), "--expected", str(ref)]) == 2
    capsys.readouterr()
    assert _run(["inspect", str(tmp_path / "none"), "--json"]) == 2
    assert "does not exist" in json.loads(capsys.readouterr().out)["error"]
    toy = write(tmp_path / "toy", _toy_tensors())
    assert _run(["diagnose", str(toy), "--expected", str(TOY)]) == 0


def test_every_subcommand_description_has_an_example() -> None:
    parser = _parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subs.choices) == {"inspect", "diff", "diagnose"}
    for name, sub in subs.choices.items():
        assert "examples:" in sub.description and f"workbench {name} " in sub.description


def test_module_entry_point(tmp_path) -> None:
    ref = write(tmp_path / "ref", model())
    bad = broken(tmp_path, "bad", lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"].T.contiguous()))
    done = subprocess.run([sys.executable, "-m", "workbench.debug.cli", "diff", str(ref), str(bad)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    assert "permuted" in done.stdout and "transposed" in done.stdout


def test_report_text_json_html() -> None:
    f1 = Finding("value_mismatch", "b", {"max_abs_diff": 1.5}, "look")
    f2 = Finding("missing_key", "a", {}, "add it")
    report = Report(subject="x", reference="y", findings=(f1, f2))
    assert [f.kind for f in report.findings] == ["missing_key", "value_mismatch"]  # basic kinds first
    assert report.to_text().splitlines()[0] == "x against y: 2 finding(s): 1 missing_key, 1 value_mismatch"
    assert json.loads(report.to_json())["kinds"] == {"missing_key": 1, "value_mismatch": 1}
    assert "<table" in report._repr_html_()
    assert Report(subject="x").to_text() == "x: healthy: no findings"
    with pytest.raises(ValueError, match="not one of"):
        Finding("bogus", "k")


def test_against_layout_checks_only_the_dtypes_it_gives(tmp_path) -> None:
    # issue 22.4: a layout that gives no dtype expects none; it used to expect float32 and call every bf16 key a
    # dtype_mismatch
    from workbench.layout.model_layout import Layout

    toy = load_layout(TOY)
    ck = write(tmp_path / "ck", _toy_tensors())
    bare = Layout(toy.mesh, toy.specs, name="no dtypes")
    report = diagnose(ck, bare)
    assert report.ok, report.to_text()
    assert report.stats["dtypes_not_checked"] == "5 parameter(s) whose layout gives no dtype"
    wrong = Layout(toy.mesh, toy.specs, dict.fromkeys(toy.specs, "float16"), name="fp16")
    kinds = {(f.kind, f.evidence["expected_dtype"], f.evidence["actual_dtype"]) for f in diagnose(ck, wrong).findings}
    assert kinds == {("dtype_mismatch", "F16", "BF16"), ("dtype_mismatch", "F16", "F32")}


def test_against_a_layout_a_fused_key_is_named_by_shape_not_dropped(tmp_path) -> None:
    # the layout expects gate and up apart; the checkpoint holds them fused: by names and shapes only, the report
    # says which keys it may hold and never advises dropping it
    tensors = _toy_tensors()
    gate, up = (f"model.layers.0.mlp.experts.0.{p}_proj.weight" for p in ("gate", "up"))
    fused = "model.layers.0.mlp.experts.0.gate_up_proj.weight"
    tensors[fused] = torch.cat([tensors.pop(gate), tensors.pop(up)])
    report = diagnose(write(tmp_path / "ck", tensors), str(TOY))
    (unexpected,) = [f for f in report.findings if f.kind == "unexpected_key"]
    assert unexpected.key == fused and f"{gate} and {up} fused on dim 0" in unexpected.hint
    assert "do not drop it" in unexpected.hint
    missing = {f.key: f.hint for f in report.findings if f.kind == "missing_key"}
    assert set(missing) == {gate, up} and all(f"half of {fused}" in h for h in missing.values())


def test_against_a_layout_three_keys_fused_are_named_by_shape_not_dropped(tmp_path) -> None:
    # three keys of one module under one key: only two equal halves were tried, so the report said "drop it"
    tensors = _toy_tensors()
    parts = [f"model.layers.0.mlp.experts.0.{p}_proj.weight" for p in ("gate", "up", "down")]
    fused = "model.layers.0.mlp.experts.0.gate_up_down.weight"
    tensors[fused] = torch.cat([tensors.pop(p) for p in parts])
    report = diagnose(write(tmp_path / "ck", tensors), str(TOY))
    (unexpected,) = [f for f in report.findings if f.kind == "unexpected_key"]
    assert f"{parts[0]}, {parts[1]} and {parts[2]} fused on dim 0" in unexpected.hint
    assert "do not drop it" in unexpected.hint
    missing = {f.key: f.hint for f in report.findings if f.kind == "missing_key"}
    assert set(missing) == set(parts) and all(f"part of {fused}" in h for h in missing.values())


def test_no_findings_against_a_layout_says_the_values_were_not_compared(tmp_path) -> None:
    # an all-zero (or all-NaN) checkpoint against a layout printed "healthy: no findings"
    zeros = {k: torch.zeros_like(v) for k, v in _toy_tensors().items()}
    report = diagnose(write(tmp_path / "zeros", zeros), load_layout(TOY))
    assert report.findings == () and report.exit_status == 0
    text = report.to_text()
    assert "healthy" not in text, text
    assert "no findings in keys, shapes and dtypes (values not compared: pass a reference to compare them)" in text


def test_shards_joined_on_the_wrong_dim_are_named_and_not_called_transposed(tmp_path) -> None:
    # a tensor cut on dim 1 over tp=2 whose shards were concatenated on dim 0: the hint said "transpose it"
    from torch.distributed.tensor import Shard

    import workbench as wb

    mesh = wb.MeshSpec((2,), ("tp",))
    spec = wb.LoadSpec.from_placements("w", "w", (16, 32), mesh, [Shard(1)])
    layout = wb.Layout(mesh, {"w": spec}, {"w": "bfloat16"}, name="tp2")
    full = torch.randn(16, 32).bfloat16()
    joined = torch.cat([full[:, :16], full[:, 16:]], dim=0)  # (32, 16): also the transposed shape
    (finding,) = diagnose(write(tmp_path / "joined", {"w": joined}), layout).findings
    assert finding.transform == "its 2 shards under S(1)@tp joined on dim 0, not dim 1", finding
    assert finding.hint.startswith("the shards of a tensor cut on dim 1 were concatenated on dim 0: gather them on "
                                   "dim 1") and "do not transpose it" in finding.hint


def test_a_key_saved_in_two_files_is_named_a_duplicate_not_a_stale_index(tmp_path) -> None:
    # the same key in both shards, the index naming one: "rebuild the index from the headers" (which name both)
    # was the advice, and "not in the weight_map" was false
    import json

    from safetensors.torch import save_file

    from workbench.debug import inspect_checkpoint

    good, stale = torch.ones(4, 4), torch.zeros(4, 4)
    save_file({"a": good, "b": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"a": stale, "c": torch.ones(2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                  "c": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    found = [f for f in inspect_checkpoint(tmp_path).findings if f.key == "a"]
    assert [(f.kind, f.evidence["file"]) for f in found] == [("index_inconsistent", "model-00002-of-00002.safetensors")]
    assert found[0].evidence["detail"].startswith("a duplicate: the key is in this file's header and in "
                                                  "model-00001-of-00002.safetensors's")
    assert "saved twice" in found[0].hint and "do not rebuild the index" in found[0].hint


def test_keys_renamed_and_cast_are_named_so_not_missing_and_unexpected(tmp_path) -> None:
    # DDP's "module." prefix on keys saved in float32 against a bf16 reference: every key was "missing" ("re-save
    # with it") and "unexpected" ("drop it"), and following that would throw the weights away
    ref = {k: v.bfloat16() if v.is_floating_point() else v for k, v in model().items()}
    act = {f"module.{k}": v.float() if v.is_floating_point() else v for k, v in ref.items()}
    report = diagnose(write(tmp_path / "act", act), write(tmp_path / "ref", ref))
    kinds = report.kinds()
    assert "missing_key" not in kinds and "unexpected_key" not in kinds, report.to_text()
    floats = sum(1 for v in ref.values() if v.is_floating_point())
    assert kinds.get("renamed_key") == len(ref) and kinds.get("dtype_mismatch") == floats, kinds
    cast = next(f for f in report.findings if f.kind == "dtype_mismatch")
    assert cast.evidence["transform"] == "cast to float32", cast


def test_shards_joined_on_the_wrong_dim_are_verified_against_a_reference(tmp_path) -> None:
    # with the training layout and a reference, the wrong join is checked bit for bit (it was "another parameter's
    # tensor, or saved from a different model config?"); a tensor of that shape with other values claims nothing
    from torch.distributed.tensor import Shard

    import workbench as wb

    mesh = wb.MeshSpec((2,), ("tp",))
    layout = wb.Layout(mesh, {"w": wb.LoadSpec.from_placements("w", "w", (16, 32), mesh, [Shard(1)])}, name="tp2")
    full = torch.randn(16, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = write(tmp_path / "ref", {"w": full})
    joined = write(tmp_path / "joined", {"w": torch.cat([full[:, :16], full[:, 16:]], dim=0)})
    (finding,) = diagnose(joined, ref, layout=layout).findings
    assert finding.kind == "shape_mismatch" and finding.evidence["verified"] == "bit for bit", finding
    assert finding.transform == "its 2 shards under S(1)@tp joined on dim 0, not dim 1"
    other = write(tmp_path / "other", {"w": torch.randn(32, 16).bfloat16()})
    (finding,) = diagnose(other, ref, layout=layout).findings
    assert "joined" not in (finding.transform or "") and "verified" not in finding.evidence, finding


def _hf_rotary_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """What HF's LLaMA conversion script does to q_proj/k_proj (written here from its formula)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def test_a_rotary_permute_of_q_proj_is_named_as_such(tmp_path) -> None:
    # the permute's row map is also an interleaved shard's: it was blamed on sharding ("undo the interleave when
    # gathering"), which was not the cause
    w = torch.randn(32, 8, generator=torch.Generator().manual_seed(2)).bfloat16()
    key = "model.layers.0.self_attn.q_proj.weight"
    ref = write(tmp_path / "ref", {key: w})
    act = write(tmp_path / "act", {key: _hf_rotary_permute(w, heads=4)})
    (finding,) = diagnose(act, ref).findings
    assert finding.kind == "permuted" and finding.evidence["verified"] == "bit for bit", finding
    assert finding.transform == "rotary permute of HF's LLaMA conversion applied once too often (heads of 8 rows)"
    assert finding.evidence["head_rows"] == 8
