"""Rank 0's pre-publish check proves the direct writes cover every file (issue 20: it summed bytes, so a piece
written twice plus one never written passed). On 2 gloo ranks, rank 1's writer is made to write its expert 3 into
expert 1's place (which rank 0 writes too) and expert 3 never: both keys lie in one file, which gets exactly its
number of bytes. Every rank raises SaveFailed,
nothing is published, and the old checkpoint at the path survives bit for bit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import workbench as wb
from tests.faults.harness import layout_of, old_values, write_old_checkpoint
from tests.io.support import read_checkpoint


def _misdirected_program(real):
    """``direct_program`` whose 'experts' step writes its second piece (expert 3) into expert 1's place."""

    def program(layout, key_meta, direct, rank):
        steps = list(real(layout, key_meta, direct, rank))
        for i, (name, whole, pieces) in enumerate(steps):
            if name == "experts" and len(pieces) == 2:
                wrong = dataclasses.replace(pieces[1], hf_key="model.experts.1.weight")
                steps[i] = (name, whole, (pieces[0], wrong))
        return tuple(steps)

    return program


def _save_with_a_misdirected_piece(root: str) -> dict:
    import torch.distributed as dist

    import workbench.io.hf.direct_queue as session
    from tests.faults.harness import _local_state

    rank = dist.get_rank()
    layout = layout_of(2)
    if rank == 1:
        session.direct_program = _misdirected_program(session.direct_program)
    out = {}
    for async_save in (False, True):
        state = _local_state(layout, rank)
        wb.load_hf(state, Path(root) / "ckpt", layout=layout)
        for tensor in state.values():
            tensor.add_(1)
        try:
            # the direct keys' files alternate over the ranks: experts 1 and 3 share the file of rank 0
            result = wb.save_hf(state, Path(root) / "ckpt", layout=layout, write_mode="direct", async_save=async_save,
                                timeout=30)
            if async_save:
                result = result.wait()
            out[async_save] = {"type": None, "bytes": result.bytes_written}
        except Exception as exc:
            out[async_save] = {"type": type(exc).__name__, "message": str(exc)}
    return out


def test_a_double_write_and_a_missing_piece_fail_every_rank_and_publish_nothing(tmp_path: Path) -> None:
    write_old_checkpoint(tmp_path / "ckpt")
    results = wb.launch(_save_with_a_misdirected_piece, nprocs=2, args=(str(tmp_path),), timeout=180)
    for rank, per_mode in results.items():
        for async_save, outcome in per_mode.items():
            assert outcome["type"] == "SaveFailed", (rank, async_save, outcome)
            message = outcome["message"]
            assert "rank 0 failed while publishing" in message, message
            assert "written by no rank: 'model.experts.3.weight' elements 0-31" in message, message
            assert "written 2 times (rank 0, rank 1): 'model.experts.1.weight' elements 0-31" in message, message
    old = old_values()
    kept = read_checkpoint(tmp_path / "ckpt")
    assert kept.keys() == old.keys()
    for key in old:
        assert torch.equal(kept[key], old[key]), key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directory left either
