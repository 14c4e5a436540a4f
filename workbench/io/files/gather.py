"""Short runs of a file read packed: one ``preadv`` per batch of runs, the bytes between them dropped.

A rank that owns half of each row of a matrix (expert tensor parallelism's ``down_proj``, a tensor-parallel
``o_proj``) owns runs shorter than a page, so the disk and the page cache give it whole pages either way. Read as
their span, every byte of the span crosses the memory bus three times: out of the page cache, into the staging
slot, and out of the slot to the GPU. Read with ``gather_runs``, the runs land packed in the slot and each gap
between two runs goes into one small scratch buffer of the calling thread, which stays in its core's cache: the
slot and the copy to the GPU carry only owned bytes. One ``preadv`` takes ``IOV_MAX`` (1,024) buffers, so a
batch is 512 runs; a gap wider than the scratch buffer starts a new batch.

``ctypes.CDLL`` releases the GIL for the call, as ``os.preadv`` does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import itertools
import os
import threading

import numpy as np

__all__ = ["SCRATCH_BYTES", "can_gather", "gather_runs"]

SCRATCH_BYTES = 64 << 10  # a reading thread's sink for the bytes between runs (gaps wider than this split a batch)
_IOV_MAX = 1024  # buffers one preadv takes (Linux's UIO_MAXIOV)
_RUNS_A_CALL = (_IOV_MAX + 1) // 2  # a run and the gap after it, the last run without one
_LIBC: list[ctypes.CDLL | None] = []
_local = threading.local()


def can_gather() -> bool:
    """Whether this platform's C library has ``preadv`` for ``gather_runs``."""
    return _preadv() is not None


def gather_runs(fd: int, offsets: np.ndarray, run: int, dest: memoryview) -> int:
    """Read the runs of ``run`` bytes at the file ``offsets`` (int64, ascending, each at least ``run`` after the
    last) into ``dest``, packed one after the other (``len(dest)`` is at least ``run * len(offsets)``). Returns the
    bytes asked of the file: the runs and the gaps between those in one batch.

    Raises:
        OSError: a read failed (``errno`` set), or the file ended before the last run (``EIO``: truncated).
    """
    preadv = _preadv()
    if preadv is None:
        raise OSError(errno.ENOSYS, "preadv is not available")
    n = len(offsets)
    if n == 0:
        return 0
    if len(dest) < run * n:
        raise ValueError(f"gather_runs: {n} runs of {run} bytes do not fit {len(dest)} bytes")
    gaps = offsets[1:] - offsets[:-1] - run
    if n > 1 and int(gaps.min()) < 0:
        raise ValueError("gather_runs: the runs overlap or are not in file order")
    base = ctypes.addressof(ctypes.c_char.from_buffer(dest))
    iov = np.empty((2 * n - 1, 2), dtype=np.uint64)
    iov[0::2, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(run)
    iov[0::2, 1] = run
    iov[1::2, 0] = _scratch().ctypes.data
    iov[1::2, 1] = gaps
    starts = [0, *(np.flatnonzero(gaps > SCRATCH_BYTES) + 1).tolist(), n]  # a wide gap ends a batch
    asked = 0
    for first, stop in itertools.pairwise(starts):
        for a in range(first, stop, _RUNS_A_CALL):
            b = min(stop, a + _RUNS_A_CALL)
            asked += _read_all(preadv, fd, iov[2 * a:2 * b - 1], int(offsets[a]))
    return asked


def _read_all(preadv: ctypes._CFuncPtr, fd: int, iov: np.ndarray, offset: int) -> int:
    """One ``preadv`` of ``iov`` (rows of address, length) at ``offset``, again from where a short one stopped."""
    want = int(iov[:, 1].sum())
    done = 0
    while done < want:
        got = preadv(fd, iov.ctypes.data, len(iov), offset + done)
        if got < 0:
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            raise OSError(code, os.strerror(code))
        if got == 0:
            raise OSError(errno.EIO, f"the file ends before byte {offset + want} (truncated?)")
        done += got
        if done < want:  # a short read: drop the buffers filled, shorten the one it stopped in
            ends = np.cumsum(iov[:, 1].astype(np.int64))
            filled = got
            k = int(np.searchsorted(ends, filled, side="right"))
            into = filled - (int(ends[k - 1]) if k else 0)
            iov = iov[k:].copy()
            iov[0, 0] += np.uint64(into)
            iov[0, 1] -= np.uint64(into)
    return want


def _scratch() -> np.ndarray:
    """The calling thread's scratch buffer (made once per thread)."""
    buffer = getattr(_local, "scratch", None)
    if buffer is None:
        buffer = _local.scratch = np.empty(SCRATCH_BYTES, dtype=np.uint8)
    return buffer


def _preadv() -> ctypes._CFuncPtr | None:
    if not _LIBC:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)  # releases the GIL per call
            lib.preadv.restype = ctypes.c_ssize_t
            lib.preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
            _LIBC.append(lib)
        except (OSError, AttributeError):
            _LIBC.append(None)
    lib = _LIBC[0]
    return None if lib is None else lib.preadv
