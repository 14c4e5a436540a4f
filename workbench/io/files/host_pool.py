"""HostPool: host buffers a save owns, reused across saves, with a bound on the bytes they hold.

An async save must copy every byte it will write before it returns, into memory the caller cannot touch: the
snapshot. A GPU save copies device tensors into *pinned* host memory (so the copy runs on the copy engine,
overlapping the next gathers). Allocating pinned memory is slow (page locking), so buffers go back to the pool
after their tensor is written and the next save reuses them.

Bound and behaviour when full: the pool never holds more than ``capacity`` bytes (buffers handed out plus free
ones). ``acquire`` first reuses a free buffer of the right size class (sizes are rounded up to a power of two,
at least 1 MiB), then frees idle buffers of other classes to make room, and when the bytes handed out already
reach the capacity it **waits** until a writer gives one back. A save therefore blocks, never over-allocates:
an async save whose share of the checkpoint exceeds the capacity returns only once enough of it is written.
One request larger than the capacity is served alone (it waits until the pool is empty) so it cannot deadlock.
A save may itself hold the buffers it waits for (copies not yet handed to its writers, writers gated until its
snapshot is complete): its ``on_full`` hands them over and opens the gate, and when no writer is left to give
one back the request is served beyond the capacity, as an oversized one is, rather than waiting forever.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

__all__ = ["DEFAULT_POOL_BYTES", "HostBuffer", "HostPool", "host_pool", "trim_host_pools"]

DEFAULT_POOL_BYTES = 4 << 30
_MIN_CLASS = 1 << 20


@dataclass(eq=False)
class HostBuffer:
    """One buffer handed out by a pool; ``tensor`` views its first ``nbytes`` with the caller's dtype/shape."""

    storage: torch.Tensor  # uint8, the whole size class
    tensor: torch.Tensor
    pool: HostPool | None = field(default=None, repr=False)

    def release(self) -> None:
        """Give the buffer back (idempotent)."""
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool._give_back(self.storage)


class HostPool:
    """A bounded pool of host buffers (pinned when ``pinned``); thread-safe.

    Args:
        capacity: the most bytes the pool holds, free and handed out together.
        pinned: page-locked buffers (for device-to-host copies); needs CUDA.
    """

    def __init__(self, capacity: int = DEFAULT_POOL_BYTES, *, pinned: bool = False) -> None:
        self.capacity = int(capacity)
        self.pinned = pinned
        self._free: dict[int, list[torch.Tensor]] = {}
        self._held = 0  # bytes of every buffer the pool owns (free and handed out)
        self._out = 0  # bytes handed out
        self._cond = threading.Condition()
        self.allocations = 0  # buffers ever allocated (reuse shows as a count that stops growing)

    @staticmethod
    def size_class(nbytes: int) -> int:
        """The buffer size serving ``nbytes``: a power of two, at least 1 MiB."""
        return max(_MIN_CLASS, 1 << max(0, math.ceil(math.log2(max(nbytes, 1)))))

    def acquire(
        self, shape: tuple[int, ...], dtype: torch.dtype, *, on_full: Callable[[], bool] | None = None
    ) -> HostBuffer:
        """A buffer for a tensor of ``shape`` and ``dtype``; waits while the pool is full (see the module doc).

        ``on_full`` (a caller that may itself hold the buffers it waits for): called, without the pool's lock,
        each time the pool is found full; it hands what the caller holds to whoever gives buffers back, and
        returns False when nobody will, and the buffer is then allocated beyond the capacity instead of waiting
        forever (given back, it is dropped, like an oversized request's)."""
        nbytes = math.prod(shape) * dtype.itemsize
        size = self.size_class(nbytes)
        nobody = False  # on_full said no writer will give a buffer back
        while True:
            with self._cond:
                storage = self._take_or_allocate(size)
                while storage is None and on_full is None:
                    self._cond.wait()
                    storage = self._take_or_allocate(size)
                if storage is None and nobody:
                    storage = self._allocate(size)
                if storage is not None:
                    self._out += storage.numel()
                    break
            assert on_full is not None
            nobody = not on_full()
            if not nobody:
                with self._cond:  # a buffer given back between on_full and this wait wakes nobody: bounded
                    self._cond.wait(timeout=0.05)
        view = storage[:nbytes].view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)
        return HostBuffer(storage, view, self)

    def _take_or_allocate(self, size: int) -> torch.Tensor | None:
        """A free buffer of class ``size``, or a new one when it fits (idle buffers evicted to make room) or the
        pool is empty; None when the pool is full. Holds the lock."""
        storage = self._take_free(size)
        if storage is not None:
            return storage
        if self._held + size > self.capacity:
            self._evict(self._held + size - self.capacity)
        if self._held + size <= self.capacity or self._held == 0:
            return self._allocate(size)
        return None

    def reserve(self, sizes: Iterable[int]) -> int:
        """Allocate now the buffers that requests of these byte sizes, all held at once, would need, so a later
        save pays no allocation (pinning, first touch) while it blocks its caller. Free buffers the pool has
        count; the capacity grows to hold them. Returns the bytes allocated."""
        wanted: dict[int, int] = {}
        for nbytes in sizes:
            size = self.size_class(nbytes)
            wanted[size] = wanted.get(size, 0) + 1
        with self._cond:
            owned = {size: len(free) for size, free in self._free.items()}
            shortfall = {size: n - owned.get(size, 0) for size, n in wanted.items() if n > owned.get(size, 0)}
            added = sum(size * n for size, n in shortfall.items())
            self.capacity = max(self.capacity, self._held + added)
            for size, n in shortfall.items():
                for _ in range(n):
                    storage = self._allocate(size)
                    if not self.pinned:
                        storage.zero_()  # fault the pages in now, not during the save
                    self._free.setdefault(size, []).append(storage)
            self._cond.notify_all()
        return added

    def _take_free(self, size: int) -> torch.Tensor | None:
        """A free buffer of class ``size``, else the smallest free one up to 4x larger (a reserved buffer serves
        a smaller piece), else None."""
        free = self._free.get(size)
        if free:
            return free.pop()
        larger = [s for s in self._free if size < s <= 4 * size and self._free[s]]
        return self._free[min(larger)].pop() if larger else None

    def _allocate(self, size: int) -> torch.Tensor:
        self._held += size
        self.allocations += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)

    def _evict(self, needed: int) -> None:
        """Drop idle buffers (largest classes first) until ``needed`` bytes are freed or none is idle."""
        for size in sorted(self._free, reverse=True):
            while self._free[size] and needed > 0:
                self._free[size].pop()
                self._held -= size
                needed -= size

    def trim(self) -> int:
        """Drop every idle buffer (those handed out stay theirs, and return here when given back); the bytes freed."""
        with self._cond:
            freed = sum(size * len(buffers) for size, buffers in self._free.items())
            self._free.clear()
            self._held -= freed
            return freed

    def _give_back(self, storage: torch.Tensor) -> None:
        with self._cond:
            size = storage.numel()
            self._out -= size
            if self._held > self.capacity:  # an oversized request: do not keep it
                self._held -= size
            else:
                self._free.setdefault(size, []).append(storage)
            self._cond.notify_all()

    @property
    def bytes_held(self) -> int:
        """Bytes of every buffer the pool owns now."""
        return self._held

    @property
    def bytes_out(self) -> int:
        """Bytes handed out and not given back."""
        return self._out

    def __repr__(self) -> str:
        return (
            f"HostPool(capacity={self.capacity}, pinned={self.pinned}, held={self._held}, out={self._out}, "
            f"allocations={self.allocations})"
        )


_POOLS: dict[bool, HostPool] = {}
_POOLS_LOCK = threading.Lock()


def host_pool(*, pinned: bool, capacity: int | None = None) -> HostPool:
    """The process-wide pool (one pinned, one pageable), reused by every save; ``capacity`` resizes it."""
    with _POOLS_LOCK:
        pool = _POOLS.get(pinned)
        if pool is None:
            pool = _POOLS[pinned] = HostPool(capacity or DEFAULT_POOL_BYTES, pinned=pinned)
        elif capacity is not None:
            pool.capacity = int(capacity)
        return pool


def trim_host_pools() -> int:
    """Drop the idle buffers of both process-wide pools and give their memory back to the system; the bytes freed.
    (glibc keeps freed heap memory for later allocations, and serves buffers of tens of MiB from its heap once it
    has freed a mapping that large: ``malloc_trim`` returns it. Elsewhere the allocator decides.)"""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
    freed = sum(pool.trim() for pool in pools)
    if freed:
        gc.collect()  # a buffer in a reference cycle
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    return freed
