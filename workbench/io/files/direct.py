"""Direct writes: every rank writes the bytes it holds straight into the final safetensors files, no gather.

A safetensors file is a header plus each tensor's bytes in row-major order, and the header is fixed before any
data moves (``safetensors_layout``). A rank's piece of an HF key is a box (``LoadSpec.key_regions``), and a box
of a row-major tensor is a set of equally long contiguous byte segments: as many as the box has index tuples over
its dims up to the last one it cuts short. So each rank writes its boxes with ``pwrite`` at their offsets, into
files rank 0 created at full size, and the checkpoint is the same bytes ``save_file`` would write.

What this module decides, with rank-independent arithmetic only (every rank must come to the same answer):

* **which tensors are written directly** (``direct_names``): those whose pieces are long enough on rank 0 (at
  least ``min_segment_bytes`` per segment on average, or one segment per key piece); the others (e.g. TP over
  the last dim of a small matrix: many short rows) are gathered to a writer as before;
* **who writes a replicated piece** (``writes_piece``): among the ranks holding the same box (HSDP replicas, a
  replicated norm), the one whose coordinate over the replicating mesh dims equals the key's index modulo the
  number of replicas, which spreads replicated keys over the replicas.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import math
import mmap
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench.errors import CheckpointError
from workbench.io.files.file_plan import FilePlan
from workbench.io.files.stream_write import byte_view, safetensors_layout
from workbench.io.files.writeback import WritebackWindow
from workbench.io.files.written_ranges import WrittenRanges, pack, packed_tiling_problems
from workbench.layout.load_spec import KeyRegion, LoadSpec
from workbench.layout.model_layout import Layout
from workbench.memo import LRU, remember_by_identity
from workbench.mesh import MeshSpec

__all__ = [
    "DEFAULT_MIN_SEGMENT_BYTES",
    "CheckpointFiles",
    "DirectStep",
    "KeySlot",
    "box",
    "direct_names",
    "direct_program",
    "replicating_dims",
    "segment_starts",
    "writes_piece",
]

DEFAULT_MIN_SEGMENT_BYTES = 64 << 10


def segment_starts(key_shape: Sequence[int], key_offset: Sequence[int], sizes: Sequence[int]) -> tuple[np.ndarray, int]:
    """Where a box of a row-major tensor lies: ``(start element of each segment, elements per segment)``.

    Dims after the last one the box cuts short are whole, so each index tuple over the dims up to and including
    that one starts one contiguous segment; the segments follow each other in the box's own row-major order.
    """
    ndim = len(key_shape)
    if ndim == 0:
        return np.zeros(1, dtype=np.int64), 1
    strides = [math.prod(key_shape[i + 1 :]) for i in range(ndim)]
    last = ndim - 1
    while last > 0 and sizes[last] == key_shape[last]:
        last -= 1
    run = sizes[last] * strides[last]
    starts = np.array([key_offset[last] * strides[last]], dtype=np.int64)
    for dim in range(last - 1, -1, -1):
        offsets = (np.arange(sizes[dim], dtype=np.int64) + key_offset[dim]) * strides[dim]
        starts = (offsets[:, None] + starts[None, :]).reshape(-1)
    return starts, run


def replicating_dims(spec: LoadSpec) -> tuple[int, ...]:
    """Indices of the mesh dims no cut of ``spec`` uses: ranks differing only there hold the same data."""
    return spec.memo("replicating_dims", lambda: _replicating_dims(spec))


def _replicating_dims(spec: LoadSpec) -> tuple[int, ...]:
    used: set[str] = set()
    for d in spec.shards:
        used.update((d.mesh_dim,) if isinstance(d.mesh_dim, str) else d.mesh_dim)
    return tuple(i for i, name in enumerate(spec.mesh.dim_names) if name not in used)


def writes_piece(spec: LoadSpec, mesh: MeshSpec, rank: int, key_index: int) -> bool:
    """True when ``rank`` writes its piece of the key with global index ``key_index`` (see the module doc)."""
    dims = replicating_dims(spec)
    if not dims:
        return True
    coord = mesh.coordinate(rank)
    replica, count = 0, 1
    for i in dims:
        replica = replica * mesh.shape[i] + coord[i]
        count *= mesh.shape[i]
    return replica == key_index % count


def direct_names(
    layout: Layout, key_meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], min_segment_bytes: int
) -> tuple[str, ...]:
    """The parameters written directly: rank 0's pieces have long segments, or one segment per key piece."""
    out = []
    for name, spec in layout.specs.items():
        regions = spec.key_regions(0)
        if not regions:
            out.append(name)
            continue
        itemsize = key_meta[spec.hf_keys[0]][0].itemsize
        segments = total = 0
        for region in regions:
            starts, run = segment_starts(_key_shape(spec), region.key_offset, region.sizes)
            segments += len(starts)
            total += len(starts) * run * itemsize
        if segments == len(regions) or total / segments >= min_segment_bytes:
            out.append(name)
    return tuple(out)


def _key_shape(spec: LoadSpec) -> tuple[int, ...]:
    from workbench.plan.load_plan import expected_key_shape

    return tuple(expected_key_shape(spec))


DirectStep = tuple[str, torch.dtype | None, tuple[KeyRegion, ...]]
"""One direct tensor of a rank's program: its name, the save dtype when the rank writes it whole (else None),
and the pieces the rank writes."""

_PROGRAMS = LRU(16)


def direct_program(
    layout: Layout, key_meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], direct: tuple[str, ...], rank: int
) -> tuple[DirectStep, ...]:
    """For each direct tensor, in order: its name, the save dtype when the rank writes it whole (every piece is
    the rank's and of one dtype: one snapshot of the local tensor) else None, and the pieces the rank writes
    (replicated pieces: only the replica ``writes_piece`` picks). Remembered per layout, key metadata (the very
    objects), direct names and rank."""

    def build() -> tuple[DirectStep, ...]:
        key_index = {k: i for i, k in enumerate(layout.hf_keys)}
        steps = []
        for name in direct:
            spec = layout.specs[name]
            regions = spec.key_regions(rank)
            mine = tuple(r for r in regions if writes_piece(spec, layout.mesh, rank, key_index[r.hf_key]))
            dtypes = {key_meta[r.hf_key][0] for r in mine}
            whole = len(mine) > 1 and len(mine) == len(regions) and len(dtypes) == 1
            steps.append((name, dtypes.pop() if whole else None, mine))
        return tuple(steps)

    return remember_by_identity(_PROGRAMS, (layout, key_meta), (direct, rank), build)


def box(region: KeyRegion) -> tuple[slice, ...]:
    """The index of a key region in its rank's local tensor."""
    return tuple(slice(o, o + n) for o, n in zip(region.local_offset, region.sizes))


@dataclass(frozen=True, slots=True)
class KeySlot:
    """Where one HF key's bytes go: its file, the byte offset of its data in that file, its dtype and shape."""

    file: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class CheckpointFiles:
    """Every file of a direct-write save: rank 0 creates them at full size; every rank writes pieces into them.

    Args:
        directory: the temporary directory of the save.
        file_plan: which keys go to which file.
        key_meta: ``{key: (save dtype, shape)}``.
        metadata: the safetensors ``__metadata__`` of every file.
        writeback: starts the disk writes as the pieces arrive (a fresh window by default).
        map_short_runs: write boxes whose contiguous runs are shorter than ``MAPPED_RUN_BYTES`` through a shared
            memory map of the file (one strided copy per box, no system call per run). Only where every writer
            shares one page cache (all ranks on one host): two ranks fill the two halves of the same pages.
    """

    def __init__(
        self,
        directory: Path,
        file_plan: FilePlan,
        key_meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: Mapping[str, str],
        writeback: WritebackWindow | None = None,
        *,
        map_short_runs: bool = False,
    ) -> None:
        self.directory = directory
        self.map_short_runs = map_short_runs
        self.mapped_boxes = 0  # boxes written through a memory map
        self.writeback = writeback if writeback is not None else WritebackWindow()
        self.slots, self.headers, self.data_bytes = _files_layout(file_plan, key_meta, metadata)
        self._fds: dict[str, int] = {}
        self._file_names: list[str] = []
        self._file_indices: dict[str, int] = {}
        self._lock = threading.Lock()
        self.written: dict[str, int] = {}  # data bytes this rank wrote, per file
        self.ranges = WrittenRanges()  # the byte ranges it wrote, per file: rank 0 proves they tile every file
        self.header_bytes = 0  # header bytes this rank wrote (rank 0, which creates the files)

    def create_all(self) -> int:
        """Rank 0: every file with its header, truncated to its full size (its data still zeros); returns the
        header bytes written."""
        import struct

        self.header_bytes = sum(8 + len(text) for text, _ in self.headers.values())
        for name, (text, size) in self.headers.items():
            fd = os.open(self.directory / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.pwrite(fd, struct.pack("<Q", len(text)) + text, 0)
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        return self.header_bytes

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                try:
                    fd = os.open(self.directory / name, os.O_RDWR)  # read too: a shared map needs it
                except OSError as exc:
                    raise CheckpointError(f"cannot open {self.directory / name} for writing: {exc.strerror}") from None
                self._fds[name] = fd
            return fd

    def write_piece(self, region: KeyRegion, piece: torch.Tensor) -> int:
        """Write one box of a key (``piece``: the box's elements, contiguous, in the key's save dtype)."""
        slot = self.slots[region.hf_key]
        if piece.dtype != slot.dtype or tuple(piece.shape) != tuple(region.sizes):
            raise CheckpointError(
                f"{region.hf_key}: piece is {piece.dtype} {tuple(piece.shape)}, expected {slot.dtype} {region.sizes}"
            )
        source = _bytes_of(piece.detach())
        return self._write_mapped(region, source) if self._mapped(region) else self._pwrite_box(region, source)

    def _pwrite_box(self, region: KeyRegion, source: np.ndarray) -> int:
        """One ``pwrite`` per run of the box (``source``: its elements as ``(*sizes, itemsize)`` bytes)."""
        slot = self.slots[region.hf_key]
        starts, run = segment_starts(slot.shape, region.key_offset, region.sizes)
        data = memoryview(np.ascontiguousarray(source).reshape(-1))
        fd = self._fd(slot.file)
        itemsize = slot.dtype.itemsize
        step = run * itemsize
        offsets = starts.tolist()
        for i, start in enumerate(offsets):
            _pwrite_all(fd, data[i * step : (i + 1) * step], slot.offset + start * itemsize)
        self.ranges.add_runs(slot.file, slot.offset + starts * itemsize, step)
        first = slot.offset + offsets[0] * itemsize
        self.writeback.wrote(fd, first, slot.offset + offsets[-1] * itemsize + step - first, len(data))
        with self._lock:
            self.written[slot.file] = self.written.get(slot.file, 0) + len(data)
        return len(data)

    def write_local(self, regions: Sequence[KeyRegion], local: torch.Tensor) -> int:
        """Write the boxes ``regions`` of ``local`` (a rank's whole local tensor, in the save dtype).

        The boxes' segments are laid side by side in memory and, for consecutive keys of one file, on disk too (a
        fused tensor's keys follow each other in its file): runs contiguous in both are merged into one ``pwrite``,
        so a rank's 32 experts of one layer are one write, not 32 (or 64 half-rows)."""
        if not regions:
            return 0
        dtype = self.slots[regions[0].hf_key].dtype
        if local.dtype != dtype:
            raise CheckpointError(f"{regions[0].hf_key}: local tensor is {local.dtype}, expected {dtype}")
        for region in regions:
            if self.slots[region.hf_key].dtype != dtype:
                raise CheckpointError(
                    f"{region.hf_key}: saved as {self.slots[region.hf_key].dtype}, the tensor's other keys as {dtype}"
                )
        local = local.contiguous()  # a view (a transposed weight, say) is copied once; the boxes index it row-major
        total = 0
        if self.map_short_runs:
            mapped, regions = _split(regions, self._mapped)
            if mapped:
                whole = _bytes_of(local)
                total = sum(self._write_mapped(r, whole[box(r)]) for r in mapped)
                if not regions:
                    return total
        data = memoryview(byte_view(local).numpy())
        itemsize = dtype.itemsize
        files, starts, file_starts, lengths = [], [], [], []
        for region in regions:
            slot = self.slots[region.hf_key]
            at, to, run = _box_segments(tuple(local.shape), slot.shape, region.local_offset, region.key_offset,
                                        tuple(region.sizes))
            files.append(np.full(len(at), self._file_index(slot.file), dtype=np.int64))
            starts.append(at * itemsize)
            file_starts.append(slot.offset + to * itemsize)
            lengths.append(np.full(len(at), run * itemsize, dtype=np.int64))
        file_of, start, file_start, length = (np.concatenate(x) for x in (files, starts, file_starts, lengths))
        # a run continues the previous one when it follows it in memory and in the same file
        joined = np.zeros(len(start), dtype=bool)
        joined[1:] = ((file_of[1:] == file_of[:-1]) & (start[1:] == start[:-1] + length[:-1])
                      & (file_start[1:] == file_start[:-1] + length[:-1]))
        heads = np.flatnonzero(~joined)
        ends = np.append(heads[1:], len(start))
        for head, end in zip(heads.tolist(), ends.tolist()):
            name = self._file_names[file_of[head]]
            lo, size = int(start[head]), int(start[end - 1] + length[end - 1] - start[head])
            fd = self._fd(name)
            _pwrite_all(fd, data[lo : lo + size], int(file_start[head]))
            self.ranges.add_runs(name, [int(file_start[head])], size)
            self.writeback.wrote(fd, int(file_start[head]), size)
            with self._lock:
                self.written[name] = self.written.get(name, 0) + size
            total += size
        return total

    def _mapped(self, region: KeyRegion) -> bool:
        """True when ``region`` goes through a memory map: a shared page cache, and many short runs (a few short
        runs cost a few ``pwrite``s)."""
        if not self.map_short_runs or not region.sizes:
            return False
        slot = self.slots[region.hf_key]
        run = _run_elements(slot.shape, tuple(region.sizes))
        return run * slot.dtype.itemsize < MAPPED_RUN_BYTES and math.prod(region.sizes) >= MAPPED_MIN_RUNS * run

    def _write_mapped(self, region: KeyRegion, source: np.ndarray) -> int:
        """Copy ``source`` (the box's elements as ``(*sizes, itemsize)`` bytes) into the file through a shared map
        of the pages the box spans: one strided copy, however many runs it has."""
        slot = self.slots[region.hf_key]
        sizes = tuple(region.sizes)
        itemsize = slot.dtype.itemsize
        if math.prod(sizes) == 0:
            return 0
        strides = [itemsize * math.prod(slot.shape[d + 1 :]) for d in range(len(slot.shape))]
        first = slot.offset + sum(o * st for o, st in zip(region.key_offset, strides))
        last = first + sum((n - 1) * st for n, st in zip(sizes, strides)) + itemsize
        base = first - first % mmap.ALLOCATIONGRANULARITY
        fd = self._fd(slot.file)
        # the file is sparse: a store into a hole on a full disk is a SIGBUS, so the blocks are allocated first,
        # where a full disk is an ordinary error (and where the filesystem cannot, the runs are pwritten). A store
        # dirties its whole page, so whole pages are allocated (a page may span several blocks)
        page_first = first - first % mmap.PAGESIZE
        page_last = min(-(-last // mmap.PAGESIZE) * mmap.PAGESIZE, self.headers[slot.file][1])
        if not _allocate(fd, page_first, page_last - page_first):
            return self._pwrite_box(region, source)
        with mmap.mmap(fd, last - base, offset=base) as mapping:
            pages = np.frombuffer(mapping, dtype=np.uint8)
            try:
                np.lib.stride_tricks.as_strided(pages[first - base :], (*sizes, itemsize), (*strides, 1))[...] = source
            finally:
                del pages  # the map closes only once no array views it (on the way out of a failed copy too)
        nbytes = math.prod(sizes) * itemsize
        self.ranges.add_box(slot.file, first, strides, sizes, itemsize)  # the elements the strided copy filled
        with self._lock:
            self.written[slot.file] = self.written.get(slot.file, 0) + nbytes
            self.mapped_boxes += 1
        self.writeback.wrote(fd, first, last - first, nbytes, defer=True)
        return nbytes

    def _file_index(self, name: str) -> int:
        with self._lock:
            index = self._file_indices.get(name)
            if index is None:
                index = self._file_indices[name] = len(self._file_names)
                self._file_names.append(name)
            return index

    def fsync(self) -> None:
        """fsync every file this rank wrote into (each client flushes its own pages on a shared filesystem)."""
        for fd in list(self._fds.values()):
            os.fsync(fd)

    def close(self) -> None:
        """Close every descriptor (idempotent). Each one is closed even when an earlier close fails (a network
        filesystem may report a deferred write error there); the first failure is raised after, naming its file."""
        with self._lock:
            fds, self._fds = dict(self._fds), {}
        failed: OSError | None = None
        for name, fd in fds.items():
            self.writeback.forget(fd)
            try:
                os.close(fd)
            except OSError as exc:
                failed = failed or OSError(exc.errno, f"closing {self.directory / name}: {exc.strerror}")
        if failed is not None:
            raise failed

    def written_ranges(self) -> bytes:
        """This rank's written byte ranges, compacted and packed: what it sends with its status (``written_ranges``
        module)."""
        return pack(self.ranges.compacted(), sorted(self.headers))

    def coverage_problems(self, ranges_by_rank: Sequence[bytes | None]) -> list[str]:
        """Rank 0, before publishing: why the byte ranges every rank wrote (``written_ranges``, in rank order) do not
        tile every file's data exactly once (a gap, a byte written twice, a write outside the data); empty when
        they do."""
        regions = {name: (size - self.data_bytes[name], size) for name, (_, size) in self.headers.items()}
        return packed_tiling_problems(regions, ranges_by_rank, self._describe)

    def _describe(self, name: str, start: int, end: int) -> str:
        """The keys (and their element ranges) that bytes ``[start, end)`` of file ``name`` hold."""
        parts = []
        for key, slot in self.slots.items():
            size = math.prod(slot.shape) * slot.dtype.itemsize
            lo, hi = max(start, slot.offset), min(end, slot.offset + size)
            if slot.file == name and lo < hi:
                item = slot.dtype.itemsize
                parts.append(f"{key!r} elements {(lo - slot.offset) // item}-{(hi - slot.offset - 1) // item} of "
                             f"{math.prod(slot.shape)} (shape {slot.shape})")
        return "; ".join(parts[:3]) + (f" and {len(parts) - 3} more key(s)" if len(parts) > 3 else "") or "no key"


_FilesLayout = tuple[dict[str, KeySlot], dict[str, tuple[bytes, int]], dict[str, int]]
_LAYOUTS = LRU(8)


def _files_layout(
    file_plan: FilePlan, key_meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str]
) -> _FilesLayout:
    """Every key's slot, every file's header and size, and its data bytes; remembered for the same file plan and
    key metadata objects (a repeat save reuses its plans, so it builds no headers)."""

    def build() -> _FilesLayout:
        slots: dict[str, KeySlot] = {}
        headers: dict[str, tuple[bytes, int]] = {}
        data_bytes: dict[str, int] = {}
        for spec in file_plan.files:
            entries = [(k, *key_meta[k]) for k in spec.keys]
            text, ranges, size = safetensors_layout(entries, metadata)
            headers[spec.name] = (text, size)
            start = 8 + len(text)
            data_bytes[spec.name] = size - start
            for key, (offset, _, dtype, shape) in ranges.items():
                slots[key] = KeySlot(spec.name, start + offset, dtype, shape)
        return slots, headers, data_bytes

    return remember_by_identity(_LAYOUTS, (file_plan, key_meta), tuple(sorted(metadata.items())), build)


@functools.lru_cache(maxsize=1 << 14)
def _box_segments(
    local_shape: tuple[int, ...], key_shape: tuple[int, ...], local_offset: tuple[int, ...],
    key_offset: tuple[int, ...], sizes: tuple[int, ...],
) -> tuple[np.ndarray, np.ndarray, int]:
    """A box held at ``local_offset`` of a row-major local tensor and at ``key_offset`` of its key, as runs
    contiguous in both: ``(start element of each run in the local tensor, in the key, elements per run)``.

    Both sides enumerate the box in its row-major order, in runs of ``segment_starts``' lengths; the shorter
    run length divides the longer (both are products of trailing box sizes), so cutting both at it pairs them.
    """
    local, local_run = segment_starts(local_shape, local_offset, sizes)
    key, key_run = segment_starts(key_shape, key_offset, sizes)
    run = min(local_run, key_run)
    local = (local[:, None] + np.arange(0, local_run, run)[None, :]).reshape(-1)
    key = (key[:, None] + np.arange(0, key_run, run)[None, :]).reshape(-1)
    local.flags.writeable = key.flags.writeable = False
    return local, key, run


MAPPED_RUN_BYTES = 4096
"""Boxes whose contiguous runs are shorter than this are copied through a memory map when ``map_short_runs``..."""
MAPPED_MIN_RUNS = 64
"""... and that have at least this many runs."""


def _libc_fallocate() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        call = libc.fallocate  # the system call itself (posix_fallocate would write zeros where it is missing)
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    call.restype = ctypes.c_int
    return call


_FALLOCATE = _libc_fallocate() if sys.platform.startswith("linux") else None


def _allocate(fd: int, offset: int, nbytes: int) -> bool:
    """Allocate the blocks of ``[offset, offset + nbytes)`` (data already there is kept). False where the system
    or filesystem cannot; a full disk raises ``OSError(ENOSPC)``."""
    if _FALLOCATE is None:
        return False
    while _FALLOCATE(fd, 0, offset, nbytes) != 0:
        code = ctypes.get_errno()
        if code in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return False
        if code != errno.EINTR:
            raise OSError(code, f"allocating {nbytes} bytes of a checkpoint file: {os.strerror(code)}")
    return True


def _run_elements(shape: Sequence[int], sizes: Sequence[int]) -> int:
    """Elements per contiguous run of a box of a row-major tensor: the dims after the last one the box cuts short
    are whole, so a run spans that dim's box size times the whole trailing dims (the whole box when none is cut)."""
    cut = [d for d, (whole, n) in enumerate(zip(shape, sizes)) if whole != n]
    if not cut:
        return math.prod(sizes)
    return sizes[cut[-1]] * math.prod(shape[cut[-1] + 1 :])


def _split(regions: Sequence[KeyRegion], test: Any) -> tuple[list[KeyRegion], list[KeyRegion]]:
    """``regions`` that pass ``test`` and those that do not, each in order."""
    passed: list[KeyRegion] = []
    failed: list[KeyRegion] = []
    for region in regions:
        (passed if test(region) else failed).append(region)
    return passed, failed


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's elements as a ``(*shape, itemsize)`` uint8 array (no copy when it is contiguous)."""
    return byte_view(tensor).numpy().reshape(*tensor.shape, tensor.element_size())


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):  # pwrite may write less than asked
        done += os.pwrite(fd, data[done:], offset + done)
