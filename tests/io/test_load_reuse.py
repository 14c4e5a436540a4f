"""A repeat load reuses what it planned for the same model and the same (unchanged) checkpoint, and nothing else.

``load_hf`` keeps each parameter's transfers and the checkpoint check for the very parsed index it was planned
for (``cached_checkpoint`` hands out the same index while the files are unchanged). The expected values are the
tensors each checkpoint was written from, so a plan reused for another checkpoint shows as wrong bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.io.support import bits, random_tensor, save_checkpoint
from workbench.errors import CheckpointError
from workbench.io.files import index as index_module
from workbench.io.hf import load as load_module


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(64, 48, dtype=torch.bfloat16), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(33, dtype=torch.float32), requires_grad=False)
        self.c = torch.nn.Parameter(torch.zeros(7, 5, dtype=torch.float16), requires_grad=False)


def _state(seed: int) -> dict[str, torch.Tensor]:
    return {"a": random_tensor((64, 48), torch.bfloat16, seed), "b": random_tensor((33,), torch.float32, seed + 1),
            "c": random_tensor((7, 5), torch.float16, seed + 2)}


def _write(path: Path, state: dict[str, torch.Tensor], order: list[str], split: bool) -> None:
    """The same keys at other offsets: another key order in the files, one file or one per key."""
    ordered = {k: state[k] for k in order}
    save_checkpoint(path, ordered, {k: i if split else 0 for i, k in enumerate(order)}, max_shard_bytes=1 << 30)


def _same(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(bits(getattr(model, k).data), bits(v)) for k, v in state.items())


@pytest.fixture(autouse=True)
def settled(monkeypatch):
    """Indexes are kept at once (files written by the test are seconds old at most), in a fresh cache."""
    monkeypatch.setattr(index_module, "_SETTLED_NS", -(10**12))
    monkeypatch.setattr(index_module, "_cache", type(index_module._cache)())


@pytest.fixture
def planned(monkeypatch) -> list[int]:
    """How many parameters' transfers each load planned."""
    calls: list[int] = []
    real = load_module.plan_transfers

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(load_module, "plan_transfers", counting)
    return calls


def test_a_repeat_load_plans_nothing_again(tmp_path: Path, planned: list[int]) -> None:
    state = _state(1)
    _write(tmp_path / "x", state, ["a", "b", "c"], split=True)
    model = Small()
    wb.load_hf(model, tmp_path / "x")
    first = len(planned)
    assert first == 3
    for _ in range(2):
        model.a.data.zero_()
        report = wb.load_hf(model, tmp_path / "x")
        assert report.ok and _same(model, state)
    assert len(planned) == first


def test_two_checkpoints_in_turn_each_load_their_own_bytes(tmp_path: Path, planned: list[int]) -> None:
    one, two = _state(1), _state(7)
    _write(tmp_path / "one", one, ["a", "b", "c"], split=False)
    _write(tmp_path / "two", two, ["c", "a", "b"], split=True)
    model = Small()
    for _ in range(2):
        wb.load_hf(model, tmp_path / "one")
        assert _same(model, one)
        wb.load_hf(model, tmp_path / "two")
        assert _same(model, two)


def test_a_checkpoint_rewritten_in_place_is_planned_again(tmp_path: Path, planned: list[int]) -> None:
    path = tmp_path / "ckpt"
    old, new = _state(1), _state(9)
    _write(path, old, ["a", "b", "c"], split=False)
    model = Small()
    wb.load_hf(model, path)
    assert _same(model, old)
    for f in path.iterdir():
        f.unlink()
    _write(path, new, ["b", "c", "a"], split=False)  # one file of the same name: every key elsewhere in it
    before = len(planned)
    wb.load_hf(model, path)
    assert _same(model, new)
    assert len(planned) == before + 3


def test_a_changed_dtype_is_checked_again(tmp_path: Path) -> None:
    state = _state(1)
    _write(tmp_path / "x", state, ["a", "b", "c"], split=False)
    model = Small()
    wb.load_hf(model, tmp_path / "x")
    model.b.data = model.b.data.double()
    with pytest.raises(CheckpointError, match=r"b: checkpoint dtype float32, the model's 'b' is float64"):
        wb.load_hf(model, tmp_path / "x")


def test_a_lenient_repeat_load_reports_the_same_problems(tmp_path: Path) -> None:
    state = _state(1)
    _write(tmp_path / "x", {k: v for k, v in state.items() if k != "c"}, ["a", "b"], split=False)
    model = Small()
    reports = [wb.load_hf(model, tmp_path / "x", strict=False) for _ in range(2)]
    assert all(r.missing == ("c",) and r.parameters == 2 for r in reports)
    assert torch.equal(bits(model.a.data), bits(state["a"]))


def test_another_checkpoint_is_checked_again(tmp_path: Path) -> None:
    """A second checkpoint whose key has another dtype is a mismatch, though the first one checked clean."""
    state = _state(1)
    _write(tmp_path / "good", state, ["a", "b", "c"], split=False)
    _write(tmp_path / "bad", {**state, "b": state["b"].half()}, ["a", "b", "c"], split=False)
    model = Small()
    assert wb.load_hf(model, tmp_path / "good").ok
    with pytest.raises(CheckpointError, match=r"b: checkpoint dtype float16, the model's 'b' is float32"):
        wb.load_hf(model, tmp_path / "bad")
    assert wb.load_hf(model, tmp_path / "good").ok


class Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)


def test_a_key_map_edited_in_place_between_loads_is_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the layout remembered for the module must not hold the caller's table: editing it is another map
    monkeypatch.setattr(index_module, "_SETTLED_NS", -(10**12))
    state = {"x": random_tensor((8, 4), torch.float32, 1), "y": random_tensor((8, 4), torch.float32, 2)}
    save_checkpoint(tmp_path, state)
    model, table = Pair(), {"a": "x", "b": "y"}
    wb.load_hf(model, tmp_path, key_map=table)
    assert torch.equal(bits(model.a.data), bits(state["x"])) and torch.equal(bits(model.b.data), bits(state["y"]))
    table["a"], table["b"] = "y", "x"
    wb.load_hf(model, tmp_path, key_map=table)
    assert torch.equal(bits(model.a.data), bits(state["y"])) and torch.equal(bits(model.b.data), bits(state["x"]))
