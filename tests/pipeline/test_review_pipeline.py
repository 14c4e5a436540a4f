"""Pipeline saves at their edges: a stage that holds no parameter, on a pure pipeline (2 gloo ranks) and on a
pipeline of DTensors (pp=2 x fsdp=2, 4 gloo ranks). Expected values are built by hand and read back with
safetensors' ``load_file``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from workbench.run import launch


def _value_a() -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32).reshape(4, 2) / 4 + 1


def _read_back(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's weight files, by safetensors itself."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _pure_pipeline_with_an_empty_stage(root: str) -> dict:
    """Rank 0 (stage 0) holds ``a``; rank 1 (stage 1) holds nothing. Saves, then stage 0 loads it back."""
    import torch.distributed as dist

    import workbench as wb
    from workbench.io.pipeline.save import pipeline_layout_from_model, save_hf_pipeline

    rank = dist.get_rank()
    model = {"a": _value_a()} if rank == 0 else {}
    pipeline = pipeline_layout_from_model(model, timeout=20)
    out: dict = {"params": [len(s) for s in pipeline.stages]}
    try:
        save_hf_pipeline(model, Path(root) / "empty-last", pipeline, timeout=10)
    except wb.SaveFailed as exc:
        out["error"] = str(exc)
        return out
    target = {name: torch.zeros_like(t) for name, t in model.items()}
    stage, place = pipeline.stage_of_rank(rank)
    wb.load_hf(target, Path(root) / "empty-last", layout=pipeline.stages[stage], rank=place, allow_unexpected=True,
               timeout=10)
    out["loaded"] = target
    return out


@pytest.mark.slow
def test_a_stage_with_no_parameters_saves_and_the_checkpoint_publishes(tmp_path: Path) -> None:
    # the old code wrote every stage's files, then failed in the merge reading the empty stage's layout file
    # ("needs at least one [[param]] table", of a file in the save's temporary directory) and published nothing
    results = launch(_pure_pipeline_with_an_empty_stage, nprocs=2, args=(str(tmp_path),), timeout=120)
    for rank, got in results.items():
        assert got["params"] == [1, 0], rank
        assert "error" not in got, (rank, got.get("error"))
    got = _read_back(tmp_path / "empty-last")
    assert got.keys() == {"a"} and torch.equal(got["a"], _value_a())
    assert torch.equal(results[0]["loaded"]["a"], _value_a()) and results[1]["loaded"] == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty-last"]  # no stage directory left beside it
