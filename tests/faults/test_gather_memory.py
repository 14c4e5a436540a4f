"""An all-gather whose memory runs out on one rank: the receive buffer before the collective, or a copy after it.
Every rank must raise the same SaveFailed naming that rank and its MemoryError within seconds (not after the
timeout, with only gloo's words), and the old checkpoint stays. Also through the communicator wrappers a save may be
given (``Float8Communicator``, ``TimedCommunicator`` around it): they forwarded the inner ``prepare_gather`` to a
driver whose call then failed on every rank (a TypeError), or hid it, and the buffer was made after the flags."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.faults.harness import _local_state, layout_of, old_values, write_old_checkpoint
from tests.io.support import read_checkpoint

TIMEOUT = 20.0  # a rank left in a collective ends only after this: the test then fails on time, not by hanging


def _save_with_a_failing_gather(root: str, where: str) -> tuple[str, float]:
    import torch.distributed as dist

    from workbench.run import torch_comm
    from workbench.run.communicator import FinishFailed

    rank = dist.get_rank()
    layout = layout_of(4)
    state = _local_state(layout, rank)
    wb.load_hf(state, Path(root) / "ckpt", layout=layout)
    for t in state.values():
        t.add_(1)
    calls = {"n": 0}
    comm = None
    if where == "receive buffer, wrapped":
        from workbench.io.hf.fp8 import Float8Communicator
        from workbench.io.hf.save import default_communicator
        from workbench.viz.measure import TimedCommunicator

        comm = TimedCommunicator(Float8Communicator(default_communicator(layout, TIMEOUT)))
    if rank == 1 and where.startswith("receive buffer"):
        prepare = torch_comm.TorchCommunicator.prepare_gather

        def failing_prepare(self, send, mesh_dim):
            calls["n"] += 1
            if calls["n"] == 2:
                raise MemoryError("cannot allocate the receive buffer")
            return prepare(self, send, mesh_dim)

        torch_comm.TorchCommunicator.prepare_gather = failing_prepare
    elif rank == 1 and where == "after the collective":
        gather = torch_comm.TorchCommunicator.all_gather

        def failing_gather(self, send, mesh_dim, **kwargs):
            out = gather(self, send, mesh_dim, **kwargs)  # the collective ran on every rank of the group
            calls["n"] += 1
            if calls["n"] == 2:
                raise FinishFailed("after the all-gather") from MemoryError("cannot allocate the reordered copy")
            return out

        torch_comm.TorchCommunicator.all_gather = failing_gather
    began = time.monotonic()
    try:
        wb.save_hf(state, Path(root) / "ckpt", layout=layout, write_mode="gather", budget_bytes=256,
                   max_shard_bytes=256, timeout=TIMEOUT, policy=wb.SavePolicy.full(), comm=comm)
        return "saved", time.monotonic() - began
    except wb.SaveFailed as exc:
        return str(exc), time.monotonic() - began


@pytest.mark.slow
@pytest.mark.parametrize("where", ["receive buffer", "after the collective", "receive buffer, wrapped"])
def test_an_all_gather_out_of_memory_on_one_rank_fails_every_rank_at_once(tmp_path: Path, where: str) -> None:
    write_old_checkpoint(tmp_path / "ckpt")
    outcomes = wb.launch(_save_with_a_failing_gather, nprocs=4, args=(str(tmp_path), where), timeout=120)
    for rank, (message, seconds) in outcomes.items():
        assert seconds < TIMEOUT / 2, (rank, seconds, message)
        assert "rank 1 failed while gathering" in message and "MemoryError: cannot allocate" in message, message
        assert "Timed out" not in message, message
    got = read_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(got[k], v) for k, v in old_values().items())


def _timed_float8_save(root: str) -> int:
    import torch.distributed as dist

    from workbench.io.hf.fp8 import Float8Communicator
    from workbench.io.hf.save import default_communicator
    from workbench.viz.measure import TimedCommunicator

    layout = layout_of(4)
    state = _local_state(layout, dist.get_rank())
    comm = TimedCommunicator(Float8Communicator(default_communicator(layout, TIMEOUT)))
    wb.save_hf(state, Path(root) / "new", layout=layout, write_mode="gather", timeout=TIMEOUT,
               policy=wb.SavePolicy.full(), comm=comm)
    return len(comm.call_seconds)


@pytest.mark.slow
def test_a_save_timed_through_the_float8_communicator_gathers(tmp_path: Path) -> None:
    # the timing wrapper handed the driver the inner prepare_gather, which Float8Communicator.all_gather refused
    calls = wb.launch(_timed_float8_save, nprocs=4, args=(str(tmp_path),), timeout=120)
    assert all(n > 0 for n in calls.values()), calls
    got = read_checkpoint(tmp_path / "new")
    want = {k: torch.zeros_like(v) for k, v in old_values().items()}  # the harness's local state: zeros, by key
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
