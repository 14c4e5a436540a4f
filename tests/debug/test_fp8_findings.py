"""fp8 checkpoints whose values differ are findings, never crashes; an internal error exits 3, not 1 or 2."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.debug.corpus import write
from workbench.cli import main as workbench_main
from workbench.debug import diagnose, diff_checkpoints
from workbench.debug.cli import main as debug_main

ROOT = Path(__file__).resolve().parents[2]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DIAGNOSE_MODULE = importlib.import_module("workbench.debug.diagnose")  # the package exports a function by this name


def _weights() -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(0))


def _pair(tmp_path: Path, actual: torch.Tensor, expected: torch.Tensor) -> tuple[Path, Path]:
    return write(tmp_path / "actual", {"w": actual}), write(tmp_path / "expected", {"w": expected})


@pytest.mark.parametrize(("actual", "expected", "kind"), [
    pytest.param((1.5, E4M3), (1.0, E4M3), "value_mismatch", id="e4m3-values-differ"),
    pytest.param((1.0, E5M2), (1.0, E4M3), "dtype_mismatch", id="e5m2-where-e4m3"),
    pytest.param((1.5, E4M3), (1.0, torch.bfloat16), "dtype_mismatch", id="e4m3-where-bf16"),
    pytest.param((1.0, torch.bfloat16), (1.5, E4M3), "dtype_mismatch", id="bf16-where-e4m3"),
])
def test_fp8_difference_is_a_finding(tmp_path, actual, expected, kind) -> None:
    w = _weights()
    act, ref = _pair(tmp_path, (w * actual[0]).to(actual[1]), (w * expected[0]).to(expected[1]))
    for report in (diagnose(act, ref), diff_checkpoints(ref, act)):
        assert [(f.kind, f.key) for f in report.findings] == [(kind, "w")], report.to_text()
        assert report.findings[0].evidence["actual_dtype"] == str(actual[1]).removeprefix("torch.")


def test_fp8_nan_counted_where_reference_finite(tmp_path) -> None:
    w = _weights()
    bad = w.clone()
    bad[0, :3] = float("nan")
    act, ref = _pair(tmp_path, bad.to(E4M3), w.to(E4M3))
    (finding,) = diagnose(act, ref).findings
    assert finding.kind == "value_mismatch" and finding.evidence["actual_nan"] == 3
    assert "actual_inf" not in finding.evidence and finding.evidence["first_differing_index"] == 0


def test_fp8_cli_exits_1_with_findings(tmp_path) -> None:
    w = _weights()
    act, ref = _pair(tmp_path, (w * 1.5).to(E4M3), w.to(E4M3))
    done = subprocess.run([sys.executable, "-m", "workbench.cli", "diagnose", str(act), "--expected", str(ref)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    assert "value_mismatch" in done.stdout and "Traceback" not in done.stderr


def _boom(*args, **kwargs):
    raise RuntimeError("a bug inside diagnose")


@pytest.mark.parametrize("entry", [workbench_main, debug_main], ids=["workbench", "workbench.debug.cli"])
def test_internal_error_exits_3(tmp_path, monkeypatch, capsys, entry) -> None:
    w = _weights()
    act, ref = _pair(tmp_path, w, w)
    monkeypatch.setattr(DIAGNOSE_MODULE, "diagnose", _boom)
    assert entry(["diagnose", str(act), "--expected", str(ref)]) == 3
    err = capsys.readouterr().err
    assert "internal error" in err and "RuntimeError: a bug inside diagnose" in err and "report" in err
