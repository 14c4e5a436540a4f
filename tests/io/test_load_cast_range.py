"""``load_hf(cast=True)`` converts only values the model's dtype holds. It wrapped int64 keys into int32 parameters,
turned float32 values over 65504 into inf in float16 ones, and saturated float8 e5m2 values into e4m3 (1024 into
448), all silently. Each load path (coalesced transfers on the CPU, boxes landing from the reading threads, keys an
adapter reads whole) now refuses such a value, naming key, parameter and dtype; values that fit still load as
torch converts them. Expected values come from torch's own conversions and from safetensors' ``load_file``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench.errors import CheckpointError
from workbench.io.files import index as index_module
from workbench.io.files.staging import StagingRing
from workbench.io.hf import load as load_module
from workbench.plan.casts import changes_kind, check_fits, narrows_range

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _changed_by_torch(value: float, stored: torch.dtype, target: torch.dtype) -> bool:
    """Whether torch's cast of ``value`` (held in ``stored``) into ``target`` gives back another number than rounding
    would: a finite value made inf or NaN, or off by more than a quarter of it (inf and NaN stay what they are)."""
    held = torch.tensor(value, dtype=torch.float64).to(stored)
    back = held.to(target).to(torch.float64).item()
    kept = held.to(torch.float64).item()
    return math.isfinite(kept) and (not math.isfinite(back) or abs(back - kept) > abs(kept) / 4)


def _extremes(dtype: torch.dtype) -> list[float]:
    """The stored dtype's largest magnitudes (half of a float's largest: rounding at a binade's top is not the
    question here)."""
    if dtype == torch.bool:
        return [1.0]
    if dtype.is_floating_point:
        return [torch.finfo(dtype).max / 2, -torch.finfo(dtype).max / 2]
    return [float(torch.iinfo(dtype).min), float(torch.iinfo(dtype).max)]


@pytest.mark.parametrize("stored", DTYPES, ids=str)
def test_a_cast_narrows_exactly_where_torch_changes_an_extreme_value(stored: torch.dtype) -> None:
    for target in DTYPES:
        if target == stored or changes_kind(stored, target):
            continue
        torch_changes = any(_changed_by_torch(v, stored, target) for v in _extremes(stored))
        assert narrows_range(stored, target) == torch_changes, (stored, target)


def test_narrowing_never_counts_a_change_of_kind_or_a_widening() -> None:
    assert not narrows_range(torch.float32, torch.int32)  # a change of kind: refused before any read
    assert not narrows_range(torch.complex64, torch.float32)
    assert not narrows_range(torch.int32, torch.int64)
    assert not narrows_range(torch.float32, torch.bfloat16)  # the common load: no pass over the values
    assert narrows_range(torch.complex128, torch.complex64)


@pytest.mark.parametrize(("stored", "target", "inside", "outside"), [
    (torch.int64, torch.int32, [0, -5, 2**31 - 1, -(2**31)], [2**31, -(2**31) - 1, 2**40]),
    (torch.int8, torch.uint8, [0, 7, 127], [-1, -128]),
    (torch.uint8, torch.int8, [0, 127], [128, 255]),
    (torch.int64, torch.bool, [0, 1], [2, -1]),
    (torch.float32, torch.float16, [0.0, -60000.0, 1e-3, float("inf"), float("nan")], [1e5, -7e4, 3e38]),
    (torch.float8_e5m2, torch.float8_e4m3fn, [0.0, 448.0, -256.0], [1024.0, -57344.0]),
    (torch.int64, torch.float16, [65504, -3], [2**20, -(2**40)]),
])
def test_check_fits_refuses_exactly_the_values_torch_would_change(stored, target, inside, outside) -> None:
    values = torch.tensor(inside + outside + inside, dtype=torch.float64 if stored.is_floating_point else torch.int64)
    values = values.to(stored)
    changed = [_changed_by_torch(v, stored, target) for v in values.to(torch.float64).tolist()]
    assert sum(changed) == len(outside), "the test's values: torch changes exactly the outside ones"
    with pytest.raises(CheckpointError) as caught:
        check_fits(values, target, "model.x, read into the model's 'x'")
    text = str(caught.value)
    assert text.startswith("model.x, read into the model's 'x'"), text
    names = str(stored).removeprefix("torch."), str(target).removeprefix("torch.")
    assert f"{len(outside)} of {values.numel()} {names[0]} value(s) do not fit into {names[1]}" in text, text
    first = values[len(inside)].item()
    assert f"(the first, {first!r}," in text, text  # the first outside value
    check_fits(values[: len(inside)], target, "x")  # the values that fit pass


# -- load_hf, every path ------------------------------------------------------------------------------------------


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return load_file(str(path / "model.safetensors"))


@pytest.fixture(params=["transfers", "landing", "adapter"])
def load_path(request, monkeypatch) -> str:
    """The path a parameter's copies take: coalesced transfers copied by the loading thread (a CPU load), boxes
    landing from the reading threads (a GPU load, through the CPU seam), or a key an adapter reads whole."""
    monkeypatch.setattr(index_module, "_SETTLED_NS", -(10**12))
    monkeypatch.setattr(index_module, "_cache", type(index_module._cache)())
    if request.param == "landing":
        monkeypatch.setattr(load_module, "_CPU_LANDING_RING", StagingRing(2, 3 * 4096, pinned=False))
    return request.param


def _load(state: dict[str, torch.Tensor], path: Path, load_path: str, **kwargs) -> wb.LoadReport:
    adapters = {k: (lambda key, t: t) for k in state} if load_path == "adapter" else None
    return wb.load_hf(state, path, cast=True, adapters=adapters, **kwargs)


@pytest.mark.parametrize(("stored", "target", "big"), [
    (torch.int64, torch.int32, 2**40),
    (torch.float32, torch.float16, 1e5),
    (torch.float8_e5m2, torch.float8_e4m3fn, 1024.0),
])
def test_load_refuses_a_value_the_model_cannot_hold(tmp_path, load_path, stored, target, big) -> None:
    values = torch.arange(96 * 40, dtype=torch.float64).reshape(96, 40) % 200 - 100
    values[70, 3] = big  # far into the key: a later box or piece than the first
    on_disk = _write(tmp_path, {"layers.0.w": values.to(stored)})
    state = {"layers.0.w": torch.zeros(96, 40, dtype=target)}
    with pytest.raises((CheckpointError, wb.LoadFailed)) as caught:
        _load(state, tmp_path, load_path)
    text = str(caught.value)
    for part in ("layers.0.w", "'layers.0.w'", f"1 of {96 * 40 if load_path == 'adapter' else ''}",
                 f"do not fit into {str(target).removeprefix('torch.')}", str(stored).removeprefix("torch.")):
        assert part in text, (part, text)

    fits = values.clone()
    fits[70, 3] = 7
    _write(tmp_path, {"layers.0.w": fits.to(stored)})
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    _load(state, tmp_path, load_path)
    expected = on_disk["layers.0.w"].to(target)
    assert torch.equal(state["layers.0.w"].view(torch.uint8), expected.view(torch.uint8))


def test_a_load_without_narrowing_casts_keeps_the_landing_path(tmp_path, monkeypatch) -> None:
    # the check must not send every cast load down the slower path: float32 into bfloat16 still lands
    monkeypatch.setattr(load_module, "_CPU_LANDING_RING", StagingRing(2, 3 * 4096, pinned=False))
    on_disk = _write(tmp_path, {"w": torch.randn(64, 48, generator=torch.Generator().manual_seed(3))})
    seen: list[set[str]] = []
    real = load_module._landed

    def landed(*args, **kwargs):
        seen.append(out := real(*args, **kwargs))
        return out

    monkeypatch.setattr(load_module, "_landed", landed)
    state = {"w": torch.zeros(64, 48, dtype=torch.bfloat16)}
    wb.load_hf(state, tmp_path, cast=True)
    assert seen == [{"w"}]
    assert torch.equal(state["w"], on_disk["w"].to(torch.bfloat16))
