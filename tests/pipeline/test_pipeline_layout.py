"""PipelineLayout: stages, stage-local ranks, and the DeepSeek-V3 PP x EP x FSDP sample."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.tensor import Replicate, Shard

from workbench.errors import LayoutError, LayoutFileError
from workbench.layout.layout_file import load_layout
from workbench.layout.layout_file import parse_layout as load_layout_text
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.layout.pipeline import (
    PipelineLayout,
    has_pipeline_table,
    load_pipeline_layout,
    parse_pipeline_layout,
    read_checkpoint_pipeline_layout,
    stage_rule,
)
from workbench.mesh import MeshSpec

SAMPLES = Path(__file__).resolve().parents[2] / "sample_meshes"
MESH = MeshSpec((2, 2), ("pp", "fsdp"))


def _layout(names: list[str], placements=None) -> Layout:
    specs = {n: LoadSpec.from_placements(n, [f"hf.{n}"], (4, 2), MESH, placements or [Shard(0)], mesh_dims=["fsdp"])
             for n in names}
    return Layout(MESH, specs)


def test_stages_hold_their_parameters_on_stage_local_ranks() -> None:
    rule = stage_rule(["0:1", "1:2"], first_stage=[r"embed\.weight"], last_stage=[r"head\.weight"])
    pipeline = PipelineLayout.from_layout(_layout(["embed.weight", "layers.0.w", "layers.1.w", "head.weight"]), "pp",
                                          rule)
    assert [list(s.specs) for s in pipeline.stages] == [["embed.weight", "layers.0.w"], ["layers.1.w", "head.weight"]]
    # (pp, fsdp) row-major: stage 1 is global ranks 2, 3 = stage-local 0, 1
    assert pipeline.stage_ranks(1) == (2, 3) and pipeline.stage_of_rank(3) == (1, 1)
    assert pipeline.stage_mesh == MeshSpec((2,), ("fsdp",))
    spec = pipeline.layout_of_rank(3)["head.weight"]
    assert spec.runs(1)[0].global_offset == (2, 0)  # stage-local rank 1 holds the second half
    assert pipeline.hf_keys["hf.layers.1.w"] == (1, "layers.1.w") and pipeline.coverage_ok()


def test_pipeline_errors_name_the_parameter() -> None:
    with pytest.raises(LayoutError, match=r"'other\.weight' is in no stage"):
        PipelineLayout.from_layout(_layout(["layers.0.w", "other.weight"]), "pp", stage_rule(["0:1", "1:2"]))
    with pytest.raises(LayoutError, match=r"'layers\.5\.w': layer 5 is in no stage"):
        PipelineLayout.from_layout(_layout(["layers.5.w"]), "pp", stage_rule(["0:1", "1:2"]))
    cut_over_pp = Layout(MESH, {"w": LoadSpec.from_placements("w", ["w"], (4, 2), MESH, [Shard(0), Replicate()])})
    with pytest.raises(LayoutError, match=r"'w': cut over the pipeline mesh dim 'pp'"):
        PipelineLayout.from_layout(cut_over_pp, "pp", lambda name: 0)
    stage_mesh = MeshSpec((2,), ("fsdp",))
    same_key = [Layout(stage_mesh, {n: LoadSpec(name=n, hf_keys=["k"], global_shape=(2,), mesh=stage_mesh)})
                for n in ("a", "b")]
    with pytest.raises(LayoutError, match=r"HF key 'k' is held by stage 0 \('a'\) and stage 1 \('b'\)"):
        PipelineLayout(MESH, "pp", tuple(same_key))


def test_deepseek_v3_pp_sample_covers_every_key_once() -> None:
    pipeline = load_pipeline_layout(SAMPLES / "deepseek_v3_pp.toml")
    flat = load_layout(SAMPLES / "deepseek_v3_671b.toml")
    assert pipeline.mesh == MeshSpec((4, 4, 64), ("pp", "dp", "ep"))
    assert set(pipeline.hf_keys) == set(flat.hf_keys)  # the same checkpoint, split in 4 stages
    assert [s for s, _ in (pipeline.hf_keys[k] for k in ("model.embed_tokens.weight", "lm_head.weight",
                                                           "model.layers.61.shared_head.head.weight"))] == [0, 3, 3]
    experts = pipeline.stages[1]["model.layers.20.mlp.experts.fused_w1w3"]
    assert experts.describe_shards() == "S(0)@ep -> S(0)@dp"
    # stage-local rank 5 = (dp=0, ep=5): experts 20-23 of the EP rank, dp quarter 0 = expert 20's gate and up
    assert [r.hf_key for r in experts.key_regions(5)] == ["model.layers.20.mlp.experts.20.gate_proj.weight",
                                                         "model.layers.20.mlp.experts.20.up_proj.weight"]


def test_to_toml_reads_back_into_the_same_pipeline() -> None:
    # the DeepSeek-V3 sample (its stages from a layer rule) written with every stage's parameters named
    pipeline = load_pipeline_layout(SAMPLES / "deepseek_v3_pp.toml")
    text = pipeline.to_toml()
    assert parse_pipeline_layout(text) == pipeline
    assert "stage_params" in text and "stage_layers" not in text
    flat = load_layout_text(text)  # as one mesh: the whole model, each parameter replicated over pp
    assert flat.mesh == pipeline.mesh and set(flat.hf_keys) == set(pipeline.hf_keys)
    spec = flat["model.layers.20.mlp.experts.fused_w1w3"]
    assert spec.describe_shards() == "S(0)@ep -> S(0)@dp"
    assert spec.key_regions(5) == spec.key_regions(256 + 5) == spec.key_regions(768 + 5)  # as if every stage held it


def _listed(stage_params: str) -> str:
    return ('name = "toy"\n[mesh]\nshape = [2, 2]\ndim_names = ["pp", "fsdp"]\n'
            '[[param]]\nname = "a"\nhf_keys = ["a"]\nglobal_shape = [4]\nmesh_dims = ["fsdp"]\nplacements = ["S(0)"]\n'
            '[[param]]\nname = "b"\nhf_keys = ["b"]\nglobal_shape = [4]\nmesh_dims = ["fsdp"]\nplacements = ["R"]\n'
            f'[pipeline]\nmesh_dim = "pp"\n{stage_params}\n')


def test_stage_params_name_every_parameter_once() -> None:
    pipeline = parse_pipeline_layout(_listed('stage_params = [["b"], ["a"]]'))
    assert [list(s.specs) for s in pipeline.stages] == [["b"], ["a"]] and pipeline.stage_ranks(1) == (2, 3)
    for table, message in [
        ('stage_params = [["a"], ["a", "b"]]', r"parameter 'a' is in stage 0 and stage 1"),
        ('stage_params = [["a"], []]', r"parameter\(s\) \['b'\] \(1 in all\) are in no stage"),
        ('stage_params = [["a"], ["b", "c"]]', r"stage 1 lists 'c', which is not a parameter of the file"),
        ('stage_params = [["a", "b"]]', r"stage_params lists 1 stages, mesh dim 'pp' has 2"),
        ('stage_params = ["a", "b"]', r"a list of lists of parameter names"),
        ('stage_params = [["a"], ["b"]]\nstage_layers = ["0:1", "1:2"]', r"stage_layers \(and its rule\) or "
         r"stage_params, not both"),
    ]:
        with pytest.raises(LayoutFileError, match=message):
            parse_pipeline_layout(_listed(table), source="toy.toml")


@pytest.mark.parametrize("header, table", [
    ("[pipeline]", 'stage_params = [\n  ["b"],\n  ["a"],\n]'),  # a stage a line: the old reader saw "[" headers
    ("[pipeline]  # the stages", 'stage_params = [["b"], ["a"]]'),  # the old checkpoint reader took it for flat
    ("[ pipeline ]", 'stage_params = [["b"],\n ["a"]]'),
    ("[pipeline]", 'first_stage = ["b"]\nlast_stage = ["a"]\nstage_layers = [\n  [],\n  [],\n]'),  # lists over lines
])
def test_a_pipeline_table_is_read_as_toml_whatever_its_text(tmp_path: Path, header: str, table: str) -> None:
    text = _listed(table).replace("[pipeline]", header)
    pipeline = parse_pipeline_layout(text, source="toy.toml")
    assert [list(s.specs) for s in pipeline.stages] == [["b"], ["a"]]
    assert has_pipeline_table(text)
    (tmp_path / "workbench_layout.toml").write_text(text)
    assert read_checkpoint_pipeline_layout(tmp_path) == pipeline


def test_a_pipeline_word_in_a_comment_or_string_leaves_a_layout_flat(tmp_path: Path) -> None:
    text = _listed("").split("[pipeline]")[0].replace('name = "toy"', 'name = "[pipeline]"\n# [pipeline]')
    assert not has_pipeline_table(text) and load_layout_text(text).name == "[pipeline]"
    (tmp_path / "workbench_layout.toml").write_text(text)
    assert read_checkpoint_pipeline_layout(tmp_path) is None


def test_a_mesh_of_the_pipeline_dim_alone_gives_one_rank_stages() -> None:
    mesh = MeshSpec((3,), ("pp",))
    specs = {n: LoadSpec.from_placements(n, n, (4, 2), mesh, [Replicate()]) for n in "abc"}
    pipeline = PipelineLayout.from_layout(Layout(mesh, specs, dict.fromkeys("abc", "bfloat16")), "pp", "abc".index)
    assert pipeline.stage_mesh == MeshSpec((1,), ("world",))
    assert [list(s.specs) for s in pipeline.stages] == [["a"], ["b"], ["c"]]
    assert [pipeline.stage_ranks(s) for s in range(3)] == [(0,), (1,), (2,)]
    assert pipeline.stage_of_rank(2) == (2, 0)
    assert pipeline.stages[1]["b"].key_regions(0) == specs["b"].key_regions(0)  # held whole
    assert parse_pipeline_layout(pipeline.to_toml()) == pipeline


def test_the_cli_reads_a_pipeline_file_whose_lists_span_lines(tmp_path: Path, capsys) -> None:
    import torch

    import workbench as wb
    from workbench.cli import main

    wb.save_hf({"a": torch.arange(4.0), "b": torch.ones(4)}, tmp_path / "ckpt")
    layout = tmp_path / "toy.toml"
    layout.write_text(_listed('stage_params = [\n  ["b"],\n  ["a"],\n]'))
    assert main(["diff", str(tmp_path / "ckpt"), str(tmp_path / "ckpt"), "--layout", str(layout)]) == 0, (
        capsys.readouterr())


def test_a_key_map_passed_by_position_is_named_not_a_type_error_deep_inside() -> None:
    from workbench.io.pipeline.save import pipeline_layout_from_model

    with pytest.raises(LayoutError, match=r"pp_dim must be the pipeline's mesh dim name, got <function .*key_map="):
        pipeline_layout_from_model({}, lambda name: name)
