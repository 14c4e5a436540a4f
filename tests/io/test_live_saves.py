"""A live save is never deleted: this process's own saves in flight, and any save whose owner marker has a fresh
heartbeat, whoever owns it (the same job included). Stale: a dead pid on this host, or a heartbeat older than
``STALE_PERIODS`` times the period its marker records. The "other process" cases run a real subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import workbench as wb
from workbench.errors import CheckpointError
from workbench.faults import fault_hook
from workbench.io.files import publish as publish_module
from workbench.io.files.index import INDEX_NAME
from workbench.io.files.ownership import MARKER_NAME, Heartbeat, read_owner, write_owner
from workbench.io.files.publish import AtomicRenamePublisher, is_complete

ROOT = Path(__file__).resolve().parents[2]
JOB = "SLURM_JOB_ID=424242"

# Another process of the same job: it prepares a save of argv[1] (period argv[2] seconds), says "ready" with its
# pid, and holds the save (its heartbeat running) until its stdin closes.
HOLDER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from workbench.io.files.publish import AtomicRenamePublisher

    kwargs = {"heartbeat_period": float(sys.argv[2])} if len(sys.argv) > 2 else {}
    publisher = AtomicRenamePublisher(Path(sys.argv[1]), **kwargs)
    publisher.prepare()
    print("ready", os.getpid(), flush=True)
    sys.stdin.read()
    """
)


def _holder(target: Path, *period: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(target), *period], cwd=ROOT, env=os.environ.copy(),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("ready"), f"the holder process did not start: {line!r}"
    return proc


@pytest.fixture
def same_job(monkeypatch) -> Iterator[list[subprocess.Popen]]:
    """This process and every holder it starts belong to one job; holders are killed at the end."""
    monkeypatch.setenv("SLURM_JOB_ID", JOB.split("=")[1])
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def _plant(directory: Path, *, host: str, pid: int, age: float, period: float | None = None) -> None:
    """A marker as another process wrote it (for another host: no such host can be reached from here)."""
    directory.mkdir()
    body = {"job": JOB, "host": host, "pid": pid, "started": time.time() - age - 60}
    if period is not None:
        body["period"] = period
    marker = directory / MARKER_NAME
    marker.write_text(json.dumps(body))
    os.utime(marker, (time.time() - age, time.time() - age))
    (directory / "model-00001-of-00001.safetensors").write_bytes(b"partial")


def test_an_async_save_in_flight_survives_clean_incomplete(tmp_path: Path, request) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow_writer(point: str, rank: int, detail: object = None) -> None:
        if point == "write":  # a background writer thread: held here until the test has cleaned
            entered.set()
            if not release.wait(60):
                raise TimeoutError("the test never released the writer")

    hook = fault_hook(slow_writer)
    hook.__enter__()
    request.addfinalizer(lambda: hook.__exit__(None, None, None))
    state = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.full((5,), 7.0)}
    handle = wb.save_hf(state, tmp_path / "step-1", async_save=True)
    temporary = tmp_path / ".step-1.incomplete"
    try:
        assert entered.wait(60), "the async save never started writing"
        removed, kept = wb.clean_incomplete(tmp_path)
        forced, kept_forced = wb.clean_incomplete(tmp_path, force=True)  # force never removes this process's own
        scan = wb.latest_checkpoint(tmp_path)
        try:
            AtomicRenamePublisher(tmp_path / "step-1").prepare()
            refused = ""
        except CheckpointError as exc:
            refused = str(exc)
    finally:
        release.set()
        outcome: BaseException | None = None
        try:
            handle.wait()  # waited on every way out: a pending save would surface in the next test's save_hf
        except BaseException as exc:
            outcome = exc
    assert removed == () and forced == ()
    assert [k.path for k in kept] == [k.path for k in kept_forced] == [temporary]
    assert [(s.path, s.live) for s in scan.incomplete] == [(temporary, True)] and scan.path is None
    assert f"{temporary} belongs to a save still in progress in this process" in refused
    assert outcome is None, f"the save failed: {outcome}"
    assert is_complete(tmp_path / "step-1") and not temporary.exists()
    weights = json.loads((tmp_path / "step-1" / INDEX_NAME).read_text())["weight_map"]
    for key, value in state.items():
        with safe_open(tmp_path / "step-1" / weights[key], framework="pt") as reader:
            assert torch.equal(reader.get_tensor(key), value)


def test_another_process_of_the_same_job_keeps_its_save(tmp_path: Path, same_job: list) -> None:
    holder = _holder(tmp_path / "ckpt")
    same_job.append(holder)
    temporary = tmp_path / ".ckpt.incomplete"
    owner = read_owner(temporary)
    assert owner is not None and (owner.job, owner.pid) == (JOB, holder.pid)  # the same job as this process

    removed, kept = wb.clean_incomplete(tmp_path)
    assert removed == () and [k.path for k in kept] == [temporary]
    assert [s.live for s in wb.latest_checkpoint(tmp_path).incomplete] == [True]
    with pytest.raises(CheckpointError) as info:
        AtomicRenamePublisher(tmp_path / "ckpt").prepare()
    message = str(info.value)
    for part in (str(temporary), f"host {socket.gethostname()}", f"pid {holder.pid}", f"job {JOB}"):
        assert part in message, (part, message)
    assert re.search(r"last heartbeat \d+\.\d s ago \(every 30 s\)", message), message
    with pytest.raises(CheckpointError, match="belongs to a save still in progress"):
        wb.save_hf({"w": torch.ones(2)}, tmp_path / "ckpt")
    assert [p.name for p in temporary.iterdir()] == [MARKER_NAME] and read_owner(temporary) == owner


def test_a_heartbeat_keeps_a_save_live_until_it_is_older_than_its_multiple(tmp_path: Path, same_job: list) -> None:
    """On this host too, a running pid is not enough: a holder that stops beating (SIGSTOP) goes stale."""
    holder = _holder(tmp_path / "ckpt", "0.3")
    same_job.append(holder)
    temporary = tmp_path / ".ckpt.incomplete"
    assert json.loads((temporary / MARKER_NAME).read_text())["period"] == 0.3  # a reader can apply the multiple
    first = read_owner(temporary).heartbeat
    time.sleep(1.0)  # three periods: still live (stale after ten)
    assert read_owner(temporary).heartbeat > first
    assert wb.clean_incomplete(tmp_path)[0] == ()
    os.kill(holder.pid, signal.SIGSTOP)  # alive, no longer beating
    deadline = time.time() + 10
    while time.time() < deadline and wb.latest_checkpoint(tmp_path).incomplete[0].live:
        time.sleep(0.1)
    save = wb.latest_checkpoint(tmp_path).incomplete[0]
    assert not save.live and re.search(r"no heartbeat for \d+(\.\d+)? s \(more than 10 x its 0.3 s period\)",
                                       save.reason), save.reason
    assert time.time() - read_owner(temporary).heartbeat >= 3.0  # never judged stale before ten periods
    assert wb.clean_incomplete(tmp_path)[0] == (temporary,)


def test_stale_saves_are_removed(tmp_path: Path, same_job: list) -> None:
    dead = _holder(tmp_path / "dead")  # this host, the same job, killed
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait()
    _plant(tmp_path / ".old-beat.incomplete", host="node-not-here", pid=1, age=3600)  # no period recorded: 30 s
    _plant(tmp_path / ".short-period.incomplete", host="node-not-here", pid=1, age=10, period=0.5)
    _plant(tmp_path / ".beating.incomplete", host="node-not-here", pid=1, age=10, period=30)
    leftover = tmp_path / ".mine.incomplete"  # this process's own marker, no save of this process holds it
    leftover.mkdir()
    write_owner(leftover)

    reasons = {s.target.name: (s.live, s.reason) for s in wb.latest_checkpoint(tmp_path).incomplete}
    assert reasons["dead"] == (False, f"pid {dead.pid} is not running on this host")
    assert reasons["old-beat"][0] is False and "no heartbeat for 3600 s (more than 10 x its 30 s period)" in (
        reasons["old-beat"][1])
    assert reasons["short-period"][0] is False and "(more than 10 x its 0.5 s period)" in reasons["short-period"][1]
    assert reasons["beating"][0] is True and "last heartbeat 10 s ago (every 30 s)" in reasons["beating"][1]
    assert reasons["mine"] == (False, f"left by this process (pid {os.getpid()}); no save of this process holds it")

    removed, kept = wb.clean_incomplete(tmp_path)
    assert sorted(p.name for p in removed) == [".dead.incomplete", ".mine.incomplete", ".old-beat.incomplete",
                                               ".short-period.incomplete"]
    assert [k.path.name for k in kept] == [".beating.incomplete"]


def test_prepare_replaces_a_dead_processs_save_and_refuses_a_beating_one(tmp_path: Path, same_job: list) -> None:
    dead = _holder(tmp_path / "ckpt")
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait()
    temporary = AtomicRenamePublisher(tmp_path / "ckpt").prepare()
    assert read_owner(temporary).pid == os.getpid()
    _plant(tmp_path / ".other.incomplete", host="node-not-here", pid=1, age=10, period=0.5)
    AtomicRenamePublisher(tmp_path / "other").prepare()  # ten seconds without a beat, at 0.5 s: stale
    assert read_owner(tmp_path / ".other.incomplete").pid == os.getpid()
    _plant(tmp_path / ".busy.incomplete", host="node-not-here", pid=1, age=10, period=30)
    with pytest.raises(CheckpointError, match=r"host node-not-here, pid 1, .*last heartbeat 10 s ago"):
        AtomicRenamePublisher(tmp_path / "busy").prepare()
    assert (tmp_path / ".busy.incomplete" / "model-00001-of-00001.safetensors").read_bytes() == b"partial"


def test_a_heartbeat_holds_its_directory_live_in_this_process(tmp_path: Path) -> None:
    directory = tmp_path / ".ckpt.incomplete"
    directory.mkdir()
    beat = Heartbeat(write_owner(directory))
    try:
        assert wb.clean_incomplete(tmp_path) == ((), wb.clean_incomplete(tmp_path)[1])
        assert [s.live for s in wb.latest_checkpoint(tmp_path).incomplete] == [True]
    finally:
        beat.stop()
    assert wb.clean_incomplete(tmp_path)[0] == (directory,)


def test_finalize_keeps_the_marker_until_the_rename(tmp_path: Path, monkeypatch) -> None:
    """While finalize verifies and fsyncs, the directory is still visibly owned: another process's
    clean_incomplete (which sees only the marker) must not take it for an ownerless leftover."""
    publisher = AtomicRenamePublisher(tmp_path / "ckpt")
    temporary = publisher.prepare()
    from tests.io.support import save_checkpoint

    save_checkpoint(temporary, {"w": torch.ones(3)})
    seen: list[bool] = []
    real = publish_module.fsync_file
    monkeypatch.setattr(publish_module, "fsync_file", lambda p: (seen.append((temporary / MARKER_NAME).exists()),
                                                                 real(p)))
    publisher.finalize()
    assert seen and all(seen)
    assert MARKER_NAME not in {p.name for p in (tmp_path / "ckpt").iterdir()}


@pytest.mark.parametrize("body", [
    "[" * 100_000 + "]" * 100_000,  # RecursionError in json.loads
    '{"job": "j", "host": "h", "pid": 1, "started": Infinity}',  # OverflowError / not finite
    '{"job": "j", "host": "h", "pid": 1e400, "started": 0}',  # OverflowError converting to int
    '{"job": "j", "host": "h", "pid": 1, "started": 0, "period": NaN}',
    " " * (128 << 10),  # over the marker cap: not read
])
def test_a_hostile_owner_marker_is_no_owner_and_crashes_nothing(tmp_path: Path, body: str) -> None:
    from workbench.io.files.ownership import MARKER_NAME, read_owner

    folder = tmp_path / ".step-1.incomplete"
    folder.mkdir()
    (folder / MARKER_NAME).write_text(body)
    assert read_owner(folder) is None
    scan = wb.latest_checkpoint(tmp_path)  # never another exception than what it documents
    assert scan.path is None
