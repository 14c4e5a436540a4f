"""The writeback window: written ranges are sent to the disk (at once, or gathered per file and thread into large
requests), the bytes on their way stay bounded (oldest waited for first), a refusal turns it off without failing
the save, and the real ``sync_file_range`` binding works on this machine's filesystem."""

from __future__ import annotations

import errno
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from workbench.io.files.direct import CheckpointFiles
from workbench.io.files.file_plan import plan_files
from workbench.io.files.stream_write import StreamWriter
from workbench.io.files.writeback import START, WAIT, WritebackWindow, sync_file_range
from workbench.layout.load_spec import KeyRegion


class Recorder:
    """A stand-in for sync_file_range that records (fd, offset, nbytes, flags) and can refuse."""

    def __init__(self, refuse: int | None = None) -> None:
        self.calls: list[tuple[int, int, int, int]] = []
        self.refuse = refuse

    def __call__(self, fd: int, offset: int, nbytes: int, flags: int) -> None:
        self.calls.append((fd, offset, nbytes, flags))
        if self.refuse is not None:
            raise OSError(self.refuse, os.strerror(self.refuse))


def test_every_write_starts_and_the_oldest_are_waited_for_past_the_window() -> None:
    rec = Recorder()
    window = WritebackWindow(100, start_bytes=0, syscall=rec)
    for i in range(6):
        window.wrote(3, i * 40, 40)
        assert window.in_flight_bytes <= 100
    starts = [c for c in rec.calls if c[3] == START]
    waits = [c for c in rec.calls if c[3] == WAIT]
    assert [c[1] for c in starts] == [0, 40, 80, 120, 160, 200]
    # 40+40+40 > 100 after the third write: the first is waited for; then one per write, oldest first
    assert [c[1] for c in waits] == [0, 40, 80, 120]
    assert window.in_flight_bytes == 80


def test_spread_writes_count_their_bytes_not_their_span() -> None:
    rec = Recorder()
    window = WritebackWindow(100, start_bytes=0, syscall=rec)
    window.wrote(3, 0, 1000, 30)  # three segments of 10 bytes spread over 1000
    window.wrote(3, 1000, 1000, 30)
    window.wrote(3, 2000, 1000, 30)
    assert rec.calls == [(3, 0, 1000, START), (3, 1000, 1000, START), (3, 2000, 1000, START)]
    window.wrote(3, 3000, 1000, 30)
    assert rec.calls[-1] == (3, 0, 1000, WAIT)


def test_a_refusal_turns_the_window_off_and_a_write_error_does_not() -> None:
    rec = Recorder(refuse=errno.EIO)  # the write's own failure: fsync reports it, the window stays on
    window = WritebackWindow(100, start_bytes=0, syscall=rec)
    window.wrote(3, 0, 10)
    assert window.enabled and window.in_flight_bytes == 0
    rec.refuse = errno.EINVAL  # a filesystem without it: off for good, no more calls
    window.wrote(3, 10, 10)
    assert not window.enabled and "sync_file_range refused" in (window.disabled_by or "")
    calls = len(rec.calls)
    window.wrote(3, 20, 10)
    assert len(rec.calls) == calls


def test_window_zero_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder()
    monkeypatch.setenv("WORKBENCH_WRITEBACK_BYTES", "0")
    window = WritebackWindow(syscall=rec)
    window.wrote(3, 0, 10)
    assert not window.enabled and rec.calls == []
    monkeypatch.setenv("WORKBENCH_WRITEBACK_BYTES", str(1 << 20))
    assert WritebackWindow(syscall=rec).window_bytes == 1 << 20


def test_forget_drops_a_closed_descriptor() -> None:
    rec = Recorder()
    window = WritebackWindow(100, start_bytes=0, syscall=rec)
    window.wrote(3, 0, 60)
    window.wrote(4, 0, 30)
    window.forget(3)
    assert window.in_flight_bytes == 30
    window.wrote(4, 30, 60)  # 90 in flight: nothing waited for, and never fd 3 again
    assert all(c[0] == 4 for c in rec.calls[2:])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_the_real_call_works_here(tmp_path: Path) -> None:
    assert sync_file_range is not None
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"x" * (1 << 20), 0)
        sync_file_range(fd, 0, 1 << 20, START)
        sync_file_range(fd, 0, 1 << 20, WAIT)
        with pytest.raises(OSError) as info:
            sync_file_range(fd, -1, 1, START)  # a negative offset is EINVAL
        assert info.value.errno == errno.EINVAL
    finally:
        os.close(fd)
    window = WritebackWindow(1 << 20)
    assert window.enabled


def test_writers_report_every_byte_they_write(tmp_path: Path) -> None:
    """Both writers of a save hand each written range to the window: the ranges cover exactly what was written."""
    rec = Recorder()
    window = WritebackWindow(1 << 30, start_bytes=0, syscall=rec)
    a, b = torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.arange(5, dtype=torch.bfloat16)
    writer = StreamWriter(tmp_path / "s.safetensors", [("a", a.dtype, a.shape), ("b", b.dtype, b.shape)], None,
                          window)
    writer.write("a", a)
    writer.write("b", b)
    writer.close()
    assert sorted(c[2] for c in rec.calls) == [10, 48]

    rec.calls.clear()
    meta = {"w": (torch.float32, (8, 4))}
    files = CheckpointFiles(tmp_path, plan_files({"w": 0}, {"w": 128}, ["w"]), meta, {"format": "pt"}, window)
    files.create_all()
    region = KeyRegion(hf_key="w", key_offset=(2, 0), local_offset=(0, 0), sizes=(3, 4))
    files.write_piece(region, torch.ones(3, 4))
    slot = files.slots["w"]
    assert rec.calls == [(next(iter(files._fds.values())), slot.offset + 2 * 16, 48, START)]
    files.close()


def test_small_writes_start_together_per_file_and_thread() -> None:
    rec = Recorder()
    window = WritebackWindow(1 << 20, start_bytes=100, syscall=rec)
    for offset in (0, 30, 60):
        window.wrote(3, offset, 30)
    assert rec.calls == []  # 90 bytes: not yet
    other = threading.Thread(target=window.wrote, args=(3, 5000, 60))  # another writer thread: its own run
    other.start()
    other.join()
    assert rec.calls == []
    window.wrote(3, 90, 30)
    assert rec.calls == [(3, 0, 120, START)]  # one request for the four writes
    window.wrote(3, 200, 30)
    window.wrote(3, 90_000, 30)  # far from the run: what was gathered starts, a new run begins
    assert rec.calls[-1] == (3, 200, 30, START)
    window.forget(3)
    window.wrote(3, 90_030, 80)  # the run forgotten with the descriptor: 80 bytes alone do not start
    assert rec.calls[-1] == (3, 200, 30, START)


def test_a_deferred_range_starts_once_later_writes_follow_it() -> None:
    """Pages other writers fill too (a column-cut tensor's halves) start their writeback only ``defer_bytes`` of
    writes later, so a page is not sent half-filled; ordinary writes around them start at once."""
    rec = Recorder()
    window = WritebackWindow(1 << 30, start_bytes=0, defer_bytes=100, syscall=rec)
    window.wrote(3, 0, 1000, 60, defer=True)  # 60 bytes in 1000: interleaved with a peer's
    assert rec.calls == []
    window.wrote(3, 1000, 50)  # an ordinary write starts at once; 50 < 100 written since the deferred one
    assert rec.calls == [(3, 1000, 50, START)]
    window.wrote(3, 1050, 50)  # now 100 bytes later: the deferred range starts too
    assert rec.calls[1:] == [(3, 1050, 50, START), (3, 0, 1000, START)]
    window.wrote(4, 0, 10, defer=True)
    window.forget(4)  # a file closed (fsynced) before its deferred range was due: dropped
    window.wrote(3, 2000, 500)
    assert (4, 0, 10, START) not in rec.calls
