"""wb.launch's reports and clean-up, mostly without starting ranks: which rank a LaunchError names first, a result
that cannot travel back, and the log folder of a launch that ends with something other than a LaunchError.

wb.launch's multi-rank tests live in tests/dist/test_launch.py; the one here that starts ranks uses 2."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

from workbench.run.launcher import _failures


@dataclass
class _TorchFailure:
    """What torch's agent knows of a failed rank (its ``ProcessFailure``)."""

    local_rank: int
    pid: int
    exitcode: int
    timestamp: float


def _record(log_dir: Path, rank: int, when: float, message: str) -> None:
    (log_dir / f"failure-rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "pid": 100 + rank, "time": when, "kind": "error", "message": message,
         "traceback": f"Traceback (most recent call last):\n{message}\n"}))


def test_a_rank_killed_by_a_signal_is_named_before_the_peer_that_lost_its_connection(tmp_path: Path) -> None:
    # rank 0 was SIGKILLed and left no record; rank 1, waiting for it, raised "Connection closed by peer" first
    # (torch's agent counts the crash in whole seconds, after it noticed)
    _record(tmp_path, 1, 1000.2, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:41135")
    crash = _TorchFailure(local_rank=0, pid=100, exitcode=-signal.SIGKILL, timestamp=1001)
    failures = _failures({0: crash}, str(tmp_path))
    assert [f.rank for f in failures] == [0, 1]
    assert failures[0].message.startswith("killed by signal SIGKILL") and failures[0].exitcode == -9


def test_a_crash_without_a_record_comes_after_a_rank_that_raised(tmp_path: Path) -> None:
    # an error a rank recorded is the cause; a peer that then died natively (an abort, no record) is not
    _record(tmp_path, 1, 1000.9, "ValueError: a bad batch")
    crash = _TorchFailure(local_rank=0, pid=100, exitcode=-signal.SIGABRT, timestamp=1000)
    assert [f.rank for f in _failures({0: crash}, str(tmp_path))] == [1, 0]
