"""Layout files of parameters whose name parts are not ASCII identifiers: the ``for``/``keys_for`` loops are TOML
inline tables whose keys are written bare, and TOML's bare keys are ``A-Za-z0-9_-`` only, so a loop variable named
after ``блок`` or ``é`` made a file that no TOML reader (nor ``read_checkpoint_layout``) could read back."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate

from workbench.layout.layout_file import parse_layout, read_checkpoint_layout
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec

MESH = MeshSpec((2,), ("fsdp",))

# name parts before a layer number: Cyrillic, Latin with accents, CJK, Greek, digits after a non-ASCII letter,
# a part that starts with a digit, a hyphen, a Python keyword, an emoji
PREFIXES = ["блок", "é", "层", "Ünïcode", "é1", "αβγ", "1a", "conv-pre", "for", "x\U0001f600"]


def _layout(prefix: str) -> Layout:
    """Two layers named ``<prefix>.<i>.w`` (one table with a ``for`` loop), each fusing experts keyed
    ``<prefix>.<i>.<prefix>_e.<e>.w`` (a ``keys_for`` loop, named after ``<prefix>_e``)."""
    specs = {}
    for i in range(2):
        name = f"{prefix}.{i}.w"
        keys = [f"model.{prefix}.{i}.{prefix}_e.{e}.w" for e in range(3)]
        specs[name] = LoadSpec.from_placements(name, keys, (6, 2), MESH, [Replicate()], fused_dim=0)
    return Layout(MESH, specs, dict.fromkeys(specs, "float32"), name=f"{prefix} layers")


def _assert_same(back: Layout, layout: Layout) -> None:
    assert list(back.specs.items()) == list(layout.specs.items())  # names, order, keys, shapes, cuts
    assert back.dtypes == layout.dtypes and back.name == layout.name and back.mesh == layout.mesh
    assert back.fingerprint() == layout.fingerprint()


@pytest.mark.parametrize("prefix", PREFIXES)
def test_a_layout_with_odd_name_parts_reads_back_equal(prefix: str) -> None:
    layout = _layout(prefix)
    text = layout.to_toml()
    loops = [v for table in tomllib.loads(text)["param"] for field in ("for", "keys_for") for v in table.get(field, {})]
    assert loops, text  # the names and keys are still written as loops, not listed
    _assert_same(parse_layout(text), layout)


def test_a_checkpoint_with_non_ascii_layer_names_keeps_a_readable_layout_file(tmp_path: Path) -> None:
    import workbench as wb

    state = {f"блок.{i}.w": torch.full((4,), float(i)) for i in range(2)}
    wb.save_hf(state, tmp_path / "ckpt")
    back = read_checkpoint_layout(tmp_path / "ckpt")
    assert back is not None and list(back.specs) == list(state)
    assert [back.specs[n].hf_keys for n in state] == [(n,) for n in state]


def test_a_layout_read_from_a_state_dict_is_named_so_and_one_of_a_module_by_its_class() -> None:
    # reports say "against layout <name>": a mapping's class ("dict") named nothing a reader knows
    state = {"w": torch.zeros(2, 2)}
    assert Layout.from_model(state).name == "state_dict"
    assert Layout.from_model(torch.nn.Linear(2, 2)).name == "Linear"
    assert Layout.from_model(state, name="mine").name == "mine"
