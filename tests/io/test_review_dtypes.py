"""A reviewer's dtype cases: places where a save or load wrote other numbers or another dtype than the model holds,
with no error. Expected values come from safetensors' own ``load_file`` or from torch, not from workbench."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate

from workbench.errors import LayoutError
from workbench.io.hf.fp8 import dequantize_blocks, dequantized_state
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec

ONE = MeshSpec((1,), ("world",))


def _spec(name: str, shape: tuple[int, ...]) -> LoadSpec:
    return LoadSpec.from_placements(name, [f"model.{name}"], shape, ONE, [Replicate()])


def test_a_weight_already_dequantized_is_not_scaled_again_when_the_layout_says_float8() -> None:
    # the layout of the float8 checkpoint (its workbench_layout.toml, say) reused for a model whose weight is bf16
    # already: dequantized_state multiplied it by its scales a second time and save_hf wrote those numbers as bf16
    raw = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).to(torch.float8_e4m3fn)
    scale = torch.tensor([[0.5, 2.0], [4.0, 0.25]])
    weight = (raw.float() * scale.repeat_interleave(4, 0).repeat_interleave(4, 1)).to(torch.bfloat16)
    specs = {"w": _spec("w", (8, 8)), "w_scale_inv": _spec("w_scale_inv", (2, 2))}
    layout = Layout(ONE, specs, {"w": "float8_e4m3fn", "w_scale_inv": "float32"})
    assert torch.equal(dequantize_blocks(raw, scale, (4, 4)), weight)  # the float8 model gives these values

    with pytest.raises(LayoutError) as caught:
        dequantized_state({"w": weight.clone(), "w_scale_inv": scale}, layout, block=(4, 4))
    for part in ("'w'", "bfloat16", "float8"):
        assert part in str(caught.value), (part, str(caught.value))
