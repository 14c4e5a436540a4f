"""A safetensors file written as its tensors arrive: header first, then each tensor at its offset.

A save knows every key's dtype and shape before any gather runs, so each file's header (and therefore every
tensor's byte range) is fixed up front. Tensors are then written with ``os.pwrite`` from any thread, in any
order, and dropped right after: host memory holds only the tensors in flight, not whole files, and writes
overlap the next gathers. The layout is safetensors' own: an 8-byte little-endian header length, the JSON
header padded with spaces to a multiple of 8, then the data, wider dtypes first so every tensor is aligned.
``tests/io/test_stream_write.py`` proves safetensors reads what this writes, byte for byte like ``save_file``.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from workbench.errors import CheckpointError
from workbench.io.files.index import safetensors_dtype
from workbench.io.files.writeback import WritebackWindow

__all__ = ["StreamWriter", "byte_view", "safetensors_layout"]


def safetensors_layout(
    entries: Sequence[tuple[str, torch.dtype, Sequence[int]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]], int]:
    """The header of a safetensors file holding ``entries`` and where each tensor goes, before any data exists:
    ``(header JSON padded to 8 bytes, {key: (data offset, nbytes, dtype, shape)}, file size)``. Tensors are laid
    out as safetensors' ``save_file`` lays them out: wider dtypes first, the given order kept within a width."""
    order = sorted(range(len(entries)), key=lambda i: -entries[i][1].itemsize)  # stable: plan order kept
    # safetensors writes __metadata__ with its keys sorted
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    ranges: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
    offset = 0
    for i in order:
        key, dtype, shape = entries[i]
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": safetensors_dtype(dtype), "shape": list(shape),
                       "data_offsets": [offset, offset + nbytes]}
        ranges[key] = (offset, nbytes, dtype, tuple(shape))
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return text, ranges, 8 + len(text) + offset


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements in row-major order as a flat stride-1 uint8 tensor; copied only when not contiguous.

    ``contiguous()`` and ``reshape(-1)`` pass a tensor of one element (or none) whatever its stride (``table[:1, 0]``
    keeps stride 3, and so does its ``clone()``), and ``view(torch.uint8)`` refuses a last stride other than 1: for
    such a tensor a stride of 1 names the same bytes, so it is taken without a copy. A conjugate or negative view
    (``z.conj()``, whose memory holds the values before the sign flips) is resolved into the values it shows."""
    flat = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() <= 1:
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


class StreamWriter:
    """One safetensors file whose tensors are written one by one, possibly from several threads.

    Args:
        path: the file to create.
        entries: ``(key, dtype, shape)`` of every tensor the file will hold.
        metadata: the header's ``__metadata__`` (strings only).
        writeback: starts the disk writes as tensors arrive (shared by a save's files; a fresh window by default).
    """

    def __init__(
        self,
        path: Path | str,
        entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
        writeback: WritebackWindow | None = None,
    ) -> None:
        self.path = Path(path)
        self.writeback = writeback if writeback is not None else WritebackWindow()
        text, self._ranges, self.size = safetensors_layout(entries, metadata)
        self._data_start = 8 + len(text)
        self._pending = set(self._ranges)
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(self._fd, struct.pack("<Q", len(text)) + text, 0)
            os.ftruncate(self._fd, self.size)
        except OSError as exc:
            os.close(self._fd)
            raise CheckpointError(f"cannot write {self.path}: {exc.strerror}") from None

    def write(self, key: str, tensor: torch.Tensor) -> int:
        """Write one tensor at its place (any thread, any order); returns the bytes written."""
        if key not in self._ranges:
            raise CheckpointError(f"{self.path.name}: key {key!r} is not in this file's header")
        offset, nbytes, dtype, shape = self._ranges[key]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(f"{self.path.name}: key {key!r} is {tensor.dtype} {tuple(tensor.shape)}, the "
                                  f"header says {dtype} {shape}")
        with self._lock:
            if key not in self._pending:
                raise CheckpointError(f"{self.path.name}: key {key!r} was written twice")
            self._pending.discard(key)
        data = byte_view(tensor.detach().to("cpu")).numpy()
        view = memoryview(data)
        done = 0
        while done < nbytes:  # pwrite may write less than asked
            done += os.pwrite(self._fd, view[done:], self._data_start + offset + done)
        self.writeback.wrote(self._fd, self._data_start + offset, nbytes)
        return nbytes

    @property
    def missing(self) -> tuple[str, ...]:
        """Keys not written yet."""
        return tuple(sorted(self._pending))

    def close(self) -> int:
        """fsync and close; returns the file size. Raises if a key was never written (the file is incomplete)."""
        if self._fd < 0:
            raise CheckpointError(f"{self.path.name}: closed already")
        try:
            if self._pending:
                raise CheckpointError(f"{self.path.name}: {len(self._pending)} key(s) never written, e.g. "
                                      f"{self.missing[:3]}; the file is incomplete")
            os.fsync(self._fd)
        finally:
            self.abandon()
        return self.size

    def abandon(self) -> None:
        """Close without fsync (a failed save: the file is deleted with its directory). Idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            self.writeback.forget(fd)
            os.close(fd)
