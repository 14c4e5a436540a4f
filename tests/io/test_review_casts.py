"""Review of the range checks of casts (``plan.casts``): a value that rounds to the target's largest one fits.
``check_fits`` refused every value over the largest, so float32 65519 into float16 (torch gives 65504) or 460 into
float8 e4m3fn (448) failed a load, a save and a DCP conversion. Expected values come from torch's own conversions
and safetensors' ``load_file``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench.errors import CheckpointError
from workbench.io.files import index as index_module
from workbench.io.files.staging import StagingRing
from workbench.io.hf import load as load_module
from workbench.plan.casts import check_fits

# targets whose overflow torch makes inf or NaN (float8 e4m3fn saturates instead: its case is below)
_OVERFLOWING = [(torch.float32, torch.float16), (torch.float64, torch.float16), (torch.bfloat16, torch.float16),
                (torch.float32, torch.float8_e5m2), (torch.float32, torch.float8_e4m3fnuz),
                (torch.float32, torch.float8_e5m2fnuz), (torch.float64, torch.float32),
                (torch.complex64, torch.complex32)]


def _near_the_top(stored: torch.dtype, target: torch.dtype) -> torch.Tensor:
    """Values of ``stored`` from just under the target's largest value to well over it, both signs."""
    real = {torch.complex64: torch.float32, torch.complex32: torch.float16}
    top = torch.finfo(real.get(target, target)).max
    steps = torch.cat([torch.linspace(-0.02, 0.2, 400, dtype=torch.float64),
                       torch.linspace(-0.001, 0.002, 400, dtype=torch.float64)])
    values = torch.cat([top * (1 + steps), -top * (1 + steps)])
    return values.to(real.get(stored, stored)).to(stored)


@pytest.mark.parametrize(("stored", "target"), _OVERFLOWING, ids=str)
def test_check_fits_passes_every_value_torch_rounds_to_a_finite_one(stored, target) -> None:
    values = _near_the_top(stored, target)
    converted = values.to(target)
    parts = torch.view_as_real(converted.to(torch.complex64)) if target.is_complex else converted.double()
    finite = torch.isfinite(parts)
    finite = finite.all(-1) if target.is_complex else finite
    assert 0 < int(finite.sum()) < values.numel(), "the test's values: some fit, some do not"
    for value, fits in zip(values, finite.tolist()):
        if fits:
            check_fits(value.reshape(1), target, "k")
        else:
            with pytest.raises(CheckpointError):
                check_fits(value.reshape(1), target, "k")


def test_check_fits_into_saturating_e4m3_passes_what_rounds_to_448() -> None:
    # e4m3fn's top values are 416 and 448 (480 is NaN): torch saturates every larger value to 448, so only those
    # within half a step (16) of 448 are rounded, not changed; 464 is a tie that goes to 448's even last bit
    values = torch.tensor([449.0, 460.0, 464.0, -464.0])
    assert torch.equal(values.to(torch.float8_e4m3fn).float(), torch.tensor([448.0, 448.0, 448.0, -448.0]))
    check_fits(values, torch.float8_e4m3fn, "k")
    for outside in (465.0, 479.0, -470.0, 1024.0):
        with pytest.raises(CheckpointError):
            check_fits(torch.tensor([outside]), torch.float8_e4m3fn, "k")


@pytest.fixture(params=["transfers", "landing", "adapter"])
def load_path(request, monkeypatch) -> str:
    monkeypatch.setattr(index_module, "_SETTLED_NS", -(10**12))
    monkeypatch.setattr(index_module, "_cache", type(index_module._cache)())
    if request.param == "landing":
        monkeypatch.setattr(load_module, "_CPU_LANDING_RING", StagingRing(2, 3 * 4096, pinned=False))
    return request.param


def test_load_of_values_rounding_to_the_largest_float16(tmp_path: Path, load_path: str) -> None:
    values = torch.full((64, 8), 3.0)
    values[40, 1], values[41, 2], values[42, 3] = 65519.0, -65510.0, 65504.0
    save_file({"w": values}, str(tmp_path / "model.safetensors"))
    state = {"w": torch.zeros(64, 8, dtype=torch.float16)}
    adapters = {"w": (lambda key, t: t)} if load_path == "adapter" else None
    wb.load_hf(state, tmp_path, cast=True, adapters=adapters)
    expected = load_file(str(tmp_path / "model.safetensors"))["w"].to(torch.float16)
    assert torch.equal(state["w"], expected)


def test_save_in_float16_of_values_rounding_to_the_largest(tmp_path: Path) -> None:
    state = {"w": torch.tensor([[65519.0, -65510.0], [1.0, 2.0]])}
    wb.save_hf(state, tmp_path / "ckpt", dtype=torch.float16)
    saved = {}
    for f in sorted((tmp_path / "ckpt").glob("*.safetensors")):
        saved.update(load_file(str(f)))
    assert torch.equal(saved["w"], state["w"].to(torch.float16))


def test_check_fits_of_values_that_fit_is_one_pass_over_them() -> None:
    # a load of 1,000 small float32 keys into float16 took about twice as long: six passes and a dtype table
    # per piece (about 40 us each, 25 times the copy itself)
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    values = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    wide, long = values.double(), values.to(torch.int64)
    for _ in range(2):  # the second time counts: what a dtype needs once is known
        ops.clear()
        with Count():
            check_fits(values, torch.float16, "k")
            check_fits(wide, torch.float32, "k")
            check_fits(long, torch.int32, "k")
    passes = [op for op in ops if not op.startswith(("aten._local_scalar_dense", "aten.unbind", "aten.select"))]
    assert len(passes) <= 3, ops
