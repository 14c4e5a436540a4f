"""A repeat load reads ahead: the first pieces of the landing the last load of the same checkpoint planned are read into
the staging ring while the load checks the checkpoint and plans (``BoxReader.reading_ahead``), and adopted where the
plan is the same. Through the CPU seam (``load._CPU_LANDING_RING``: a GPU load's path into CPU tensors). Expected
values are the tensors the checkpoint was written from; reads are counted at ``os.preadv``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.io.support import bits, random_tensor, save_checkpoint
from workbench.errors import CheckpointError
from workbench.io.files import box_reads, landing
from workbench.io.files import index as index_module
from workbench.io.files.staging import StagingRing
from workbench.io.hf import load as load_module

ALIGN = 4096
NAMES = [f"w{i}" for i in range(6)]


def _state() -> dict[str, torch.Tensor]:
    return {n: random_tensor((64, 48), torch.bfloat16, i) for i, n in enumerate(NAMES)}


def _zeros(rows: int = 64) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(rows, 48, dtype=torch.bfloat16) for n in NAMES}


@pytest.fixture(autouse=True)
def seam(monkeypatch) -> StagingRing:
    """Three slots of three pages: the 6 x 6 KiB weights are six pieces, three of them read ahead."""
    ring = StagingRing(3, 3 * ALIGN, pinned=False)
    monkeypatch.setattr(load_module, "_CPU_LANDING_RING", ring)
    monkeypatch.setattr(index_module, "_SETTLED_NS", -(10**12))  # the test's files are kept at once
    monkeypatch.setattr(index_module, "_cache", type(index_module._cache)())
    landing._KEPT.clear()
    box_reads._AHEAD.clear()
    return ring


@pytest.fixture
def reads(monkeypatch) -> list[int]:
    """The offset of every ``preadv`` the reader makes, in order."""
    seen: list[int] = []
    real = os.preadv
    monkeypatch.setattr(box_reads.os, "preadv", lambda fd, bufs, off, *a: seen.append(off) or real(fd, bufs, off, *a))
    return seen


def _reads_before_planning(monkeypatch, reads: list[int]) -> list[int]:
    """How many reads had been made when each load began to read the model's layout (held 0.1 s)."""
    at: list[int] = []
    real = load_module.layout_and_locals

    def held(*args, **kwargs):
        time.sleep(0.1)
        at.append(len(reads))
        return real(*args, **kwargs)

    monkeypatch.setattr(load_module, "layout_and_locals", held)
    return at


def _all_back(ring: StagingRing) -> bool:
    deadline = time.monotonic() + 5  # a dropped read gives its slot back when it ends
    while time.monotonic() < deadline:
        slots = [ring.try_take() for _ in range(ring.slots)]
        for s in slots:
            if s is not None:
                ring.give(s)
        if all(s is not None for s in slots):
            return True
        time.sleep(0.01)
    return False


def test_a_repeat_load_reads_ahead_of_its_plan_and_lands_exactly(tmp_path: Path, monkeypatch, reads, seam) -> None:
    state = _state()
    save_checkpoint(tmp_path, state, {k: i % 2 for i, k in enumerate(state)})
    at = _reads_before_planning(monkeypatch, reads)
    counts = []
    for _ in range(3):
        targets = _zeros()
        reads.clear()
        report = wb.load_hf(targets, tmp_path)
        assert report.ok
        for n in NAMES:
            assert torch.equal(bits(targets[n]), bits(state[n])), n
        counts.append(len(reads))
    assert at[0] == 0 and at[1] == at[2] == seam.slots  # the first load plans first; the repeats read ahead
    assert counts[0] == counts[1] == counts[2]  # what was read ahead is not read again
    assert _all_back(seam)


def test_a_load_of_another_geometry_lets_the_reads_ahead_go(tmp_path: Path, monkeypatch, reads, seam) -> None:
    """The second load fills tensors of a state dict whose strides differ (transposed storage): another landing.
    What was read ahead for the first is dropped, every slot comes back, and the load is exact."""
    state = _state()
    save_checkpoint(tmp_path, state)
    assert wb.load_hf(_zeros(), tmp_path).ok
    reads.clear()
    at = _reads_before_planning(monkeypatch, reads)
    targets = {n: torch.zeros(48, 64, dtype=torch.bfloat16).t() for n in NAMES}
    assert wb.load_hf(targets, tmp_path).ok
    assert at == [seam.slots]
    for n in NAMES:
        assert torch.equal(bits(targets[n]), bits(state[n])), n
    assert _all_back(seam)


def test_a_load_that_fails_its_check_gives_every_slot_read_ahead_back(tmp_path: Path, seam) -> None:
    state = _state()
    save_checkpoint(tmp_path, state)
    assert wb.load_hf(_zeros(), tmp_path).ok
    with pytest.raises(CheckpointError, match="another shape"):
        wb.load_hf(_zeros(rows=32), tmp_path)
    assert _all_back(seam)
    targets = _zeros()
    assert wb.load_hf(targets, tmp_path).ok
    assert all(torch.equal(bits(targets[n]), bits(state[n])) for n in NAMES)


def test_a_failed_read_ahead_fails_the_load_that_adopts_it(tmp_path: Path, monkeypatch, seam) -> None:
    """A read ahead that raises is this load's failure once the piece is adopted (never a piece left unread)."""
    state = _state()
    save_checkpoint(tmp_path, state)
    assert wb.load_hf(_zeros(), tmp_path).ok
    real = box_reads.BoxReader._land_fill
    failed = []

    def broken(self, piece, slot):
        if not failed and not piece.parts:  # a piece read ahead (it has no parts yet)
            failed.append(1)
            raise OSError("disk gone")
        return real(self, piece, slot)

    monkeypatch.setattr(box_reads.BoxReader, "_land_fill", broken)
    with pytest.raises(wb.LoadFailed, match="disk gone"):
        wb.load_hf(_zeros(), tmp_path)
    assert failed and _all_back(seam)


def test_a_changed_checkpoint_is_not_read_ahead(tmp_path: Path, monkeypatch, reads, seam) -> None:
    """Another save at the same path gives a new index: nothing of the old one is read ahead."""
    state = _state()
    save_checkpoint(tmp_path, state)
    assert wb.load_hf(_zeros(), tmp_path).ok
    newer = {n: t + 1 for n, t in state.items()}
    time.sleep(0.01)
    save_checkpoint(tmp_path, newer)
    reads.clear()
    at = _reads_before_planning(monkeypatch, reads)
    targets = _zeros()
    assert wb.load_hf(targets, tmp_path).ok
    assert at == [0]
    assert all(torch.equal(bits(targets[n]), bits(newer[n])) for n in NAMES)
