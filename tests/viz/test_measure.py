"""TimedCommunicator records one entry per all-gather, with the bytes the wrapped communicator returned."""

from __future__ import annotations

import torch

from workbench.viz.measure import TimedCommunicator


class _TwoRanks:
    rank = 1

    def __init__(self) -> None:
        self.barriers = 0

    def all_gather(self, send: torch.Tensor, mesh_dim: str) -> torch.Tensor:
        return torch.cat([send, send])

    def barrier(self) -> None:
        self.barriers += 1


def test_records_each_gather_and_forwards_the_rest() -> None:
    inner = _TwoRanks()
    comm = TimedCommunicator(inner)
    out = comm.all_gather(torch.ones(3, dtype=torch.bfloat16), "tp")
    comm.all_gather(torch.ones(5), "dp")
    assert out.shape == (6,)
    assert comm.call_bytes == [12, 40]  # the gathered buffers: 6 bf16, 10 float32
    assert len(comm.call_seconds) == 2 and all(s >= 0 for s in comm.call_seconds)
    comm.barrier()
    assert comm.rank == 1 and inner.barriers == 1

    class Result:
        seconds = 2.5

    measured = comm.measured(Result())
    assert measured == {"call_seconds": comm.call_seconds, "call_bytes": [12, 40], "seconds": 2.5}


def test_a_save_result_brings_its_own_predicted_peak() -> None:
    comm = TimedCommunicator(_TwoRanks())

    class Result:
        seconds = 1.0
        predicted_peak_bytes = 16 << 20  # the save's schedule, planned with its writer queue

    assert comm.measured(Result())["predicted_peak_bytes"] == 16 << 20
