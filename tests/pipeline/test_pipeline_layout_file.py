"""A pipeline checkpoint carries the layout of the whole pipeline (``workbench_layout.toml``): 4 gloo ranks
(pp=2 x fsdp=2, the setup of ``test_pipeline_faults``) save with ``save_hf_pipeline``; the published folder holds
every stage's layout, with the dtypes the stages wrote, and a ``[pipeline]`` table naming each stage's parameters.
It reads back into the same ``PipelineLayout``, checks the checkpoint's keys, shapes and dtypes (``diagnose``
against it), and names the global rank and pipeline stage that wrote a region that differs. The old code moved
only the indexed files at the merge: the folder had no layout file; read as one mesh, the layout would name a
rank of each stage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import workbench as wb
from tests.pipeline.test_pipeline_faults import PARAMS, _local_state, _pipeline, new_values
from workbench.layout.layout_file import LAYOUT_FILE_NAME, load_layout
from workbench.layout.pipeline import read_checkpoint_pipeline_layout
from workbench.run import launch

KEY = "model.layers.1.proj.weight"  # (12, 8) bfloat16, stage 1, Shard(0) over fsdp: rows 6:12 from global rank 3


def _save(root: str) -> int:
    import torch.distributed as dist

    from workbench.io.pipeline.save import save_hf_pipeline

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


def _with_rows_changed(good: Path, bad: Path, key: str, rows: slice) -> None:
    """A copy of ``good`` (its layout file too) whose ``key`` differs in ``rows`` only."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shutil.copytree(good, bad)
    name = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][key]
    with safe_open(str(bad / name), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(bad / name))
    tensors[key][rows] += 1
    save_file(tensors, str(bad / name), metadata=metadata)


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
    report = wb.diagnose(saved, str(saved / LAYOUT_FILE_NAME))
    assert report.ok, report
    # the stages' fingerprints are the carried pipeline's, not "saved from layout [...], this layout is ..."
    assert report.stats["layout_fingerprint"] == "same as the layout (saved stage by stage: one per pipeline stage)"
    # each stage's files carry its own layout's fingerprint: those of the carried stages, not different checkpoints
    inspection = wb.inspect_checkpoint(saved)
    assert sorted(inspection.layout_fingerprints) == sorted(s.fingerprint() for s in carried.stages)
    assert inspection.ok and inspection.exit_status == 0, inspection.to_text()


@pytest.mark.slow
def test_diagnose_names_the_global_rank_that_wrote_a_differing_region(saved: Path, tmp_path: Path, capsys) -> None:
    from workbench.cli import main

    bad = tmp_path / "bad"
    _with_rows_changed(saved, bad, KEY, slice(6, 12))
    written = f"rows 6:12 of {KEY} were written from rank 3 (pp=1, fsdp=1)"  # one mesh: 'ranks 1, 3 (fsdp=1; ...)'
    [finding] = wb.diagnose(bad, saved).by_key(KEY)  # the layout bad carries
    assert finding.evidence["differing_ranks"] == [3] and written in finding.evidence["written_from"], finding
    (bad / LAYOUT_FILE_NAME).unlink()  # given instead: the pipeline, or the folder that carries it
    for layout in (read_checkpoint_pipeline_layout(saved), None):  # None: the layout the reference carries
        [finding] = wb.diff_checkpoints(saved, bad, layout=layout).by_key(KEY)
        assert written in finding.evidence["written_from"], finding
    capsys.readouterr()
    assert main(["diff", str(saved), str(bad), "--layout", str(saved)]) == 1
    assert written in capsys.readouterr().out
