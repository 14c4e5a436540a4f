"""2 gloo ranks on one host save column-cut tensors (every rank holds half of every row) directly, through a shared
memory map of the files: the checkpoint equals the reference bit for bit. When one rank's disk fills in the middle
of those writes (its block allocation fails on the third tensor), every rank raises SaveFailed naming it, nothing
is published, and the checkpoint already at the path is intact."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Shard

import workbench as wb
from tests.io.support import read_checkpoint

NAMES = [f"layers.{i}.proj" for i in range(6)]
SHAPE = (128, 64)  # each rank: 128 runs of 32 floats (128 bytes): short runs, many of them -> the memory map


def _layout() -> wb.Layout:
    mesh = wb.MeshSpec((2,), ("tp",))
    return wb.Layout(mesh, {n: wb.LoadSpec.from_placements(n, n + ".weight", SHAPE, mesh, [Shard(1)]) for n in NAMES})


def _full(step: int) -> dict[str, torch.Tensor]:
    return {n: torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) + 1000 * i + step
            for i, n in enumerate(NAMES)}


def _save(root: str, step: int, fail_on_allocation: int | None) -> str:
    import torch.distributed as dist

    import workbench.io.files.direct as direct

    rank = dist.get_rank()
    state = {n: t[:, rank * 32 : (rank + 1) * 32].contiguous() for n, t in _full(step).items()}
    if fail_on_allocation is not None and rank == 1:
        real, calls = direct._allocate, [0]

        def full_disk(fd: int, offset: int, nbytes: int) -> bool:
            calls[0] += 1
            if calls[0] == fail_on_allocation:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, offset, nbytes)

        direct._allocate = full_disk
    try:
        wb.save_hf(state, Path(root) / "ckpt", layout=_layout(), write_threads=1, timeout=30)
    except wb.SaveFailed as exc:
        return f"SaveFailed: {exc}"
    return "saved"



@pytest.mark.slow
def test_column_cuts_are_mapped_and_a_full_disk_mid_save_publishes_nothing(tmp_path: Path) -> None:
    assert wb.launch(_save, nprocs=2, args=(str(tmp_path), 0, None), timeout=120) == {0: "saved", 1: "saved"}
    want = {n + ".weight": t for n, t in _full(0).items()}
    got = read_checkpoint(tmp_path / "ckpt")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    outcomes = wb.launch(_save, nprocs=2, args=(str(tmp_path), 1, 3), timeout=120)
    for rank, outcome in outcomes.items():
        assert outcome.startswith("SaveFailed") and "rank 1" in outcome and "No space left" in outcome, (rank,
                                                                                                         outcome)
    got = read_checkpoint(tmp_path / "ckpt")  # the step-0 checkpoint, untouched
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not [p for p in tmp_path.iterdir() if p.name != "ckpt"]  # no temporary directory left behind
