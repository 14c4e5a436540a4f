"""On a GPU (skipped without CUDA): bytes staged through the pinned ring land on the device bit for bit, from many
threads at once with more pieces than slots, and the process's ring is pinned once."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from workbench.io.files.staging import StagingRing, staging_ring

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")


def test_pieces_staged_from_a_file_land_on_the_gpu_bit_for_bit(tmp_path: Path) -> None:
    data = os.urandom(40 * 4096 + 123)  # 10 slots' worth and a ragged tail
    path = tmp_path / "blob"
    path.write_bytes(data)
    ring = StagingRing(slots=2, slot_bytes=4 * 4096)
    out = torch.empty(len(data), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    fd = os.open(path, os.O_RDONLY)
    try:
        def piece(at: int) -> torch.cuda.Event:
            n = min(ring.slot_bytes, len(data) - at)
            return ring.stage(lambda view: os.preadv(fd, [view], at), n, out[at:at + n], stream)

        with ThreadPoolExecutor(8) as pool:  # 8 threads contend for 2 slots
            events = list(pool.map(piece, range(0, len(data), ring.slot_bytes)))
    finally:
        os.close(fd)
    for event in events:
        torch.cuda.current_stream().wait_event(event)
    assert bytes(out.cpu().numpy()) == data
    assert ring.allocations == 1 and ring.slots == 2


def test_the_process_ring_is_made_once_and_pinned() -> None:
    ring = staging_ring()
    assert staging_ring() is ring
    slot = ring.acquire()
    try:
        assert slot.buffer.is_pinned()
    finally:
        ring.release(slot)
