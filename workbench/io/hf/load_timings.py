"""Where one rank's load spent its time, stage by stage.

A slow load shows its cause here:

* **many small keys**: ``check`` (parsing the files' headers, comparing them with the layout) and ``plan``
  (the slices, transfers and reads of every parameter) long against ``read``;
* **the disk or the page cache**: ``read`` and ``drain`` long (the loading thread waiting for the reading threads);
* **replicated parameters**: ``share`` long (the broadcasts from each replica group's reader);
* **a slow peer**: ``agree`` long on the fast ranks (they wait for the slow one at the agreements).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from workbench.io.hf.stage_times import StageTimes

__all__ = ["LoadClock", "LoadTimings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadTimings(StageTimes):
    """Seconds one rank's ``load_hf`` spent in each stage, one after the other on the calling thread.

    Stages: ``check`` (the layout, the checkpoint's index and headers, checked against each other, and who reads
    each replicated parameter), ``plan`` (each parameter's slices, coalesced transfers and reads), ``read`` (the
    reads and copies into the model, while the reading threads run ahead), ``drain`` (waiting for the last reads
    and copies, the device included; on a GPU, where the boxes land in the model's tensors, the loading thread
    queues their copies here, so ``read`` is short and ``drain`` holds the load), ``share`` (broadcasting
    replicated parameters to their replicas),
    ``agree`` (the two agreements of every rank: waiting for the slowest rank counts here).
    ``read_wait``: the part of ``read`` and ``drain`` the calling thread spent blocked on reads not done yet (long:
    the files or the page cache bound the load; short against ``read``: the calling thread's own work does).
    """

    check: float = 0.0
    plan: float = 0.0
    read: float = 0.0
    drain: float = 0.0
    share: float = 0.0
    agree: float = 0.0
    read_wait: float = 0.0

    STAGES = ("check", "plan", "read", "drain", "share", "agree")

    @property
    def total(self) -> float:
        """Seconds of every stage together."""
        return self._seconds_of(self.STAGES)

    def __str__(self) -> str:
        text = f"stages (s): {self._listed(self.STAGES, 'none')}"
        return text + (f" (read and drain waited {self.read_wait:.3f} for reads)" if self.read_wait >= 5e-4 else "")


class LoadClock:
    """Stage times of one load on the calling thread: ``lap(stage)`` counts the time since the last lap."""

    def __init__(self) -> None:
        self._seconds = dict.fromkeys(LoadTimings.STAGES, 0.0)
        self._last = time.perf_counter()
        self._extra: dict[str, float] = {}

    def add(self, what: str, seconds: float) -> None:
        """Count ``seconds`` more of ``what`` (a ``LoadTimings`` field that is not a stage: ``read_wait``)."""
        self._extra[what] = self._extra.get(what, 0.0) + seconds

    def lap(self, stage: str) -> None:
        """Count the seconds since the previous lap (or the clock's start) as ``stage``."""
        if stage not in self._seconds:
            raise ValueError(f"LoadClock: {stage!r} is not a LoadTimings stage {LoadTimings.STAGES}")
        now = time.perf_counter()
        self._seconds[stage] += now - self._last
        self._last = now

    def timings(self) -> LoadTimings:
        """The figures so far, frozen."""
        return LoadTimings(**self._seconds, **self._extra)
