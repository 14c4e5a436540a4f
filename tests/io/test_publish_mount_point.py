"""A save to a mount point (a volume: SageMaker's /opt/ml/model, a k8s volume) is refused before any data is written.

It used to write the whole checkpoint into ``.NAME.incomplete`` beside the path, on the parent's filesystem, and only
then fail: no directory can be renamed over a mount point (EBUSY) or across filesystems (EXDEV).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from workbench.errors import CheckpointError
from workbench.faults import fault_hook
from workbench.io.files import publish
from workbench.io.files.publish import AtomicRenamePublisher


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[Path]:
    """An empty tmpfs mounted at ``tmp_path / "volume"`` (skipped where this process cannot mount one)."""
    mount_point = tmp_path / "volume"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)],
                          capture_output=True, check=False)
    if done.returncode != 0 or not os.path.ismount(mount_point):
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_a_save_to_a_mount_point_is_refused_before_any_data_is_written(volume: Path) -> None:
    written: list[str] = []

    def record(point: str, rank: int, detail: object) -> None:
        if point in ("write", "rename"):
            written.append(point)

    with fault_hook(record), pytest.raises(wb.SaveFailed) as failed:
        wb.save_hf({"w": torch.ones(4)}, volume)
    message = str(failed.value)
    assert "planning the save" in message and f"cannot save to {volume}: it is a mount point" in message
    assert f"save to a subdirectory of it instead (e.g. {volume / 'checkpoint'})" in message
    assert written == [] and os.listdir(volume) == []
    assert sorted(p.name for p in volume.parent.iterdir()) == ["volume"]  # no .volume.incomplete beside it
    wb.save_hf({"w": torch.ones(4)}, volume / "checkpoint")  # what the message suggests works
    assert load_file(volume / "checkpoint" / "model-00001-of-00001.safetensors")["w"].tolist() == [1.0] * 4


def test_a_symbolic_link_to_a_mount_point_is_replaced_as_before(volume: Path) -> None:
    # the link itself lies on the parent's filesystem: the publish replaces the link, never the volume
    link = volume.parent / "latest"
    link.symlink_to(volume)
    wb.save_hf({"w": torch.ones(4)}, link)
    assert not link.is_symlink() and load_file(link / "model-00001-of-00001.safetensors")["w"].tolist() == [1.0] * 4
    assert os.path.ismount(volume) and os.listdir(volume) == []


def test_a_directory_on_another_filesystem_is_refused_by_prepare(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    final = tmp_path / "ckpt"
    final.mkdir()
    monkeypatch.setattr(publish, "_devices", lambda path: (41, 42))  # as st_dev reads for a bind of another disk
    with pytest.raises(CheckpointError, match=r"ckpt: it is on another filesystem than its parent directory; .*"
                                              r"save to a subdirectory of it instead"):
        AtomicRenamePublisher(final).prepare()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary made


def test_a_directory_on_the_parents_filesystem_is_prepared(tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    final.mkdir()
    assert AtomicRenamePublisher(final).prepare() == tmp_path / ".ckpt.incomplete"


def test_a_link_to_a_checkpoint_is_replaced_whatever_device_the_link_reports(tmp_path, monkeypatch) -> None:
    # on an overlay whose layers are other filesystems, a link reports its lower layer's device and its folder the
    # overlay's: only the link is renamed, which crosses nothing
    target = tmp_path / "step-1"
    target.mkdir()
    (tmp_path / "latest").symlink_to(target)
    monkeypatch.setattr(publish, "_devices", lambda final: (41, 42))
    assert publish._elsewhere(tmp_path / "latest") is None
    assert publish._elsewhere(target) is not None  # a real directory on "another device" is still refused
