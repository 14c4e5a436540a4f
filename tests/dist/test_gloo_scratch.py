"""The fact behind the gloo term of ``SaveResult.predicted_peak_bytes``: a gloo all-gather stages its output in
a scratch buffer of the output's size, so one gather of N output bytes raises the peak RSS by about 2N (the
output, then the scratch it is copied from). If a torch release gathers in place, this fails and the term goes."""

from __future__ import annotations

import torch

import workbench as wb

MiB = 1 << 20


def _gather_peak() -> dict:
    from workbench.mesh import MeshSpec
    from workbench.run.torch_comm import TorchCommunicator

    comm = TorchCommunicator(MeshSpec((2,), ("fsdp",)), ["fsdp"])
    send = torch.ones(16 * MiB, dtype=torch.float32)  # 64 MiB sent, 128 MiB gathered
    comm.all_gather(torch.ones(8), "fsdp")  # warm the group up
    from tests.peak_rss import peak_bytes, reset_peak

    if not reset_peak():
        return {"skip": True}
    before = peak_bytes()
    out = comm.all_gather(send, "fsdp")
    return {"skip": False, "scratch": comm.gather_scratch, "increase": peak_bytes() - before, "out": out.numel() * 4}


def test_a_gloo_gather_needs_a_scratch_buffer_of_its_output_size() -> None:
    results = wb.launch(_gather_peak, nprocs=2, timeout=120)
    for rank, r in results.items():
        if r["skip"]:
            continue
        assert r["scratch"], rank
        assert r["increase"] >= 1.8 * r["out"], (rank, r["increase"] / MiB)
