"""StagingRing: a few pinned host slots that a load into GPU memory reads through, kept for the whole process.

A read from a file lands in host memory; a copy to a GPU overlaps the next read only from pinned memory, and
pinning is slow (about half a second per GB on the machines measured, ``bench/warm_limits.py``). A buffer per
request, pinned afresh, made the first load of a process spend most of its time pinning. The ring pins
``slots x slot_bytes`` once (512 MiB and 128 KiB by default) and every load of the process reuses it: the loader
takes a slot for the next piece it reads ahead, a reader thread waits for the slot's last copy to have run and reads
into it, and the loader, when it needs the piece, queues the slot's copy to the GPU and gives the slot back with
that copy's event. Sixteen slots reach the page cache's copy limit on the H200 hosts measured (27 GB/s per GPU with
two GPUs reading at once, 40 GB/s with one; ``bench/warm_limits.py``). Each piece of a load costs its loading thread
and a reading thread their Python, so larger slots make a load faster down to the fewest that keep 16 threads
reading: 16 MiB a slot rather than 8 halved the pieces (a warm 4 GB Qwen3-MoE on 2 H200s, same call: EP2 0.109 s
against 0.134, ETP2 0.140 against 0.147), and 32 MiB rather than 16 halved them again (8 GB, round robin in the
same processes, two calls: ETP2 0.255-0.260 s against 0.281-0.288 and 0.287 against 0.319, EP2 0.186-0.197 against
0.194-0.200, FSDP2 0.200 against 0.204); 8 slots of 64 MiB or 12 of 32 were slower than 16 of 32
(``bench/RESULTS.md``). The price: 512 MiB of pinned host memory a process. A piece whose bytes go to strided
places goes through a buffer of one slot on the GPU, which the loader takes from torch's caching allocator per piece
and lets go (``box_reads.py``): the ring holds no GPU memory.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import torch

__all__ = ["SLOTS", "SLOT_BYTES", "StagingRing", "as_dtype", "staging_ring"]

_ALIGN = 4096  # slots start on a page: O_DIRECT reads land in them
# 32 MiB of data and the two pages an unaligned range's O_DIRECT cover may add: a slot carries 32 MiB whole (a
# 1 MiB-per-expert box in 32 experts a slot, not 31 and a remainder)
SLOT_BYTES = (32 << 20) + 2 * _ALIGN
SLOTS = 16


@dataclass(eq=False)
class Slot:
    """One slot: ``buffer`` (uint8, ``slot_bytes``) and the event of the last copy out of it (None: none pending)."""

    buffer: torch.Tensor
    event: torch.cuda.Event | None = None
    _views: dict[object, torch.Tensor | memoryview] = field(
        default_factory=dict, init=False, repr=False)
    _done: dict[torch.device, torch.cuda.Event] = field(default_factory=dict, init=False, repr=False)

    @property
    def bytes(self) -> memoryview:
        """The slot's buffer as a writable memoryview (made once: a reading thread reads into it per piece)."""
        view = self._views.get("bytes")
        if view is None:
            view = self._views["bytes"] = memoryview(self.buffer.numpy())
        return view

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The slot's buffer as a flat tensor of ``dtype`` (kept: a part's place is then one ``as_strided`` of it,
        from the view's own storage offset)."""
        view = self._views.get(dtype)
        if view is None:
            view = self._views[dtype] = as_dtype(self.buffer, dtype)
        return view

    def done_event(self, device: torch.device) -> torch.cuda.Event:
        """The slot's own event for copies on ``device`` (an event belongs to the device it was first recorded on,
        and the ring serves every GPU of the process), recorded after each copy out of the slot and waited on by
        ``ready``: made once per device (the slot's copies and fills take turns: a record never meets a wait)."""
        event = self._done.get(device)
        if event is None:
            event = self._done[device] = torch.cuda.Event()
        return event

    def ready(self) -> None:
        """Wait until the last copy out of the slot has run: then it may be written. On the thread that fills it."""
        event, self.event = self.event, None
        if event is not None and not event.query():  # done: no wait (query keeps the GIL, a wait gives it up)
            event.synchronize()  # a failed copy (a broken device) raises here; the slot stays usable


def as_dtype(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The flat uint8 tensor ``raw`` seen as ``dtype``: its whole elements, from its first byte."""
    return raw[:raw.numel() // dtype.itemsize * dtype.itemsize].view(dtype)


class StagingRing:
    """``slots`` host buffers of ``slot_bytes``, pinned when ``pinned``, from one allocation; thread-safe.

    ``take`` hands out a slot (``try_take``: None when none is free), whose copy may still be running: the thread
    that fills it calls ``Slot.ready`` first. ``give`` puts it back with the event of the copy just queued out of
    it. ``allocations`` counts allocations (one per ring): a process's later loads pin nothing.
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

    def take(self) -> Slot:
        """A slot, waiting until one is given back."""
        return self._free.get()

    def try_take(self) -> Slot | None:
        """A slot if one is free now, else None."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return None

    def give(self, slot: Slot, event: torch.cuda.Event | None = None) -> None:
        """Give ``slot`` back; ``event`` is recorded after the copy queued out of it (None: nothing in flight)."""
        if event is not None:
            slot.event = event
        self._free.put(slot)


_RING: StagingRing | None = None
_RING_LOCK = threading.Lock()


def staging_ring() -> StagingRing:
    """The process's pinned staging ring (made on first use, then kept: later loads pin nothing)."""
    global _RING
    with _RING_LOCK:
        if _RING is None:
            _RING = StagingRing()
        return _RING
