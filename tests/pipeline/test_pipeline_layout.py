"""PipelineLayout: stages, stage-local ranks, and the DeepSeek-V3 PP x EP x FSDP sample."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.tensor import Replicate, Shard

from workbench.errors import LayoutError
from workbench.layout.layout_file import load_layout
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.layout.pipeline import PipelineLayout, load_pipeline_layout, stage_rule
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
