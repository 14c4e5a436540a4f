"""Tensors to compare, read in bounded row blocks: keys of a safetensors checkpoint, or of a state dict.

Checkpoint reads use ``os.pread`` at the byte offsets the header gives (no memory map, so pages read do
not stay in the process's RSS): a block of rows is ``rows x row bytes`` and nothing more is allocated.
``fingerprint`` hashes a key's raw bytes in blocks, so equal tensors are recognised without holding them.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from workbench.io.files.index import CheckpointIndex, safetensors_dtype, torch_dtype

__all__ = ["CheckpointSource", "KeyMeta", "MemorySource", "Source", "rows_per_block"]

DEFAULT_BLOCK_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)
class KeyMeta:
    """A key's stored dtype (safetensors string, e.g. ``"BF16"``), shape and byte count."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype, or None for dtypes torch lacks (F4, F6): those are compared as bytes only."""
        try:
            return torch_dtype(self.dtype)
        except ValueError:
            return None

    @property
    def rows(self) -> int:
        """Length of dim 0 (1 for a scalar)."""
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        """Bytes of one dim-0 slice."""
        return self.nbytes // self.rows if self.rows else 0


def rows_per_block(meta: KeyMeta, block_bytes: int, expand: int = 1) -> int:
    """Rows of ``meta`` per block so that ``expand`` x the block's bytes stay within ``block_bytes``."""
    return max(1, block_bytes // max(1, meta.row_bytes * expand))


class Source(Protocol):
    """What a diff reads from each side."""

    label: str

    def metas(self) -> Mapping[str, KeyMeta]:
        """``{key: KeyMeta}`` in the source's order."""
        ...

    def read_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of dim 0 (a scalar is one row), in the stored dtype."""
        ...

    def read_raw(self, key: str, start: int, stop: int) -> bytes | bytearray:
        """Bytes ``start:stop`` of the key's data."""
        ...

    def fingerprint(self, key: str) -> str:
        """A hash of the key's dtype, shape and raw bytes."""
        ...


def _hash(meta: KeyMeta, source: Source, key: str, block_bytes: int) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{meta.dtype}{list(meta.shape)}".encode())
    for begin in range(0, meta.nbytes, block_bytes):
        digest.update(source.read_raw(key, begin, min(begin + block_bytes, meta.nbytes)))
    return digest.hexdigest()


class CheckpointSource:
    """Read keys of a parsed checkpoint (``CheckpointIndex``) by byte range, with bounded buffers.

    Args:
        index: the parsed checkpoint; only its keys (those with a readable header) are offered.
        block_bytes: the largest read a fingerprint makes at once.
    """

    def __init__(self, index: CheckpointIndex, *, block_bytes: int = DEFAULT_BLOCK_BYTES, label: str = "") -> None:
        self.index = index
        self.label = label or str(index.directory)
        self.block_bytes = block_bytes
        self.bytes_read = 0
        self._metas = {k: KeyMeta(i.dtype, i.shape, i.nbytes) for k, i in index.keys.items()}
        self._fds: dict[str, int] = {}
        self._data_start: dict[str, int] = {}
        self._fingerprints: dict[str, str] = {}

    def metas(self) -> Mapping[str, KeyMeta]:
        return self._metas

    def _fd(self, file: str) -> tuple[int, int]:
        fd = self._fds.get(file)
        if fd is None:
            fd = os.open(self.index.path_of(file), os.O_RDONLY)
            self._fds[file] = fd
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            self._data_start[file] = 8 + n
        return fd, self._data_start[file]

    def read_raw(self, key: str, start: int, stop: int) -> bytearray:
        info = self.index.keys[key]
        fd, data = self._fd(info.file)
        length = stop - start
        out = bytearray(length)
        view = memoryview(out)
        got = 0
        while got < length:
            n = os.preadv(fd, [view[got:]], data + info.data_offsets[0] + start + got)
            if n <= 0:
                raise OSError(f"{self.index.path_of(info.file)}: short read of key {key!r} (file truncated?)")
            got += n
        self.bytes_read += length
        return out

    def read_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        meta = self._metas[key]
        dtype = meta.torch_dtype
        if dtype is None:
            raise ValueError(f"key {key!r} has dtype {meta.dtype}, which torch cannot hold")
        raw = self.read_raw(key, start * meta.row_bytes, stop * meta.row_bytes)
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape((stop - start, *meta.shape[1:]) if meta.shape else (1,))

    def fingerprint(self, key: str) -> str:
        found = self._fingerprints.get(key)
        if found is None:
            found = self._fingerprints[key] = _hash(self._metas[key], self, key, self.block_bytes)
        return found

    def close(self) -> None:
        """Close every file descriptor."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class MemorySource:
    """A state dict (or a module's state dict) offered as a source; DTensors are gathered by ``full_tensor``."""

    def __init__(self, tensors: Mapping[str, Any], *, label: str = "state dict") -> None:
        self.label = label
        self._tensors: dict[str, torch.Tensor] = {}
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                continue
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            self._tensors[str(key)] = full.detach().to("cpu").contiguous()
        self._metas = {
            k: KeyMeta(safetensors_dtype(t.dtype), tuple(t.shape), t.numel() * t.element_size())
            for k, t in self._tensors.items()
        }
        self._fingerprints: dict[str, str] = {}

    def metas(self) -> Mapping[str, KeyMeta]:
        return self._metas

    def _bytes(self, key: str) -> torch.Tensor:
        t = self._tensors[key].resolve_conj().resolve_neg()  # the values a conjugate or negative view shows
        return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)

    def read_raw(self, key: str, start: int, stop: int) -> bytes:
        return self._bytes(key)[start:stop].numpy().tobytes()

    def read_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        t = self._tensors[key]
        return t.reshape(1) if t.dim() == 0 else t[start:stop]

    def fingerprint(self, key: str) -> str:
        found = self._fingerprints.get(key)
        if found is None:
            meta = self._metas[key]
            found = self._fingerprints[key] = _hash(meta, self, key, DEFAULT_BLOCK_BYTES)
        return found
