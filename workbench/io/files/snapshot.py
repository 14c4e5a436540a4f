"""Host copies of the tensors a save writes: what a writer thread may read while training goes on.

``Snapshotter.take(value)`` returns a ``HostCopy`` the writer waits on, then releases:

* a CUDA tensor is copied into a pinned buffer of the process's ``HostPool`` with a non-blocking copy and an
  event (the copy overlaps the next gathers; ``settle`` waits for every event). The copy runs on the current
  stream, so the device tensor is not kept: the caching allocator may hand its memory to a later allocation of
  that stream, whose kernels run after the copy. A gather's output is thus freed when its wave ends, as the
  memory model counts, not when a writer thread gets to its bytes;
* a CPU tensor that shares storage with one of the model's own tensors (a replicated parameter, an expert under
  the minimal policy, a same-dtype ``.to()``) is copied into a pageable pool buffer when the save is async, so a
  later ``add_`` by the optimizer cannot reach the file; a sync save writes it before returning and needs no copy;
* any other CPU tensor (the output of a gather, a cast) already belongs to the save alone and is kept as is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from workbench.io.files.host_pool import HostBuffer, HostPool, host_pool

__all__ = ["HostCopy", "Snapshotter"]


_UNMARKED = object()  # the event of a device copy taken with mark=False, until Snapshotter.mark()


@dataclass
class HostCopy:
    """A tensor on its way to host memory; ``wait()`` returns it once copied, ``release()`` frees its buffer."""

    host: torch.Tensor
    buffer: HostBuffer | None = None
    event: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor."""
        return self.host.numel() * self.host.element_size()

    def wait(self) -> torch.Tensor:
        """The host tensor, after its device-to-host copy finished."""
        if self.event is _UNMARKED:
            raise RuntimeError("a snapshot copy was waited on before Snapshotter.mark() recorded its event")
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host

    def release(self) -> None:
        """Give the pool buffer back (after the tensor is written)."""
        self.event = None
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None

    def discard(self) -> None:
        """Give the pool buffer back once no copy is still landing in it (a failed or abandoned save): a buffer
        back in the pool may be the next save's, which a late copy would overwrite. Never raises."""
        if self.buffer is not None:
            try:
                if self.event is _UNMARKED:  # no event of its own: wait for every device
                    for device in range(torch.cuda.device_count()):
                        torch.cuda.synchronize(device)
                elif self.event is not None:
                    self.event.synchronize()
            except Exception:  # the copy failed: nothing is landing any more
                pass
        self.release()


class Snapshotter:
    """Makes the ``HostCopy`` of each tensor a save writes (see the module docstring for when it copies).

    Args:
        model_tensors: the rank's own local tensors (their storages are what a caller may change later).
        own_everything: copy tensors that alias the model's storage (async saves).
        pool_bytes: capacity of the process's host pools (None: keep the current capacity).
    """

    def __init__(self, model_tensors: Iterable[torch.Tensor], *, own_everything: bool, pool_bytes: int | None) -> None:
        self._model_tensors = list(model_tensors)
        self._storages: set[tuple[str, int]] | None = None  # their storages, found on the first CPU tensor taken
        self.own_everything = own_everything
        self.pool_bytes = pool_bytes
        self._pools: dict[bool, HostPool] = {}
        self.copied_bytes = 0
        self._streams: dict[torch.device, Any] = {}  # per device, the stream its copies run on (the caller's)
        self._last: dict[torch.device, Any] = {}  # per device, the event of its latest copy
        self._unmarked: list[tuple[HostCopy, torch.device]] = []  # device copies waiting for mark()
        # called when a bounded pool is full: hands the copies taken so far to the writers, and says whether a
        # writer will give a buffer back (else the pool serves the copy beyond its capacity rather than hang)
        self.on_full: Callable[[], bool] | None = None

    def _pool(self, pinned: bool) -> HostPool:
        if pinned not in self._pools:
            self._pools[pinned] = host_pool(pinned=pinned, capacity=self.pool_bytes)
        return self._pools[pinned]

    def take(self, value: torch.Tensor, *, mark: bool = True) -> HostCopy:
        """The host copy of ``value`` that a writer thread will write.

        ``mark=False`` (a batch of copies): the device copy gets no event of its own; ``mark()`` records one for
        every such copy, and must run before any of them is handed to a writer."""
        value = value.detach()
        if value.device.type != "cpu":
            buffer = self._pool(pinned=True).acquire(tuple(value.shape), value.dtype, on_full=self.on_full)
            buffer.tensor.copy_(value, non_blocking=True)
            self.copied_bytes += value.numel() * value.element_size()
            copy = HostCopy(buffer.tensor, buffer, _UNMARKED)
            self._unmarked.append((copy, value.device))
            if mark:
                self.mark()
            return copy
        if self.own_everything and _storage_key(value) in self._model_storages():
            buffer = self._pool(pinned=False).acquire(tuple(value.shape), value.dtype, on_full=self.on_full)
            buffer.tensor.copy_(value)
            self.copied_bytes += value.numel() * value.element_size()
            return HostCopy(buffer.tensor, buffer)
        return HostCopy(value)

    def add_model_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        """More of the rank's own tensors (a snapshotter made before the model was read)."""
        self._model_tensors.extend(tensors)
        self._storages = None

    def forget_model_tensors(self) -> None:
        """Drop the references to the rank's tensors (the save is over: a handle kept must not keep the model)."""
        self._model_tensors = []
        self._storages = None

    def _model_storages(self) -> set[tuple[str, int]]:
        if self._storages is None:
            self._storages = {_storage_key(t) for t in self._model_tensors}
        return self._storages

    def mark(self) -> None:
        """Record one event per device after the copies taken so far with ``mark=False``; they wait on it (a
        device's copies run in order on one stream, so its latest event covers them all)."""
        events: dict[torch.device, Any] = {}
        for copy, device in self._unmarked:
            event = events.get(device)
            if event is None:
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = torch.cuda.current_stream(device)
                event = events[device] = torch.cuda.Event()
                event.record(stream)
            copy.event = event
        self._unmarked.clear()
        self._last.update(events)

    def settle(self) -> None:
        """Wait until every device-to-host copy made so far has landed (the snapshot is complete): a device's copies
        run in order on one stream, so its last one's event is enough."""
        self.mark()
        for event in self._last.values():
            event.synchronize()
        self._last.clear()


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (tensor.device.type, tensor.untyped_storage().data_ptr())
