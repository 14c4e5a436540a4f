"""A pipeline checkpoint (``save_hf_pipeline``, pp=2 x fsdp=2 on 4 gloo ranks, replicated norms in both stages)
loaded stage by stage, with replica sharing left on (``read_replicas_once``'s default), in one launch.

* A load without the stage's layout is refused before any tensor changes, and its message gives the stage load
  call; that very call then loads every stage bit for bit. The old code read every slice into the model, then
  failed while sharing the replicated norms over a communicator of the stage's 2-rank mesh in the 4-rank world.
  Each replica of a stage reads its replicated norms itself: it receives nothing.
* One rank of one stage failing mid-load (global rank 3, stage 1, place 1 in its stage) fails the load on every
  rank at once (no rank waits for it in a collective), and every message names global rank 3 with its place. The
  old code named the place alone ("rank 1"): a healthy rank of stage 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workbench.run import launch

FAILING = 3  # global rank: stage 1, its place in the stage 1
TIMEOUT = 20.0  # the loads' timeout: a rank left waiting for a peer would take this long
ADVICE = "load_hf(model, path, layout=pipeline.stages[stage], rank=local, allow_unexpected=True)"
# name, global shape, cut dim over fsdp (None: replicated), stage
PARAMS = (
    ("model.embed_tokens.weight", (16, 8), 0, 0),
    ("model.layers.0.input_layernorm.weight", (8,), None, 0),
    ("model.layers.1.proj.weight", (12, 8), 0, 1),
    ("model.layers.1.input_layernorm.weight", (8,), None, 1),
    ("model.norm.weight", (8,), None, 1),
)


def _saved_values() -> dict[str, torch.Tensor]:
    """Every parameter's global value, as saved: distinct per key, exact in bf16."""
    out = {}
    for i, (name, shape, _, _) in enumerate(PARAMS):
        out[name] = (torch.arange(torch.Size(shape).numel()).reshape(shape) + 256 * i).to(torch.bfloat16)
    return out


def _expected_local(stage: int, local: int) -> dict[str, torch.Tensor]:
    """What a rank of ``stage`` at ``local`` in it holds of each of its stage's parameters."""
    values = _saved_values()
    return {name: values[name] if cut is None else values[name].chunk(2, dim=cut)[local]
            for name, _, cut, s in PARAMS if s == stage}


def _ranks(path: str) -> dict:
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import workbench as wb
    from workbench.faults import fault_hook
    from workbench.io.pipeline.save import pipeline_layout_from_model, save_hf_pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "fsdp"))
    stage, local = mesh.get_coordinate()
    cuts = {name: cut for name, _, cut, _ in PARAMS}

    def stage_model(zero: bool) -> dict[str, DTensor]:
        return {name: DTensor.from_local(torch.zeros_like(t) if zero else t.clone(), mesh["fsdp"],
                                         [Replicate() if cuts[name] is None else Shard(cuts[name])], run_check=False)
                for name, t in _expected_local(stage, local).items()}

    def locals_of(model: dict[str, DTensor]) -> dict[str, torch.Tensor]:
        return {name: t.to_local().clone() for name, t in model.items()}

    pipeline = pipeline_layout_from_model(stage_model(False), timeout=30)
    save_hf_pipeline(stage_model(False), path, pipeline, timeout=30)
    place = pipeline.stage_of_rank(dist.get_rank())[1]
    out: dict = {"stage": stage, "local": local, "place": place}

    unstaged = stage_model(True)  # no stage layout: the ranks of both stages look like one model's replicas
    try:
        wb.load_hf(unstaged, path, strict=False, timeout=TIMEOUT)
    except wb.LoadFailed as exc:
        out["refused"] = str(exc)
    out["refused_untouched"] = not any(t.to_local().any() for t in unstaged.values())

    target = stage_model(True)
    report = wb.load_hf(target, path, layout=pipeline.stages[stage], rank=place, allow_unexpected=True,
                        timeout=TIMEOUT)
    out["report"] = (report.ok, report.bytes_received)
    out["loaded"] = locals_of(target)

    def fail_on_rank_3(point: str, rank: int, detail: object) -> None:
        if point == "load.read" and dist.get_rank() == FAILING:
            raise OSError("injected: the disk went away")

    begun = time.perf_counter()
    try:
        with fault_hook(fail_on_rank_3):
            wb.load_hf(stage_model(True), path, layout=pipeline.stages[stage], rank=place, allow_unexpected=True,
                       timeout=TIMEOUT)
    except wb.LoadFailed as exc:
        out["failed"] = (exc.failed_ranks, str(exc))
    out["failed_seconds"] = time.perf_counter() - begun
    return out


@pytest.mark.slow
def test_a_pipeline_checkpoint_loads_stage_by_stage_and_a_failing_rank_is_named_by_its_global_rank(
    tmp_path: Path,
) -> None:
    results = launch(_ranks, nprocs=4, args=(str(tmp_path / "ckpt"),), timeout=150)
    for rank, got in results.items():
        assert (got["stage"], got["local"], got["place"]) == (rank // 2, rank % 2, rank % 2), rank  # pp outermost
        assert ADVICE in got["refused"] and "no tensor was changed" in got["refused"], (rank, got["refused"])
        assert got["refused_untouched"], rank
        assert got["report"] == (True, 0), rank  # every replica read its norms itself: nothing received
        want = _expected_local(got["stage"], got["local"])
        assert got["loaded"].keys() == want.keys(), rank
        for name, value in want.items():
            assert torch.equal(got["loaded"][name], value), (rank, name)
        failed_ranks, message = got["failed"]
        assert failed_ranks == (FAILING,), (rank, message)
        assert "rank 3 failed while reading its slices as rank 1 of its layout's mesh: OSError: injected" in message
        assert got["failed_seconds"] < TIMEOUT / 2, (rank, got["failed_seconds"])  # no peer waited for rank 3
