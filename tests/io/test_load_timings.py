"""``LoadReport.timings``: the stages of a load add up to its time, and a slow stage shows where it was slow.

The slow stages are made slow from outside (a ``fault_hook`` that sleeps at one fault point), so the expected
stage comes from the test, not from the clock under test.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.io.support import small_model
from workbench.faults import fault_hook
from workbench.io.hf.load_timings import LoadClock, LoadTimings

PAUSE = 0.2


def _saved(tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    state = small_model()
    wb.save_hf(state, tmp_path / "ckpt")
    return {k: torch.zeros_like(v) for k, v in state.items()}, tmp_path / "ckpt"


def test_the_stages_add_up_to_the_load(tmp_path: Path) -> None:
    target, path = _saved(tmp_path)
    started = time.perf_counter()
    report = wb.load_hf(target, path)
    wall = time.perf_counter() - started
    timings = report.timings
    assert isinstance(timings, LoadTimings)
    assert all(getattr(timings, s) >= 0 for s in LoadTimings.STAGES)
    assert timings.total <= report.seconds <= wall
    assert timings.total >= 0.8 * report.seconds - 1e-3


@pytest.mark.parametrize(("point", "stage"), [("load.plan", "check"), ("load.planned", "plan"), ("load.read", "read")])
def test_a_slow_stage_is_counted_where_it_was_slow(tmp_path: Path, point: str, stage: str) -> None:
    target, path = _saved(tmp_path)
    slept = []

    def slow(where: str, rank: int, detail: object) -> None:
        if where == point and not slept:
            slept.append(where)
            time.sleep(PAUSE)

    with fault_hook(slow):
        report = wb.load_hf(target, path)
    assert slept
    assert report.timings.slowest_stage() == stage
    assert getattr(report.timings, stage) >= PAUSE
    assert report.timings.total - getattr(report.timings, stage) < PAUSE
    assert f"{stage} {getattr(report.timings, stage):.3f}" in str(report.timings)


def test_the_clock_refuses_an_unknown_stage() -> None:
    with pytest.raises(ValueError, match="'reading' is not a LoadTimings stage"):
        LoadClock().lap("reading")


def test_reads_slower_than_the_loop_show_as_read_wait(tmp_path: Path, monkeypatch) -> None:
    """Every positional read made slow (in the reading threads): the calling thread waits for them, and says so."""
    import os

    from workbench.io.files import box_reads

    target, path = _saved(tmp_path)
    quick = wb.load_hf(target, path).timings
    real = os.preadv
    calls = []

    def slow_preadv(fd, buffers, offset, *args):
        calls.append(offset)
        time.sleep(0.05)
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(box_reads.os, "preadv", slow_preadv)
    slow = wb.load_hf(target, path).timings
    assert calls
    assert slow.read_wait >= 0.05 > quick.read_wait
    assert slow.read_wait <= slow.read + slow.drain
    assert "waited" in str(slow)
