"""StagingRing: a few pinned host slots that a load into GPU memory reads through, kept for the whole process.

A read from a file lands in host memory; a copy to a GPU overlaps the next read only from pinned memory, and
pinning is slow (about half a second per GB on the machines measured, ``bench/warm_limits.py``). A buffer per
request, pinned afresh, made the first load of a process spend most of its time pinning. The ring pins
``slots x slot_bytes`` once (128 MiB by default) and every load of the process reuses it: a reader thread takes a
slot, reads into it, queues the slot's copy to the GPU on a copy stream and gives the slot back with the copy's
event; the next thread to take that slot waits for the event before writing into it. Sixteen slots of 8 MiB reach
the page cache's copy limit on the H200 hosts measured (27 GB/s per GPU with two GPUs reading at once).

Nothing waits for the consumer: a slot is given back as soon as its copy is queued, so threads that hold no slot
never block a thread that holds one (no deadlock however many requests are in flight).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["SLOTS", "SLOT_BYTES", "StagingRing", "staging_ring"]

SLOT_BYTES = 8 << 20
SLOTS = 16
_ALIGN = 4096  # slots start on a page: O_DIRECT reads land in them


@dataclass(eq=False)
class Slot:
    """One slot: ``buffer`` (uint8, ``slot_bytes``) and the event of the last copy out of it (None: free now)."""

    buffer: torch.Tensor
    event: torch.cuda.Event | None = None


class StagingRing:
    """``slots`` host buffers of ``slot_bytes``, pinned when ``pinned``, from one allocation; thread-safe.

    ``acquire`` blocks until a slot is free and its last copy has run; ``release`` gives it back with the event of
    the copy just queued out of it. ``allocations`` counts allocations (one per ring): a process's later loads
    pin nothing.
    """

    def __init__(self, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES, *, pinned: bool = True) -> None:
        if slots < 1 or slot_bytes < _ALIGN or slot_bytes % _ALIGN:
            raise ValueError(f"a staging ring needs >= 1 slot of a multiple of {_ALIGN} bytes, got {slots} x "
                             f"{slot_bytes}")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.pinned = pinned
        whole = torch.empty(slots * slot_bytes + _ALIGN, dtype=torch.uint8, pin_memory=pinned)
        skip = -whole.data_ptr() % _ALIGN
        self._free: queue.SimpleQueue[Slot] = queue.SimpleQueue()
        for i in range(slots):
            self._free.put(Slot(whole[skip + i * slot_bytes:skip + (i + 1) * slot_bytes]))
        self.allocations = 1

    def acquire(self) -> Slot:
        """A free slot whose last copy has finished (waits for both)."""
        slot = self._free.get()
        if slot.event is not None:
            try:
                slot.event.synchronize()
            except BaseException:  # the copy failed (a broken device) or the wait was interrupted
                slot.event = None  # the caller sees the error; the slot goes back, not lost to the ring
                self._free.put(slot)
                raise
            slot.event = None
        return slot

    def release(self, slot: Slot, event: torch.cuda.Event | None = None) -> None:
        """Give ``slot`` back; ``event`` is recorded after the last copy out of it (None: nothing in flight)."""
        slot.event = event
        self._free.put(slot)

    def stage(
        self, fill: Callable[[memoryview], None], nbytes: int, out: torch.Tensor, stream: torch.cuda.Stream
    ) -> torch.cuda.Event:
        """Fill a slot's first ``nbytes`` with ``fill`` (a read into the view it is given), queue their copy into
        ``out`` (``nbytes`` of uint8 on a GPU) on ``stream`` and give the slot back; returns the copy's event,
        which a consumer of ``out`` waits for."""
        if nbytes > self.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a staging slot of {self.slot_bytes}")
        slot = self.acquire()
        event = None
        try:
            source = slot.buffer[:nbytes]
            fill(memoryview(source.numpy()))
            with torch.cuda.stream(stream):
                out.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        finally:
            self.release(slot, event)
        return event


_RING: StagingRing | None = None
_RING_LOCK = threading.Lock()


def staging_ring() -> StagingRing:
    """The process's pinned staging ring (made on first use, then kept: later loads pin nothing)."""
    global _RING
    with _RING_LOCK:
        if _RING is None:
            _RING = StagingRing()
        return _RING
