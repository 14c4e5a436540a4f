"""The staging ring: page-aligned slots of one allocation, a slot taken by one thread at a time, and a slot not
written again before the copy out of it has run (its event waited for)."""

from __future__ import annotations

import threading
from itertools import pairwise

import pytest

from workbench.io.files.staging import StagingRing


class _Event:
    """A stand-in for a CUDA event: records that it was waited for, or fails as a broken device would."""

    def __init__(self, fail: bool = False) -> None:
        self.waited = 0
        self.fail = fail

    def synchronize(self) -> None:
        self.waited += 1
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_slots_are_page_aligned_disjoint_views_of_one_allocation() -> None:
    ring = StagingRing(slots=4, slot_bytes=8192, pinned=False)
    slots = [ring.acquire() for _ in range(4)]
    starts = sorted(s.buffer.data_ptr() for s in slots)
    assert all(p % 4096 == 0 for p in starts)
    assert [b - a for a, b in pairwise(starts)] == [8192] * 3  # back to back, no overlap
    assert all(s.buffer.numel() == 8192 for s in slots)
    assert len({s.buffer.untyped_storage().data_ptr() for s in slots}) == 1
    assert ring.allocations == 1


def test_acquire_waits_until_a_slot_is_given_back() -> None:
    ring = StagingRing(slots=1, slot_bytes=4096, pinned=False)
    first = ring.acquire()
    got: list[object] = []
    taker = threading.Thread(target=lambda: got.append(ring.acquire()))
    taker.start()
    taker.join(timeout=0.2)
    assert taker.is_alive() and not got  # the only slot is out
    ring.release(first)
    taker.join(timeout=5)
    assert got == [first]


def test_a_slot_is_not_handed_out_before_its_copy_ran() -> None:
    ring = StagingRing(slots=1, slot_bytes=4096, pinned=False)
    slot = ring.acquire()
    copy_done = _Event()
    ring.release(slot, copy_done)  # type: ignore[arg-type]
    again = ring.acquire()
    assert again is slot and copy_done.waited == 1 and again.event is None


def test_a_failed_copy_keeps_the_slot_in_the_ring() -> None:
    ring = StagingRing(slots=1, slot_bytes=4096, pinned=False)
    ring.release(ring.acquire(), _Event(fail=True))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        ring.acquire()
    assert ring.acquire().event is None  # the slot went back to the ring, without the failed event


@pytest.mark.parametrize(("slots", "slot_bytes"), [(0, 4096), (2, 100), (2, 6000)])
def test_bad_sizes_are_refused(slots: int, slot_bytes: int) -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        StagingRing(slots=slots, slot_bytes=slot_bytes, pinned=False)
