"""The live view's and the flight recorder's text, the magics and install options that switch them (no ranks)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from workbench.kernel.cli import register
from workbench.kernel.kernel import _flight_recorder_default
from workbench.kernel.live import RankState, bundle, group_states, summary, where_label
from workbench.kernel.magics import MagicError, parse_cell
from workbench.kernel.recorder import last_entries, recorder_lines


@pytest.mark.parametrize(
    ("where", "label"),
    [('File "<ipython-input-7-0123abcd>", line 3, in <module>: time.sleep(600)', "In [7] line 3: time.sleep(600)"),
     ('File "/home/me/train/step.py", line 42, in step', "train/step.py:42 in step"),
     ('File "/x/a.py", line 5, in f: y = {"a": 1}', 'x/a.py:5 in f: y = {"a": 1}'),
     ("outside user code", "outside user code"), ("", "outside user code")],
)
def test_where_label(where: str, label: str) -> None:
    assert where_label(where) == label


def test_64_ranks_in_three_states_make_three_lines() -> None:
    now = 1000.0
    dp = "all_reduce #12 on group dp (ranks 0-63)"
    states = {r: RankState("collective", dp, now - 3.1 + 0.01 * r) for r in range(60)}
    states.update({r: RankState("code", "In [7] line 3: time.sleep(600)", now - 2.0) for r in (60, 61, 63)})
    states[62] = RankState("done")
    text = bundle(states, elapsed=3.2, now=now)["text/plain"]
    assert text.splitlines() == [
        "cell running 3.2 s on 64 ranks",
        "  ranks 60,61,63  running In [7] line 3: time.sleep(600), 2.0 s",  # those the others wait for first
        "  ranks 0-59      waiting in all_reduce #12 on group dp (ranks 0-63), 3.1 s",  # the longest waiter's time
        "  rank 62         done",
    ]


def test_collectives_apart_by_call_number_longest_first_and_many_states_are_cut() -> None:
    now = 50.0
    rows = group_states({0: RankState("collective", "all_reduce #3 on group default", now - 1),
                         1: RankState("collective", "all_reduce #4 on group default", now - 5),
                         2: RankState("collective", "all_reduce #3 on group default", now - 2)}, now)
    assert [(r.ranks, r.what, r.seconds) for r in rows] == [((1,), "all_reduce #4 on group default", 5.0),
                                                            ((0, 2), "all_reduce #3 on group default", 2.0)]
    many = {r: RankState("code", f"In [1] line {r}: f()", now - 1) for r in range(30)}
    lines = bundle(many, 1.0, now)["text/plain"].splitlines()
    assert len(lines) == 1 + 12 and lines[-1] == "  ... 19 more states of 19 ranks", lines
    html = bundle({0: RankState("code", "In [1] line 1: x < y", now - 1)}, 1.0, now)["text/html"]
    assert "x &lt; y" in html and "<table" in html


def test_summary_says_who_finished_last_and_who_failed() -> None:
    done = summary({0: 3.25, 1: 1.0, 2: 1.5}, {}, 3.3)["text/plain"]
    assert done == "cell ran 3.3 s on 3 ranks; last to finish: rank 0, 2.2 s after rank 1"
    failed = summary({0: 1.0, 1: 1.2}, {0: "ValueError", 1: "ValueError"}, 1.2)["text/plain"]
    assert failed.endswith("ranks 0,1 failed (ValueError)")


def test_a_rank_state_names_its_kinds() -> None:
    with pytest.raises(ValueError, match=r"RankState\.kind 'sleeping': use one of code, gpu"):
        RankState("sleeping")


# a flight recorder dump shaped as torch 2.13 pickles it (`_dump_fr_trace` of a gloo rank; NCCL adds the same keys)
TRACE = {
    "version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
    "entries": [
        {"process_group": ("0", "default_pg"), "collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False,
         "profiling_name": f"nccl:{op}", "state": state, "time_created_ns": int(created * 1e9)}
        for seq, op, state, created in ((1, "broadcast", "completed", 90.0), (2, "all_reduce", "completed", 95.0),
                                        (3, "all_reduce", "scheduled", 97.0))
    ] + [{"process_group": ("1", "pp"), "collective_seq_id": 0, "p2p_seq_id": 7, "is_p2p": True,
          "profiling_name": "nccl:send 0->1", "state": "started", "time_created_ns": int(98e9)}],
}


def test_last_entries_newest_first_with_group_ranks_and_p2p_numbers() -> None:
    entries = last_entries(TRACE, 2)
    assert [(e["op"], e["seq"], e["group"], e["desc"], e["ranks"], e["state"]) for e in entries] == [
        ("send 0->1", 7, "1", "pp", "", "started"), ("all_reduce", 3, "0", "default_pg", "0,1", "scheduled")]
    assert entries[1]["created"] == pytest.approx(97.0)
    assert last_entries(None, 3) == [] and last_entries({"entries": []}, 3) == []


def test_recorder_lines_put_ranks_that_reached_the_same_calls_together() -> None:
    behind = {**TRACE, "entries": TRACE["entries"][:2]}
    answers = {0: {"entries": last_entries(TRACE, 2)}, 1: {"entries": last_entries(behind, 2)},
               2: {"entries": last_entries(behind, 2)}, 3: {"entries": [], "error": "RuntimeError: boom"}}
    lines = recorder_lines(answers, [0, 1, 2, 3, 4], now=100.0)
    assert lines == [
        "flight recorder (torch's; each rank's last collectives, newest first):",
        "  rank 0: send 0->1 #7 on group 1 (pp) started 2.0 s ago; before it all_reduce #3 on group 0 (default_pg, "
        "ranks 0,1) scheduled",
        "  ranks 1,2: all_reduce #2 on group 0 (default_pg, ranks 0,1) completed 5.0 s ago; before it broadcast #1 "
        "completed",
        "  rank 3: could not read it: RuntimeError: boom",
        "  rank 4: no answer within the time allowed (its I/O thread is blocked)",
    ]


def test_live_and_flight_recorder_magics() -> None:
    d = parse_cell("%live off\n%flight_recorder on\nx = 1", 2)
    assert (d.live, d.flight_recorder, d.code) == (False, True, "x = 1")
    assert parse_cell("x = 1", 2).live is None and parse_cell("x = 1", 2).flight_recorder is None
    with pytest.raises(MagicError, match="%live 'sometimes': use %live on or %live off"):
        parse_cell("%live sometimes", 2)
    with pytest.raises(MagicError, match="%flight_recorder '': use %flight_recorder on or %flight_recorder off"):
        parse_cell("%flight_recorder", 2)


def test_install_options_reach_the_kernel_environment(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="workbench")
    register(parser.add_subparsers(dest="command"))

    def env(*extra: str) -> dict[str, str]:
        args = parser.parse_args(["kernel", "install", "--nprocs", "2", "--name", "k", "--prefix", str(tmp_path),
                                  *extra])
        assert args.func(args) == 0
        return json.loads((tmp_path / "share" / "jupyter" / "kernels" / "k" / "kernel.json").read_text())["env"]

    plain = env()
    assert "WORKBENCH_KERNEL_LIVE" not in plain and "WORKBENCH_KERNEL_FLIGHT_RECORDER" not in plain
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in plain
    on = env("--live", "off", "--flight-recorder", "on")
    assert on["WORKBENCH_KERNEL_LIVE"] == "off" and on["WORKBENCH_KERNEL_FLIGHT_RECORDER"] == "on"
    assert on["TORCH_FR_BUFFER_SIZE"] == on["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    off = env("--flight-recorder", "off")
    assert off["WORKBENCH_KERNEL_FLIGHT_RECORDER"] == "off" and "TORCH_FR_BUFFER_SIZE" not in off


@pytest.mark.parametrize(
    ("env", "on"),
    [({}, False), ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}, True), ({"TORCH_FR_BUFFER_SIZE": "0"}, False),
     ({"TORCH_FR_BUFFER_SIZE": "100", "WORKBENCH_KERNEL_FLIGHT_RECORDER": "off"}, False),
     ({"WORKBENCH_KERNEL_FLIGHT_RECORDER": "on"}, True)],
)
def test_hang_reports_read_the_recorder_when_asked_or_sized(env: dict[str, str], on: bool) -> None:
    assert _flight_recorder_default(env) is on


def test_entries_of_destroyed_groups_are_left_out() -> None:
    assert [e["seq"] for e in last_entries(TRACE, 3, since=96.0)] == [7, 3]  # made at 98 s and 97 s
    assert last_entries(TRACE, 3, since=99.0) == []
