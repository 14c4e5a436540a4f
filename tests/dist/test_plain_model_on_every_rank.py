"""A model of plain tensors that every rank holds whole (DDP, or a model each rank builds alike) saves and loads
from every rank of a world of several: its layout is replicated over the world. Both were refused ("the world has 2
ranks but the layout's mesh MeshSpec(world=1) has 1"; a load named pipeline stages)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _save_and_load(root: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_model())  # names under "module.": the checkpoint has the model's own
    result = wb.save_hf(ddp, Path(root) / "ckpt", timeout=30)
    target = _model()
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    report = wb.load_hf(target, Path(root) / "ckpt", timeout=30)
    want = _model().state_dict()
    return {"files": result.files, "ok": report.ok,
            "equal": all(torch.equal(target.state_dict()[k], v) for k, v in want.items())}


@pytest.mark.slow
def test_a_ddp_model_saves_and_loads_from_every_rank(tmp_path: Path) -> None:
    results = wb.launch(_save_and_load, nprocs=2, args=(str(tmp_path),), timeout=120)
    assert all(r["ok"] and r["equal"] for r in results.values()), results
    assert {f for r in results.values() for f in r["files"]} == {  # both ranks write: the writers are spread
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    saved = {k: v for f in (tmp_path / "ckpt").glob("*.safetensors") for k, v in load_file(f).items()}
    want = _model().state_dict()
    assert saved.keys() == want.keys()
    assert all(torch.equal(saved[k], v) for k, v in want.items())
