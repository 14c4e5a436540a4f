"""On a GPU (skipped without CUDA): the process's ring is pinned, made once, and a slot whose copy is still queued
is not written before that copy has run (``Slot.ready``)."""

from __future__ import annotations

import pytest
import torch

from workbench.io.files.staging import StagingRing, staging_ring

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")


def test_the_process_ring_is_made_once_and_pinned() -> None:
    ring = staging_ring()
    assert staging_ring() is ring
    slot = ring.take()
    try:
        assert slot.buffer.is_pinned()
    finally:
        ring.give(slot)


def test_a_slot_is_rewritten_only_after_the_copy_out_of_it_ran() -> None:
    ring = StagingRing(slots=1, slot_bytes=64 << 20)
    out = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    for value in range(1, 6):
        slot = ring.take()
        slot.ready()
        slot.buffer.fill_(value)  # the previous copy out of this slot must have read its bytes by now
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)  # hold the copy back: without ready() the next fill would overtake it
            out.copy_(slot.buffer, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        ring.give(slot, event)
        taken = ring.take()
        taken.ready()
        assert event.query()
        assert int(out.min()) == int(out.max()) == value
        ring.give(taken)
