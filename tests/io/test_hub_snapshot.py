"""``wb.load_hf`` reads a Hugging Face hub cache snapshot (``REPO/snapshots/REV``, what ``snapshot_download``
returns), whose files are links to ``REPO/blobs/HASH``: it refused every one as "a symbolic link pointing outside the
checkpoint folder". A link out of a snapshot elsewhere than its blobs is still refused, unopened."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench.errors import CheckpointError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def _snapshot(repo: Path, files: dict[str, bytes | dict[str, torch.Tensor]]) -> Path:
    """A hub cache repo: each file in ``blobs`` under a hash-like name, linked from ``snapshots/rev`` by its name."""
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for n, (name, content) in enumerate(files.items()):
        blob = blobs / f"{n:040x}"
        if isinstance(content, bytes):
            blob.write_bytes(content)
        else:
            save_file(content, str(blob))
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    return snapshot


def _zeroed() -> torch.nn.Module:
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def test_an_indexed_and_a_single_file_snapshot_load_bit_for_bit(tmp_path: Path) -> None:
    want = _model().state_dict()
    first = {k: v for k, v in want.items() if k.startswith("0.")}
    second = {k: v for k, v in want.items() if k.startswith("1.")}
    index = {"metadata": {}, "weight_map": {**{k: "model-00001-of-00002.safetensors" for k in first},
                                            **{k: "model-00002-of-00002.safetensors" for k in second}}}
    indexed = _snapshot(tmp_path / "models--org--two", {"model-00001-of-00002.safetensors": first,
                                                        "model-00002-of-00002.safetensors": second,
                                                        "model.safetensors.index.json": json.dumps(index).encode()})
    single = _snapshot(tmp_path / "models--org--one", {"model.safetensors": dict(want)})
    for snapshot in (indexed, single):
        model = _zeroed()
        assert wb.load_hf(model, snapshot).ok
        on_disk = {k: v for f in snapshot.glob("*.safetensors") for k, v in load_file(f).items()}
        assert on_disk.keys() == want.keys()
        assert all(torch.equal(model.state_dict()[k], on_disk[k]) for k in want)


def test_a_link_out_of_a_snapshot_elsewhere_than_its_blobs_is_refused_unopened(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path / "models--org--one", {"model.safetensors": dict(_model().state_dict())})
    link = snapshot / "model.safetensors"
    elsewhere = tmp_path / "elsewhere.safetensors"
    link.resolve().rename(elsewhere)
    link.unlink()
    link.symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match=r"symbolic link pointing outside the checkpoint folder.*refused"):
        wb.load_hf(_zeroed(), snapshot)
