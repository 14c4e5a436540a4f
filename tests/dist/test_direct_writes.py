"""4 gloo ranks write a checkpoint directly (every rank its own pieces, at their offsets, no gather): HSDP-style
replicas written once, columns cut by TP written as many short segments, experts over EP x FSDP; the files hold
exactly the values of a gather-mode save and of the reference, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.io.support import read_checkpoint
from tests.faults.harness import layout_of, new_values, write_old_checkpoint


def _save_both_ways(root: str) -> dict:
    import torch.distributed as dist

    from tests.faults.harness import _local_state

    rank = dist.get_rank()
    layout = layout_of(4)
    state = _local_state(layout, rank)
    wb.load_hf(state, Path(root) / "old", layout=layout)
    for tensor in state.values():
        tensor.add_(1)
    results = {}
    for mode, min_segment in (("direct", 0), ("direct", 1 << 20), ("gather", 0)):
        name = f"{mode}-{min_segment}"
        results[name] = wb.save_hf(state, Path(root) / name, layout=layout, write_mode=mode,
                                   min_segment_bytes=min_segment, max_shard_bytes=256)
    return results



@pytest.mark.slow
def test_direct_writes_equal_gathered_writes_and_the_reference(tmp_path: Path) -> None:
    write_old_checkpoint(tmp_path / "old")
    results = wb.launch(_save_both_ways, nprocs=4, args=(str(tmp_path),), timeout=180)
    want = new_values()
    for name in ("direct-0", "direct-1048576", "gather-0"):
        got = read_checkpoint(tmp_path / name)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (name, key)
    # every tensor written directly; with a 1 MiB minimum segment the column-cut one is gathered instead
    assert {r["direct-0"].direct_tensors for r in results.values()} == {4}
    assert {r["direct-1048576"].direct_tensors for r in results.values()} == {3}
    assert all(r["direct-0"].write_mode == "direct" and r["gather-0"].write_mode == "gather"
               for r in results.values())
    # every rank wrote something directly (no writer rank funnels the data)
    assert all(r["direct-0"].bytes_written > 0 for r in results.values())
