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


def test_a_layout_that_gives_no_dtypes_still_dequantizes_its_float8_weights(tmp_path: Path) -> None:
    # the float8 weight is found by its tensor's dtype: a layout built from specs alone says none, and the save
    # used to come out float8 with its scale, where bf16 was promised
    from safetensors.torch import load_file

    import workbench as wb

    specs = {"w": _spec("w", (4, 4)), "w_scale_inv": _spec("w_scale_inv", (1, 1)), "norm": _spec("norm", (4,))}
    state = {"w": torch.full((4, 4), 2.0).to(torch.float8_e4m3fn), "w_scale_inv": torch.tensor([[0.25]]),
             "norm": torch.arange(4, dtype=torch.bfloat16)}

    dequant, out = dequantized_state(state, Layout(ONE, specs), block=(4, 4))

    assert set(dequant) == {"w", "norm"} and dequant["w"].dtype == torch.bfloat16
    assert out.dtypes == {"w": "bfloat16"}  # norm's stays unknown, as it was given
    wb.save_hf(dequant, tmp_path / "bf16", layout=out)
    saved = load_file(next((tmp_path / "bf16").glob("*.safetensors")))
    assert set(saved) == {"model.w", "model.norm"}
    assert torch.equal(saved["model.w"], torch.full((4, 4), 0.5, dtype=torch.bfloat16))  # 2.0 x 0.25


def test_a_cast_of_a_float8_model_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    # save_hf(dtype=bf16) wrote the raw float8 numbers as bf16 (never scaled) beside scales rounded to bf16
    import pytest

    import workbench as wb
    from workbench.run.guard import SaveFailed

    state = {"w": torch.full((4, 4), 2.0).to(torch.float8_e4m3fn), "w_scale_inv": torch.tensor([[0.0123456]])}
    for options in ({"dtype": torch.bfloat16}, {"fp32_keys_pattern": r"^w$"}, {"dtype": torch.int8}):
        target = tmp_path / "out"
        with pytest.raises(SaveFailed) as info:
            wb.save_hf(state, target, **options)
        assert "PlanError" in str(info.value) and "rank 0" in str(info.value), str(info.value)
        assert not target.exists() or not any(target.iterdir()), list(target.iterdir())
    wb.save_hf(state, tmp_path / "as_is")  # no cast: float8 and its float32 scale, as they are
