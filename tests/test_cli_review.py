"""The workbench command line on inputs people mistype: each is refused with exit status 2 and a message."""

from __future__ import annotations

from pathlib import Path

import pytest

from workbench.cli import main

TOY = Path(__file__).resolve().parents[1] / "sample_meshes" / "toy_expert_tp.toml"  # mesh dims fsdp, ep, tp


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_policy_naming_a_mesh_dim_the_layout_lacks_is_refused(command: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    status = main([command, str(TOY), "--policy", "preserve:ePp"])  # a typo of ep
    err = capsys.readouterr().err
    assert status == 2
    assert "ePp" in err and "fsdp" in err and "tp" in err


@pytest.mark.parametrize("count", ["0", "-3"])
def test_max_writers_below_one_is_refused(count: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["plan", str(TOY), "--max-writers", count])
    assert done.value.code == 2
    assert "--max-writers" in capsys.readouterr().err


def test_simulate_refuses_a_rank_outside_the_mesh_before_simulating(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["simulate", str(TOY), "--rank", "99"])  # the toy mesh has 8 ranks
    out, err = capsys.readouterr()
    assert status == 2 and "99" in err
    assert out == ""  # no round trip printed before the refusal
