"""Watch a launch's rank processes from the launching process, for what torch's elastic agent cannot see.

The agent waits until every rank has handed back a result and counts only a non-zero exit as a failure: a rank whose
process ended with code 0 and no result (``os._exit(0)``, a native ``exit(0)``) left ``wb.launch`` waiting forever,
``timeout`` or not (the ranks' watchdogs stop with their rank). So every rank leaves marks in the launch's private
folder (``started``, ``running`` its function, ``returned`` a result), and a thread of the launching process reads
them with the ranks' exit codes. It stops the agent when

* a rank's process ended with code 0 and no ``returned`` mark, and no rank failed otherwise (torch reports that
  failure itself), or
* a rank has run its function past ``budget`` seconds (the timeout, the grace of the rank's own watchdogs and a
  margin) with no result, its watchdogs having failed to end it.

The agent runs in the launching thread: the watch stops it by raising an exception there, as a signal does, and the
agent shuts its ranks down on the way out; the launcher then raises ``LaunchError`` from what the watch saw.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import process as mp_process
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["RankWatch", "Stopped", "mark"]

_STAGES = ("started", "running", "returned")
_FAILURE_RECORDS = "failure-*.json"  # the launcher's records of ranks that failed
T = TypeVar("T")


def mark(directory: str | None, rank: int, stage: str) -> None:
    """In a rank: record that it reached ``stage`` (one of ``started``, ``running``, ``returned``)."""
    if directory:
        with contextlib.suppress(OSError):
            (Path(directory) / f"rank{rank}.{stage}").write_text(str(os.getpid()))


@dataclass(frozen=True, slots=True)
class Stopped:
    """Why the watch stopped a launch: ``silent``, ranks that ended with code 0 and no result, as (rank, pid); or
    ``overdue``, ranks past their deadline, as (rank, pid, seconds they ran their function)."""

    silent: tuple[tuple[int, int], ...] = ()
    overdue: tuple[tuple[int, int, float], ...] = ()


class _Stop(BaseException):
    """Raised in the launching thread to end torch's agent (a BaseException: no ``except Exception`` keeps it)."""


class RankWatch:
    """Watch the ranks that mark their stages in ``directory``; ``budget``: seconds a rank may run its function
    (None: no deadline)."""

    def __init__(self, directory: str, budget: float | None, interval: float = 0.1) -> None:
        self._dir = Path(directory)
        self._budget = budget
        self._interval = interval
        self._lock = threading.Lock()
        self._halted = threading.Event()
        self._thread_id = threading.get_ident()
        self._processes: dict[int, Any] = {}  # pid -> torch's multiprocessing.Process of the rank
        self._running_since: dict[int, float] = {}  # rank -> when this process first saw it running its function
        self.stopped: Stopped | None = None

    def run(self, call: Callable[[], T]) -> T | None:
        """``call()`` (torch's agent) in this thread, watched; its result, or None when the watch stopped it."""
        self._thread_id = threading.get_ident()
        watcher = threading.Thread(target=self._loop, name="workbench-rank-watch", daemon=True)
        watcher.start()
        try:
            try:
                return call()
            finally:
                self._halt()
        except _Stop:
            self._halt()  # again: the stop may have landed in the first one
            return None
        finally:
            watcher.join(5.0)

    def silent(self) -> list[tuple[int, int]]:
        """The ranks, as (rank, pid), whose process ended with code 0 and no result."""
        found = []
        for rank, pid in sorted(self._pids().items()):
            if not (self._dir / f"rank{rank}.returned").exists() and self.exit_code(pid) == 0:
                found.append((rank, pid))
        return found

    def reap(self, grace: float = 5.0) -> None:
        """Once the agent is gone: kill and collect any rank process still running (the agent may have been stopped
        partway through shutting its ranks down)."""
        self._track()
        for pid in self._pids().values():
            process = self._processes.get(pid)
            if process is not None and process.is_alive():
                process.kill()
                process.join(grace)

    def _halt(self) -> None:
        """Stop watching; a stop sent but not yet raised is cancelled, so it cannot land in the launcher's cleanup."""
        with self._lock:
            self._halted.set()
            if self.stopped is not None:
                _raise_in(self._thread_id, None)

    def _loop(self) -> None:
        while not self._halted.wait(self._interval):
            self._track()
            found = self._check()
            if found is None:
                continue
            with self._lock:
                if not self._halted.is_set():
                    self.stopped = found
                    _raise_in(self._thread_id, _Stop)
            return

    def _check(self) -> Stopped | None:
        """Why to stop the launch now, if there is a reason."""
        now = time.monotonic()
        silent, overdue, failed = [], [], any(self._dir.glob(_FAILURE_RECORDS))
        for rank, pid in sorted(self._pids().items()):
            if (self._dir / f"rank{rank}.returned").exists():
                continue
            code = self.exit_code(pid)
            if code == 0:
                silent.append((rank, pid))
            elif code is not None:
                failed = True  # torch's agent reports it, and stops the others
            elif self._budget is not None and (self._dir / f"rank{rank}.running").exists():
                ran = now - self._running_since.setdefault(rank, now)
                if ran > self._budget:
                    overdue.append((rank, pid, ran))
        if silent and not failed:
            return Stopped(silent=tuple(silent))
        return Stopped(overdue=tuple(overdue)) if overdue else None

    def _pids(self) -> dict[int, int]:
        """rank -> pid of every rank that has started."""
        pids = {}
        for path in self._dir.glob("rank*.started"):
            with contextlib.suppress(OSError, ValueError):
                pids[int(path.stem[len("rank"):])] = int(path.read_text())
        return pids

    def _track(self) -> None:
        """Keep hold of the processes this process has started (torch's rank processes among them) while they are
        listed: torch's agent drops them once it has collected their exit."""
        for process in list(mp_process._children):  # multiprocessing's own set of this process's live children
            self._processes.setdefault(process.pid, process)

    def exit_code(self, pid: int) -> int | None:
        """A rank process's exit code once torch's agent has collected it, else None. Read, never waited for: a second
        waiter could take the exit status from under the agent."""
        return getattr(getattr(self._processes.get(pid), "_popen", None), "returncode", None)


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in the thread ``thread_id`` at its next Python instruction; None cancels one not yet raised."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)
