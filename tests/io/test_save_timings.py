"""SaveResult.timings: the calling thread's stages add up to the save's wall time, and each writer activity is
counted where it happens (a slowed stand-in for the disk's writeback shows up as writeback_wait, not write;
writers held up by a full queue show up as queue_wait)."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.io.files.writeback import WAIT, WritebackWindow
from workbench.io.hf import save_session
from workbench.io.hf.save_timings import SaveClock, SaveTimings


def _state(n: int = 8, rows: int = 64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(rows, 256, generator=gen) for i in range(n)}


class SlowDisk:
    """A stand-in for sync_file_range whose waits take ``delay`` seconds each (a disk that lags the writes)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.waits = 0

    def __call__(self, fd: int, offset: int, nbytes: int, flags: int) -> None:
        if flags == WAIT:
            self.waits += 1
            time.sleep(self.delay)


@pytest.mark.parametrize("write_mode", ["direct", "gather"])
def test_the_stages_add_up_to_the_save(tmp_path: Path, write_mode: str) -> None:
    result = wb.save_hf(_state(), tmp_path / "ckpt", write_mode=write_mode)
    t = result.timings
    assert all(getattr(t, s) >= 0 for s in SaveTimings.STAGES + SaveTimings.WRITERS)
    assert t.stages_total <= result.seconds
    assert result.seconds - t.stages_total < 0.05  # only the hand-offs between stages are not counted
    assert t.write > 0 and t.publish > 0 and t.plan > 0
    assert t.queue_wait <= t.snapshot
    assert t.slowest_stage() in SaveTimings.STAGES


def test_writeback_waits_are_counted_apart_from_the_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = SlowDisk(0.02)
    # a window of 1 byte, every write started at once: each write after the first waits for the one before
    monkeypatch.setattr(save_session, "WritebackWindow", partial(WritebackWindow, 1, start_bytes=0, syscall=disk))
    result = wb.save_hf(_state(), tmp_path / "ckpt", write_mode="gather", write_threads=1)
    t = result.timings
    assert disk.waits >= 6
    assert t.writeback_wait >= disk.delay * disk.waits * 0.95
    # the writes themselves are 64 KiB each: without the subtraction, `write` would hold every wait too
    assert t.write < disk.delay * disk.waits / 2
    assert t.write > 0


def test_a_full_queue_shows_as_queue_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = SlowDisk(0.02)
    monkeypatch.setattr(save_session, "WritebackWindow", partial(WritebackWindow, 1, start_bytes=0, syscall=disk))
    state = _state()
    one = next(iter(state.values()))
    # room for one tensor in flight: the calling thread waits for each slow write before queueing the next
    result = wb.save_hf(state, tmp_path / "ckpt", write_mode="gather", write_threads=1,
                        host_buffer_bytes=one.numel() * one.element_size())
    t = result.timings
    assert t.queue_wait >= disk.delay * (disk.waits - 1) * 0.5
    assert t.queue_wait <= t.snapshot


def test_an_async_save_returns_after_its_snapshot_stage(tmp_path: Path) -> None:
    handle = wb.save_hf(_state(), tmp_path / "ckpt", async_save=True, write_mode="direct")
    result = handle.wait()
    t = result.timings
    before_return = t.prepare + t.plan + t.snapshot
    assert before_return <= result.blocked_seconds + 0.05
    assert result.blocked_seconds - before_return < 0.05
    assert t.write > 0


def test_the_clock_refuses_a_name_that_is_not_a_field() -> None:
    clock = SaveClock()
    clock.add("write", 0.5)
    clock.add("write", 0.25)
    with clock.measure("fsync"):
        pass
    timings = clock.timings()
    assert timings.write == 0.75 and timings.fsync >= 0
    clock.add("wirte", 1.0)
    with pytest.raises(ValueError, match="wirte"):
        clock.timings()


def test_the_summary_names_stages_and_writers() -> None:
    text = str(SaveTimings(plan=0.01, snapshot=1.5, queue_wait=1.2, drain=0.3, write=2.0, writeback_wait=0.9))
    assert "snapshot 1.500" in text and "waited 1.200 for room" in text
    assert "write 2.000" in text and "writeback_wait 0.900" in text
    assert "fsync" not in text  # a stage that took no time is left out
    assert SaveTimings(snapshot=1.5, drain=0.3).slowest_stage() == "snapshot"
