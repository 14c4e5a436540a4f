"""A pipeline checkpoint loaded stage by stage, as ``load_hf``'s message says: 4 gloo ranks (pp=2 x fsdp=2), DTensors
on each stage's fsdp mesh, replicated norms. Each stage loads with its own layout, ``rank=`` its place in the
stage and ``allow_unexpected=True`` (the other stage's keys), and gets back exactly what it saved. The old code read
every slice into the model, then failed while sharing the replicated norms over a communicator of the stage's mesh in
the 4-rank world ("the model's values must not be used"). A stage layout given without ``rank=`` is refused before
any tensor changes, saying what to pass. Pure pipeline parallelism (plain tensors, a mesh of the pipeline dim alone)
saves and loads each rank as a stage.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workbench.run import launch

# name, global shape, cut dim over fsdp (None: replicated), stage
PARAMS = (
    ("model.embed_tokens.weight", (16, 8), 0, 0),
    ("model.layers.0.proj.weight", (8, 12), 1, 0),
    ("model.layers.0.input_layernorm.weight", (8,), None, 0),
    ("model.layers.1.proj.weight", (12, 8), 0, 1),
    ("model.layers.1.input_layernorm.weight", (8,), None, 1),
    ("model.norm.weight", (8,), None, 1),
)


def _values() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen).to(torch.bfloat16) for name, shape, _, _ in PARAMS}


def _ranks(path: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import workbench as wb
    from workbench.io.pipeline.save import pipeline_layout_from_model, save_hf_pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "fsdp"))
    stage, local = mesh.get_coordinate()
    values = _values()

    def stage_model(zero: bool) -> dict[str, DTensor]:
        out = {}
        for name, _, cut, s in PARAMS:
            if s == stage:
                mine = values[name] if cut is None else values[name].chunk(2, dim=cut)[local].clone()
                out[name] = DTensor.from_local(torch.zeros_like(mine) if zero else mine, mesh["fsdp"],
                                               [Replicate() if cut is None else Shard(cut)], run_check=False)
        return out

    pipeline = pipeline_layout_from_model(stage_model(False), timeout=30)
    save_hf_pipeline(stage_model(False), path, pipeline, timeout=30)
    result: dict = {"rank": dist.get_rank(), "stage": stage}
    # without rank=: refused before anything is read, saying what to pass
    target = stage_model(True)
    try:
        wb.load_hf(target, path, layout=pipeline.stages[stage], strict=False, timeout=20)
    except Exception as exc:
        result["no_rank"] = str(exc)
    result["untouched"] = not any(t.to_local().any() for t in target.values())
    # as the message says: each stage with its own layout and its place in the stage
    target = stage_model(True)
    place = pipeline.stage_of_rank(dist.get_rank())[1]
    report = wb.load_hf(target, path, layout=pipeline.stages[stage], rank=place, allow_unexpected=True, timeout=20)
    result["report"] = (report.ok, sorted(report.unexpected))
    result["loaded"] = {name: t.to_local().clone() for name, t in target.items()}
    result["local"] = local
    return result


@pytest.mark.slow
def test_a_pipeline_stage_loads_with_its_own_layout_and_its_place_in_the_stage(tmp_path: Path) -> None:
    results = launch(_ranks, nprocs=4, args=(str(tmp_path / "ckpt"),), timeout=150)
    values = _values()
    cuts = {name: cut for name, _, cut, _ in PARAMS}
    for rank, got in results.items():
        others = sorted(name for name, _, _, s in PARAMS if s != got["stage"])
        assert got["report"] == (True, others), rank  # only the other stage's keys are left out, as allowed
        want = {name: values[name] if cuts[name] is None else values[name].chunk(2, dim=cuts[name])[got["local"]]
                for name, _, _, s in PARAMS if s == got["stage"]}
        assert got["loaded"].keys() == want.keys(), rank
        assert all(torch.equal(got["loaded"][n], want[n]) for n in want), rank
        assert got["untouched"], rank
        # ranks 2 and 3 are outside the stage mesh of 2 ranks; ranks 0 and 1 hear of it from them
        assert "pipeline.stage_of_rank(rank)[1]" in got["no_rank"], (rank, got["no_rank"])
        assert "no tensor was changed" in got["no_rank"] or rank >= 2, (rank, got["no_rank"])


def _pure_pipeline(path: str) -> dict:
    import torch.distributed as dist

    import workbench as wb
    from workbench.io.pipeline.save import pipeline_layout_from_model, save_hf_pipeline

    rank = dist.get_rank()
    values = _values()
    mine = {name: values[name].clone() for name, _, _, s in PARAMS if s == rank}
    pipeline = pipeline_layout_from_model(mine, timeout=30)  # plain tensors in a world of 2: rank r is stage r
    save_hf_pipeline(mine, path, pipeline, timeout=30)
    target = {name: torch.zeros_like(t) for name, t in mine.items()}
    stage, place = pipeline.stage_of_rank(rank)
    assert wb.load_hf(target, path, layout=pipeline.stages[stage], rank=place, allow_unexpected=True, timeout=20).ok
    return {"stage": stage, "mesh": repr(pipeline.mesh), "equal": all(torch.equal(target[n], mine[n]) for n in mine)}


@pytest.mark.slow
def test_pure_pipeline_parallelism_saves_and_loads_each_rank_as_a_stage(tmp_path: Path) -> None:
    from workbench.io.files.read import CheckpointReader

    results = launch(_pure_pipeline, nprocs=2, args=(str(tmp_path / "ckpt"),), timeout=120)
    assert {r: (got["stage"], got["mesh"], got["equal"]) for r, got in results.items()} == {
        0: (0, "MeshSpec(pp=2)", True), 1: (1, "MeshSpec(pp=2)", True)}
    with CheckpointReader(tmp_path / "ckpt") as reader:  # every parameter once, as it was
        assert sorted(reader.keys()) == sorted(_values())
        assert all(torch.equal(reader.read(k), v) for k, v in _values().items())


def _stages_with_other_dtypes(path: str) -> str:
    """Stage 0 saves in bf16, stage 1 as it holds its tensors (fp32)."""
    import torch.distributed as dist

    import workbench as wb
    from workbench.io.pipeline.save import pipeline_layout_from_model, save_hf_pipeline

    rank = dist.get_rank()
    mine = {name: _values()[name].clone() for name, _, _, s in PARAMS if s == rank}
    pipeline = pipeline_layout_from_model(mine, timeout=30)
    try:
        save_hf_pipeline(mine, path, pipeline, timeout=30, dtype=torch.bfloat16 if rank == 0 else None)
    except wb.SaveFailed as exc:
        return str(exc)
    return "published"


@pytest.mark.slow
def test_stages_that_pass_other_arguments_publish_nothing(tmp_path: Path) -> None:
    # each stage's save agreed within its stage only: the checkpoint came out half bf16, half fp32, silently
    results = launch(_stages_with_other_dtypes, nprocs=2, args=(str(tmp_path / "ckpt"),), timeout=120)
    for message in results.values():
        assert message.endswith("refused before anything was written: the ranks passed different arguments: dtype "
                                "(bfloat16 on rank(s) 0, None on rank(s) 1); every rank must pass the same"), message
    assert list(tmp_path.iterdir()) == []
