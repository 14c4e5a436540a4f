"""Owner markers on unpublished saves: a live job's folder is never deleted; latest_checkpoint and
clean_incomplete find the newest complete checkpoint and the stale leftovers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.errors import CheckpointError
from workbench.io.files.ownership import MARKER_NAME, Heartbeat, Owner, read_owner, write_owner


def _this_boot() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _this_pid_namespace() -> str:
    return os.readlink("/proc/self/ns/pid")


needs_proc = pytest.mark.skipif(not Path("/proc/self/ns/pid").exists(), reason="the kernel names no PID namespace")


def _plant(directory: Path, *, job: str, host: str, pid: int, age: float = 0.0, **place: str) -> None:
    """A marker another process wrote: in this PID space (this boot and PID namespace) unless ``place`` names
    another, or leaves them out (``boot=None``) as an older workbench did."""
    directory.mkdir()
    marker = directory / MARKER_NAME
    body = {"job": job, "host": host, "pid": pid, "started": time.time() - age}
    if Path("/proc/self/ns/pid").exists():
        body |= {"boot": _this_boot(), "pid_namespace": _this_pid_namespace()}
    body = {k: v for k, v in (body | place).items() if v is not None}
    marker.write_text(json.dumps(body))
    os.utime(marker, (time.time() - age, time.time() - age))
    (directory / "model-00001-of-00002.safetensors").write_bytes(b"partial")


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_a_live_jobs_incomplete_folder_is_not_deleted_by_a_new_save(tmp_path: Path, sleeper: int) -> None:
    live = tmp_path / ".ckpt.incomplete"
    _plant(live, job="SLURM_JOB_ID=4242", host=socket.gethostname(), pid=sleeper)
    with pytest.raises(CheckpointError, match=r"belongs to a save still in progress \(job SLURM_JOB_ID=4242.*"
                       r"clean_incomplete"):
        wb.save_hf({"w": torch.ones(2)}, tmp_path / "ckpt")
    assert (live / "model-00001-of-00002.safetensors").read_bytes() == b"partial"  # untouched
    assert not (tmp_path / "ckpt").exists()


def test_a_dead_jobs_folder_is_replaced_and_the_marker_is_not_published(tmp_path: Path) -> None:
    _plant(tmp_path / ".ckpt.incomplete", job="SLURM_JOB_ID=1", host=socket.gethostname(), pid=_dead_pid())
    wb.save_hf({"w": torch.ones(2)}, tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert MARKER_NAME not in {p.name for p in (tmp_path / "ckpt").iterdir()}


def _dead_pid() -> int:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(dead.stdout)


@needs_proc
@pytest.mark.parametrize("place", [
    {"pid_namespace": "pid:[1]"},  # another container on this host name: its pids are not ours to look up
    {"boot": "00000000-0000-0000-0000-000000000000"},  # this host before a reboot, or another kernel by its name
    {"boot": None, "pid_namespace": None},  # an older workbench's marker: no place recorded
], ids=["other-pid-namespace", "other-boot", "no-place-recorded"])
def test_a_pid_outside_this_pid_space_is_never_looked_up(tmp_path: Path, place: dict) -> None:
    """A container sharing this host name has pids of its own: a pid not running here says nothing of its save. Only
    the heartbeat judges it, so a beating save is kept and a save whose heartbeat stopped is removed."""
    for pid in (_dead_pid(), os.getpid()):  # a pid no process here has, and this process's own
        live = tmp_path / f".live-{pid}.incomplete"
        _plant(live, job="SLURM_JOB_ID=11", host=socket.gethostname(), pid=pid, **place)
        save = wb.latest_checkpoint(tmp_path).incomplete[0]
        assert save.live and save.reason.startswith("last heartbeat"), save
        with pytest.raises(CheckpointError, match="belongs to a save still in progress"):
            wb.save_hf({"w": torch.ones(2)}, tmp_path / f"live-{pid}")
        assert wb.clean_incomplete(tmp_path) == ((), (save,))
        assert (live / "model-00001-of-00002.safetensors").read_bytes() == b"partial"
        os.utime(live / MARKER_NAME, (time.time() - 301, time.time() - 301))  # its heartbeat stopped 5 minutes ago
        assert wb.clean_incomplete(tmp_path)[0] == (live,)


@needs_proc
def test_a_marker_records_the_pid_space_its_pid_belongs_to(tmp_path: Path) -> None:
    directory = tmp_path / ".ckpt.incomplete"
    directory.mkdir()
    body = json.loads(write_owner(directory).read_text())
    assert (body["boot"], body["pid_namespace"]) == (_this_boot(), _this_pid_namespace())
    owner = read_owner(directory)
    assert owner.in_this_pid_space() and owner.is_this_process()
    pid = _dead_pid()
    _plant(tmp_path / ".dead.incomplete", job="j", host=socket.gethostname(), pid=pid)  # this PID space
    assert read_owner(tmp_path / ".dead.incomplete").stale_reason() == f"pid {pid} is not running on this host"


def test_another_hosts_folder_is_live_until_its_heartbeat_is_stale() -> None:
    now = time.time()
    owner = Owner(job="SLURM_JOB_ID=7", host="node-that-is-not-here", pid=1, started=now - 900, heartbeat=now - 60)
    assert owner.is_live(now=now)
    assert not owner.is_live(now=now + 600)  # no heartbeat for 11 minutes: its job is gone


def test_a_heartbeat_beats_at_the_period_its_marker_records(tmp_path: Path) -> None:
    """Readers judge staleness by the period in the marker: a heartbeat with its own interval writes it there."""
    directory = tmp_path / ".ckpt.incomplete"
    directory.mkdir()
    marker = write_owner(directory)
    assert read_owner(directory).period == 30.0  # the default
    beat = Heartbeat(marker, interval=0.05)
    try:
        assert read_owner(directory).period == 0.05 and beat.interval == 0.05
        first = marker.stat().st_mtime_ns
        time.sleep(0.5)
        assert marker.stat().st_mtime_ns > first
    finally:
        beat.stop()
    with pytest.raises(ValueError, match="period must be a positive number of seconds, got 0"):
        write_owner(directory, period=0)


def test_latest_checkpoint_and_clean_incomplete(tmp_path: Path, sleeper: int) -> None:
    for step in (100, 20, 300):
        wb.save_hf({"w": torch.full((2,), float(step))}, tmp_path / f"step-{step}")
    (tmp_path / "step-400").mkdir()  # a directory that is no checkpoint (no index)
    _plant(tmp_path / ".step-500.incomplete", job="SLURM_JOB_ID=9", host=socket.gethostname(), pid=sleeper)
    _plant(tmp_path / ".step-600.incomplete", job="SLURM_JOB_ID=8", host="gone-host", pid=1, age=3600)
    scan = wb.latest_checkpoint(tmp_path)
    assert scan.path == tmp_path / "step-300" and os.fspath(scan) == str(tmp_path / "step-300")
    assert scan.complete == (tmp_path / "step-300", tmp_path / "step-100", tmp_path / "step-20")
    live = {s.target.name: s.live for s in scan.incomplete}
    assert live == {"step-500": True, "step-600": False}
    assert "LIVE" in str(scan) and read_owner(tmp_path / ".step-500.incomplete").pid == sleeper

    removed, kept = wb.clean_incomplete(tmp_path)
    assert removed == (tmp_path / ".step-600.incomplete",)
    assert [k.path for k in kept] == [tmp_path / ".step-500.incomplete"]
    removed, kept = wb.clean_incomplete(tmp_path, force=True)
    assert removed == (tmp_path / ".step-500.incomplete",) and kept == ()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        os.fspath(wb.latest_checkpoint(tmp_path / "step-400"))


def test_config_files_may_not_overwrite_what_the_save_writes(tmp_path: Path) -> None:
    fake = tmp_path / "src" / "model.safetensors.index.json"
    fake.parent.mkdir()
    fake.write_text("{}")
    with pytest.raises(CheckpointError, match=r"would overwrite the index or weight files"):
        wb.save_hf({"w": torch.ones(2)}, tmp_path / "ckpt", config_files=[fake])
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / ".ckpt.incomplete").exists()
