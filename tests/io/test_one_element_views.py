"""A tensor of one element (or none) whose stride is not 1 saves like the same values in a fresh tensor.

``contiguous()`` passes such a tensor unchanged (a size-1 dim is contiguous whatever its stride), and so does
``clone()``; its bytes used to be taken with ``view(torch.uint8)``, which refuses a last stride other than 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from workbench.io.files.index import INDEX_NAME
from workbench.io.files.stream_write import StreamWriter


def _strided_state() -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """Tensors of at most one element with strides other than 1, and the values each holds (as lists)."""
    table = torch.arange(12.0).reshape(4, 3)
    head = torch.tensor([[7.5], [8.5], [9.5]]).t()[:, :1]  # shape (1, 1), strides (1, 3)
    state = {
        "layers.0.scale": table[1:2, 2],  # shape (1,), stride (3,)
        "layers.1.scale": table[2:3, 1].clone(),  # clone() keeps stride (3,)
        "head.weight": head,
        "layers.0.empty": table[:0, 0],  # shape (0,), stride (3,)
        "layers.0.count": torch.arange(8, dtype=torch.int64).reshape(4, 2)[3:, 1],  # shape (1,), stride (2,)
    }
    expected = {"layers.0.scale": [5.0], "layers.1.scale": [7.0], "head.weight": [[7.5]], "layers.0.empty": [],
                "layers.0.count": [7]}
    return state, expected


def _saved(path: Path) -> dict[str, torch.Tensor]:
    assert (path / INDEX_NAME).is_file()
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("mode", ["direct", "gather"])
def test_one_element_strided_tensors_are_saved(tmp_path: Path, mode: str) -> None:
    state, expected = _strided_state()
    assert state["layers.0.scale"].stride() == (3,) and state["layers.1.scale"].stride() == (3,)
    wb.save_hf(state, tmp_path / mode, write_mode=mode)
    saved = _saved(tmp_path / mode)
    assert {k: v.tolist() for k, v in saved.items()} == expected
    assert {k: v.dtype for k, v in saved.items()} == {k: v.dtype for k, v in state.items()}


def test_stream_writer_takes_a_strided_one_element_tensor(tmp_path: Path) -> None:
    tensor = torch.arange(12.0).reshape(4, 3)[3:, 0]  # shape (1,), stride (3,): the value 9.0
    writer = StreamWriter(tmp_path / "one.safetensors", [("x", torch.float32, (1,))])
    assert writer.write("x", tensor) == 4
    writer.close()
    assert load_file(tmp_path / "one.safetensors")["x"].tolist() == [9.0]
