"""The pipeline merge reads each stage's index with the bounded, checked parser (``read_index``): a stage index that
is not what a save writes stops the merge with a CheckpointError naming the stage and the file, before any file is
moved or anything is published (``json.loads`` gave an AttributeError, or moved a file from outside the stage)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.errors import CheckpointError
from workbench.io.files.index import INDEX_NAME
from workbench.io.files.ownership import MARKER_NAME
from workbench.io.files.publish import AtomicRenamePublisher
from workbench.io.pipeline.save import _merge
from workbench.layout.model_layout import Layout
from workbench.layout.pipeline import PipelineLayout
from workbench.mesh import MeshSpec


def _stage(root: Path, body: object) -> Path:
    stage = root / "stage0"  # inside the save's own prepared directory, as save_hf_pipeline makes it
    stage.mkdir()
    (stage / INDEX_NAME).write_text(json.dumps(body))
    return stage


def _one_stage() -> PipelineLayout:
    return PipelineLayout.from_layout(Layout(MeshSpec((1, 1), ("pp", "fsdp")), {}), "pp", lambda name: 0)


@pytest.mark.parametrize(("body", "message"), [
    ({"weight_map": ["model.w"]}, r"corrupt index: 'weight_map' must be an object of key -> file name"),
    ({"weight_map": {"model.w": "../outside.safetensors"}},
     r"file name\(s\) \['\.\./outside\.safetensors'\] are not in its directory"),
])
def test_a_bad_stage_index_stops_the_merge_naming_the_stage(tmp_path: Path, body: object, message: str) -> None:
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"not a stage file")
    publisher = AtomicRenamePublisher(tmp_path / "ckpt")
    stage = _stage(publisher.prepare(), body)
    with pytest.raises(CheckpointError, match=rf"pipeline stage 0's index cannot be merged: .*{INDEX_NAME}.*{message}"):
        _merge([stage], publisher, [], _one_stage())
    assert outside.read_bytes() == b"not a stage file"  # not moved into the checkpoint
    assert not (tmp_path / "ckpt").exists()
    assert sorted(p.name for p in publisher.temporary.iterdir()) == [MARKER_NAME, "stage0"]  # nothing moved
    publisher.abort()  # as save_hf_pipeline does after a failed merge
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside.safetensors"]


@pytest.mark.parametrize("name", [INDEX_NAME, MARKER_NAME, "workbench_layout.toml", "extra.safetensors"])
def test_config_files_may_not_take_the_name_of_a_file_the_save_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    import torch.distributed as dist

    from workbench.io.pipeline.save import _check_arguments

    config = tmp_path / name
    config.write_text("{}")
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)  # the one-rank world of _one_stage's mesh
    with pytest.raises(CheckpointError, match=rf"config file\(s\) \['{tmp_path}/{name}'\] would overwrite"):
        _check_arguments(_one_stage(), [config], {})
    fine = tmp_path / "config.json"
    fine.write_text("{}")
    _check_arguments(_one_stage(), [fine], {})  # a config file of its own name is copied
