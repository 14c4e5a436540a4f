"""`save_hf(layout=...)` refuses a tensor the layout does not list unless a callable key map leaves it out: a key-map
table that misses it is a gap, not a choice; a state entry that is no tensor (extra state) is not asked about."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import workbench as wb
from workbench.errors import LayoutError


def _keys(path: Path) -> set[str]:
    keys: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            keys.update(handle.keys())
    return keys


def test_a_table_key_map_that_does_not_cover_an_unlisted_tensor_does_not_leave_it_out(tmp_path: Path) -> None:
    """A table cannot map a name to None (``Layout.from_model`` calls a name it lacks a gap), so a tensor the layout
    lacks and the table does not cover is refused, as without a key map."""
    state = {"embed.weight": torch.ones(3, 2), "extra": torch.ones(4)}
    table = {r"embed\.weight": "model.embed.weight"}
    layout = wb.Layout.from_model({"embed.weight": state["embed.weight"]}, table)
    with pytest.raises(LayoutError, match=r"1 tensor\(s\) that the layout .* does not list: \['extra'\]"):
        wb.save_hf(state, tmp_path / "refused", layout=layout, key_map=table)
    assert not (tmp_path / "refused").exists()
    # a callable that maps it to None leaves it out on purpose
    wb.save_hf(state, tmp_path / "ckpt", layout=layout,
               key_map=lambda name: None if name == "extra" else "model.embed.weight")
    assert _keys(tmp_path / "ckpt") == {"model.embed.weight"}


class _WithExtraState(torch.nn.Linear):
    """A module whose state dict holds a value that is no tensor (as TransformerEngine's FP8 metadata)."""

    def get_extra_state(self) -> io.BytesIO:
        return io.BytesIO(b"fp8 metadata")

    def set_extra_state(self, state: object) -> None:
        pass


def test_a_state_entry_that_is_no_tensor_is_not_refused_as_an_unlisted_tensor(tmp_path: Path) -> None:
    model = _WithExtraState(4, 3)
    assert "_extra_state" in model.state_dict()
    layout = wb.Layout.from_model({"weight": model.weight, "bias": model.bias})
    wb.save_hf(model, tmp_path / "ckpt", layout=layout)
    assert _keys(tmp_path / "ckpt") == {"weight", "bias"}
