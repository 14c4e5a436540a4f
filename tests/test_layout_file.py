"""Layout files: the TOML format expands templates, and bad files name the file, line and field."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from workbench import _compat
from workbench.errors import LayoutError, LayoutFileError
from workbench.layout import InterleavedShard
from workbench.layout.layout_file import load_layout, parse_layout, parse_placement

ROOT = Path(__file__).resolve().parents[1]

GOOD = """
name = "tiny"
[mesh]
shape = [2, 2]
dim_names = ["ep", "tp"]

[[param]]
name = "layers.{layer}.experts.w13"
for = { layer = 2 }
hf_keys = ["layers.{layer}.experts.{e}.gate.weight", "layers.{layer}.experts.{e}.up.weight"]
keys_for = { e = 2 }
global_shape = [16, 3]
fused_dim = 0
placements = ["S(0)", "IS(0,2)"]
dtype = "bfloat16"

[[param]]
name = "norm.weight"
hf_keys = ["norm.weight"]
global_shape = [5]
mesh_dims = ["ep+tp"]
placements = ["S(0)"]
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("R", Replicate()),
        ("S(1)", Shard(1)),
        ("Shard(0)", Shard(0)),
        ("SS(0,4)", _compat.make_strided_shard(0, 4)),
        ("IS(0, 2)", InterleavedShard(0, 2)),
        ("P", Partial()),
    ],
)
def test_parse_placement_short_forms(text: str, expected: object) -> None:
    placement = parse_placement(text)
    assert placement == expected
    assert type(placement) is type(expected)


@pytest.mark.parametrize("text", ["S", "S(0,1)", "X(0)", "SS(0)", "IS(0,0)", "S(a)"])
def test_parse_placement_rejects(text: str) -> None:
    with pytest.raises(LayoutError, match="placement"):
        parse_placement(text)


def test_templates_expand_in_order() -> None:
    layout = parse_layout(GOOD, source="tiny.toml")
    assert list(layout) == ["layers.0.experts.w13", "layers.1.experts.w13", "norm.weight"]
    spec = layout["layers.1.experts.w13"]
    assert spec.hf_keys == (
        "layers.1.experts.0.gate.weight",
        "layers.1.experts.0.up.weight",
        "layers.1.experts.1.gate.weight",
        "layers.1.experts.1.up.weight",
    )
    assert spec.describe_shards() == "S(0)@ep -> IS(0,2)@tp"
    assert layout.dtypes["layers.0.experts.w13"] == "bfloat16"
    assert layout.dtype("norm.weight").is_floating_point
    norm = layout["norm.weight"]
    assert norm.describe_shards() == "S(0)@ep+tp"
    assert [norm.local_shape(r) for r in range(4)] == [(2,), (2,), (1,), (0,)]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # a typo in a field name is caught, not ignored
        (("global_shape = [5]", "global_shap = [5]"), r"line 17 .*'norm.weight'.*unknown field"),
        # one placement too many for the flattened group
        (('placements = ["S(0)"]', 'placements = ["S(0)", "R"]'), r"line 17 .*expected one placement per mesh dim"),
        # a template variable no loop sets
        (("keys_for = { e = 2 }", "keys_for = { x = 2 }"), r"line 7 .*template names 'e'"),
        # uneven interleave names N, W and F
        (("global_shape = [16, 3]", "global_shape = [12, 3]"), r"line 7 .*N=6 .*W\*F=2\*2=4"),
        # Partial is rejected with the parameter named
        (('placements = ["S(0)", "IS(0,2)"]', 'placements = ["S(0)", "P"]'), r"'layers.0.experts.w13'.*Partial"),
        # unknown mesh dim
        (('mesh_dims = ["ep+tp"]', 'mesh_dims = ["ep+pp"]'), r"mesh dim 'pp'"),
        # a bad loop spec
        (("for = { layer = 2 }", 'for = { layer = "x" }'), r"'for'.*not a count"),
    ],
)
def test_bad_files_name_line_and_field(change: tuple[str, str], message: str) -> None:
    old, new = change
    assert old in GOOD
    with pytest.raises(LayoutFileError, match=message):
        parse_layout(GOOD.replace(old, new, 1), source="tiny.toml")


def test_bad_toml_syntax_names_the_line() -> None:
    with pytest.raises(LayoutFileError, match=r"tiny.toml: not valid TOML.*line 3"):
        parse_layout('name = "x"\n[mesh]\nshape = [2 3]\n[[param]]\n', source="tiny.toml")


def test_missing_mesh_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(LayoutFileError, match=r"\[mesh\]"):
        parse_layout('name = "x"\n', source="x.toml")
    with pytest.raises(LayoutFileError, match="cannot read layout file"):
        load_layout(tmp_path / "nope.toml")


def test_duplicate_parameter_and_key() -> None:
    doubled = GOOD + GOOD[GOOD.index("[[param]]\nname = \"norm.weight\"") :]
    with pytest.raises(LayoutFileError, match=r"'norm\.weight' is defined twice"):
        parse_layout(doubled, source="tiny.toml")


@pytest.mark.parametrize("path", sorted((ROOT / "sample_meshes").glob("*.toml")), ids=lambda p: p.stem)
def test_every_sample_loads_and_covers_exactly(path: Path) -> None:
    layout = load_layout(path)
    assert len(layout) > 0
    reports = layout.coverage()
    bad = [str(r) for r in reports.values() if not r.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # a typo in the mesh table is an error, not silently ignored
        ('[mesh]\nshape = [2]\ndim_nmes = ["a"]\n[[param]]\n', r"\[mesh\]: unknown field.*dim_nmes"),
        # defaults only set dtype
        ('[mesh]\nshape = [2]\n[defaults]\ndtyp = "bfloat16"\n[[param]]\n', r"\[defaults\] may only set dtype"),
    ],
)
def test_mesh_and_defaults_reject_unknown_fields(text: str, message: str) -> None:
    with pytest.raises(LayoutFileError, match=message):
        parse_layout(text, source="x.toml")


def test_custom_rank_order() -> None:
    text = GOOD.replace('dim_names = ["ep", "tp"]', 'dim_names = ["ep", "tp"]\nranks = [3, 2, 1, 0]')
    layout = parse_layout(text, source="tiny.toml")
    assert layout.mesh.coordinate(3) == (0, 0)
    assert layout["norm.weight"].local_shape(0) == (0,)  # rank 0 sits last on the flattened ep+tp group
