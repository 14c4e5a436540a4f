"""``gc_paused``: no automatic garbage collection while a load runs.

A load makes tens of thousands of short-lived objects (plans, pieces, futures), most of them alive when the cyclic
collector's youngest generation fills. A collection then promotes them, and every few loads the promoted count
triggers a full collection of the whole process: about 0.2 s for the 330,000 objects a process that imported torch
and built a Qwen3-MoE holds (seen on 2 H200s as one load in seven taking 0.2 s longer on one rank, which its peer
waits for). With collection paused the load's objects die by reference count as they always did, none is promoted,
and no full collection follows. Collection is process-wide: other threads run without it for the load's duration
(objects in reference cycles made meanwhile wait for the next collection after it).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Automatic garbage collection off inside the block, back on after it (even when it raises) if it was on; a
    block inside another keeps it off until the outer one ends."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
