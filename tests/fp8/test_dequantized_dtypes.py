"""``dequantized_state`` keeps a parameter's dtype unknown when its layout gave none (a Layout built from LoadSpecs):
it must not claim float32 for a bf16 tensor, or ``save_hf`` refuses the layout it returned."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import Replicate

from workbench.io.hf.fp8 import dequantized_state
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec

ONE = MeshSpec((1,), ("fsdp",))


def _spec(name: str, shape: tuple[int, ...]) -> LoadSpec:
    return LoadSpec.from_placements(name, [f"model.{name}"], shape, ONE, [Replicate()])


def test_a_parameter_without_a_given_dtype_is_saved_in_its_own_dtype(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    import workbench as wb

    specs = {"w": _spec("w", (4, 4)), "w_scale_inv": _spec("w_scale_inv", (1, 1)),
             "norm": _spec("norm", (4,)), "bias": _spec("bias", (4,))}
    # only the float8 weight (how its scale is found) and the bias have a dtype; norm has none
    layout = Layout(ONE, specs, {"w": "float8_e4m3fn", "bias": "float16"})
    state = {"w": torch.full((4, 4), 2.0).to(torch.float8_e4m3fn), "w_scale_inv": torch.tensor([[0.5]]),
             "norm": torch.arange(4, dtype=torch.bfloat16), "bias": torch.ones(4, dtype=torch.float16)}

    dequant, out = dequantized_state(state, layout, block=(4, 4))

    assert out.dtypes == {"w": "bfloat16", "bias": "float16"}  # norm: not given, so not claimed
    assert out.given_dtype("norm") is None
    wb.save_hf(dequant, tmp_path / "bf16", layout=out)  # the old layout said float32 for norm: LayoutError here
    saved = {}
    for f in (tmp_path / "bf16").glob("*.safetensors"):
        saved.update(load_file(f))
    assert saved["model.norm"].dtype == torch.bfloat16 and torch.equal(saved["model.norm"], state["norm"])
    assert saved["model.bias"].dtype == torch.float16
    assert torch.equal(saved["model.w"], torch.full((4, 4), 1.0, dtype=torch.bfloat16))  # 2.0 x 0.5
    assert "model.w_scale_inv" not in saved
