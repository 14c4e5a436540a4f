"""The staging ring: page-aligned slots of one allocation, a slot held by one user at a time, and a slot not
written again before the copy out of it has run (its event waited for by whoever fills it next)."""

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

    def query(self) -> bool:  # still running (a broken device raises here too)
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return False

    def synchronize(self) -> None:
        self.waited += 1
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_slots_are_page_aligned_disjoint_views_of_one_allocation() -> None:
    ring = StagingRing(slots=4, slot_bytes=8192, pinned=False)
    slots = [ring.take() for _ in range(4)]
    starts = sorted(s.buffer.data_ptr() for s in slots)
    assert all(p % 4096 == 0 for p in starts)
    assert [b - a for a, b in pairwise(starts)] == [8192] * 3  # back to back, no overlap
    assert all(s.buffer.numel() == 8192 for s in slots)
    assert len({s.buffer.untyped_storage().data_ptr() for s in slots}) == 1
    assert ring.try_take() is None and ring.allocations == 1


def test_take_waits_until_a_slot_is_given_back() -> None:
    ring = StagingRing(slots=1, slot_bytes=4096, pinned=False)
    first = ring.take()
    got: list[object] = []
    taker = threading.Thread(target=lambda: got.append(ring.take()))
    taker.start()
    taker.join(timeout=0.2)
    assert taker.is_alive() and not got  # the only slot is out
    ring.give(first)
    taker.join(timeout=5)
    assert got == [first]


def test_a_slot_is_written_only_after_its_copy_ran() -> None:
    ring = StagingRing(slots=1, slot_bytes=4096, pinned=False)
    copy_done = _Event()
    ring.give(ring.take(), copy_done)  # type: ignore[arg-type]
    slot = ring.take()
    assert slot.event is copy_done and copy_done.waited == 0  # handed out at once: the filling thread waits
    slot.ready()
    assert copy_done.waited == 1 and slot.event is None
    slot.ready()  # nothing pending: no second wait
    assert copy_done.waited == 1


def test_a_failed_copy_is_raised_once_and_the_slot_stays_usable() -> None:
    ring = StagingRing(slots=1, slot_bytes=4096, pinned=False)
    ring.give(ring.take(), _Event(fail=True))  # type: ignore[arg-type]
    slot = ring.take()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        slot.ready()
    ring.give(slot)
    again = ring.take()
    again.ready()  # the failed event went with the error
    assert again is slot and again.event is None


@pytest.mark.parametrize(("slots", "slot_bytes"), [(0, 4096), (2, 100), (2, 6000)])
def test_bad_sizes_are_refused(slots: int, slot_bytes: int) -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        StagingRing(slots=slots, slot_bytes=slot_bytes, pinned=False)
