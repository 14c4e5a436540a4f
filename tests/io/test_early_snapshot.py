"""EarlySnapshot: copies taken before a save planned are handed over only for the very plan and tensors they
were taken for; any other plan or tensor releases them (their pool buffers come back), and a release is
idempotent. (The end-to-end path on CUDA, where take_early runs, is in tests/gpu.)"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import workbench as wb
from workbench.io.files.direct import direct_names, direct_program
from workbench.io.files.host_pool import HostPool
from workbench.io.files.snapshot import Snapshotter
from workbench.io.hf.early_snapshot import EarlySnapshot, take_early, take_step
from workbench.layout.model_layout import layout_and_locals, remembered_locals
from workbench.plan.save_set import key_meta


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8, bias=False)
        self.b = nn.Linear(8, 4)


def _setup(model: nn.Module) -> tuple:
    layout, locals_ = layout_and_locals(model)
    meta = key_meta(layout, {n: layout.dtype(n) for n in layout}, None, None)
    direct = direct_names(layout, meta, 0)
    anchors = (layout, meta, direct, 0)
    return layout, locals_, anchors, direct_program(layout, meta, direct, 0)


def _early(snapshot: Snapshotter, anchors: tuple, program: tuple, locals_: dict) -> EarlySnapshot:
    early = EarlySnapshot(snapshot, anchors, program)
    for step in program:
        early.copies.append(take_step(snapshot, locals_[step[0]], step, anchors[1]))
        early.sources.append((lambda t: (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device))(
            locals_[step[0]]))
    snapshot.mark()
    return early


def _snapshot(pool: HostPool, model: nn.Module) -> Snapshotter:
    snapshot = Snapshotter(list(model.state_dict().values()), own_everything=True, pool_bytes=None)
    snapshot._pools[False] = pool  # a private pool, so the test sees its buffers come back
    return snapshot


def test_copies_are_claimed_for_their_own_plan_and_tensors() -> None:
    model = _Model()
    _, locals_, anchors, program = _setup(model)
    pool = HostPool(1 << 30)
    snapshot = _snapshot(pool, model)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    early = _early(snapshot, anchors, program, locals_)
    assert pool.bytes_out > 0
    with torch.no_grad():
        model.a.weight.add_(1)  # after the copies: they hold the values of their time
    claimed = early.claim(anchors, program, locals_)
    assert claimed is not None and len(claimed) == len(program)
    for (name, _, _), copies in zip(program, claimed):
        assert torch.equal(copies[0].wait(), expected[name])
    assert early.claim(anchors, program, locals_) is None  # handed over once
    early.release()  # a claimed copy is the save's: release leaves it alone
    assert pool.bytes_out > 0
    for copies in claimed:
        for copy in copies:
            copy.release()
    assert pool.bytes_out == 0


def test_another_tensor_or_plan_releases_the_copies() -> None:
    model = _Model()
    _, locals_, anchors, program = _setup(model)
    pool = HostPool(1 << 30)

    snapshot = _snapshot(pool, model)
    early = _early(snapshot, anchors, program, locals_)
    copied = snapshot.copied_bytes
    moved = dict(locals_, **{"a.weight": locals_["a.weight"].clone()})  # same values, another storage
    assert early.claim(anchors, program, moved) is None
    assert pool.bytes_out == 0 and snapshot.copied_bytes == copied - sum(
        t.numel() * t.element_size() for t in locals_.values())

    early = _early(snapshot, anchors, program, locals_)
    other = (anchors[0], dict(anchors[1]), anchors[2], anchors[3])  # equal key metadata, not the plan's object
    assert early.claim(other, program, locals_) is None and pool.bytes_out == 0
    early.release()  # idempotent
    assert pool.bytes_out == 0


def test_take_early_needs_a_remembered_gpu_plan(tmp_path: Path) -> None:
    model = _Model()
    snapshot = Snapshotter((), own_everything=True, pool_bytes=None)
    assert take_early(model, snapshot) is None  # no async direct save of it yet
    layout, _ = layout_and_locals(model)
    assert remembered_locals(model, layout)["a.weight"].data_ptr() == model.a.weight.data_ptr()
    wb.save_hf(model, tmp_path / "ckpt", async_save=True, write_mode="direct").wait()
    assert take_early(model, snapshot) is None  # remembered, but a CPU model's copies would block: not taken


def test_a_copy_that_fails_after_the_snapshot_agreement_fails_wait_and_publishes_nothing(
    tmp_path: Path, monkeypatch
) -> None:
    """The snapshot is agreed on while the last copies land; a copy that then fails makes ``wait()`` raise on
    every rank (here one), naming the stage, and nothing is published."""
    import pytest

    from workbench.io.files import snapshot as snapshot_module

    def broken(self: Snapshotter) -> None:
        raise RuntimeError("the copy engine reported an error")

    monkeypatch.setattr(snapshot_module.Snapshotter, "settle", broken)
    handle = wb.save_hf(_Model(), tmp_path / "ckpt", async_save=True)  # the agreement came before the failure
    with pytest.raises(wb.SaveFailed, match=r"a copy did not land.*copy engine reported an error"):
        handle.wait()
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.iterdir())
