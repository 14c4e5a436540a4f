"""Writeback that keeps pace with the writes: the disk works while later bytes are still being written.

A machine with plenty of memory keeps every byte a save writes dirty in the page cache until the final
``fsync`` (the kernel starts background writeback only past ``dirty_background_ratio`` of memory, gigabytes on
a training node). The save then costs the copy into the page cache *plus* the whole disk time, one after the
other. ``WritebackWindow`` overlaps the two, as a streaming writer should: after each write it asks the kernel
to start writing that range out (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait), and
once more than ``window_bytes`` are on their way it waits for the oldest ranges to reach the disk. The final
``fsync`` then finds little left to do, and the dirty memory a save leaves behind stays bounded by the window.

This is a speed measure, never a durability one: the save still ``fsync``s every file before it publishes.
Where ``sync_file_range`` does not exist (not Linux) or a filesystem refuses it, the window turns itself off
and the ``fsync`` does all the work, as before. ``WORKBENCH_WRITEBACK_BYTES`` sets the window of the saves a
process makes (0 turns it off: the benchmark's baseline).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["DEFAULT_DEFER_BYTES", "DEFAULT_WINDOW_BYTES", "WritebackWindow", "sync_file_range"]

DEFAULT_WINDOW_BYTES = 256 << 20
DEFAULT_START_BYTES = 8 << 20  # writes of one file gathered before their writeback starts: large requests
DEFAULT_DEFER_BYTES = 128 << 20  # a range other writers share pages with starts this many bytes later

# <linux/fs.h>
START = 2  # SYNC_FILE_RANGE_WRITE: start writeback of the range's dirty pages, do not wait
WAIT = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER: the range is on the disk when the call returns

SyncFileRange = Callable[[int, int, int, int], None]


def _libc_sync_file_range() -> SyncFileRange | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int

    def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
        while call(fd, offset, nbytes, flags) != 0:
            code = ctypes.get_errno()
            if code != errno.EINTR:
                raise OSError(code, os.strerror(code))

    return sync_file_range


sync_file_range: SyncFileRange | None = _libc_sync_file_range()
"""Linux ``sync_file_range(fd, offset, nbytes, flags)`` (raises ``OSError``), or None where there is none."""


class WritebackWindow:
    """Starts writeback of every written range at once and bounds the bytes on their way to the disk.

    Thread-safe: several writer threads of one save share one window. Small writes close to each other in one
    file (a save's many small tensors) are started together once ``start_bytes`` of them are written, so the
    disk gets large requests rather than one per tensor; what is left unstarted is the final fsync's.

    Args:
        window_bytes: bytes whose writeback may be in progress before a writer waits for the oldest range (None:
            ``WORKBENCH_WRITEBACK_BYTES`` or 256 MiB; 0: off).
        start_bytes: bytes written near each other in one file before their writeback starts (0: every write).
        defer_bytes: bytes recorded after a deferred range (``wrote(defer=True)``) before its writeback starts.
        syscall: ``sync_file_range``'s stand-in (tests); None: the platform's, or no writeback where there is none.
    """

    def __init__(
        self,
        window_bytes: int | None = None,
        *,
        start_bytes: int = DEFAULT_START_BYTES,
        defer_bytes: int = DEFAULT_DEFER_BYTES,
        syscall: SyncFileRange | None = None,
    ) -> None:
        if window_bytes is None:
            window_bytes = int(os.environ.get("WORKBENCH_WRITEBACK_BYTES", DEFAULT_WINDOW_BYTES))
        self.window_bytes = window_bytes
        self.start_bytes = start_bytes
        # (fd, writer thread) -> [lo, hi, bytes] written and not started yet: each thread writes its own run of
        # tensors, so its writes lie together
        self._pending: dict[tuple[int, int], list[int]] = {}
        self._syscall = syscall if syscall is not None else sync_file_range
        self._ranges: deque[tuple[int, int, int, int]] = deque()  # (fd, offset, span, bytes), oldest first
        self._in_flight = 0
        # ranges whose pages other writers fill too: (bytes written when recorded, fd, offset, span, bytes)
        self._deferred: deque[tuple[int, int, int, int, int]] = deque()
        self._written = 0  # bytes recorded so far
        self.defer_bytes = defer_bytes
        self._lock = threading.Lock()
        self.waited_seconds = 0.0  # writers' time waiting for the oldest ranges, summed over threads
        self.disabled_by: str | None = None
        if self._syscall is None:
            self.disabled_by = "no sync_file_range on this platform"
        elif window_bytes <= 0:
            self.disabled_by = "turned off (window 0)"

    @property
    def enabled(self) -> bool:
        """False once the platform or the filesystem refused ``sync_file_range`` (the final fsync does it all)."""
        return self.disabled_by is None

    @property
    def in_flight_bytes(self) -> int:
        """Bytes whose writeback was started and not yet waited for."""
        return self._in_flight

    def wrote(self, fd: int, offset: int, span: int, nbytes: int | None = None, *, defer: bool = False) -> None:
        """Record a write into ``fd`` within ``[offset, offset + span)``: start the writeback of this thread's
        recent writes to ``fd`` once they reach ``start_bytes``; past the window, wait (in this thread) until the
        oldest ranges are on the disk.

        ``nbytes``: the bytes actually written there when the write was several segments spread over the span
        (they, not the span, count towards the window); default ``span``. ``defer``: other writers fill the rest
        of the range's pages (a column-cut tensor's halves): its writeback starts only once ``defer_bytes`` more
        were recorded, by when they have, so each page goes to the disk once rather than half-filled twice.
        """
        counted = span if nbytes is None else nbytes
        if span <= 0 or not self.enabled:
            return
        with self._lock:
            self._written += counted
            if defer:
                self._deferred.append((self._written, fd, offset, span, counted))
                ready = []
            else:
                ready = self._gather(fd, offset, offset + span, counted)
            while self._deferred and self._written - self._deferred[0][0] >= self.defer_bytes:
                ready.append(self._deferred.popleft()[1:])
        started = [r for r in ready if self._call(r[0], r[1], r[2], START)]
        if not started:
            return
        with self._lock:
            for r in started:
                self._ranges.append(r)
                self._in_flight += r[3]
            due = []
            while self._in_flight > self.window_bytes and len(self._ranges) > 1:
                oldest = self._ranges.popleft()
                self._in_flight -= oldest[3]
                due.append(oldest)
        if not due:
            return
        started_waiting = time.perf_counter()
        for fd_, offset_, span_, _ in due:  # outside the lock: other writers go on meanwhile
            self._call(fd_, offset_, span_, WAIT)
        waited = time.perf_counter() - started_waiting
        with self._lock:
            self.waited_seconds += waited

    def _gather(self, fd: int, lo: int, hi: int, counted: int) -> list[tuple[int, int, int, int]]:
        """Add a write to ``fd``'s pending hull; the ranges whose writeback is due now (under the lock)."""
        ready = []
        key = (fd, threading.get_ident())
        pending = self._pending.get(key)
        if pending is not None and (lo > pending[1] + self.start_bytes or hi < pending[0] - self.start_bytes):
            ready.append((fd, pending[0], pending[1] - pending[0], pending[2]))  # far away: start what was there
            pending = None
        if pending is None:
            pending = self._pending[key] = [lo, hi, 0]
        pending[0], pending[1], pending[2] = min(pending[0], lo), max(pending[1], hi), pending[2] + counted
        if pending[2] >= self.start_bytes:
            ready.append((fd, pending[0], pending[1] - pending[0], pending[2]))
            del self._pending[key]
        return ready

    def forget(self, fd: int) -> None:
        """Drop the ranges of a descriptor about to be closed (its fsync or abandonment covers them)."""
        with self._lock:
            for key in [k for k in self._pending if k[0] == fd]:
                del self._pending[key]
            self._deferred = deque(r for r in self._deferred if r[1] != fd)
            kept = deque(r for r in self._ranges if r[0] != fd)
            self._in_flight = sum(r[3] for r in kept)
            self._ranges = kept

    def _call(self, fd: int, offset: int, nbytes: int, flags: int) -> bool:
        if self.disabled_by is not None:
            return False
        assert self._syscall is not None
        try:
            self._syscall(fd, offset, nbytes, flags)
        except OSError as exc:
            if exc.errno in (errno.EBADF, errno.EIO, errno.ENOSPC):  # the write's own failure: fsync reports it
                return False
            self.disabled_by = f"sync_file_range refused: {exc.strerror or exc}"
            return False
        return True
