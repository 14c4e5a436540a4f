"""Where one rank's save spent its time: the stages of the calling thread and the work of its writer threads.

A slow save has one of a few causes, and each leaves its mark here:

* the **disk**: writer threads busy in ``write`` (the copy into the page cache) and ``writeback_wait`` (waiting
  for the oldest ranges to reach the disk), the calling thread in ``queue_wait`` and ``drain``, ``fsync`` short;
* the **gathers**: the calling thread's ``snapshot`` stage (it runs the all-gather waves) long, writers idle in
  ``copy_wait`` or not yet started;
* the **peers**: ``plan`` or ``publish`` long on one rank while they are short on the others (a slow rank
  reaches the agreements late, and the fast ones wait for it there);
* **device-to-host copies**: writer threads in ``copy_wait``.

``SaveClock`` collects the figures while a save runs (thread-safe); ``SaveResult.timings`` is the frozen
``SaveTimings`` it ends with.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

from workbench.io.hf.stage_times import StageTimes

__all__ = ["SaveClock", "SaveTimings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveTimings(StageTimes):
    """Seconds one rank's save spent, by stage (calling thread, one after the other) and by writer activity
    (summed over the writer threads, which overlap each other and the stages).

    Stages: ``prepare`` (checks and the write-mode agreement), ``plan`` (planning and agreeing on it),
    ``snapshot`` (gathers, device-to-host copies and queueing writes; an async save's call ends here),
    ``queue_wait`` (the part of ``snapshot`` spent waiting for writers to free room), ``drain`` (waiting for the
    last writes), ``fsync``, ``publish`` (status agreement, index, rename, final agreement).
    Writers: ``write`` (in ``pwrite``), ``copy_wait`` (waiting for a device-to-host copy), ``writeback_wait``
    (waiting for the disk to catch up with the writeback window), ``gate_wait`` (an async save's writers held
    back until its snapshot is complete).
    """

    prepare: float = 0.0
    plan: float = 0.0
    snapshot: float = 0.0
    queue_wait: float = 0.0
    drain: float = 0.0
    fsync: float = 0.0
    publish: float = 0.0
    write: float = 0.0
    copy_wait: float = 0.0
    writeback_wait: float = 0.0
    gate_wait: float = 0.0

    STAGES = ("prepare", "plan", "snapshot", "drain", "fsync", "publish")
    WRITERS = ("write", "copy_wait", "writeback_wait", "gate_wait")

    @property
    def stages_total(self) -> float:
        """Seconds of the calling thread's stages together (``queue_wait`` is inside ``snapshot``)."""
        return self._seconds_of(self.STAGES)

    def __str__(self) -> str:
        text = f"stages (s): {self._listed(self.STAGES, 'none')}"
        if self.queue_wait >= 5e-4:
            text += f" (snapshot waited {self.queue_wait:.3f} for room)"
        return text + f"; writer threads (s, summed): {self._listed(self.WRITERS, 'idle')}"


class SaveClock:
    """Seconds per activity of one save, added from any thread; ``timings()`` freezes them."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, what: str, seconds: float) -> None:
        """Count ``seconds`` more of ``what`` (a ``SaveTimings`` field)."""
        with self._lock:
            self._seconds[what] = self._seconds.get(what, 0.0) + seconds

    @contextmanager
    def measure(self, what: str) -> Iterator[None]:
        """Count the time the block takes as ``what``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(what, time.perf_counter() - start)

    def seconds(self, what: str) -> float:
        """Seconds counted as ``what`` so far."""
        with self._lock:
            return self._seconds.get(what, 0.0)

    def timings(self) -> SaveTimings:
        """The figures so far, frozen."""
        names = {f.name for f in fields(SaveTimings)}
        with self._lock:
            unknown = set(self._seconds) - names
            if unknown:
                raise ValueError(f"SaveClock: not SaveTimings fields: {sorted(unknown)}")
            return SaveTimings(**self._seconds)
