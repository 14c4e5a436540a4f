"""Ranks that parse one checkpoint path while another save publishes there (a reviewer's repro): on the GPU's load
path each rank opens the files it parsed before the first agreement, and each checked only its own files, so rank
0 loaded checkpoint A and rank 1 checkpoint B with no error. The ranks compare what they parsed at that agreement
now, and fail together."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import workbench as wb
from workbench.io.hf.load import ParsedCheckpoint, _check_same_checkpoint
from workbench.run.guard import LoadFailed

_A = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)


def _load_while_republished(root: str) -> str:
    """Rank 0 parses checkpoint A and opens its files (the CPU seam takes the GPU's path); then rank 1 publishes
    checkpoint B at the same path and loads it."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from workbench.io.files.staging import StagingRing
    from workbench.io.hf import load as load_module

    load_module._CPU_LANDING_RING = StagingRing(2, 3 * 4096, pinned=False)
    rank, base = dist.get_rank(), Path(root)
    mesh = wb.MeshSpec((2,), ("fsdp",))
    layout = wb.Layout(mesh, {"w": wb.LoadSpec.from_placements("w", "w", (64, 32), mesh, [Shard(0)])})
    local = {"w": torch.zeros(32, 32)}
    wb.load_hf(local, base / "warm", layout=layout, timeout=60)  # the load's groups made on both ranks
    if rank == 0:
        open_files = load_module.BoxReader

        def opened_then_signal(*args: object, **kwargs: object) -> object:
            # the signal once rank 0 holds its files open: a rename before that is rank 0's own CheckpointError
            # (tests/io/test_load_changed_files.py), which a loaded host reached first here
            boxes = open_files(*args, **kwargs)
            (base / "parsed").touch()
            return boxes

        load_module.BoxReader = opened_then_signal
    else:
        deadline = time.monotonic() + 60
        while not (base / "parsed").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.rename(base / "ckpt", base / "ckpt_old")  # another job publishes checkpoint B at the same path
        os.rename(base / "ckpt_new", base / "ckpt")
    try:
        wb.load_hf(local, base / "ckpt", layout=layout, timeout=60)
    except LoadFailed as exc:
        return f"LoadFailed: {exc}"
    return "loaded " + ("A" if torch.equal(local["w"], _A[32 * rank:32 * (rank + 1)]) else "B")


@pytest.mark.slow
def test_ranks_that_parsed_two_checkpoints_at_one_path_fail_together(tmp_path: Path) -> None:
    for name, values in (("ckpt", _A), ("ckpt_new", -_A), ("warm", torch.zeros(64, 32))):
        (tmp_path / name).mkdir()
        save_file({"w": values}, str(tmp_path / name / "model.safetensors"))
    results = wb.launch(_load_while_republished, nprocs=2, backend="gloo", args=(str(tmp_path),), timeout=120)
    for rank, text in results.items():
        assert text.startswith("LoadFailed"), (rank, text)
        assert f"ranks 0 and 1 read different checkpoints at {tmp_path / 'ckpt'}" in text, text
        assert "it was replaced during the load" in text, text


def _parsed(host: str = "h1:[1]", files: str = "f", inodes: str = "i", directory: str = "/ckpt") -> ParsedCheckpoint:
    return ParsedCheckpoint(directory, host, files, inodes)


def test_ranks_that_parsed_the_same_files_agree() -> None:
    shared = [_parsed(), _parsed(), _parsed("h2:[7]", inodes="other inodes")]  # a shared mount, or a kept copy
    _check_same_checkpoint(shared, "load of /ckpt")


def test_ranks_that_load_other_directories_are_not_compared() -> None:
    shared = [_parsed(), _parsed(files="g", directory="/stage1"), _parsed(), _parsed(files="g", directory="/stage1")]
    _check_same_checkpoint(shared, "load of /ckpt")
    with pytest.raises(LoadFailed, match=r"ranks 1 and 3 read different checkpoints at /stage1"):
        _check_same_checkpoint([*shared[:3], _parsed(files="h", directory="/stage1")], "load of /ckpt")


def test_ranks_of_one_host_whose_files_are_other_inodes_fail_naming_both() -> None:
    shared = [_parsed(), _parsed("h2:[7]", inodes="j"), _parsed(inodes="i"), _parsed("h2:[7]", inodes="k")]
    with pytest.raises(LoadFailed, match=r"ranks 1 and 3 read different checkpoints at /ckpt: it was replaced"):
        _check_same_checkpoint(shared, "load of /ckpt")


def test_ranks_whose_files_differ_in_size_or_time_fail_and_other_hosts_hear_of_copies() -> None:
    with pytest.raises(LoadFailed, match=r"ranks 0 and 1 read different checkpoints .*replaced during the load;"):
        _check_same_checkpoint([_parsed(), _parsed(files="g")], "load of /ckpt")
    with pytest.raises(LoadFailed, match=r"ranks 0 and 2 .*or each host holds a checkpoint of its own there and"):
        _check_same_checkpoint([_parsed(), _parsed(), _parsed("h2:[7]", files="g")], "load of /ckpt")


def test_copies_on_each_hosts_disk_agree_whatever_their_times_and_another_checkpoint_does_not(tmp_path: Path) -> None:
    # a plain `cp -r` to each host's local disk gives new inodes and times: only the headers can be compared there
    from workbench.io.files.index import read_checkpoint
    from workbench.io.hf.load import parsed_checkpoint

    for name, values in (("host1", _A), ("host2", _A), ("other", -_A), ("bigger", torch.zeros(65, 32))):
        (tmp_path / name).mkdir()
        save_file({"w": values}, str(tmp_path / name / "model.safetensors"))
    os.utime(tmp_path / "host2" / "model.safetensors", ns=(1_000_000_000, 1_000_000_000))
    one, two, other, bigger = (parsed_checkpoint(read_checkpoint(tmp_path / n))
                               for n in ("host1", "host2", "other", "bigger"))
    assert one.files == two.files and one.inodes != two.inodes
    assert other.files == one.files  # same keys, shapes and sizes: told apart only on one host (inode, time)
    assert bigger.files != one.files


def test_lone_files_of_one_folder_are_different_checkpoints_on_purpose(tmp_path: Path) -> None:
    # pipeline stages each loading a file of their own from one folder were refused as "replaced during the load"
    from workbench.io.files.index import read_checkpoint
    from workbench.io.hf.load import parsed_checkpoint

    for name, values in (("stage0", _A), ("stage1", -_A)):
        save_file({"w": values}, str(tmp_path / f"{name}.safetensors"))
    stage0, stage1 = (parsed_checkpoint(read_checkpoint(tmp_path / f"{n}.safetensors")) for n in ("stage0", "stage1"))
    assert stage0.directory != stage1.directory
    _check_same_checkpoint([stage0, stage1], "load of stages")
