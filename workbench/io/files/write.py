"""Write one safetensors file with safetensors' own writer, then make it durable (fsync)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError

from workbench.errors import CheckpointError

__all__ = ["fsync_dir", "fsync_file", "write_safetensors"]


def fsync_file(path: Path | str) -> None:
    """Flush a written file's data and metadata to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path | str) -> None:
    """Flush a directory's entries (creations, renames) to stable storage."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prepare(tensors: Mapping[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors; a tensor whose memory overlaps an earlier one (tied weights) is cloned.

    safetensors refuses tensors that share memory; disjoint views of one buffer (keys split from a fused
    tensor) are fine and are not copied.
    """
    out: dict[str, torch.Tensor] = {}
    spans_of_storage: dict[int, list[tuple[int, int]]] = {}
    for key, tensor in tensors.items():
        if not isinstance(key, str):
            raise CheckpointError(f"cannot write {path}: keys must be str, got {key!r} ({type(key).__name__})")
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"cannot write {path}: key {key!r} holds a {type(tensor).__name__}, not a tensor")
        t = tensor.detach()
        if t.layout != torch.strided:
            t = t.to_dense()
        t = t.to("cpu").contiguous()
        begin = t.data_ptr()
        end = begin + t.numel() * t.element_size()
        if end > begin:
            spans = spans_of_storage.setdefault(t.untyped_storage().data_ptr(), [])
            if any(begin < e and b < end for b, e in spans):
                t = t.clone()
                spans = spans_of_storage.setdefault(t.untyped_storage().data_ptr(), [])
                begin = t.data_ptr()
                end = begin + t.numel() * t.element_size()
            spans.append((begin, end))
        out[key] = t
    return out


def write_safetensors(
    path: Path | str,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write ``tensors`` to ``path`` with ``safetensors.torch.save_file``, fsync it, return its size in bytes.

    Tensors are detached, moved to CPU and made contiguous first; the caller keeps its own tensors. A
    tensor that shares memory with an earlier key (tied weights) is copied, since safetensors refuses
    shared memory. safetensors (0.8) writes through a hidden scratch file and a rename, so ``path`` never
    holds half a file.
    The file's directory is not fsynced here (call ``fsync_dir`` once after writing every file, or let
    ``AtomicRenamePublisher.finalize`` do it).

    Raises:
        CheckpointError: a non-str key, a non-tensor value, non-str metadata, or a failed write (the path
            and the cause are named).
    """
    path = Path(path)
    meta: dict[str, str] | None = None
    if metadata is not None:
        bad = {k: v for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)}
        if bad:
            raise CheckpointError(
                f"cannot write {path}: safetensors metadata must map str to str, got {bad!r}; "
                "serialize values (json.dumps) first"
            )
        meta = dict(metadata)
    prepared = _prepare(tensors, path)
    try:
        safetensors.torch.save_file(prepared, str(path), metadata=meta)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise CheckpointError(f"writing {path} failed: {exc}") from exc
    fsync_file(path)
    return path.stat().st_size
