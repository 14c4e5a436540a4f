"""Read HF keys, or slices of them, from a safetensors checkpoint, counting the bytes read."""

from __future__ import annotations

import operator
import weakref
from pathlib import Path
from types import TracebackType

import torch

from workbench.errors import CheckpointError
from workbench.io.files.box_reads import BoxReader
from workbench.io.files.index import CheckpointIndex, KeyInfo, cached_checkpoint, torch_dtype

__all__ = ["CheckpointReader"]


class CheckpointReader:
    """Open a checkpoint once, then read whole keys or boxes of them (one ``slice`` per dim).

    Only the requested box is read, with positional reads on the calling thread (``BoxReader``: its
    span, or its runs where they lie pages apart), through the page cache; each file is opened once,
    checked to be the file the index parsed, and kept open until ``close`` (or until the reader is
    collected). After each read the file read is checked again: a file replaced or rewritten in place
    since its header was parsed is an error naming it, never bytes of another checkpoint (a memory map
    would return them, and die of SIGBUS on a file truncated under it). Each tensor returned is its
    own (not a view of a buffer shared with other reads). ``bytes_read`` counts the bytes of every
    tensor returned (elements x itemsize), so a loader can report bytes read against bytes owned (the
    goal is 1.0). It counts what was asked for, not disk traffic: a box narrow in a trailing dim is
    read as its span.

    Example::

        with CheckpointReader(path) as reader:
            rows = reader.read("model.embed_tokens.weight", (slice(0, 1024), slice(None)))
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.index: CheckpointIndex = cached_checkpoint(self.path)
        self.bytes_read = 0
        self.reads = 0
        self._boxes: BoxReader | None = None  # opened on the first read
        self._finalizer: weakref.finalize | None = None

    def keys(self) -> tuple[str, ...]:
        """Every HF key of the checkpoint, in weight-map order."""
        return tuple(self.index.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.index.keys

    def info(self, key: str) -> KeyInfo:
        """Where ``key`` lives (file, safetensors dtype, shape, offsets)."""
        try:
            return self.index.keys[key]
        except KeyError:
            close = [k for k in self.index.keys if key.rsplit(".", 1)[-1] == k.rsplit(".", 1)[-1]][:3]
            hint = f"; keys with the same suffix: {close}" if close else ""
            raise CheckpointError(
                f"key {key!r} is not in checkpoint {self.index.directory} ({len(self.index.keys)} keys){hint}"
            ) from None

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of ``key`` as stored."""
        return self.info(key).shape

    def dtype(self, key: str) -> torch.dtype:
        """The torch dtype of ``key`` as stored."""
        return torch_dtype(self.info(key).dtype)

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Read ``key``, or only the box ``index`` of it (a CPU tensor of the stored dtype).

        Args:
            key: the HF key.
            index: one ``slice(start, stop)`` per leading dim (missing trailing dims are read whole);
                bounds must lie in ``[0, size]`` and steps must be 1: safetensors would clamp or ignore
                them silently, so they are refused here. None reads the whole key.

        Raises:
            CheckpointError: the key is not in the checkpoint (named with the checkpoint), ``index``
                does not fit its shape, or a file is not (or no longer) the one the index parsed.
        """
        info = self.info(key)
        box = None if index is None else self._check_index(info, index)
        sizes = [n if box is None or d >= len(box) else box[d].stop - box[d].start for d, n in enumerate(info.shape)]
        if 0 in sizes:  # no byte to read (and no stride to read it with)
            tensor = torch.empty(sizes, dtype=torch_dtype(info.dtype))
        else:
            boxes = self._boxes
            if boxes is None:  # reads on this thread; the files close with the reader, or when it is collected
                boxes = self._boxes = BoxReader(self.index, (), threads=0, direct=False)
                self._finalizer = weakref.finalize(self, boxes.close)
            tensor = boxes.read(key, box)
            boxes.check_unchanged((info.file,))  # the parsed file's bytes: not rewritten before or while read
            if not _owns_its_storage(tensor):  # a view of a buffer shared with other reads: a tensor of its own
                tensor = tensor.clone(memory_format=torch.contiguous_format)
        self.bytes_read += tensor.numel() * tensor.element_size()
        self.reads += 1
        return tensor

    def _check_index(self, info: KeyInfo, index: tuple[slice, ...]) -> tuple[slice, ...]:
        index = tuple(index)
        where = f"key {info.hf_key!r} ({info.dtype}{list(info.shape)}) in {self.index.directory}"
        if len(index) > len(info.shape):
            raise CheckpointError(f"index has {len(index)} slices but {where} has {len(info.shape)} dims")
        out = []
        for dim, (s, size) in enumerate(zip(index, info.shape)):
            if not isinstance(s, slice):
                raise CheckpointError(f"index[{dim}] must be a slice, got {s!r} for {where}")
            if s.step not in (None, 1):
                raise CheckpointError(f"index[{dim}] = {s} has step {s.step}; only step 1 is read, for {where}")
            try:
                start = 0 if s.start is None else operator.index(s.start)
                stop = size if s.stop is None else operator.index(s.stop)
            except TypeError:
                raise CheckpointError(f"index[{dim}] = {s} needs integer bounds, for {where}") from None
            if not 0 <= start <= stop <= size:
                raise CheckpointError(
                    f"index[{dim}] = {s} does not fit dim {dim} of size {size} of {where}; "
                    "expected 0 <= start <= stop <= size"
                )
            out.append(slice(start, stop))
        return tuple(out)

    def close(self) -> None:
        """Close every open file (reading again reopens them)."""
        self._boxes = None
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer()  # closes the BoxReader, once

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointReader({str(self.path)!r}, keys={len(self.index.keys)}, files={len(self.index.files)}, "
            f"bytes_read={self.bytes_read})"
        )


def _owns_its_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is contiguous and is the whole of its storage (not a view of a buffer that holds more)."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())
