"""The workbench console script: summaries by default, --full, --json, one --rank syntax, helpful --help."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pipeline.toy_pipeline_text import FLAT as TOY_PIPELINE
from tests.pipeline.toy_pipeline_text import TABLES as PIPELINE_TABLES
from tests.pipeline.toy_pipeline_text import with_table
from workbench.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "sample_meshes" / "toy_expert_tp.toml"
DEEPSEEK = ROOT / "sample_meshes" / "deepseek_v3_671b.toml"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_help_lists_layout(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "layout" in out and "plan" in out and "example" in out


def test_every_subcommand_help_has_a_description_and_an_example() -> None:
    commands = _subcommands()
    assert {"layout", "plan", "simulate", "demo"} <= set(commands)
    for name, sub in commands.items():
        assert sub.description and len(sub.description) > 40, name
        text = sub.format_help()
        assert "examples:" in text and f"workbench {name}" in text.split("examples:")[1], name


def test_every_rank_option_takes_lists_and_ranges() -> None:
    parser = build_parser()
    for name, sub in _subcommands().items():
        if any("--rank" in a.option_strings for a in sub._actions):
            args = parser.parse_args([name, str(TOY), "--rank", "0,2-3"])
            assert args.rank == (0, 2, 3), name


def test_toy_layout_full_listing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", str(TOY), "--full"]) == 0
    out = capsys.readouterr().out
    # rank 5 = (fsdp=1, ep=0, tp=1) holds rows 6-7 of the fused gate/up tensor: up_proj rows 2-3 of expert 0
    block = out.split("rank 5  (fsdp=1, ep=0, tp=1)")[1].split("\nrank 6")[0]
    assert "model.layers.0.mlp.experts.0.up_proj.weight[2:4, 0:4] -> local[0:2, 0:4]" in block
    # embed_tokens: 10 rows over 8 ranks -> ranks 5-7 hold nothing
    assert "model.embed_tokens.weight               local (0, 4)  bfloat16  0 B   holds nothing" in block
    assert "verdict: all exact (5 parameters checked on 8 ranks)" in out
    assert "S(0)@ep -> IS(0,2)@tp -> S(0)@fsdp" in out


def test_toy_layout_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", str(TOY), "--rank", "5"]) == 0
    out = capsys.readouterr().out
    assert "rank 5  (fsdp=1, ep=0, tp=1): holds 36 B in 4 tensors, 1 empty" in out
    assert "model.embed_tokens.weight (holds nothing)" in out
    assert "model.layers.0.mlp.experts.0.up_proj.weight[2:4, 0:4] -> local[0:2, 0:4]" in out
    assert "coverage: all 5 parameters exact" in out and "  exact  " not in out


def test_rank_and_param_filters(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", str(TOY), "--rank", "2-3", "--param", "*experts*", "--full"]) == 0
    out = capsys.readouterr().out
    assert "rank 2  (" in out and "rank 3  (" in out and "rank 4  (" not in out
    assert "embed_tokens" not in out


def test_deepseek_rank_summary_is_short(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", str(DEEPSEEK), "--rank", "0"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 80
    assert "--full lists every key region" in out  # the CLI's own hint


def test_layout_json_has_the_python_totals(capsys: pytest.CaptureFixture[str]) -> None:
    from workbench.layout.layout_file import load_layout
    from workbench.report import summarize_layout

    assert main(["layout", str(DEEPSEEK), "--rank", "0,1023", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    layout = load_layout(DEEPSEEK)
    python = summarize_layout(layout, ranks=[0, 1023]).to_dict()
    assert data["ranks"] == python["ranks"] and data["total_bytes"] == python["total_bytes"]
    held = sum(math.prod(layout[n].local_shape(1023)) * layout.dtype(n).itemsize for n in layout)
    assert data["ranks"][1]["rank"] == 1023 and data["ranks"][1]["bytes_held"] == held
    assert data["coverage"] == {"checked": 989, "exact": 989, "not_exact": []}


def test_plan_json_has_the_python_totals(capsys: pytest.CaptureFixture[str]) -> None:
    from workbench.layout.layout_file import load_layout
    from workbench.plan.policy import SavePolicy
    from workbench.run.simulated import plan_save

    assert main(["plan", str(DEEPSEEK), "--rank", "0", "--budget", "4GiB", "--policy", "full", "--json",
                 "--write-mode", "gather"]) == 0
    data = json.loads(capsys.readouterr().out)
    schedule = plan_save(load_layout(DEEPSEEK), ranks=[0], policy=SavePolicy.full(), budget_bytes=4 << 30).schedules[0]
    (rank,) = data["ranks"]
    assert (rank["peak_bytes"], rank["bytes_received"], rank["calls"]) == (
        schedule.peak_bytes, schedule.bytes_moved, schedule.num_calls)
    assert data["findings"][0]["kind"] == "over_budget" and data["budget_bytes"] == 4 << 30


def test_plan_overrun_warning_in_first_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(DEEPSEEK), "--budget", "4GiB", "--policy", "full", "--write-mode", "gather"]) == 0
    head = capsys.readouterr().out.splitlines()[:4]
    assert any("predicted peak 14.2 GiB is over the 4 GiB budget" in line for line in head)


def test_plan_defaults_to_minimal(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(TOY), "--rank", "5", "--budget", "200B", "--write-mode", "gather"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("save of toy-expert-tp [minimal]")
    assert "over the" not in out  # the toy fits its 200 B budget
    argv = ["plan", str(TOY), "--rank", "5", "--budget", "100B", "--policy", "minimal", "--write-mode", "gather"]
    assert main(argv) == 0
    assert "over the 100 B budget" in "\n".join(capsys.readouterr().out.splitlines()[:4])


@pytest.mark.parametrize("policy", [None, "minimal", "full", "preserve:ep"])
def test_simulate_is_bit_exact_under_each_hf_policy(capsys: pytest.CaptureFixture[str], policy: str | None) -> None:
    argv = ["simulate", str(TOY)] + (["--policy", policy] if policy else [])
    assert main(argv) == 0
    assert "bit-exact" in capsys.readouterr().out


def test_simulate_refuses_gather_only_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    # gather_only saves in runtime layout, keyed by parameter name: an HF round trip cannot compare it (it once
    # reported "MISMATCH in 11 keys" for 9 keys and exit 1, as if the data were wrong)
    with pytest.raises(SystemExit) as done:
        main(["simulate", str(TOY), "--policy", "gather_only:fsdp"])
    assert done.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "usage:" in err and "argument --policy" in err, err
    assert "gather_only:fsdp" in err and all(p in err for p in ("minimal", "full", "preserve:DIM")), err
    assert "MISMATCH" not in err
    policy_help = next(a.help for a in _subcommands()["simulate"]._actions if "--policy" in a.option_strings)
    assert "full or preserve:DIM" in policy_help and "gather_only saves no HF checkpoint" in policy_help


def test_simulate_lists_only_its_policies_for_an_unknown_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["simulate", str(TOY), "--policy", "bogus"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "'bogus'" in err and "full or preserve:DIM[,DIM]" in err and "gather_only" not in err, err


def test_simulate_round_trip_refuses_gather_only_naming_the_policy() -> None:
    from workbench.layout.layout_file import load_layout
    from workbench.plan.policy import SavePolicy
    from workbench.run.round_trip import simulate_round_trip

    with pytest.raises(ValueError, match=r"policy gather_only\(fsdp\): .*use minimal .*full or preserve"):
        simulate_round_trip(load_layout(TOY), policy=SavePolicy.gather_only("fsdp"))


def test_plan_still_takes_gather_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(TOY), "--rank", "0", "--policy", "gather_only:fsdp"]) == 0
    assert "gather_only(fsdp)" in capsys.readouterr().out


def test_bad_input_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[mesh]\nshape = [2]\n")
    assert main(["layout", str(bad)]) == 2
    assert "workbench: error:" in capsys.readouterr().err
    assert main(["layout", str(TOY), "--rank", "8"]) == 2
    assert "rank(s) 8 outside 'toy-expert-tp''s 8 ranks" in capsys.readouterr().err
    assert main(["plan", str(TOY), "--rank", "9"]) == 2
    assert "outside" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", str(TOY), "--policy", "half"])
    assert "use minimal (save_hf's default)" in capsys.readouterr().err


def test_demo_removes_its_temporary_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    import workbench.demo as demo

    seen: list[Path] = []

    def fake(nprocs: int, root: Path) -> bool:
        (root / "saved").mkdir()
        (root / "saved" / "model.safetensors").write_bytes(b"x")
        seen.append(root)
        return True

    monkeypatch.setattr(demo, "_run_demo", fake)
    assert main(["demo"]) == 0
    assert seen and not seen[0].exists()


@pytest.mark.parametrize("command", [[str(Path(sys.executable).with_name("workbench"))],
                                     [sys.executable, "-m", "workbench"]], ids=["script", "python -m"])
def test_console_script_runs(command: list[str]) -> None:
    result = subprocess.run([*command, "layout", str(TOY), "--rank", "0"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "rank 0  (fsdp=0, ep=0, tp=0)" in result.stdout


def test_plan_shows_which_tensors_are_written_in_place(capsys) -> None:
    # by default `workbench plan` plans as save_hf does on one host (no minimum segment): all five tensors in place
    assert main(["plan", str(TOY), "--rank", "5", "--budget", "200B"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("write mode direct: all 5 tensors written in place")
    # across hosts the toy's down projections, cut by TP on their last dim (rows of 2 elements), are the only tensor
    # whose pieces are too short to write in place; the other four are written by their holders, with no gather
    assert main(["plan", str(TOY), "--rank", "5", "--budget", "200B", "--across-hosts"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("write mode direct: 4 tensor(s) written in place") and "covers the 1 gathered" in first
    assert main(["plan", str(TOY), "--rank", "5", "--json", "--across-hosts"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["write_mode"] == "direct" and "model.layers.0.mlp.experts.fused_w2" not in data["direct_tensors"]
    assert len(data["direct_tensors"]) == 4
    for minimum in ("1B", "0"):  # an explicit minimum wins over --across-hosts
        assert main(["plan", str(TOY), "--rank", "5", "--min-segment", minimum, "--across-hosts"]) == 0
        assert capsys.readouterr().out.splitlines()[0].startswith("write mode direct: all 5 tensors written in place")


def _bad_inputs(root: Path) -> dict[str, Path]:
    """A path that does not exist, an empty folder, a text file and a binary '.toml': none is a checkpoint."""
    (root / "empty").mkdir()
    (root / "notes.txt").write_text("not a checkpoint\n")
    (root / "binary.toml").write_bytes(b"\x00\xb8\xff\xfe binary")
    return {"missing": root / "missing", "empty": root / "empty", "text": root / "notes.txt",
            "binary": root / "binary.toml"}


# (argv with {name} for a path of _bad_inputs, the path the message must name); every one exits 2
_UNREADABLE = [
    (["inspect", "{missing}"], "missing"),
    (["inspect", "{empty}"], "empty"),
    (["inspect", "{text}"], "text"),
    (["diff", "{missing}", "{empty}"], "missing"),
    (["diff", "{empty}", "{missing}"], "missing"),
    (["diagnose", "{missing}", "--expected", str(TOY)], "missing"),
    (["diagnose", "{text}", "--expected", "{empty}"], "text"),
    (["diagnose", "{empty}", "--expected", "{binary}"], "binary"),
    (["diff", "{empty}", "{empty}", "--layout", "{binary}"], "binary"),
    (["layout", "{missing}"], "missing"),
    (["layout", "{binary}"], "binary"),
    (["plan", "{binary}"], "binary"),
    (["simulate", "{empty}"], "empty"),
]


@pytest.mark.parametrize(("argv", "named"), _UNREADABLE, ids=[" ".join(a[:2]) + f"-{n}" for a, n in _UNREADABLE])
def test_an_unreadable_path_exits_2_naming_it_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        argv: list[str], named: str) -> None:
    paths = _bad_inputs(tmp_path)
    args = [a.format(**paths) for a in argv]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "", out  # nothing on stdout: a pipe reading a report must not take an error for one
    assert str(paths[named]) in err and err.startswith("workbench"), err


def test_json_of_an_unreadable_checkpoint_still_goes_to_stdout(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "missing"
    assert main(["inspect", str(missing), "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["error"] == f"{missing}: checkpoint does not exist"
    assert err.startswith(f"workbench inspect: {missing}: could not be read"), err


def test_console_script_exit_status_of_a_missing_checkpoint(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("workbench")
    missing = tmp_path / "missing"
    done = subprocess.run([str(exe), "inspect", str(missing)], capture_output=True, text=True, check=False)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == "" and f"{missing}: checkpoint does not exist" in done.stderr, (done.stdout, done.stderr)


@pytest.fixture(scope="module")
def b_differs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints ``A`` and ``B`` of the two parameters of ``tests/pipeline``'s toy pipeline; only ``b`` differs, and
    ``B`` carries no layout file, so the ranks a report names come from ``--layout``."""
    import torch

    import workbench as wb

    root = tmp_path_factory.mktemp("b-differs")
    wb.save_hf({"a": torch.arange(4.0), "b": torch.ones(4)}, root / "A")
    wb.save_hf({"a": torch.arange(4.0), "b": torch.zeros(4)}, root / "B")
    (root / "B" / "workbench_layout.toml").unlink()
    return root


def _differing_ranks(root: Path, layout_text: str, capsys: pytest.CaptureFixture[str]) -> list[list[int]]:
    """``differing_ranks`` of ``diff A B`` and of ``diagnose B --expected A``, each given ``--layout`` that text."""
    (root / "layout.toml").write_text(layout_text)
    a, b, layout = str(root / "A"), str(root / "B"), str(root / "layout.toml")
    ranks = []
    for argv in (["diff", a, b], ["diagnose", b, "--expected", a]):
        assert main([*argv, "--layout", layout, "--json"]) == 1
        [finding] = json.loads(capsys.readouterr().out)["findings"]
        ranks.append(finding["evidence"]["differing_ranks"])
    return ranks


@pytest.mark.parametrize(("header", "body"), PIPELINE_TABLES)
def test_a_pipeline_layout_names_the_ranks_of_the_stage_whatever_its_table_text(
        b_differs: Path, capsys: pytest.CaptureFixture[str], header: str, body: str) -> None:
    text = with_table(header, body)
    # b is on stage 0: global ranks 0 and 1 of the row-major (pp=2, fsdp=2) mesh; read as one mesh, all four
    assert _differing_ranks(b_differs, text, capsys) == [[0, 1], [0, 1]]


def test_the_word_pipeline_in_a_string_or_comment_leaves_a_layout_one_mesh(b_differs: Path, capsys) -> None:
    text = TOY_PIPELINE.replace('name = "toy"', 'name = "[pipeline]"\n# [pipeline]')
    assert _differing_ranks(b_differs, text, capsys) == [[0, 1, 2, 3], [0, 1, 2, 3]]  # b replicated on every rank


def test_a_pipeline_that_is_not_a_table_is_an_error(b_differs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layout = b_differs / "not_a_table.toml"
    layout.write_text('pipeline = "pp"\n' + TOY_PIPELINE)
    assert main(["diff", str(b_differs / "A"), str(b_differs / "B"), "--layout", str(layout)]) == 2
    err = capsys.readouterr().err
    assert "not_a_table.toml: a pipeline layout file needs a [pipeline] table" in err, err
