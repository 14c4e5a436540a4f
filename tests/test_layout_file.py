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


# -- writing layouts: Layout.to_toml / wb.save_layout round trip through load_layout -----------------------------------
def _same(a, b) -> None:
    assert list(a.specs) == list(b.specs)  # same parameters, same (model) order
    for name in a.specs:
        assert b.specs[name] == a.specs[name], name  # keys, shapes, fused dim, origin shape, cuts, mesh
    assert b.dtypes == a.dtypes and b.name == a.name and b.mesh == a.mesh
    assert b.fingerprint() == a.fingerprint()


@pytest.mark.parametrize("path", sorted((ROOT / "sample_meshes").glob("*.toml")), ids=lambda p: p.stem)
def test_every_sample_round_trips_through_save_layout(path: Path, tmp_path: Path) -> None:
    import workbench as wb

    layout = load_layout(path)
    written = wb.save_layout(layout, tmp_path / "out.toml")
    _same(layout, wb.load_layout(written))
    assert written.stat().st_size <= path.stat().st_size  # loops and key templates keep it as small as the sample


def test_toy_is_written_with_loops_and_forward_cuts() -> None:
    text = load_layout(ROOT / "sample_meshes" / "toy_expert_tp.toml").to_toml()
    # the sample says placements ["SS(0,4)", "S(0)", "IS(0,2)"] over (fsdp, ep, tp); FSDP's strided cut applies last
    assert 'mesh_dims = ["ep", "tp", "fsdp"]\nplacements = ["S(0)", "IS(0,2)", "S(0)"]' in text
    assert ('hf_keys = ["model.layers.0.mlp.experts.{experts}.gate_proj.weight", '
            '"model.layers.0.mlp.experts.{experts}.up_proj.weight"]\nkeys_for = { experts = 2 }') in text


def test_layer_major_layout_keeps_its_order_and_stays_small() -> None:
    # what Layout.from_model gives: every parameter of layer 0, then of layer 1, ... (the samples are pattern-major)
    import re

    from workbench.layout.model_layout import Layout

    sample = load_layout(ROOT / "sample_meshes" / "qwen3_30b_a3b.toml")

    def layer(name: str) -> int:
        found = re.search(r"layers\.(\d+)\.", name)
        return int(found.group(1)) if found else -1

    order = sorted(sample.specs, key=layer)
    assert order != list(sample.specs)
    layout = Layout(sample.mesh, {n: sample.specs[n] for n in order}, sample.dtypes, name="layer-major")
    text = layout.to_toml()
    _same(layout, parse_layout(text))
    listed = sum(len(k) + 4 for s in layout.specs.values() for k in s.hf_keys)  # every key written out, quoted
    assert len(text) < listed // 4, (len(text), listed)  # expert keys are written as one template and a loop


def test_odd_layouts_round_trip() -> None:
    from torch.distributed.tensor import Replicate, Shard

    from workbench.layout.load_spec import LoadSpec
    from workbench.layout.model_layout import Layout
    from workbench.mesh import MeshSpec

    mesh = MeshSpec((2, 2, 2), ("dp", "ep", "tp"), ranks=(7, 6, 5, 4, 3, 2, 1, 0))
    specs = [
        # FSDP over a flattened group after an interleave, fp8-style tail padding
        LoadSpec.from_placements("blocks.0.w13", [f"blocks.0.e.{e}.{p}" for e in (0, 1) for p in ("g", "u")], (16, 8),
                                 mesh, [_compat.make_strided_shard(0, 2), Replicate(), InterleavedShard(0, 2)],
                                 fused_dim=0, origin_shape=(16, 6)),
        # keys that follow no loop, braces and quotes in names, a key whose number is not the name's
        LoadSpec.from_placements('odd{x}."q"', ["b.3.x", "a.1.y", "c.7"], (6, 2), mesh,
                                 [Shard(1), Replicate(), Replicate()], fused_dim=0),
        LoadSpec.from_placements("blocks.1.w13", [f"blocks.1.e.{e}.{p}" for e in (0, 1) for p in ("g", "u")], (16, 8),
                                 mesh, [_compat.make_strided_shard(0, 2), Replicate(), InterleavedShard(0, 2)],
                                 fused_dim=0, origin_shape=(16, 6)),
        LoadSpec.from_placements("h.2.bias", ["transformer.h.2.bias"], (5,), mesh, [Replicate()] * 3),
        LoadSpec.from_placements("h.3.bias", ["transformer.h.3.bias"], (5,), mesh, [Replicate()] * 3),
        LoadSpec.from_placements("x.0.y.5", ["x.0.y.5"], (4,), mesh, [Shard(0)], mesh_dims=[("dp", "tp")]),
    ]
    layout = Layout(mesh, {s.name: s for s in specs}, {s.name: "bfloat16" for s in specs}, name='odd "name"')
    text = layout.to_toml()
    _same(layout, parse_layout(text))
    assert 'for = { h = [2, 3] }' in text or 'for = { h = "2:4" }' in text  # the two biases share one table


def test_parts_that_are_not_canonical_numbers_stay_literal() -> None:
    # "01", "00", "07" or a non-ASCII digit are not loop numbers: written as numbers they would read back as "1",
    # "0", "7", "3" and change names, keys and the fingerprint; canonical numbers next to them still share loops
    from torch.distributed.tensor import Replicate

    from workbench.layout.load_spec import LoadSpec
    from workbench.layout.model_layout import Layout
    from workbench.mesh import MeshSpec

    mesh = MeshSpec((2,), ("fsdp",))

    def spec(name: str, keys: list[str]) -> LoadSpec:
        return LoadSpec.from_placements(name, keys, (4 * len(keys), 4), mesh, [Replicate()],
                                        fused_dim=0 if len(keys) > 1 else None)

    specs = [
        *(spec(f"blocks.{i}.attn.w", [f"vision.blocks.{i}.attn.qkv.weight"]) for i in ("00", "01")),
        spec("head.w", ["head.07.weight"]),
        spec("blocks.\u0663.w", ["vision.blocks.\u0663.attn.qkv.weight"]),  # ARABIC-INDIC DIGIT THREE
        *(spec(f"layers.{i}.mlp", [f"model.layers.{i}.mlp.experts.{e}.w" for e in (0, 1, 2, 3)]) for i in range(4)),
        spec("layers.01.mlp", [f"model.layers.01.mlp.experts.{e}.w" for e in ("0", "01", "1", "\u0663")]),
        spec("layers.5.mlp", [f"model.layers.5.mlp.experts.{e}.w" for e in ("0", "1", "07")]),
        spec("x.00.y", ["x.0.y", "x.#.y"]),  # "#" is how key shapes blank numbers: still a literal here
    ]
    layout = Layout(mesh, {s.name: s for s in specs}, {s.name: "float32" for s in specs}, name="leading zeros")
    text = layout.to_toml()
    back = parse_layout(text)
    _same(layout, back)
    assert [k for s in back.specs.values() for k in s.hf_keys] == [k for s in specs for k in s.hf_keys]
    assert 'for = { layers = 4 }' in text and 'keys_for = { experts = 4 }' in text  # 0..3 still loop

def test_a_parameter_without_dtype_reads_back_without_one_and_a_missing_field_is_float32() -> None:
    from workbench.layout.model_layout import Layout

    sample = load_layout(ROOT / "sample_meshes" / "toy_expert_tp.toml")
    bare = Layout(sample.mesh, sample.specs, name="bare")
    back = parse_layout(bare.to_toml())
    assert list(back.specs.items()) == list(bare.specs.items())
    assert back.dtypes == {} and back.fingerprint() == bare.fingerprint()  # written as dtype = "none"
    first = next(iter(sample.specs))
    some = Layout(sample.mesh, sample.specs, {first: "bfloat16"}, name="some")
    assert parse_layout(some.to_toml()).dtypes == {first: "bfloat16"}
    # a hand-written table without the field: sample_meshes/README.md says it defaults to float32
    hand = "[mesh]\nshape = [2]\ndim_names = ['fsdp']\n[[param]]\nname = 'w'\nhf_keys = ['w']\n" \
           "global_shape = [4]\nplacements = ['S(0)']\n"
    assert parse_layout(hand).dtypes == {"w": "float32"}


def test_the_text_of_a_layout_follows_a_dtype_set_in_place() -> None:
    # the text is remembered per layout object, but its dtypes dict can be set in place (the save's fingerprint
    # memo follows such a change): the layout file must describe the layout as it is
    layout = load_layout(ROOT / "sample_meshes" / "toy_expert_tp.toml")
    name = next(iter(layout.specs))
    other = "float16" if layout.dtypes[name] != "float16" else "bfloat16"
    assert parse_layout(layout.to_toml()).dtypes[name] == layout.dtypes[name] != other
    layout.dtypes[name] = other
    assert parse_layout(layout.to_toml()).dtypes[name] == other
    assert layout.to_toml() is layout.to_toml()  # unchanged since: remembered


def test_checkpoint_layout_file(tmp_path: Path) -> None:
    from workbench.layout.layout_file import LAYOUT_FILE_NAME, read_checkpoint_layout, write_checkpoint_layout

    layout = load_layout(ROOT / "sample_meshes" / "toy_expert_tp.toml")
    assert read_checkpoint_layout(tmp_path) is None
    path = write_checkpoint_layout(layout, tmp_path)
    assert path == tmp_path / LAYOUT_FILE_NAME == tmp_path / "workbench_layout.toml"
    assert [p.name for p in tmp_path.iterdir()] == [LAYOUT_FILE_NAME]  # no temporary file left behind
    _same(layout, read_checkpoint_layout(tmp_path))
    path.write_text("[mesh]\n")
    with pytest.raises(LayoutFileError, match=r"workbench_layout\.toml"):
        read_checkpoint_layout(tmp_path)


def test_a_loop_bomb_is_refused_before_it_expands() -> None:
    import time

    bomb = GOOD.replace("for = { layer = 2 }", "for = { layer = 100000, x = 100000 }")
    start = time.perf_counter()
    with pytest.raises(LayoutFileError, match=r"line 7 .*more than 10,000,000 HF keys"):
        parse_layout(bomb, source="tiny.toml")
    assert time.perf_counter() - start < 1.0


def test_an_oversized_checkpoint_layout_file_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from workbench.layout import layout_file

    write = layout_file.write_checkpoint_layout(load_layout(ROOT / "sample_meshes" / "toy_expert_tp.toml"), tmp_path)
    monkeypatch.setattr(layout_file, "MAX_LAYOUT_FILE_BYTES", write.stat().st_size - 1)
    with pytest.raises(LayoutFileError, match="more than a layout file may have"):
        layout_file.read_checkpoint_layout(tmp_path)
