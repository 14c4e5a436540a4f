"""Damaged or missing files are findings in diff and diagnose (issue 22.1, 22.5), never a crash; exit 2 only when
nothing can be read. Findings of one kind and fix are grouped by layer pattern, the fix said once."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.debug.corpus import write
from workbench.cli import main as workbench_main
from workbench.debug import diagnose, diff_checkpoints

EXPERT = "model.layers.{}.mlp.experts.{}.w1.weight"


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {EXPERT.format(i, e): torch.randn(2, 3, generator=g).bfloat16() for i in range(2) for e in range(8)}
    out["model.norm.weight"] = torch.randn(5, generator=g)
    out |= {f"model.layers.{i}.self_attn.o_proj.weight": torch.randn(32, 32, generator=g).bfloat16() for i in range(3)}
    return out


def _split(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """The 17 expert and norm keys in one file (writer 1), the three o_proj keys in others (writer 0)."""
    return {k: 0 if "o_proj" in k else 1 for k in tensors}


def _file_of(directory: Path, key: str) -> Path:
    import json

    return directory / json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"][key]


def test_truncated_file_is_findings_and_the_rest_is_compared(tmp_path) -> None:
    good = write(tmp_path / "good", _tensors())
    bad_tensors = _tensors()
    bad_tensors["model.norm.weight"] = bad_tensors["model.norm.weight"].flip(0).contiguous()  # a real bug elsewhere
    bad = write(tmp_path / "bad", bad_tensors, max_shard_bytes=2048 * 2)
    last = "model.layers.2.self_attn.o_proj.weight"
    victim = _file_of(bad, last)
    assert {_file_of(bad, k) for k in _tensors()} - {victim}, "the victim must not hold every key"
    os.truncate(victim, victim.stat().st_size - 1000)  # the file loses its last 1,000 bytes (part of o_proj.2)
    for report in (diff_checkpoints(good, bad), diagnose(bad, good)):
        kinds = {(f.kind, f.key) for f in report.findings}
        assert ("truncated_file", last) in kinds, report.to_text()
        assert ("truncated_file", victim.name) in kinds  # the file itself, from the integrity scan
        assert ("value_mismatch", "model.norm.weight") in kinds or ("permuted", "model.norm.weight") in kinds
        assert report.readable and report.exit_status == 1
        assert report.stats["equal"] == len(_tensors()) - 2  # every other key was compared and found equal
    assert workbench_main(["diagnose", str(bad), "--expected", str(good)]) == 1
    assert workbench_main(["diff", str(good), str(bad)]) == 1


def test_nothing_readable_is_status_2(tmp_path) -> None:
    good = write(tmp_path / "good", _tensors())
    bad = write(tmp_path / "bad", _tensors())
    for f in bad.glob("*.safetensors"):
        os.truncate(f, 100)  # the header survives, no tensor's data does
    report = diff_checkpoints(good, bad)
    assert not report.readable and report.exit_status == 2, report.to_text()
    assert "none of the" in report.stats["error"]
    assert workbench_main(["diagnose", str(bad), "--expected", str(good)]) == 2


def test_missing_file_gives_one_group_with_the_fix_once(tmp_path) -> None:
    tensors = _tensors()
    good = write(tmp_path / "good", tensors)
    bad = write(tmp_path / "bad", tensors, writers=_split(tensors))
    lost = _file_of(bad, "model.norm.weight")
    assert _file_of(bad, EXPERT.format(1, 7)) == lost
    lost.unlink()
    report = diff_checkpoints(good, bad)
    assert report.exit_status == 1 and report.stats["equal"] == 3
    missing = [f for f in report.findings if f.kind == "missing_key"]
    assert len(missing) == 17 and all(f.evidence["file"] == lost.name for f in missing)
    (group,) = [g for g in report.groups() if g.kind == "missing_key"]
    assert group.count == 17
    assert group.patterns == (("model.layers.{0,1}.mlp.experts.{0..7}.w1.weight", 16), ("model.norm.weight", 1))
    text = report.to_text()
    assert text.count(group.hint) == 1 and lost.name in group.hint
    assert "missing_key x17" in text and "... and 14 more" in text
    body = report.to_dict()
    assert body["groups"][[g["kind"] for g in body["groups"]].index("missing_key")]["count"] == 17
    assert len(body["findings"]) == len(report.findings)  # JSON keeps every finding


def test_missing_file_against_a_layout(tmp_path) -> None:
    from tests.debug.test_diagnose_cli import TOY, _toy_tensors
    from workbench.layout.layout_file import load_layout

    tensors = _toy_tensors()
    ck = write(tmp_path / "ck", tensors, writers={k: 1 if "experts.1" in k else 0 for k in tensors})
    _file_of(ck, "model.layers.0.mlp.experts.1.up_proj.weight").unlink()
    report = diagnose(ck, load_layout(TOY))
    missing = {f.key: f for f in report.findings if f.kind == "missing_key"}
    assert set(missing) == {f"model.layers.0.mlp.experts.1.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert all("is missing" in f.evidence["detail"] for f in missing.values())


def test_a_directory_where_a_data_file_should_be_is_a_missing_file_not_a_crash(tmp_path) -> None:
    # the old code stopped diff and diagnose with "IsADirectoryError: [Errno 21]" and exit 2
    tensors = _tensors()
    good = write(tmp_path / "good", tensors)
    bad = write(tmp_path / "bad", tensors, writers=_split(tensors))
    lost = _file_of(bad, "model.norm.weight")
    lost.unlink()
    lost.mkdir()
    report = diff_checkpoints(good, bad)
    assert report.exit_status == 1 and report.stats["equal"] == 3, report.to_text()
    missing = [f for f in report.findings if f.kind == "missing_key"]
    assert len(missing) == 17 and all(f.evidence["file"] == lost.name for f in missing)
    assert workbench_main(["diagnose", str(bad), "--expected", str(good)]) == 1
