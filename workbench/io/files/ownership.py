"""Who owns an unpublished save, whether it is still live, and which checkpoint under a root is the newest complete one.

Every ``.NAME.incomplete`` directory a save creates holds an owner marker (``.workbench-owner.json``: job id, host,
pid, the kernel's boot id and PID namespace, start time and the heartbeat ``period`` in seconds); the marker's
modification time is a heartbeat its writer refreshes every ``period`` seconds while the save is in progress
(``Heartbeat``).

A pid in a marker is looked up only when the marker's host, boot id and PID namespace are all this process's
(``Owner.in_this_pid_space``, see ``workbench.pid_space``): containers sharing a host name have pids of their own.
Any other marker, and one written by an older workbench that recorded neither, is judged by its heartbeat alone
(where this kernel names no PID space either, a host without ``/proc``, the host name decides, as it did before).

Liveness, one rule for ``clean_incomplete``, ``latest_checkpoint`` and ``AtomicRenamePublisher.prepare``:

* **claimed in this process**: a save of this process holds the directory (its publisher between ``prepare`` and
  ``finalize``/``abort``, or a running ``Heartbeat``): live, always, whatever its marker says;
* no readable marker (an older workbench, another tool): stale;
* a marker written by this process (same pid in the same PID space, see above) that no save of this process holds:
  stale (an earlier attempt of ours that failed);
* a marker of another process in this PID space whose pid is not running: stale;
* a heartbeat older than ``STALE_PERIODS`` (10) times the marker's period (30 s unless it says otherwise, so
  5 minutes): stale, on any host, even if the pid still runs (a stopped or hung process, or a reused pid);
* otherwise live, whoever owns it: another job, or another process of the same job.

A live save is never deleted: ``clean_incomplete`` keeps it (``force=True`` removes live saves of other processes,
never one this process holds) and ``prepare`` refuses, naming the owner and the heartbeat's age. Heartbeat ages are
read from the marker's modification time against this host's clock: hosts whose clocks disagree by more than the
stale multiple judge each other wrongly.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from workbench.io.files.complete import OLD_SUFFIX, is_complete
from workbench.io.files.limits import parse_json, read_capped
from workbench.io.files.publish_types import INCOMPLETE_SUFFIX, is_temporary_path
from workbench.pid_space import PidSpace, in_this_pid_space, this_pid_space

MAX_MARKER_BYTES = 64 << 10
"""An owner marker is a few hundred bytes; a larger file is not read."""

__all__ = [
    "HEARTBEAT_PERIOD",
    "MARKER_NAME",
    "STALE_AFTER",
    "STALE_PERIODS",
    "CheckpointScan",
    "Heartbeat",
    "IncompleteSave",
    "LiveClaim",
    "Owner",
    "claimed_here",
    "clean_incomplete",
    "incomplete_save",
    "latest_checkpoint",
    "read_owner",
    "remove_if_stale",
    "write_owner",
]

MARKER_NAME = ".workbench-owner.json"
HEARTBEAT_PERIOD = 30.0
STALE_PERIODS = 10
STALE_AFTER = STALE_PERIODS * HEARTBEAT_PERIOD  # for a marker with the default period


def _job_id() -> str:
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID"):
        value = os.environ.get(name)
        if value and value != "none":
            return f"{name}={value}"
    return f"pid={os.getpid()}@{socket.gethostname()}"


# -- the directories this process is writing ---------------------------------------------------------------------

_CLAIMS_LOCK = threading.RLock()  # also held while clean_incomplete removes a directory: no claim starts meanwhile
_CLAIMS: Counter[str] = Counter()


def _claim_key(directory: Path | str) -> str:
    return os.path.realpath(directory)


def claimed_here(directory: Path | str) -> bool:
    """True while a save of this process holds ``directory`` (a ``LiveClaim`` or a running ``Heartbeat``)."""
    with _CLAIMS_LOCK:
        return _CLAIMS[_claim_key(directory)] > 0


class LiveClaim:
    """This process is writing ``directory``: until ``release``, this process's ``clean_incomplete``,
    ``latest_checkpoint`` and ``prepare`` treat it as live whatever its marker says.

    ``exclusive=True`` takes the claim only if no one in this process holds the directory (else ``ValueError``
    naming it): a publisher's claim, so two saves of one process never share a temporary directory. Shared
    claims (a ``Heartbeat``'s) are counted. Releasing twice is harmless."""

    def __init__(self, directory: Path | str, *, exclusive: bool = False) -> None:
        self.directory = Path(directory)
        self._key = _claim_key(directory)
        with _CLAIMS_LOCK:
            if exclusive and _CLAIMS[self._key] > 0:
                raise ValueError(f"{directory} is already held by a save of this process")
            _CLAIMS[self._key] += 1
        self._held = True

    def release(self) -> None:
        """Stop holding the directory (idempotent)."""
        with _CLAIMS_LOCK:
            if self._held:
                self._held = False
                _CLAIMS[self._key] -= 1
                if _CLAIMS[self._key] <= 0:
                    del _CLAIMS[self._key]

    def __repr__(self) -> str:
        return f"LiveClaim({str(self.directory)!r}, held={self._held})"


# -- markers -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Owner:
    """The process that created an unpublished save, when it last showed it was alive (``heartbeat``, a time
    stamp), and how often it promised to (``period``, seconds)."""

    job: str
    host: str
    pid: int
    started: float
    heartbeat: float
    period: float = HEARTBEAT_PERIOD
    boot: str = ""
    pid_namespace: str = ""

    def in_this_pid_space(self) -> bool:
        """True when the marker's pid names a process this one can look up: the same host, the same boot of its
        kernel and the same PID namespace (``pid_space.in_this_pid_space``; a marker that does not record them is in
        it only where this process's kernel names no PID space either)."""
        return in_this_pid_space(self.host, PidSpace(self.boot, self.pid_namespace))

    def is_this_process(self) -> bool:
        """True when this process wrote the marker."""
        return self.pid == os.getpid() and self.in_this_pid_space()

    def heartbeat_age(self, now: float | None = None) -> float:
        """Seconds since the last heartbeat (0 when the marker's clock is ahead of this host's)."""
        return max(0.0, (now if now is not None else time.time()) - self.heartbeat)

    def stale_reason(self, *, stale_after: float | None = None, now: float | None = None) -> str | None:
        """Why the marker alone shows its owner gone, or None while it may still be writing. ``stale_after``
        (seconds) replaces ``STALE_PERIODS * period``. This process's own markers are judged by its claims, which a
        marker cannot show: see ``incomplete_save``."""
        if self.pid != os.getpid() and self.in_this_pid_space() and not _pid_running(self.pid):
            return f"pid {self.pid} is not running on this host"
        limit = stale_after if stale_after is not None else STALE_PERIODS * self.period
        age = self.heartbeat_age(now)
        if age > limit:
            why = (f"stale_after={limit:g} s" if stale_after is not None
                   else f"{STALE_PERIODS} x its {self.period:g} s period")
            return f"no heartbeat for {_seconds(age)} s (more than {why})"
        return None

    def is_live(self, *, stale_after: float | None = None, now: float | None = None) -> bool:
        """True while the marker shows its owner may still be writing (see the module docstring for the rules)."""
        return self.stale_reason(stale_after=stale_after, now=now) is None

    def describe(self, now: float | None = None) -> str:
        """The owner and its heartbeat, for messages."""
        return f"{self}; last heartbeat {_seconds(self.heartbeat_age(now))} s ago (every {self.period:g} s)"

    def __str__(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"job {self.job}, host {self.host}, pid {self.pid}, started {started}"


def _seconds(value: float) -> str:
    """Whole seconds, or tenths below ten (a 0.3 s period's stale limit is 3 s: "3.1", not "3")."""
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user has this pid
        return True
    return True


def write_owner(directory: Path, *, period: float = HEARTBEAT_PERIOD) -> Path:
    """Write this process's owner marker into ``directory`` (an unpublished save), promising a heartbeat every
    ``period`` seconds; returns the marker's path. The marker is replaced in one rename: a reader never sees it
    half written. Writing a marker claims nothing: hold the directory with a ``LiveClaim`` or a ``Heartbeat``."""
    if not period > 0:
        raise ValueError(f"period must be a positive number of seconds, got {period!r}")
    marker = Path(directory) / MARKER_NAME
    space = this_pid_space()
    body = {"job": _job_id(), "host": socket.gethostname(), "pid": os.getpid(), "boot": space.boot,
            "pid_namespace": space.namespace, "started": time.time(), "period": float(period)}
    staged = marker.with_name(f"{MARKER_NAME}.{os.getpid()}.{threading.get_ident()}.tmp")
    staged.write_text(json.dumps(body))
    os.replace(staged, marker)
    return marker


def read_owner(directory: Path) -> Owner | None:
    """The owner recorded in ``directory``, or None when there is no readable marker. A marker without a period
    (an older workbench) gets ``HEARTBEAT_PERIOD``; one without a boot id or PID namespace is judged by its heartbeat
    alone."""
    marker = Path(directory) / MARKER_NAME
    try:  # a marker is a few hundred bytes: anything larger, deeper or not finite is no readable marker
        body = parse_json(read_capped(marker, MAX_MARKER_BYTES, "MAX_MARKER_BYTES"))
        period, started = float(body.get("period", HEARTBEAT_PERIOD)), float(body["started"])
        if not (math.isfinite(period) and math.isfinite(started)):
            return None
        return Owner(str(body["job"]), str(body["host"]), int(body["pid"]), started,
                     marker.stat().st_mtime, period if period > 0 else HEARTBEAT_PERIOD,
                     str(body.get("boot", "")), str(body.get("pid_namespace", "")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError):
        return None


class Heartbeat:
    """Refresh a marker's modification time every ``interval`` seconds from a daemon thread until ``stop``, and
    hold its directory live in this process meanwhile (a shared ``LiveClaim``).

    ``interval`` defaults to the period the marker records; another interval is written into the marker first, so
    readers always judge it by the period it keeps."""

    def __init__(self, marker: Path, interval: float | None = None) -> None:
        self.marker = Path(marker)
        owner = read_owner(self.marker.parent)
        recorded = owner.period if owner is not None else HEARTBEAT_PERIOD
        if interval is None:
            interval = recorded
        elif owner is not None and interval != recorded:
            _record_period(self.marker, interval)
        self.interval = interval
        self._claim = LiveClaim(self.marker.parent)
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
        """Stop refreshing and release the directory (idempotent)."""
        self._stop.set()
        self._claim.release()


def _record_period(marker: Path, period: float) -> None:
    if not period > 0:
        raise ValueError(f"interval must be a positive number of seconds, got {period!r}")
    body = json.loads(marker.read_text())
    body["period"] = float(period)
    staged = marker.with_name(f"{MARKER_NAME}.{os.getpid()}.{threading.get_ident()}.tmp")
    staged.write_text(json.dumps(body))
    os.replace(staged, marker)


@dataclass(frozen=True, slots=True)
class IncompleteSave:
    """An unpublished save: its directory, the checkpoint it would publish, its owner, whether it is live and why
    (the rule that decided, see the module docstring)."""

    path: Path
    target: Path
    owner: Owner | None
    live: bool
    reason: str = ""

    def __str__(self) -> str:
        who = str(self.owner) if self.owner else "no owner marker"
        return f"{self.path.name} -> {self.target.name} ({'LIVE: ' if self.live else 'stale: '}{who}; {self.reason})"


def _judge(directory: Path, owner: Owner | None, *, claims: bool, stale_after: float | None,
           now: float | None) -> tuple[bool, str]:
    if claims and claimed_here(directory):
        return True, f"a save of this process (pid {os.getpid()}) is writing it"
    if owner is None:
        return False, "no owner marker (an older workbench, or another tool)"
    if owner.is_this_process():
        return False, f"left by this process (pid {owner.pid}); no save of this process holds it"
    stale = owner.stale_reason(stale_after=stale_after, now=now)
    if stale is not None:
        return False, stale
    return True, f"last heartbeat {_seconds(owner.heartbeat_age(now))} s ago (every {owner.period:g} s)"


def incomplete_save(
    directory: Path | str, *, stale_after: float | None = None, now: float | None = None, claims: bool = True
) -> IncompleteSave:
    """Judge the unpublished save in ``directory`` (a ``.NAME.incomplete`` path) by the module's liveness rule.

    Args:
        stale_after: seconds without a heartbeat after which an owner is gone; None (default): ``STALE_PERIODS``
            times the period its marker records.
        now: the time to judge at (default: now).
        claims: count this process's claims (False: the caller holds the directory's exclusive claim itself and
            asks what the marker alone says).
    """
    directory = Path(directory)
    owner = read_owner(directory)
    live, reason = _judge(directory, owner, claims=claims, stale_after=stale_after, now=now)
    target = directory.with_name(directory.name[1 : -len(INCOMPLETE_SUFFIX)])
    return IncompleteSave(directory, target, owner, live, reason)


def _same_owner(a: Owner | None, b: Owner | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.job, a.host, a.pid, a.boot, a.pid_namespace, a.started) == (
        b.job, b.host, b.pid, b.boot, b.pid_namespace, b.started)


def remove_if_stale(save: IncompleteSave, *, force: bool = False, holding: bool = False) -> bool:
    """Remove ``save.path`` if it is still the save that was judged (same owner) and no save of this process holds
    it; True when removed (or found gone). A directory taken over meanwhile by a new save is left alone.

    Args:
        force: skip the owner check (never the claim check).
        holding: the caller holds the directory's exclusive ``LiveClaim`` (a publisher replacing a stale save):
            its own claim does not count.
    """
    path = save.path
    with _CLAIMS_LOCK:  # no save of this process can claim the path while it is removed
        if not holding and claimed_here(path):
            return False
        if not force and not _same_owner(read_owner(path), save.owner):
            return False
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            pass  # removed meanwhile by another cleaner
        return True


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


def latest_checkpoint(root: str | Path, *, stale_after: float | None = None) -> CheckpointScan:
    """The newest complete checkpoint directly under ``root`` (by the last number in its name, e.g. the step,
    then by modification time), and the incomplete saves beside it, each judged live or stale by the module's rule
    (``stale_after``: seconds, instead of ``STALE_PERIODS`` times each marker's period). A directory counts as
    complete only when ``validate_final`` finds nothing wrong (index, files, headers, sizes)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    complete, incomplete = [], []
    now = time.time()
    for child in sorted(root.iterdir()):
        if not child.is_dir() or child.is_symlink():
            continue
        if is_temporary_path(child):
            incomplete.append(incomplete_save(child, stale_after=stale_after, now=now))
        elif not child.name.endswith(OLD_SUFFIX) and is_complete(child):
            complete.append(child)
    complete.sort(key=_order, reverse=True)
    return CheckpointScan(root, complete[0] if complete else None, tuple(complete), tuple(incomplete))


def clean_incomplete(
    root: str | Path, *, stale_after: float | None = None, force: bool = False
) -> tuple[tuple[Path, ...], tuple[IncompleteSave, ...]]:
    """Remove the unpublished saves under ``root`` whose owner is gone (the module's rule; ``stale_after`` in
    seconds replaces ``STALE_PERIODS`` times each marker's period); returns (removed, kept live ones).

    A live save is kept: one this process is writing (an async save not yet waited on), or one whose heartbeat is
    fresh, whoever owns it. ``force`` removes live saves of other processes too (only when you know their job is
    dead, e.g. its node was lost); never one of this process. A directory taken over by a new save between the scan
    and its removal is kept.
    """
    scan = latest_checkpoint(root, stale_after=stale_after)
    removed, kept = [], []
    for save in scan.incomplete:
        if (not save.live or force) and remove_if_stale(save, force=force):
            removed.append(save.path)
        else:
            kept.append(save if save.live else incomplete_save(save.path, stale_after=stale_after))
    return tuple(removed), tuple(kept)
