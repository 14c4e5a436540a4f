"""Who owns an unpublished save, and which checkpoint under a root is the newest complete one.

Every ``.NAME.incomplete`` directory a save creates holds an owner marker (``.workbench-owner.json``: job id,
host, pid, start time) whose modification time is a heartbeat the saving rank refreshes while it works. A new
save to the same path replaces the directory only when its owner is gone:

* no marker (an older workbench, or another tool): stale;
* the same job (``TORCHELASTIC_RUN_ID`` / ``SLURM_JOB_ID``): our own earlier attempt, stale;
* the same host: stale when the pid is no longer running;
* another host: stale when the heartbeat is older than ``stale_after`` seconds (default 5 minutes).

Otherwise the save is refused with the owner named, so two jobs writing the same path never delete each other's
work. ``latest_checkpoint(root)`` and ``clean_incomplete(root)`` use the same rules.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from workbench.io.publish_types import INCOMPLETE_SUFFIX, is_temporary_path

__all__ = [
    "MARKER_NAME",
    "STALE_AFTER",
    "CheckpointScan",
    "Heartbeat",
    "IncompleteSave",
    "Owner",
    "clean_incomplete",
    "latest_checkpoint",
    "read_owner",
    "write_owner",
]

MARKER_NAME = ".workbench-owner.json"
STALE_AFTER = 300.0


def _job_id() -> str:
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID"):
        value = os.environ.get(name)
        if value and value != "none":
            return f"{name}={value}"
    return f"pid={os.getpid()}@{socket.gethostname()}"


@dataclass(frozen=True, slots=True)
class Owner:
    """The job that created an unpublished save, and when it last showed it was alive (``heartbeat``)."""

    job: str
    host: str
    pid: int
    started: float
    heartbeat: float

    def is_live(self, *, stale_after: float = STALE_AFTER, now: float | None = None) -> bool:
        """True while the owner may still be writing (see the module docstring for the rules)."""
        if self.job == _job_id():
            return False
        if self.host == socket.gethostname():
            return _pid_running(self.pid)
        return (now if now is not None else time.time()) - self.heartbeat < stale_after

    def __str__(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"job {self.job}, host {self.host}, pid {self.pid}, started {started}"


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user has this pid
        return True
    return True


def write_owner(directory: Path) -> Path:
    """Write this process's owner marker into ``directory`` (an unpublished save); returns the marker's path."""
    marker = directory / MARKER_NAME
    body = {"job": _job_id(), "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    marker.write_text(json.dumps(body))
    return marker


def read_owner(directory: Path) -> Owner | None:
    """The owner recorded in ``directory``, or None when there is no readable marker."""
    marker = Path(directory) / MARKER_NAME
    try:
        body = json.loads(marker.read_text())
        return Owner(str(body["job"]), str(body["host"]), int(body["pid"]), float(body["started"]),
                     marker.stat().st_mtime)
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Heartbeat:
    """Refresh a marker's modification time every ``interval`` seconds from a daemon thread until ``stop``."""

    def __init__(self, marker: Path, interval: float = 30.0) -> None:
        self.marker = marker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), name="workbench-heartbeat", daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                os.utime(self.marker)
            except OSError:
                return  # published or removed

    def stop(self) -> None:
        """Stop refreshing (idempotent)."""
        self._stop.set()


@dataclass(frozen=True, slots=True)
class IncompleteSave:
    """An unpublished save under a root: its directory, the checkpoint it would publish, and its owner."""

    path: Path
    target: Path
    owner: Owner | None
    live: bool

    def __str__(self) -> str:
        who = str(self.owner) if self.owner else "no owner marker"
        return f"{self.path.name} -> {self.target.name} ({'LIVE: ' if self.live else 'stale: '}{who})"


@dataclass(frozen=True, slots=True)
class CheckpointScan:
    """Checkpoints under ``root``: the newest complete one (``path``), every complete one, newest first, and the
    unpublished saves found beside them."""

    root: Path
    path: Path | None
    complete: tuple[Path, ...]
    incomplete: tuple[IncompleteSave, ...]

    def __fspath__(self) -> str:
        if self.path is None:
            raise FileNotFoundError(f"no complete checkpoint under {self.root}")
        return str(self.path)

    def __str__(self) -> str:
        lines = [f"latest complete checkpoint under {self.root}: {self.path or 'none'}"]
        lines += [f"  incomplete: {s}" for s in self.incomplete]
        return "\n".join(lines)


def _order(path: Path) -> tuple:
    numbers = re.findall(r"\d+", path.name)
    return (int(numbers[-1]) if numbers else -1, path.stat().st_mtime, path.name)


def latest_checkpoint(root: str | Path, *, stale_after: float = STALE_AFTER) -> CheckpointScan:
    """The newest complete checkpoint directly under ``root`` (by the last number in its name, e.g. the step,
    then by modification time), and the incomplete saves beside it. A directory counts as complete only when
    ``validate_final`` finds nothing wrong (index, files, headers, sizes)."""
    from workbench.io.publish import OLD_SUFFIX, is_complete

    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    complete, incomplete = [], []
    for child in sorted(root.iterdir()):
        if not child.is_dir() or child.is_symlink():
            continue
        if is_temporary_path(child):
            owner = read_owner(child)
            target = child.with_name(child.name[1 : -len(INCOMPLETE_SUFFIX)])
            live = owner is not None and owner.is_live(stale_after=stale_after)
            incomplete.append(IncompleteSave(child, target, owner, live))
        elif not child.name.endswith(OLD_SUFFIX) and is_complete(child):
            complete.append(child)
    complete.sort(key=_order, reverse=True)
    return CheckpointScan(root, complete[0] if complete else None, tuple(complete), tuple(incomplete))


def clean_incomplete(
    root: str | Path, *, stale_after: float = STALE_AFTER, force: bool = False
) -> tuple[tuple[Path, ...], tuple[IncompleteSave, ...]]:
    """Remove the unpublished saves under ``root`` whose owner is gone; returns (removed, kept live ones).

    ``force`` removes live ones too (only when you know their job is dead, e.g. its node was lost).
    """
    scan = latest_checkpoint(root, stale_after=stale_after)
    removed, kept = [], []
    for save in scan.incomplete:
        if save.live and not force:
            kept.append(save)
            continue
        shutil.rmtree(save.path)
        removed.append(save.path)
    return tuple(removed), tuple(kept)
