"""A pipeline checkpoint carries the layout of the whole pipeline (``workbench_layout.toml``): 4 gloo ranks
(pp=2 x fsdp=2, the setup of ``test_pipeline_faults``) save with ``save_hf_pipeline``; the published folder holds
every stage's layout, with the dtypes the stages wrote, and a ``[pipeline]`` table naming each stage's parameters.
It reads back into the same ``PipelineLayout`` and checks the checkpoint's keys, shapes and dtypes (``diagnose``
against it). The old code moved only the indexed files at the merge: the folder had no layout file."""

from __future__ import annotations

from pathlib import Path

import pytest

import workbench as wb
from tests.pipeline.test_pipeline_faults import PARAMS, _local_state, _pipeline, new_values
from workbench.layout.layout_file import LAYOUT_FILE_NAME, load_layout
from workbench.layout.pipeline import read_checkpoint_pipeline_layout
from workbench.run import launch


def _save(root: str) -> int:
    import torch.distributed as dist

    from workbench.io.pipeline_save import save_hf_pipeline

    pipeline = _pipeline()
    stage, local = pipeline.stage_of_rank(dist.get_rank())
    save_hf_pipeline(_local_state(stage, local), Path(root) / "good", pipeline, max_shard_bytes=256, timeout=30)
    return stage


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pipeline-layout")
    stages = launch(_save, nprocs=4, args=(str(root),), timeout=120)
    assert sorted(stages.values()) == [0, 0, 1, 1]
    return root / "good"


@pytest.mark.slow
def test_the_checkpoint_carries_the_pipeline_it_was_saved_with(saved: Path) -> None:
    carried = read_checkpoint_pipeline_layout(saved)
    want = _pipeline()
    assert carried is not None and carried.mesh == want.mesh and carried.pp_dim == "pp"
    assert [list(s.specs) for s in carried.stages] == [[k for k, *_, s in PARAMS if s == stage] for stage in (0, 1)]
    for got, expected in zip(carried.stages, want.stages):
        assert got.specs == expected.specs  # the same cuts on the stage mesh
        assert got.dtypes == {k: str(d).removeprefix("torch.") for k, _, d, *_ in PARAMS if k in got.specs}
    assert carried.stage_ranks(1) == (2, 3)
    # read as one mesh it is the whole model: every key of the checkpoint with its shape and dtype
    flat = load_layout(saved / LAYOUT_FILE_NAME)
    assert set(flat.hf_keys) == set(new_values())
    assert wb.diagnose(saved, str(saved / LAYOUT_FILE_NAME)).ok
