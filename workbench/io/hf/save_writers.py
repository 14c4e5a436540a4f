"""The writer threads of one save and the queue of host copies waiting for them.

``WriterQueue`` runs each write job on a thread pool. Jobs wait at a *gate* (an async save opens it once its
snapshot is agreed on, a sync save at once) and for their copy to land in host memory; past ``in_flight_bytes``
queued, the caller waits for the oldest job first, so the host memory a save holds stays bounded. A queued value that
is a view (a key of a fused output) keeps its whole storage alive: the queue charges that storage, once however many
queued values share it, until the last of them leaves the queue. Consecutive
small direct writes share one job (``WriteBatch``). A job's failure is recorded as the rank's ``write_problem``
(the gathers poll it, the status exchange reports it), never raised in the writer thread.
"""

from __future__ import annotations

import concurrent.futures as futures
import threading
from collections.abc import Callable
from typing import Any

from workbench.faults import fault_point
from workbench.io.files.snapshot import HostCopy
from workbench.io.hf.save_timings import SaveClock
from workbench.run.guard import RankProblem

__all__ = ["BATCH_BYTES", "WriteBatch", "WriterQueue"]

BATCH_BYTES = 64 << 20  # direct writes handed to a writer thread together: one submit per batch, not per tensor


class WriteBatch:
    """Consecutive small writes run by one writer thread as one job; each copy is released once written."""

    def __init__(self) -> None:
        self.items: list[tuple[Any, HostCopy, str]] = []
        self.nbytes = 0
        self.current = ""  # the key being written (named when it fails)

    def add(self, job: Any, copy: HostCopy, key: str) -> None:
        """Append one write of ``copy``'s bytes."""
        self.items.append((job, copy, key))
        self.nbytes += copy.nbytes
        self.current = self.current or key

    def wait(self) -> None:
        """Wait until every copy of the batch is in host memory."""
        for _, copy, _ in self.items:
            copy.wait()

    def __call__(self) -> int:
        total = 0
        for job, copy, key in self.items:
            self.current = key
            total += job()
            copy.release()
        return total

    def release(self) -> None:
        """Free every copy (after the job; releasing twice is harmless)."""
        for _, copy, _ in self.items:
            copy.release()

    def discard(self) -> None:
        """Free every copy once no device-to-host copy is landing in it (a failed or abandoned save)."""
        for _, copy, _ in self.items:
            copy.discard()


class WriterQueue:
    """Write jobs of one rank's save on ``threads`` threads, at most ``in_flight_bytes`` of copies queued.

    ``caught(exc, stage)`` turns a writer's exception into the rank's problem (and keeps an interrupt to raise
    again); ``clock`` records the waits (gate, copy, queue) and the writing time.
    """

    def __init__(self, rank: int, threads: int, in_flight_bytes: int, clock: SaveClock,
                 caught: Callable[[BaseException, str], RankProblem], *, gated: bool) -> None:
        self.rank = rank
        self.in_flight_bytes = in_flight_bytes
        self.clock = clock
        self._caught = caught
        self._pool = futures.ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="workbench-write")
        # (job, bytes charged to it, its copies, the storage charged once for it and its sharers, else None)
        self.pending: list[tuple[futures.Future[int], int, HostCopy | WriteBatch, int | None]] = []
        self._storages: dict[int, list[int]] = {}  # storage -> [bytes, pending jobs holding it]
        self.queued_bytes = 0
        self.write_problem: RankProblem | None = None
        self.stopped = False  # the save failed or ended: queued writes are skipped
        self.gate = threading.Event()  # writers start when it opens
        if not gated:
            self.gate.set()
        self.batch = WriteBatch()  # direct writes snapshotted and not yet handed to a writer
        self._lock = threading.Lock()

    def add(self, job: Any, copy: HostCopy, key: str, *, mark: Callable[[], None]) -> None:
        """Add one write to the current batch; hand the batch to a writer once it holds ``BATCH_BYTES``."""
        self.batch.add(job, copy, key)
        if self.batch.nbytes >= BATCH_BYTES:
            self.flush(key, mark=mark)

    def flush(self, key: str, *, mark: Callable[[], None]) -> None:
        """Hand the batch to a writer thread (``mark`` first records the event its copies wait on)."""
        mark()
        if self.batch.items:
            self.queue(self.batch.nbytes, self.batch, self.batch, key)
            self.batch = WriteBatch()

    def drop_batch(self) -> None:
        """Give back the copies of the batch not handed to a writer (once they have landed), and start afresh."""
        self.batch.discard()
        self.batch = WriteBatch()

    def queue(self, nbytes: int, job: Any, copy: HostCopy | WriteBatch, key: str, *,
              storage: tuple[int, int] | None = None) -> None:
        """Hand ``job`` to a writer thread; past ``in_flight_bytes`` queued, wait for the oldest writes first.

        ``storage``: ``(id, bytes)`` of the storage ``copy`` keeps alive (a view of a larger tensor): charged instead of
        ``nbytes``, once while any queued job holds it."""
        def charge() -> int:
            if storage is None:
                return nbytes
            return 0 if storage[0] in self._storages else storage[1]

        while self.pending and self.queued_bytes + charge() > self.in_flight_bytes:
            self.gate.set()
            future, size, _, held = self.pending.pop(0)
            with self.clock.measure("queue_wait"):
                futures.wait([future])
            self.queued_bytes -= size
            if held is not None:
                entry = self._storages[held]
                entry[1] -= 1
                if not entry[1]:
                    self.queued_bytes -= entry[0]
                    del self._storages[held]
        if storage is None:
            self.queued_bytes += nbytes
        else:
            entry = self._storages.get(storage[0])
            if entry is None:
                entry = self._storages[storage[0]] = [storage[1], 0]
                self.queued_bytes += storage[1]
            entry[1] += 1
        self.pending.append((self._pool.submit(self._run, job, copy, key), 0 if storage else nbytes, copy,
                             None if storage is None else storage[0]))

    def busy(self) -> bool:
        """True while a queued write has not finished (and so not given its buffers back)."""
        return any(not future.done() for future, *_ in self.pending)

    def done(self) -> bool:
        """True when every queued write has finished."""
        return all(future.done() for future, *_ in self.pending)

    def drain(self) -> RankProblem | None:
        """Open the gate and wait for every queued write; the first problem of a writer (or a Ctrl-C while
        waiting here), else None."""
        self.gate.set()
        problem = None
        for future, *_ in self.pending:
            try:
                future.result()
            except BaseException as exc:  # _run records its own; this is a Ctrl-C while waiting here
                problem = problem or self._caught(exc, "writing its files")
                self.stopped = True  # the writes still queued are skipped
        self.pending.clear()
        self._storages.clear()
        self.queued_bytes = 0
        return problem or self.write_problem

    def close(self) -> None:
        """Stop: skip queued writes, join the threads, free the copies no writer will release. Idempotent."""
        self.stopped = True
        self.gate.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for future, _, copy, _ in self.pending:
            if future.cancelled():  # never ran, so never gave its pool buffers back
                copy.discard()
        self.batch.discard()  # snapshotted, never handed to a writer

    def _run(self, job: Any, copy: HostCopy | WriteBatch, key: str) -> int:
        """A writer thread's job. A failure is recorded (the gathers poll it), never raised."""
        try:
            with self.clock.measure("gate_wait"):
                self.gate.wait()
            if self.write_problem is not None or self.stopped:
                return 0  # the save has failed: do not keep writing
            fault_point("write", self.rank)
            with self.clock.measure("copy_wait"):
                copy.wait()
            with self.clock.measure("write"):  # the window's waits inside are moved to writeback_wait at the end
                return job()
        except BaseException as exc:  # KeyboardInterrupt too: kept for the main thread, never raised in this one
            with self._lock:
                if self.write_problem is None:
                    what = job.current if isinstance(job, WriteBatch) else key
                    self.write_problem = self._caught(exc, f"writing {what!r}")
                elif not isinstance(exc, Exception):
                    self._caught(exc, "writing")  # keeps the interrupt; the first problem stays the rank's
            return 0
        finally:
            copy.discard()  # written: already landed; skipped (a failed save): waited for before it is reused
