"""A pipeline save's stages are never checkpoints of their own: they are written inside the save's own unpublished
directory (``.NAME.incomplete/stageK``). A job polling ``latest_checkpoint`` during the save sees the checkpoint that
was there before, and after the whole job is killed mid-save the old checkpoint is still the newest, and
``clean_incomplete`` removes what the dead save left. (Stages used to be published as ``.NAME.stageK`` beside the
target: complete checkpoints of half the model, ranked above ``NAME``, and never cleaned.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.io.files.index import INDEX_NAME

# stage 0 is small and stage 1 large: stage 0's save ends long before the merge
PARAMS = (
    ("model.embed.weight", (16, 8), 0, 0),
    ("model.layers.0.proj.weight", (8, 12), 1, 0),
    ("model.layers.1.proj.weight", (2048, 1024), 0, 1),
    ("model.norm.weight", (8,), None, 1),
)


def _pipeline():
    from torch.distributed.tensor import Replicate, Shard

    from workbench.layout.pipeline import PipelineLayout

    mesh = wb.MeshSpec((2, 2), ("pp", "fsdp"))
    specs = {key: wb.LoadSpec.from_placements(key, key, shape, mesh, [Replicate(), Replicate() if cut is None
                                                                      else Shard(cut)])
             for key, shape, cut, _ in PARAMS}
    stage_of = {key: stage for key, *_, stage in PARAMS}
    return PipelineLayout.from_layout(wb.Layout(mesh, specs, dict.fromkeys(specs, "float32")), "pp",
                                      stage_of.__getitem__)


def _ranks(root: str) -> None:
    import torch.distributed as dist

    from workbench.io.pipeline.save import save_hf_pipeline

    rank = dist.get_rank()
    (Path(root) / "pids" / str(rank)).write_text(str(os.getpid()))
    pipeline = _pipeline()
    stage, local = pipeline.stage_of_rank(rank)
    state = {key: torch.full(shape, 1.0) if cut is None else torch.full(shape, 1.0).chunk(2, dim=cut)[local].clone()
             for key, shape, cut, s in PARAMS if s == stage}
    save_hf_pipeline(state, Path(root) / "ckpt", pipeline, timeout=60, budget_bytes=1 << 20)


def _old_checkpoint(root: Path) -> None:
    (root / "pids").mkdir()
    wb.save_hf({key: torch.zeros(shape) for key, shape, *_ in PARAMS}, root / "ckpt")


@pytest.mark.slow
def test_a_job_polling_during_a_pipeline_save_sees_only_whole_checkpoints(tmp_path: Path) -> None:
    _old_checkpoint(tmp_path)
    seen, stop = set(), threading.Event()

    def poll() -> None:
        while not stop.is_set():
            scan = wb.latest_checkpoint(tmp_path)
            seen.update(p.name for p in scan.complete)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        wb.launch(_ranks, nprocs=4, args=(str(tmp_path),), timeout=120)
    finally:
        stop.set()
        watcher.join()
    assert seen == {"ckpt"}, seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "pids"]
    from safetensors.torch import load_file

    loaded = {}
    for file in (tmp_path / "ckpt").glob("*.safetensors"):
        loaded.update(load_file(file))
    assert sorted(loaded) == sorted(key for key, *_ in PARAMS)
    assert all(torch.equal(t, torch.ones_like(t)) for t in loaded.values())  # the new save, whole


@pytest.mark.slow
def test_a_job_killed_mid_pipeline_save_leaves_the_old_checkpoint_newest_and_a_stale_save(tmp_path: Path) -> None:
    _old_checkpoint(tmp_path)
    stage0 = tmp_path / ".ckpt.incomplete" / "stage0" / INDEX_NAME

    def preempt() -> None:  # every rank killed once stage 0 is saved, before the merge
        deadline = time.monotonic() + 100
        while not stage0.exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        for pid in (tmp_path / "pids").iterdir():
            os.kill(int(pid.read_text()), signal.SIGKILL)

    killer = threading.Thread(target=preempt, daemon=True)
    killer.start()
    with pytest.raises(Exception):  # noqa: B017 - the launcher reports the killed ranks in its own words
        wb.launch(_ranks, nprocs=4, args=(str(tmp_path),), timeout=120)
    killer.join()
    scan = wb.latest_checkpoint(tmp_path)
    assert scan.path == tmp_path / "ckpt" and [p.name for p in scan.complete] == ["ckpt"]
    assert [(s.path.name, s.live) for s in scan.incomplete] == [(".ckpt.incomplete", False)]
    removed, kept = wb.clean_incomplete(tmp_path)
    assert removed == (tmp_path / ".ckpt.incomplete",) and kept == ()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "pids"]
