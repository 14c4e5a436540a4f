"""Ctrl-C while ``save_hf`` finishes an earlier async save is a ``KeyboardInterrupt``, as it is inside ``wait()``.

It used to come out as ``SaveFailed("an earlier async save failed")``: ``_finish_pending`` wrapped every exception.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.faults import fault_hook
from workbench.io.hf import save as save_module


def test_an_interrupt_while_finishing_an_earlier_save_is_raised_as_it_is(tmp_path: Path) -> None:
    state = {"w": torch.ones(4, 4)}
    earlier = wb.save_hf(state, tmp_path / "earlier", async_save=True)
    fired: list[str] = []

    def ctrl_c_once(point: str, rank: int, detail: object) -> None:
        if point == "status" and not fired:  # the main thread finishing the earlier save: where a Ctrl-C lands
            fired.append(point)
            raise KeyboardInterrupt

    with fault_hook(ctrl_c_once), pytest.raises(KeyboardInterrupt):
        wb.save_hf(state, tmp_path / "next")
    assert fired == ["status"]
    assert not save_module._PENDING  # the earlier save was finished (failed) before the interrupt was raised again
    with pytest.raises(KeyboardInterrupt):
        earlier.wait()  # the interrupted save failed, and says so again
    assert not (tmp_path / "earlier").exists() and not (tmp_path / "next").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing left beside them either


def test_a_failure_while_finishing_an_earlier_save_is_still_save_failed(tmp_path: Path) -> None:
    wb.save_hf({"w": torch.ones(4)}, tmp_path / "first", async_save=True)

    def fail(point: str, rank: int, detail: object) -> None:
        if point == "status":
            raise OSError("disk gone")

    with fault_hook(fail), pytest.raises(wb.SaveFailed, match="an earlier async save failed"):
        wb.save_hf({"w": torch.ones(4)}, tmp_path / "second")
