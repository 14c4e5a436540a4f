"""Conjugate and negative views (``z.conj()``, ``torch._neg_view``): their memory holds the values before the sign
flips, and a flag on the view applies it. A save that was not async failed on them ("view is not supported for
conjugate view tensors"), a diagnose against such a state failed the same way, and a tie check compared the
memory, not the values. Each now takes the values the view shows. Expected values: safetensors' ``load_file`` of
what the save wrote, compared with ``resolve_conj``/``resolve_neg`` of the state (torch's own resolution)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb


def _state() -> dict[str, torch.Tensor]:
    z = torch.tensor([[1 + 2j, 3 - 4j], [-5 + 0.5j, 0 - 1j]], dtype=torch.complex64)
    n = torch.arange(6, dtype=torch.float32).reshape(2, 3) - 2.5
    return {"z": z.conj(), "zt": z.t().conj(), "n": torch._neg_view(n), "plain": n.clone()}


@pytest.mark.parametrize("write_mode", ["direct", "gather"])
@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_writes_the_values_a_conjugate_or_negative_view_shows(tmp_path: Path, write_mode, async_save) -> None:
    state = _state()
    assert state["z"].is_conj() and state["n"].is_neg()
    result = wb.save_hf(state, tmp_path / "ckpt", write_mode=write_mode, async_save=async_save)
    if async_save:
        result.result()
    written: dict[str, torch.Tensor] = {}
    for file in sorted((tmp_path / "ckpt").glob("*.safetensors")):
        written.update(load_file(str(file)))
    for key, value in state.items():
        shown = value.resolve_conj().resolve_neg()
        assert torch.equal(written[key], shown), key
        assert not written[key].is_conj() and not written[key].is_neg()


def test_diagnose_against_a_state_of_flag_views_finds_nothing_wrong(tmp_path: Path) -> None:
    state = _state()
    wb.save_hf({k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}, tmp_path / "ckpt")
    report = wb.diagnose(tmp_path / "ckpt", state)
    assert not report.findings, report.findings

    changed = dict(state, z=state["z"].conj())  # the same memory without the flag: the values before the flip
    report = wb.diagnose(tmp_path / "ckpt", changed)
    assert [f.key for f in report.findings] == ["z"], report.findings
