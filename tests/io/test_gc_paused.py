"""A load runs without automatic garbage collection (a full collection meeting it cost a rank 0.2 s), and leaves
collection as it found it: on after a load that succeeded or failed, still off where the caller had turned it off."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.io.support import save_checkpoint
from workbench.errors import CheckpointError
from workbench.io.gc_paused import gc_paused
from workbench.io.hf import load as load_module


def _model_and_checkpoint(tmp_path: Path) -> tuple[torch.nn.Module, Path, dict[str, torch.Tensor]]:
    state = {f"w{i}": torch.randn(64, 32) for i in range(6)}
    save_checkpoint(tmp_path, state)
    model = torch.nn.Module()
    for name in state:
        model.register_parameter(name, torch.nn.Parameter(torch.zeros(64, 32), requires_grad=False))
    return model, tmp_path, state


def test_a_load_runs_with_collection_off_and_turns_it_back_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """Whether collection is on, asked from inside the load (as it plans, and as it reads the files)."""
    model, path, state = _model_and_checkpoint(tmp_path)
    seen: list[tuple[str, bool]] = []
    for name in ("layout_and_locals", "BoxReader"):
        real = getattr(load_module, name)

        def spy(*args, real=real, name=name, **kwargs):
            seen.append((name, gc.isenabled()))
            return real(*args, **kwargs)

        monkeypatch.setattr(load_module, name, spy)
    assert gc.isenabled()
    wb.load_hf(model, path)
    assert seen == [("layout_and_locals", False), ("BoxReader", False)]
    assert gc.isenabled()
    for name, value in state.items():
        assert torch.equal(getattr(model, name), value), name


def test_a_failed_load_turns_collection_back_on(tmp_path: Path) -> None:
    model, path, _ = _model_and_checkpoint(tmp_path)
    model.register_parameter("extra", torch.nn.Parameter(torch.zeros(3), requires_grad=False))
    with pytest.raises(CheckpointError, match="extra"):
        wb.load_hf(model, path)
    assert gc.isenabled()


def test_collection_the_caller_turned_off_stays_off() -> None:
    gc.disable()
    try:
        with gc_paused():
            with gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_collection_comes_back_when_the_last_of_two_overlapping_loads_ends() -> None:
    """Two loads on two threads, the first to begin ending first: collection stays off until the second ends."""
    second_inside, first_ended = threading.Event(), threading.Event()
    seen: list[bool] = []

    def second() -> None:
        with gc_paused():
            second_inside.set()
            first_ended.wait(10)
            seen.append(gc.isenabled())  # the first block has ended, this one still runs

    with gc_paused():
        worker = threading.Thread(target=second)
        worker.start()
        assert second_inside.wait(10)
    first_ended.set()
    worker.join(10)
    assert seen == [False]
    assert gc.isenabled()
