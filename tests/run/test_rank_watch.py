"""The launcher's rank watch on its own, with plain child processes standing in for ranks and a loop that collects
them standing in for torch's agent: which ends stop the watched call, which do not, and that a stopped call returns
in the thread that made it."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

from workbench.run.rank_watch import RankWatch, mark


def _exit_after(seconds: float, code: int) -> None:
    time.sleep(seconds)
    os._exit(code)


def _start(target_seconds: float, code: int) -> multiprocessing.Process:
    process = multiprocessing.get_context("fork").Process(target=_exit_after, args=(target_seconds, code))
    process.start()
    return process


def _agent(processes: list[multiprocessing.Process], until: float) -> str:
    """Collect the processes like torch's agent (never noticing an exit 0 without a result) until ``until``."""
    while time.monotonic() < until:
        for process in processes:
            process.join(0.02)
    return "the agent ran to its end"


def test_a_mark_names_the_rank_the_stage_and_the_pid(tmp_path: Path) -> None:
    mark(str(tmp_path), 3, "running")
    mark(None, 3, "returned")  # outside a launch: nothing
    assert [(p.name, p.read_text()) for p in tmp_path.iterdir()] == [("rank3.running", str(os.getpid()))]


def test_a_rank_that_exits_0_without_returning_stops_the_agent_at_once(tmp_path: Path) -> None:
    process = _start(0.5, 0)
    (tmp_path / "rank1.started").write_text(str(process.pid))
    watch = RankWatch(str(tmp_path), budget=None)
    start = time.monotonic()
    assert watch.run(lambda: _agent([process], start + 30)) is None
    assert time.monotonic() - start < 5
    assert watch.stopped is not None and watch.stopped.silent == ((1, process.pid),)
    assert watch.silent() == [(1, process.pid)] and watch.exit_code(process.pid) == 0


def test_a_rank_that_returned_or_failed_does_not_stop_the_agent(tmp_path: Path) -> None:
    returned, failed = _start(0.3, 0), _start(0.3, 3)
    for rank, process in enumerate((returned, failed)):
        (tmp_path / f"rank{rank}.started").write_text(str(process.pid))
    (tmp_path / "rank0.returned").write_text(str(returned.pid))
    watch = RankWatch(str(tmp_path), budget=None)
    assert watch.run(lambda: _agent([returned, failed], time.monotonic() + 1.5)) == "the agent ran to its end"
    assert watch.stopped is None and watch.silent() == []


def test_a_rank_past_its_budget_stops_the_agent_and_is_killed(tmp_path: Path) -> None:
    process = _start(60, 0)
    (tmp_path / "rank0.started").write_text(str(process.pid))
    (tmp_path / "rank0.running").write_text(str(process.pid))
    watch = RankWatch(str(tmp_path), budget=0.5)
    start = time.monotonic()
    assert watch.run(lambda: _agent([process], start + 30)) is None
    assert 0.5 < time.monotonic() - start < 5
    assert watch.stopped is not None and [o[:2] for o in watch.stopped.overdue] == [(0, process.pid)]
    watch.reap()
    assert not process.is_alive() and watch.exit_code(process.pid) == -9
