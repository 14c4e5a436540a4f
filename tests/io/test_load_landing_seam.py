"""``load_hf`` on the path of a GPU load, run on the CPU: boxes landing in the model's tensors from the reading threads
(not asked for by the load's loop), keys an adapter reads whole through the staging ring, repeat loads taking the
kept landing plan. ``load._CPU_LANDING_RING`` routes a load into CPU tensors through an unpinned ring, whose copies
run at once (``BoxReader``'s CPU seam). The expected values are the tensors the checkpoint was written from.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.io.support import bits, random_tensor, save_checkpoint
from tests.io.test_landing import _within
from workbench.io.files import index as index_module
from workbench.io.files import landing
from workbench.io.files.staging import StagingRing
from workbench.io.hf import load as load_module

ALIGN = 4096
NAMES = [f"w{i}" for i in range(10)]


class Model(torch.nn.Module):
    """Ten bf16 weights (two of them float32 in the model: their copies cast), then ``z``, read by an adapter."""

    def __init__(self) -> None:
        super().__init__()
        for i, name in enumerate(NAMES):
            dtype = torch.float32 if i in (3, 7) else torch.bfloat16
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(64, 48, dtype=dtype), requires_grad=False))
        self.z = torch.nn.Parameter(torch.zeros(40, 24, dtype=torch.bfloat16), requires_grad=False)


def _state() -> dict[str, torch.Tensor]:
    out = {n: random_tensor((64, 48), torch.bfloat16, i) for i, n in enumerate(NAMES)}
    out["z"] = torch.randn(40, 24, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)
    return out


@pytest.fixture(autouse=True)
def seam(monkeypatch) -> StagingRing:
    """Two slots of three pages: every weight is several pieces, and the landing pieces hold every slot at once."""
    ring = StagingRing(2, 3 * ALIGN, pinned=False)
    monkeypatch.setattr(load_module, "_CPU_LANDING_RING", ring)
    monkeypatch.setattr(index_module, "_SETTLED_NS", -(10**12))  # the test's files are kept at once
    monkeypatch.setattr(index_module, "_cache", type(index_module._cache)())
    landing._KEPT.clear()
    return ring


def _load(model: Model, path: Path, **kwargs) -> wb.LoadReport:
    """``wb.load_hf`` on a thread: a load that does not return within 30 s fails the test (a hang)."""
    out: list = []
    failure = _within(30, lambda: out.append(wb.load_hf(model, path, **kwargs)))
    if failure is not None:
        raise failure
    return out[0]


def _expect(model: Model, state: dict[str, torch.Tensor], z_scale: float) -> None:
    for name in NAMES:
        got = getattr(model, name).data
        assert torch.equal(bits(got), bits(state[name].to(got.dtype))), name
    assert torch.equal(bits(model.z.data), bits(state["z"] * z_scale))


def test_landed_weights_and_a_key_read_whole_by_an_adapter_load_exactly_without_waiting_forever(
        tmp_path: Path, seam: StagingRing) -> None:
    """The adapter's key comes last: by then the landing pieces hold both slots, and its read through the ring
    needs one (a load that hung before 7218351)."""
    state = _state()
    save_checkpoint(tmp_path, state, {k: 0 for k in state})
    model = Model()
    report = _load(model, tmp_path, cast=True, adapters={"z": lambda key, t: t * 2})
    assert report.ok and report.parameters == 11
    _expect(model, state, 2.0)
    free = [seam.try_take() for _ in range(seam.slots)]
    assert all(s is not None for s in free)  # every slot back


def test_a_repeat_load_lands_through_the_kept_plan(tmp_path: Path, monkeypatch) -> None:
    state = _state()
    save_checkpoint(tmp_path, state, {k: i % 3 for i, k in enumerate(state)})  # three files
    calls = []
    real = landing.plan_landing
    monkeypatch.setattr(landing, "plan_landing", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = Model()
    for _ in range(3):
        for p in model.parameters():
            p.data.zero_()
        report = _load(model, tmp_path, cast=True)
        assert report.ok
        _expect(model, state, 1.0)
    assert len(calls) == 1 and landing._KEPT.hits == 2
    other = Model()  # another model of the same geometry: the kept plan, its own tensors
    _load(other, tmp_path, cast=True)
    _expect(other, state, 1.0)
    assert len(calls) == 1


def test_the_reads_start_before_the_agreement_and_nothing_lands_before_it(tmp_path: Path, monkeypatch) -> None:
    """At the first agreement (held 0.2 s here) the reading threads have already read pieces into the ring, and the
    model is still all zeros: the reads overlap the agreement, the copies wait for it. On the first load (planned)
    and on a repeat (the kept plan, its pieces made as they are taken)."""
    from workbench.io.files import box_reads

    state = _state()
    save_checkpoint(tmp_path, state, {k: i % 3 for i, k in enumerate(state)})
    reads: list[int] = []
    real_preadv = os.preadv
    monkeypatch.setattr(box_reads.os, "preadv", lambda fd, bufs, off, *a: reads.append(off) or real_preadv(
        fd, bufs, off, *a))
    seen: list[tuple[int, bool]] = []
    real_agree = load_module._agree

    def held(*args, **kwargs):  # the first agreement (the last one is not _agree's)
        time.sleep(0.2)
        seen.append((len(reads), all(not p.any() for p in model.parameters())))
        return real_agree(*args, **kwargs)

    monkeypatch.setattr(load_module, "_agree", held)
    for _ in range(2):
        model = Model()
        seen.clear()
        reads.clear()
        assert _load(model, tmp_path, cast=True).ok
        assert len(seen) == 1 and seen[0][0] > 0 and seen[0][1], seen
        _expect(model, state, 1.0)
    assert landing._KEPT.hits == 1
