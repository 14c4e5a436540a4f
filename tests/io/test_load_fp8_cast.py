"""``cast=True`` of a float8 key that has a scale key into a parameter that is not float8 (a reviewer's repro): the
raw float8 values were cast and the scales left unread, so the model held numbers a hundred times too large, with no
error. It is refused now, before any tensor changes; float8 into float8 loads as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import workbench as wb
from workbench.errors import CheckpointError


def _fp8_checkpoint(path: Path, scale_key: str) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    raw = (weight / 0.01).to(torch.float8_e4m3fn)  # block-scaled: dequantized = raw * scale
    scale = torch.full((2, 2), 0.01)
    save_file({"layer.weight": raw, scale_key: scale, "norm": torch.ones(4)}, str(path / "model.safetensors"))
    return raw, scale


@pytest.mark.parametrize("scale_key", ["layer.weight_scale_inv", "layer.weight_scale"])
def test_a_scaled_float8_key_is_not_cast_into_a_bf16_parameter(tmp_path: Path, scale_key: str) -> None:
    _fp8_checkpoint(tmp_path, scale_key)
    state = {"layer.weight": torch.full((256, 256), 7.0, dtype=torch.bfloat16), "norm": torch.zeros(4)}
    with pytest.raises(CheckpointError) as caught:
        wb.load_hf(state, tmp_path, cast=True, strict=False)
    text = str(caught.value)
    for part in ("layer.weight", "float8_e4m3fn", repr(scale_key), "bfloat16", "dequantize"):
        assert part in text, (part, text)
    assert torch.equal(state["layer.weight"], torch.full((256, 256), 7.0, dtype=torch.bfloat16))  # nothing changed
    assert torch.equal(state["norm"], torch.zeros(4))


def test_a_scaled_float8_key_loads_into_float8_with_cast_as_before(tmp_path: Path) -> None:
    raw, scale = _fp8_checkpoint(tmp_path, "layer.weight_scale_inv")
    state = {"layer.weight": torch.zeros(256, 256, dtype=torch.float8_e4m3fn),
             "layer.weight_scale_inv": torch.zeros(2, 2), "norm": torch.zeros(4)}
    report = wb.load_hf(state, tmp_path, cast=True)
    assert report.ok
    assert torch.equal(state["layer.weight"].view(torch.uint8), raw.view(torch.uint8))
    assert torch.equal(state["layer.weight_scale_inv"], scale)


def test_a_float8_key_without_a_scale_key_is_still_cast(tmp_path: Path) -> None:
    raw = torch.linspace(-4, 4, 64).to(torch.float8_e4m3fn).reshape(8, 8)
    save_file({"w": raw}, str(tmp_path / "model.safetensors"))
    state = {"w": torch.zeros(8, 8, dtype=torch.bfloat16)}
    wb.load_hf(state, tmp_path, cast=True)
    assert torch.equal(state["w"], raw.to(torch.bfloat16))
