"""A save writes each tensor in its own dtype (issue 20): a Layout's dtype never changes what is saved, only an
``fp32_keys_pattern`` does; a Layout dtype that was given and disagrees with the tensor is refused.

Every saved dtype here is read back from the safetensors header bytes (8-byte length, JSON), not from a plan."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

import workbench as wb
from workbench.errors import LayoutError, LayoutFileError

# safetensors' own dtype names (the format's spec), written out here rather than taken from workbench
SAFETENSORS_NAMES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
MESH = wb.MeshSpec((1,), ("fsdp",))


def header_dtypes(path: Path) -> dict[str, str]:
    """``{key: dtype name}`` of every tensor of every safetensors file under ``path``, from the header bytes."""
    out: dict[str, str] = {}
    for file in sorted(path.glob("*.safetensors")):
        raw = file.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + length])
        header.pop("__metadata__", None)
        for key, entry in header.items():
            assert key not in out, f"{key} is in two files"
            out[key] = entry["dtype"]
    return out


def tensor_of(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-100, 100, shape, generator=gen).to(dtype)


def test_a_bf16_tensor_with_no_layout_dtype_is_saved_as_bf16_and_loads_back_strictly(tmp_path: Path) -> None:
    state = {"w": tensor_of((4, 6), torch.bfloat16, 0)}
    layout = wb.Layout(MESH, {"w": wb.LoadSpec.from_placements("w", "model.w", (4, 6), MESH, [Shard(0)])})
    assert layout.given_dtype("w") is None  # nothing was said: unknown, not float32
    assert layout.dtype("w") == torch.float32  # the documented default for planning without tensors
    wb.save_hf(state, tmp_path / "ckpt", layout=layout)
    assert header_dtypes(tmp_path / "ckpt") == {"model.w": "BF16"}
    back = {"w": torch.zeros(4, 6, dtype=torch.bfloat16)}
    wb.load_hf(back, tmp_path / "ckpt", layout=layout)  # strict: a dtype change would be refused
    assert torch.equal(back["w"].view(torch.int16), state["w"].view(torch.int16))
    # the file holds 2 bytes per element, not 4
    (file,) = (tmp_path / "ckpt").glob("*.safetensors")
    (length,) = struct.unpack("<Q", file.read_bytes()[:8])
    assert file.stat().st_size - 8 - length == 4 * 6 * 2


@pytest.mark.parametrize("write_mode", ["direct", "gather"])
def test_a_given_layout_dtype_that_disagrees_with_the_tensor_is_refused(tmp_path: Path, write_mode: str) -> None:
    state = {"w": tensor_of((4, 6), torch.bfloat16, 0), "b": tensor_of((6,), torch.float32, 1)}
    specs = {"w": wb.LoadSpec.from_placements("w", "model.w", (4, 6), MESH, [Shard(0)]),
             "b": wb.LoadSpec.from_placements("b", "model.b", (6,), MESH, [Replicate()])}
    layout = wb.Layout(MESH, specs, {"w": "float32", "b": "float32"})
    with pytest.raises(LayoutError) as info:
        wb.save_hf(state, tmp_path / "ckpt", layout=layout, write_mode=write_mode)
    message = str(info.value)
    assert "'w'" in message and "float32" in message and "bfloat16" in message and "'b'" not in message
    assert not (tmp_path / "ckpt").exists()
    assert not [p for p in tmp_path.iterdir()]  # nothing was created, not even a temporary directory


def test_a_given_layout_dtype_that_agrees_is_accepted(tmp_path: Path) -> None:
    state = {"w": tensor_of((4, 6), torch.float16, 0)}
    layout = wb.Layout(MESH, {"w": wb.LoadSpec.from_placements("w", "model.w", (4, 6), MESH, [Shard(0)])},
                       {"w": "float16"})
    assert layout.given_dtype("w") == torch.float16
    wb.save_hf(state, tmp_path / "ckpt", layout=layout)
    assert header_dtypes(tmp_path / "ckpt") == {"model.w": "F16"}


def float64_values() -> torch.Tensor:
    """(8, 4) random float64 values (nearly all change in float32), and 1 + 2**-40 (1.0 in float32)."""
    full = torch.randn(8, 4, generator=torch.Generator().manual_seed(64), dtype=torch.float64)
    full[6, 0] = 1 + 2**-40
    return full


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("write_mode", ["direct", "gather"])
def test_a_float64_fused_tensor_with_one_float32_key_writes_every_key_from_the_float64_values(
    tmp_path: Path, write_mode: str, dtype: torch.dtype | None
) -> None:
    # gate matches the pattern (float32); up is written in float64 (dtype=None) or bfloat16, each cast once from
    # the float64 source: never through a float32 copy of the whole fused tensor
    from safetensors.torch import load_file

    full = float64_values()
    layout = wb.Layout(MESH, {"gu": wb.LoadSpec.from_placements("gu", ["gate", "up"], (8, 4), MESH, [Replicate()],
                                                                fused_dim=0)}, {"gu": "float64"})
    wb.save_hf({"gu": full.clone()}, tmp_path / "ckpt", layout=layout, dtype=dtype, fp32_keys_pattern=r"^gate$",
               write_mode=write_mode)
    up_dtype = dtype or torch.float64
    assert header_dtypes(tmp_path / "ckpt") == {"gate": "F32", "up": SAFETENSORS_NAMES[up_dtype]}
    saved = {k: v for f in (tmp_path / "ckpt").glob("*.safetensors") for k, v in load_file(f).items()}
    want = {"gate": full[:4].to(torch.float32), "up": full[4:].to(up_dtype)}
    assert saved.keys() == want.keys()
    for key, tensor in want.items():
        assert saved[key].dtype == tensor.dtype and torch.equal(saved[key], tensor), (key, saved[key] - tensor)


# -- the property ----------------------------------------------------------------------------------------------
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool]
PATTERNS = [None, r"norm", r"\.1\.", r"^layers\.0\.", [r"bias$", r"norm"], r"nothing-matches"]


@st.composite
def models(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], wb.Layout]:
    """1-4 parameters of random dtypes and shapes, some fused from 2-3 HF keys, in a Layout built from LoadSpecs
    that gives the dtype of a random subset of them (always the tensor's own) and says nothing of the rest."""
    count = draw(st.integers(1, 4))
    state, specs, given = {}, {}, {}
    for i in range(count):
        name = f"layers.{i}.{draw(st.sampled_from(['norm', 'proj', 'bias', 'experts']))}"
        dtype = draw(st.sampled_from(DTYPES))
        keys_count = draw(st.integers(1, 3))
        rows = keys_count * draw(st.integers(1, 3))
        shape = (rows, draw(st.integers(1, 5))) if draw(st.booleans()) or keys_count > 1 else (rows,)
        keys = [f"{name}.{k}.weight" for k in range(keys_count)] if keys_count > 1 else [f"{name}.weight"]
        placement = draw(st.sampled_from([Shard(0), Replicate()]))
        specs[name] = wb.LoadSpec.from_placements(name, keys, shape, MESH, [placement],
                                                  fused_dim=0 if keys_count > 1 else None)
        state[name] = tensor_of(shape, dtype, i)
        if draw(st.booleans()):
            given[name] = str(dtype).removeprefix("torch.")
    return state, wb.Layout(MESH, specs, given)


@settings(max_examples=40)
@given(model=models(), pattern=st.sampled_from(PATTERNS), write_mode=st.sampled_from(["direct", "gather"]))
def test_every_saved_key_has_the_models_dtype_unless_a_pattern_matches(
    tmp_path_factory: pytest.TempPathFactory, model, pattern, write_mode: str
) -> None:
    state, layout = model
    path = tmp_path_factory.mktemp("save") / "ckpt"
    wb.save_hf(state, path, layout=layout, fp32_keys_pattern=pattern, write_mode=write_mode)
    patterns = [pattern] if isinstance(pattern, str) else list(pattern or [])
    want = {}
    for name, spec in layout.specs.items():
        dtype = state[name].dtype
        for key in spec.hf_keys:
            matched = dtype.is_floating_point and any(re.search(p, key) for p in patterns)
            want[key] = "F32" if matched else SAFETENSORS_NAMES[dtype]
    assert header_dtypes(path) == want


@pytest.mark.parametrize("kwargs", [{"fp32_keys_pattern": r"^1\."}, {"dtype": torch.float16}])
def test_a_model_saves_again_with_its_checkpoints_own_layout(tmp_path, kwargs) -> None:
    # the layout file records the dtypes written; read back as the layout of the next save with the same arguments,
    # it was refused ("the layout says float32, the tensor is bfloat16")
    from safetensors.torch import load_file

    from workbench.layout.layout_file import read_checkpoint_layout

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)
    wb.save_hf(model, tmp_path / "first", **kwargs)
    layout = read_checkpoint_layout(tmp_path / "first")
    wb.save_hf(model, tmp_path / "second", layout=layout, **kwargs)
    first, second = ({k: v for f in (tmp_path / name).glob("*.safetensors") for k, v in load_file(f).items()}
                     for name in ("first", "second"))
    assert first.keys() == second.keys() and all(
        first[k].dtype == second[k].dtype and torch.equal(first[k], second[k]) for k in first)
    assert read_checkpoint_layout(tmp_path / "second").dtypes == layout.dtypes
    with pytest.raises(LayoutError, match="the layout says"):  # other arguments: the layout's dtypes are wrong
        wb.save_hf(model, tmp_path / "third", layout=layout)


def test_a_fused_parameter_saved_in_two_dtypes_has_no_dtype_in_its_layout_file(tmp_path: Path) -> None:
    # q and v in bfloat16, k in float32 (fp32_keys_pattern): the parameter has no one dtype. The layout file used to
    # leave the field out, which reads back as float32, so diagnosing the checkpoint against its own layout reported
    # dtype mismatches that are not there and the files' layout fingerprint differed from the layout file's
    from safetensors import safe_open

    from workbench.layout.key_map import HFKeys
    from workbench.layout.layout_file import read_checkpoint_layout

    model = torch.nn.Sequential(torch.nn.Linear(4, 12, bias=False), torch.nn.LayerNorm(4))

    def key_map(name: str):
        return HFKeys(("q.weight", "k.weight", "v.weight"), 0) if name == "0.weight" else name

    path = tmp_path / "ckpt"
    wb.save_hf(model, path, key_map=key_map, fp32_keys_pattern=r"^k\.", dtype=torch.bfloat16)
    assert header_dtypes(path) == {"q.weight": "BF16", "k.weight": "F32", "v.weight": "BF16",
                                   "1.weight": "BF16", "1.bias": "BF16"}
    text = (path / "workbench_layout.toml").read_text()
    assert 'dtype = "none"' in text
    layout = read_checkpoint_layout(path)
    assert layout.given_dtype("0.weight") is None and layout.given_dtype("1.weight") == torch.bfloat16
    with safe_open(next(path.glob("*.safetensors")), "pt") as handle:
        assert handle.metadata()["layout"] == layout.fingerprint()
    assert not wb.diagnose(path, layout).findings


def test_a_layout_of_loadspecs_alone_reads_back_without_dtypes() -> None:
    from workbench.layout.layout_file import parse_layout

    layout = wb.Layout(MESH, {"w": wb.LoadSpec.from_placements("w", ["w"], (4, 2), MESH, [Shard(0)])})
    again = parse_layout(layout.to_toml())
    assert again.dtypes == {} and again.fingerprint() == layout.fingerprint()
    with pytest.raises(LayoutFileError, match="'dtype' must be"):
        parse_layout(layout.to_toml().replace('dtype = "none"', "dtype = 3"))
