"""``gc_paused``: no automatic garbage collection while a load runs.

A load makes tens of thousands of short-lived objects (plans, pieces, futures), most of them alive when the cyclic
collector's youngest generation fills. A collection then promotes them, and every few loads the promoted count
triggers a full collection of the whole process: about 0.2 s for the 330,000 objects a process that imported torch
and built a Qwen3-MoE holds (seen on 2 H200s as one load in seven taking 0.2 s longer on one rank, which its peer
waits for). With collection paused the load's objects die by reference count as they always did, none is promoted,
and no full collection follows. Collection is process-wide: other threads run without it while any load runs
(objects in reference cycles made meanwhile wait for the next collection after it).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]

_LOCK = threading.Lock()
_depth = 0  # blocks inside gc_paused now, on any thread
_was_on = False  # whether collection was on when the first of them began


@contextmanager
def gc_paused() -> Iterator[None]:
    """Automatic garbage collection off inside the block; when the last such block of the process ends (blocks on
    several threads, or one inside another), back on if it was on when the first began. Even when a block raises."""
    global _depth, _was_on
    with _LOCK:
        if _depth == 0:
            _was_on = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0 and _was_on:
                gc.enable()
