"""wb.launch when a rank's process ends without returning a result, or outlives every watchdog: the launch raises a
LaunchError naming the rank within seconds, and leaves no rank process behind. It used to wait forever: torch's
agent waits for a result from every rank and counts only a non-zero exit as a failure.

Each launch runs in a script of its own under a wall-clock limit, so a launch that hangs fails the test instead of
hanging the suite; the script reports what the launch raised, how long it took, and which of its child processes
outlived the launch (read from ``/proc``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = '''
import json, os, sys, time
import workbench as wb

MODE = sys.argv[1]
PIDS = sys.argv[2]


def fn():
    import faulthandler, os, re, sys
    import torch.distributed as dist

    rank = dist.get_rank()
    with open(os.path.join(PIDS, str(rank)), "w") as f:
        f.write(str(os.getpid()))
    if MODE == "os_exit" and rank == 1:
        os._exit(0)
    if MODE == "os_exit_all":
        os._exit(0)
    if MODE == "sys_exit" and rank == 1:
        sys.exit(0)
    if MODE == "escape_watchdogs" and rank == 1:
        faulthandler.cancel_dump_traceback_later()  # no native backstop
        re.match(r"(a+)+$", "a" * 40 + "b")  # holds the GIL: the Python watchdog never runs
    return rank


def children():
    """This process's live children, as (pid, state, command line); the multiprocessing resource tracker left out."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid() and "resource_tracker" not in cmdline:
            found.append((int(entry), state, cmdline))
    return found


if __name__ == "__main__":
    start = time.monotonic()
    try:
        result = wb.launch(fn, nprocs=2, timeout=float(sys.argv[3]) if len(sys.argv) > 3 else None)
        outcome = {"returned": repr(result)}
    except wb.LaunchError as e:
        outcome = {"error": str(e), "ranks": [f.rank for f in e.failures], "first": str(e.failures[0]),
                   "exitcode": e.failures[0].exitcode, "timed_out": e.failures[0].timed_out}
    outcome["elapsed"] = time.monotonic() - start
    outcome["children"] = children()
    print("OUTCOME " + json.dumps(outcome), flush=True)
'''


def _launch(tmp_path: Path, mode: str, timeout: float | None = None, limit: float = 90) -> dict:
    """Run the script's launch in ``mode``; its outcome, with the rank pids the function wrote down."""
    script, pids = tmp_path / "launch_exit.py", tmp_path / "pids"
    script.write_text(_SCRIPT)
    pids.mkdir()
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, str(script), mode, str(pids)] + ([] if timeout is None else [str(timeout)])
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        _kill(pids)
        pytest.fail(f"the launch ({mode}) did not end within {limit:g} s; its output:\n{(e.stderr or b'')[-3000:]!r}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("OUTCOME ")]
    assert lines, f"no outcome (exit code {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    outcome = json.loads(lines[-1][len("OUTCOME "):])
    outcome["pids"] = {int(p.name): int(p.read_text()) for p in pids.iterdir()}
    return outcome


def _kill(pids: Path) -> None:
    """End the rank processes a hung launch left (the test's own mess, so that one failure does not leak)."""
    import signal

    for path in pids.iterdir():
        try:
            os.kill(int(path.read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _assert_no_rank_left(outcome: dict) -> None:
    assert outcome["children"] == [], f"child processes outlived the launch: {outcome['children']}"
    assert sorted(outcome["pids"]) == [0, 1], outcome["pids"]
    left = [pid for pid in outcome["pids"].values() if _running(pid)]
    assert not left, f"rank processes {left} outlived the launching process"


@pytest.mark.slow
@pytest.mark.parametrize("timeout", [None, 10.0])
def test_a_rank_that_exits_with_code_0_without_a_result_is_named_at_once(tmp_path: Path, timeout: float | None) -> None:
    outcome = _launch(tmp_path, "os_exit", timeout)
    assert "error" in outcome, f"the launch returned {outcome.get('returned')} without rank 1's result"
    assert outcome["ranks"] == [1], outcome["error"]  # rank 0 returned its result: not a failure
    assert 1 in outcome["pids"], f"rank 1 failed before it ran fn: {outcome['error']}"
    pid = outcome["pids"][1]
    assert outcome["first"].startswith(f"rank 1 failed (exit code 0):\nrank 1 (pid {pid}) exited with code 0 "
                                       "without returning a result"), outcome["first"]
    assert outcome["exitcode"] == 0 and not outcome["timed_out"]
    assert outcome["elapsed"] < 30, f"the error came after {outcome['elapsed']:.1f} s"
    _assert_no_rank_left(outcome)


@pytest.mark.slow
def test_ranks_that_all_exit_with_code_0_without_a_result_are_all_named(tmp_path: Path) -> None:
    # no rank is left for torch's agent to see fail: only the launcher's watch can end this launch
    outcome = _launch(tmp_path, "os_exit_all")
    assert "error" in outcome, outcome
    assert sorted(outcome["ranks"]) == [0, 1], outcome["error"]
    assert "exited with code 0 without returning a result" in outcome["first"], outcome["first"]
    assert outcome["elapsed"] < 30, f"the error came after {outcome['elapsed']:.1f} s"
    _assert_no_rank_left(outcome)


@pytest.mark.slow
def test_a_rank_that_calls_sys_exit_0_is_named_with_where_it_did(tmp_path: Path) -> None:
    # torch's own wrapper turns SystemExit(0) into a None result: rank 1's "result" was made up
    outcome = _launch(tmp_path, "sys_exit", timeout=10.0)
    assert "error" in outcome, f"the launch returned {outcome.get('returned')}: rank 1 returned nothing"
    assert outcome["ranks"] == [1], outcome["error"]
    pid = outcome["pids"][1]
    first = outcome["first"]
    assert first.startswith(f"rank 1 failed (exit code 0):\nrank 1 (pid {pid}) exited with code 0 without "
                            "returning a result: fn called sys.exit(0)"), first
    line = next(i for i, text in enumerate(_SCRIPT.splitlines(), 1) if "sys.exit(0)" in text)
    assert "Traceback" in first and f"line {line}, in fn" in first, first  # the line that exited
    assert outcome["elapsed"] < 30, f"the error came after {outcome['elapsed']:.1f} s"
    _assert_no_rank_left(outcome)


@pytest.mark.slow
def test_a_rank_that_escapes_every_watchdog_is_stopped_by_the_launcher(tmp_path: Path) -> None:
    # rank 1 holds the GIL (no Python watchdog) with faulthandler's backstop cancelled: the launching process's own
    # deadline (the timeout, the backstop's grace and a margin after the rank started) stops it
    outcome = _launch(tmp_path, "escape_watchdogs", timeout=2.0, limit=120)
    assert "error" in outcome, outcome
    assert outcome["ranks"] == [1], outcome["error"]
    pid = outcome["pids"][1]
    assert outcome["timed_out"], outcome["first"]
    assert f"rank 1 (pid {pid}) had no result" in outcome["first"], outcome["first"]
    assert outcome["elapsed"] < 60, f"a 2 s timeout took {outcome['elapsed']:.1f} s to report"
    _assert_no_rank_left(outcome)
