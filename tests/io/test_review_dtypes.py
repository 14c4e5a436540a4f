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


@pytest.mark.parametrize("target", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_cast_does_not_truncate_a_floating_key_into_an_integer_or_bool_parameter(tmp_path, target) -> None:
    # cast=True converted float weights into an integer or bool tensor (1.7 -> 1, -0.3 -> 0, any nonzero -> True),
    # where a save refuses such a target: a key mapped to an integer buffer by mistake loaded as other numbers
    from safetensors.torch import load_file, save_file

    import workbench as wb
    from workbench.errors import CheckpointError

    save_file({"w": torch.tensor([[1.7, -0.3], [2.5, 0.0]]), "steps": torch.tensor([3, 4])},
              str(tmp_path / "model.safetensors"))
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    state = {"w": torch.full((2, 2), 9).to(target), "steps": torch.zeros(2, dtype=torch.int64)}
    with pytest.raises(CheckpointError) as caught:
        wb.load_hf(state, tmp_path, cast=True)
    for part in ("w:", "float32", str(target).removeprefix("torch.")):
        assert part in str(caught.value), (part, str(caught.value))
    assert torch.equal(state["w"], torch.full((2, 2), 9).to(target))  # nothing changed

    report = wb.load_hf(state, tmp_path, cast=True, strict=False)  # skipped and listed, the rest loads
    assert [m.split(":")[0] for m in report.mismatched] == ["w"]
    assert torch.equal(state["w"], torch.full((2, 2), 9).to(target))
    assert torch.equal(state["steps"], on_disk["steps"])


def test_cast_does_not_drop_the_imaginary_part_of_a_complex_key(tmp_path) -> None:
    from safetensors.torch import save_file

    import workbench as wb
    from workbench.errors import CheckpointError

    save_file({"z": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)}, str(tmp_path / "model.safetensors"))
    state = {"z": torch.zeros(2)}
    with pytest.raises(CheckpointError, match=r"z: .*complex64.*float32"):
        wb.load_hf(state, tmp_path, cast=True)
    assert torch.equal(state["z"], torch.zeros(2))


def test_cast_still_converts_between_floating_dtypes_and_from_integers(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    import workbench as wb

    save_file({"w": torch.tensor([1.7, -0.3]), "n": torch.tensor([3, 4], dtype=torch.int32)},
              str(tmp_path / "model.safetensors"))
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    state = {"w": torch.zeros(2, dtype=torch.bfloat16), "n": torch.zeros(2, dtype=torch.int64)}
    assert wb.load_hf(state, tmp_path, cast=True).ok
    assert torch.equal(state["w"], on_disk["w"].to(torch.bfloat16))
    assert torch.equal(state["n"], on_disk["n"].to(torch.int64))


@pytest.mark.parametrize("pattern", ["", [""], ["norm", ""]])
def test_an_empty_fp32_keys_pattern_is_refused_not_matched_against_every_key(tmp_path, pattern) -> None:
    # an empty regex matches every key: fp32_keys_pattern=os.environ.get("FP32_KEYS", "") or "".split(",") saved a
    # bf16 checkpoint (dtype=torch.bfloat16) all in float32, with no error
    from safetensors.torch import load_file

    import workbench as wb
    from workbench.errors import PlanError

    state = {"w": torch.randn(4, 4), "norm": torch.randn(4)}
    with pytest.raises((PlanError, wb.SaveFailed), match="empty"):
        wb.save_hf(state, tmp_path / "ckpt", dtype=torch.bfloat16, fp32_keys_pattern=pattern)
    assert not (tmp_path / "ckpt").exists()
    wb.save_hf(state, tmp_path / "ok", dtype=torch.bfloat16, fp32_keys_pattern=None)  # none: every key bf16
    saved = load_file(str(next((tmp_path / "ok").glob("*.safetensors"))))
    assert {k: t.dtype for k, t in saved.items()} == {"w": torch.bfloat16, "norm": torch.bfloat16}
