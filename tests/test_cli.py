"""The workbench console script: ``workbench layout`` prints per-rank key regions and coverage."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from workbench.cli import main

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "sample_meshes" / "toy_expert_tp.toml"


def test_help_lists_layout(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    assert "layout" in capsys.readouterr().out


def test_toy_layout_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", str(TOY)]) == 0
    out = capsys.readouterr().out
    # rank 5 = (fsdp=1, ep=0, tp=1) holds rows 6-7 of the fused gate/up tensor: up_proj rows 2-3 of expert 0
    block = out.split("rank 5  (fsdp=1, ep=0, tp=1)")[1].split("\nrank 6")[0]
    assert "model.layers.0.mlp.experts.0.up_proj.weight[2:4, 0:4] -> local[0:2, 0:4]" in block
    # embed_tokens: 10 rows over 8 ranks -> ranks 5-7 hold nothing
    assert "model.embed_tokens.weight               local (0, 4)  bfloat16   holds nothing" in block
    assert "verdict: all exact (5 parameters checked on 8 ranks)" in out
    assert "S(0)@ep -> IS(0,2)@tp -> S(0)@fsdp" in out


def test_rank_and_param_filters(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", str(TOY), "--rank", "2-3", "--param", "*experts*"]) == 0
    out = capsys.readouterr().out
    assert "rank 2  (" in out and "rank 3  (" in out and "rank 4  (" not in out
    assert "embed_tokens" not in out


def test_bad_file_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[mesh]\nshape = [2]\n")
    assert main(["layout", str(bad)]) == 2
    assert "workbench: error:" in capsys.readouterr().err


def test_console_script_runs() -> None:
    exe = Path(sys.executable).with_name("workbench")
    result = subprocess.run([str(exe), "layout", str(TOY), "--rank", "0"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "rank 0  (fsdp=0, ep=0, tp=0)" in result.stdout
