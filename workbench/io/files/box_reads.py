"""Read boxes of safetensors tensors with ``pread``: only their bytes, in parallel, in the order a load uses them.

A safetensors tensor is row-major bytes at a known offset, so the box a rank owns is a set of byte runs the plan
knows before anything is read. ``BoxReader`` reads them with positional reads into buffers it allocates
(``os.preadv``, which releases the GIL), from a few threads, ahead of the consumer, within a byte budget:

- a box whose runs are dense (rows cut on a leading dim: one run; a column cut of narrow rows) is read as the one
  span from its first byte to its last and viewed with the tensor's strides; a box of long runs far apart (a
  column cut of wide rows) is read run by run into a contiguous buffer, so the disk reads what is owned;
- boxes that follow each other in a file (neighbouring keys, or the halves of one key) are read by one request;
- a request larger than ``chunk_bytes`` is split over the threads.

Files are opened with ``POSIX_FADV_RANDOM``: the kernel's readahead (8 MiB on the VMs we measure on) would read
past a box into bytes another rank owns, and the reads here are large and parallel already. Reading through
``safe_open`` maps the file instead, and the readahead of a mapping read a whole 24 MiB file for the 16 MiB two
ranks owned of it. What the OS reads is counted in ``tests/dist/test_os_read_bytes.py`` from ``/proc/self/io``.

A box whose runs leave no whole page between them (``gap_pages``) is read as its span too, and handed out as a
contiguous copy: the disk reads whole pages, so reading a 512-byte half of each 1 KiB row run by run fetched the same
pages in a thousand small reads.

**O_DIRECT.** A request of one contiguous byte range (a span, or neighbouring spans) can be read with ``O_DIRECT``:
the disk's blocks land straight in the (pinned) buffer, with no copy out of the page cache and no page cache
filled. The read covers the range rounded out to ``ALIGN`` (4 KiB: offset, length and buffer address), and the
buffer handed on starts at the range's first byte, so a request reads at most ``2 * ALIGN`` bytes it does not own.
``direct`` picks the path: ``False`` never; ``True`` every contiguous request; ``"auto"`` (the default, or the
``WORKBENCH_READ_DIRECT`` environment variable: ``auto``, ``1``, ``0``) a contiguous request of at least
``DIRECT_MIN_BYTES`` of which at most ``DIRECT_COLD_SHARE`` of the pages are in the page cache (``mincore`` on
sampled pages, once per ``COLD_REGION_BYTES`` of a file: the first request in a region decides for the rest):
cold and large. Not a request with a box read as its span and compacted: its pages hold a peer's
bytes too (the other half of each row of an expert-TP ``down_proj``), and through the page cache the disk reads
them once for both ranks, where O_DIRECT read them once for each. A warm page cache is faster than any disk, and a
cold read with ``O_DIRECT`` leaves the cache as cold as it found it: a second load of the same files reads the disk
again. Requests of runs far apart (a column cut of wide rows) go through the page cache. A file or filesystem that
refuses ``O_DIRECT`` (``EINVAL`` when opened or read) is read through the page cache from then on, and
``direct_refused`` says why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import itertools
import math
import mmap
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from workbench.errors import CheckpointError
from workbench.io.files.index import CheckpointIndex, KeyInfo, changed_since_parsed, torch_dtype
from workbench.io.files.landing import LandingPart, LandingPiece, kept_landing
from workbench.io.files.staging import Slot, StagingRing, as_dtype, staging_ring
from workbench.io.files.transfers import FileBox

__all__ = ["BoxReader", "box_runs", "cached_share", "gap_pages"]

Box = tuple[slice, ...] | None
Direct = bool | Literal["auto"]

DENSE_FILL = 0.9  # a box is read as one span when its bytes (or the pages they touch) fill this share of the span
CHUNK_BYTES = 16 << 20  # requests are split into pieces of this size, read by the threads in parallel
MERGE_BYTES = 8 << 20  # neighbouring boxes are merged into requests of at most this many bytes
SLAB_BYTES = 64 << 20  # buffers up to a quarter of this are carved from slabs of this size (one allocation each)
ALIGN = 4096  # O_DIRECT: file offsets, lengths and buffer addresses are multiples of this (a page, >= a block)
DIRECT_MIN_BYTES = 1 << 20  # auto: smaller requests go through the page cache (alignment costs up to 8 KiB each)
DIRECT_COLD_SHARE = 0.1  # auto: O_DIRECT when at most this share of a request's sampled pages are cached
LANDING_RUN_BYTES = 64 << 10  # a box given a tensor lands there run by run when its runs are this long
DIRECT_ENV = "WORKBENCH_READ_DIRECT"  # the default of ``direct``: auto, 1 (True) or 0 (False)
_SAMPLES = 32  # pages of a range cached_share asks mincore about
PACKED_CACHED_SHARE = 0.9  # auto: a landing packs its pieces full in a file with this share of its pages cached
COLD_REGION_BYTES = 64 << 20  # auto decides once per region of a file this long (the first request in it samples)
_AUTO_SAMPLES = 8  # pages of a request that auto asks about (one mincore call each, ~4 us: 32 cost a warm load of
# 8 MiB requests a quarter of its time)


def box_runs(shape: Sequence[int], itemsize: int, box: Box) -> list[tuple[int, int]]:
    """The byte runs ``(offset, length)`` of ``box`` in a row-major tensor of ``shape``, in row-major order, each
    as long as it can be (trailing dims the box holds whole are folded into one run)."""
    shape = tuple(shape)
    full = [slice(0, n) for n in shape]
    box = tuple(box or ()) + tuple(full[len(box or ()):])
    sizes = [s.stop - s.start for s in box]
    if not shape:
        return [(0, itemsize)]
    if any(n == 0 for n in sizes):
        return []
    strides = [itemsize * math.prod(shape[d + 1:]) for d in range(len(shape))]
    # fold the trailing dims that are whole, and the last cut dim, into one run
    k = len(shape) - 1
    while k > 0 and sizes[k] == shape[k]:
        k -= 1
    run = sizes[k] * strides[k]
    starts = [box[k].start * strides[k] + sum(box[d].start * strides[d] for d in range(k))]
    for d in range(k - 1, -1, -1):  # every index of the leading dims, the innermost varying fastest
        starts = [s + i * strides[d] for i in range(sizes[d]) for s in starts]
    return [(s, run) for s in starts]


def gap_pages(shape: Sequence[int], itemsize: int, box: Box) -> int:
    """Whole ``ALIGN``-byte blocks that fit in the gaps between the runs of ``box`` (``box_runs``), counted from the
    box's shape alone: at most one block more per gap than the pages a read of its span fetches for none of its
    bytes. 0 where every gap is shorter than a page (a half-column of 1 KiB rows)."""
    shape = tuple(shape)
    box = tuple(box or ()) + tuple(slice(0, n) for n in shape[len(box or ()):])
    sizes = [s.stop - s.start for s in box]
    if not shape or any(n == 0 for n in sizes):
        return 0
    strides = [itemsize * math.prod(shape[d + 1:]) for d in range(len(shape))]
    k = len(shape) - 1
    while k > 0 and sizes[k] == shape[k]:
        k -= 1
    return _gap_pages(sizes[k] * strides[k], sizes[:k], strides[:k])


def _gap_pages(run: int, sizes: Sequence[int], strides: Sequence[int]) -> int:
    """``gap_pages`` of runs of ``run`` bytes at every index of the outer dims ``sizes`` (byte ``strides``, each at
    least the extent of the dims inside it)."""
    total = inner = 0  # inner: from the first to the last run of one block of the dims inside d
    for d in range(len(sizes) - 1, -1, -1):
        gap = strides[d] - inner - run  # from the end of a block's last run to the next block's first
        total += (sizes[d] - 1) * math.prod(sizes[:d]) * (gap // ALIGN)
        inner += (sizes[d] - 1) * strides[d]
    return total


@dataclass(frozen=True, slots=True)
class _Runs:
    """Runs of ``length`` bytes at ``start + sum(i[d] * strides[d])`` for every index ``i`` of ``sizes``, in order."""

    length: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    def offsets(self, start: int) -> np.ndarray:
        out = np.full(1, start, dtype=np.int64)
        for n, s in zip(self.sizes, self.strides):
            out = (out[:, None] + np.arange(n, dtype=np.int64) * s).reshape(-1)
        return out


@dataclass(frozen=True, slots=True)
class _Box:
    """One requested box: where its bytes are and how its tensor is made from the buffer they land in."""

    ident: object  # what the consumer asks for: ``(key, box)`` or a ``FileBox``
    file: str
    start: int  # offset in the data section of the first byte read for it
    length: int  # bytes read for it (the span, or the runs packed)
    sizes: tuple[int, ...]
    strides: tuple[int, ...]  # element strides of the box within its buffer
    dtype: torch.dtype
    compact: bool = False  # read as its span, handed out as a contiguous copy of the box
    runs: _Runs | None = None  # read run by run, packed (None: one range, ``length`` bytes at ``start``)
    into: torch.Tensor | None = field(default=None, compare=False)  # the consumer's tensor it lands in, if given
    landing: tuple[int, tuple[int, ...]] | None = None  # runs read straight into ``into``: its byte offset, steps
    solid: bool = False  # its runs are one range of the file (O_DIRECT can read it into a buffer)


class _Request:
    """Boxes read together into one buffer: the runs of one or more boxes of one file, in file order."""

    def __init__(self, file: str, boxes: list[_Box]) -> None:
        self.file = file
        self.boxes = boxes
        self.nbytes = sum(b.length for b in boxes)
        self.remaining = len(boxes)  # boxes not handed out yet
        self.buffer: torch.Tensor | None = None
        self.futures: list[Future] = []
        self.compacted: dict[int, torch.Tensor] = {}  # compact boxes (by position) copied out by the reading task
        self.started = False
        self.landed = False  # every box's runs were read straight into its ``into``
        self.staged = False  # read through the staging ring into a device buffer, piece by piece
        self.pieces: list[_Piece] = []
        self.cover: torch.Tensor | None = None  # an O_DIRECT request's device buffer: its range rounded out
        self.copied = 0  # pieces whose copy into the device buffer is queued

    @property
    def contiguous(self) -> bool:
        """Whether its bytes are one range of the file (spans one after the other), which O_DIRECT can read."""
        return self.nbytes > 0 and all(b.runs is None or b.solid for b in self.boxes)

    @property
    def lands(self) -> bool:
        """Whether every box can be read run by run straight into the tensor it goes to."""
        return all(b.landing is not None for b in self.boxes)


@dataclass(eq=False)
class _Piece:
    """At most a staging slot of a staged request: the runs read one after the other into a slot (or, ``direct``,
    one aligned piece of the request's cover), and where the slot's first ``nbytes`` go in the request's buffer."""

    request: _Request
    at: int  # the first byte's place in the request's device buffer (its cover, for O_DIRECT)
    nbytes: int
    runs: list[tuple[int, int]] | None = None  # (absolute file offset, bytes), read back to back into the slot
    direct: tuple[int, int] | None = None  # (aligned absolute file offset, aligned bytes) read with O_DIRECT
    slot: Slot | None = None
    future: Future | None = None


class _Upcoming:
    """Landing pieces not started yet, in order, taken from an iterator as they are needed (one looked at ahead). An
    error making the next piece is raised again on every later look: the pieces after it are never silently lost."""

    def __init__(self) -> None:
        self._pieces: Iterator[LandingPiece] = iter(())
        self._next: LandingPiece | None = None
        self._error: BaseException | None = None

    def extend(self, pieces: Iterable[LandingPiece]) -> None:
        """Add ``pieces`` after those already here."""
        self._pieces = itertools.chain(self._pieces, pieces)

    def __bool__(self) -> bool:
        if self._error is not None:
            raise self._error
        if self._next is None:
            try:
                self._next = next(self._pieces, None)
            except BaseException as exc:
                self._error = exc
                raise
        return self._next is not None

    def popleft(self) -> LandingPiece:
        """The next piece (IndexError: none left)."""
        if not self:
            raise IndexError("no landing piece left")
        piece, self._next = self._next, None
        assert piece is not None
        return piece

    def clear(self) -> None:
        """Drop every piece not taken (and an error making one)."""
        self._pieces, self._next, self._error = iter(()), None, None


class BoxReader:
    """Serve ``read(key, box)`` (or ``read(file_box)``) from reads issued ahead, in the order ``expected`` lists them.

    Args:
        index: the checkpoint's parsed index.
        expected: every ``(key, box)`` (``box`` None for the whole key) or ``FileBox`` (a strided box of a file's
            bytes, ``transfers.plan_transfers``) the consumer will ask for, in order, or ``(FileBox, tensor)``: a
            box read into that CPU tensor of its shape and dtype (a view of the consumer's own tensor), which
            ``read`` then hands back, so no copy follows. A request that does not come next in this order is still
            served, by a read of its own.
        threads: reading threads (0: every read on the calling thread).
        budget_bytes: bytes of buffers read ahead and not yet handed out, at most (at least one request).
        pin_memory: allocate buffers in pinned memory (for host-to-device copies that overlap).
        device: a CUDA device to read into: requests in the expected order are read through the process's pinned
            staging ring (``staging.py``, 16 slots of 32 MiB pinned once per process) in slot-sized pieces, in
            order, as far ahead as the ring's free slots allow; when the consumer asks for a box, the pieces of its
            request are copied, on the current stream, into a buffer on this device, and ``read`` hands out a device
            tensor. ``budget_bytes`` then bounds device buffers; pinned memory is the ring's whatever the load.
            Boxes read into a CPU tensor, and boxes asked out of the expected order, are read without the ring.
            An expected ``(FileBox, tensor)`` whose tensor is on this device **lands** there: its pieces
            (``landing.py``) are read by the threads into free slots from the start, and the loading thread copies
            each, as its read ends (in ``read`` and in ``finish``), straight into the tensor or through a buffer of one
            slot on the device; ``read`` hands the tensor back at once and ``finish`` queues what is left, or raises the
            first failure.
        ring: the staging ring to read through (default the process's). With ``device="cpu"`` and an unpinned
            ring, the staged and landing paths run without a GPU, their copies at once (how the tests run them).

    ``bytes_read`` counts the bytes of every box handed out; ``bytes_fetched`` the bytes ``pread`` asked the files
    for (more when a dense span held bytes outside its box, or an O_DIRECT read its aligned cover), of which
    ``bytes_direct`` with O_DIRECT. ``direct_refused`` maps a file that refused O_DIRECT to the reason.

    A box read into a tensor lands there straight from the file where its runs (contiguous in the file and in the
    tensor alike) are at least ``LANDING_RUN_BYTES`` long and it is not read with O_DIRECT; else it is read into a
    buffer as any box and copied into the tensor by the thread that read it (numpy, byte for byte).

    Without ``device``, buffers of small requests are views of shared slabs of ``SLAB_BYTES`` (pinning memory costs
    about a millisecond per allocation), so the memory a load holds is ``budget_bytes`` plus the largest request plus
    one slab.
    """

    def __init__(
        self,
        index: CheckpointIndex,
        expected: Sequence[tuple[str, Box] | FileBox],
        *,
        threads: int = 8,
        budget_bytes: int = 1 << 30,
        pin_memory: bool = False,
        direct: Direct | None = None,
        device: torch.device | str | None = None,
        ring: StagingRing | None = None,
    ) -> None:
        self.index = index
        self.device = _staging_device(device, ring)
        self._ring: StagingRing | None = (ring or staging_ring()) if self.device is not None else None
        self._unissued: deque[_Piece] = deque()  # pieces of started staged requests without a slot yet, in order
        self._held: dict[int, Slot] = {}  # slots this reader holds (by id), given back by close() at the latest
        self._fds_of: dict[int, tuple[int, int | None]] = {}  # a staged request's file descriptors, by id
        if self.device is not None:
            pin_memory = False  # pinned memory is the ring's: buffers read without it (out of order) are pageable
        self.budget_bytes = budget_bytes
        # staged, requests started (device buffers allocated) further ahead than the ring can read would only hold
        # device memory: twice the ring's bytes keep every slot busy
        ring_bytes = self._ring.slots * self._ring.slot_bytes if self._ring is not None else budget_bytes
        self._ahead_bytes = min(budget_bytes, 2 * ring_bytes)
        self.pin_memory = pin_memory
        self.direct = _direct_mode(direct)
        self.bytes_read = 0
        self.bytes_fetched = 0
        self.bytes_direct = 0
        self.reads = 0
        self.wait_seconds = 0.0  # the consumer's time blocked on reads not done yet (and on free ring slots)
        self.direct_refused: dict[str, str] = {}
        self._fds: dict[str, tuple[int, int]] = {}
        self._direct_fds: dict[str, int] = {}
        self._maps: dict[str, _PageMap] = {}  # auto: which pages of a file are cached
        self._cold_regions: dict[tuple[str, int], bool] = {}  # auto: (file, region) -> read with O_DIRECT
        self._slab: torch.Tensor | None = None  # small buffers are views of this (_buffer)
        self._slab_used = 0
        self._closing: list[int] = []  # direct fds a refusal retired: closed with the rest, no thread may hold one
        self._lock = threading.Lock()
        self._pool = _pool(threads) if threads > 0 else None  # none: every read on the calling thread
        self._futures: list[Future] = []  # every task this reader submitted to the shared pool
        # boxes that land in tensors on the device: read and copied by the reading threads, piece by piece
        self._landing = _Upcoming()  # pieces not started yet, in order, made as they are taken
        self._land_issued: dict[int, tuple[Future, Slot]] = {}  # by slot: pieces being read or read, not copied
        self._land_ended: queue.SimpleQueue[tuple[LandingPiece, Slot, BaseException | None]] = queue.SimpleQueue()
        self._lands: dict[FileBox, deque[torch.Tensor]] = {}  # what ``read`` hands back for each
        self._land_error: BaseException | None = None
        landing: list[tuple[FileBox, torch.Tensor]] = []
        items: list[_Box] = []
        for entry in expected:
            if self.device is not None and _lands_on(entry, self.device):
                fb, into = entry  # type: ignore[misc]
                landing.append((fb, into))
                self._lands.setdefault(fb, deque()).append(into)
            else:
                items.append(self._expected(entry))
        requests = _merge(items)
        self._queue: deque[tuple[_Box, _Request]] = deque((b, r) for r in requests for b in r.boxes)
        self._pending: deque[_Request] = deque(requests)  # not issued yet, in order
        self._in_flight = 0  # bytes of issued requests whose boxes are not all handed out
        if landing:
            try:
                self._start_landing(landing)
            except BaseException:
                self.close()
                raise

    # -- the consumer's side ---------------------------------------------------------------------------------------

    def read(self, key: str | FileBox, box: Box = None) -> torch.Tensor:
        """The tensor of ``key`` (or of ``box`` of it), or of a ``FileBox``, read ahead when it was expected here.
        A box expected with a tensor on the reader's device is handed back at once: it lands there on the reading
        threads (``finish`` waits for it)."""
        if isinstance(key, FileBox) and self._lands:
            queue = self._lands.get(key)
            if queue:
                self._drain(block=False)  # the copies of the pieces read meanwhile, and the next reads
                if self._land_error is not None:
                    raise self._land_error
                self.bytes_read += key.nbytes
                self.reads += 1
                return queue.popleft()
        ident = key if isinstance(key, FileBox) else (key, _normal(box))
        head = self._queue[0][0].ident if self._queue else None
        if head is not None and (head is ident or head == ident):
            item, request = self._queue.popleft()
            self._issue()
            if not request.started:  # boxes asked out of order hold the budget: issue this one all the same
                self._pending.remove(request)
                self._start(request)
                self._in_flight += request.nbytes
            tensor = self._take(item, request)
            request.remaining -= 1
            if not request.remaining:
                self._in_flight -= request.nbytes
                request.buffer = None  # the tensors handed out keep what they view
                self._issue()
        else:  # not in the expected order: a read of its own (not through the ring, whose slots are read ahead)
            item = self._describe(key) if isinstance(key, FileBox) else self._describe_key(key, box)
            request = _Request(item.file, [item])
            self._start(request, staged=False)
            tensor = self._take(item, request)
            if self.device is not None and item.into is None:
                tensor = tensor.to(self.device)
        self.bytes_read += tensor.numel() * tensor.element_size()
        self.reads += 1
        return tensor

    def close(self) -> None:
        """Cancel the reads not started, wait for those in flight, then close every file."""
        self._stop_landing()
        futures, self._futures = self._futures, []
        for future in futures:
            future.cancel()
        wait(futures)
        held, self._held = self._held, {}
        for slot in held.values():  # pieces read ahead and never copied: their slots go back to the process's ring
            assert self._ring is not None
            self._ring.give(slot)
        self._unissued.clear()
        fds, self._fds = self._fds, {}
        direct, self._direct_fds = self._direct_fds, {}
        closing, self._closing = self._closing, []
        maps, self._maps = self._maps, {}
        for pages in maps.values():
            pages.close()
        for fd in [fd for fd, _ in fds.values()] + list(direct.values()) + closing:
            os.close(fd)

    def __enter__(self) -> BoxReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- issuing and taking ----------------------------------------------------------------------------------------

    def _issue(self) -> None:
        """Issue pending requests in order while the bytes in flight stay within the budget (one at least); staged,
        give their pieces slots in order while the ring has free ones."""
        if self._ring is not None:
            self._issue_pieces()
        while self._pending:
            request = self._pending[0]
            if self._in_flight and self._in_flight + request.nbytes > self._ahead_bytes:
                return
            self._pending.popleft()
            self._start(request)
            self._in_flight += request.nbytes
            if self._ring is not None:
                self._issue_pieces()

    def _issue_pieces(self) -> None:
        """Give the next pieces slots while the ring has free ones, and start their reads. Landing pieces whose
        reads have ended hold their slots until this thread copies them out: copied out first, so a box read into
        a device buffer keeps reading ahead."""
        assert self._ring is not None
        while self._unissued:
            slot = self._ring.try_take()
            stream = self._current_stream() if slot is None and self._land_issued else None
            while slot is None and self._land_issued and self._copy_landed(False, stream):
                slot = self._ring.try_take()
            if slot is None:
                return
            self._issue_piece(self._unissued.popleft(), slot)
        self._pump()  # the slots this reader's loading thread gave back serve the landing too

    def _issue_piece(self, piece: _Piece, slot: Slot) -> None:
        self._held[id(slot)] = slot
        piece.slot = slot
        piece.future = self._submit(self._fill, piece)

    def _start(self, request: _Request, staged: bool = True) -> None:
        request.started = True
        fd, data_start = self._fd(request.file)
        staged = staged and self._ring is not None and all(b.into is None for b in request.boxes)
        if request.contiguous and self._wants_direct(request, fd, data_start):
            dfd = self._direct_fd(request.file)
            if dfd is not None:
                if staged:
                    self._start_staged_direct(request, fd, dfd, data_start)
                else:
                    self._start_direct(request, fd, dfd, data_start)
                return
        if staged:
            self._start_staged(request, fd, data_start)
            return
        pieces: list[tuple[int, memoryview]] = []
        if request.lands:  # straight into the consumer's tensors: no buffer, no copy
            request.landed = True
            for item in request.boxes:
                assert item.runs is not None and item.landing is not None and item.into is not None
                target = memoryview(_storage_bytes(item.into))
                length = item.runs.length
                at = _Runs(length, item.runs.sizes, item.landing[1]).offsets(item.landing[0]).tolist()
                for offset, to in zip(item.runs.offsets(item.start).tolist(), at):
                    for k in range(0, length, CHUNK_BYTES):
                        n = min(CHUNK_BYTES, length - k)
                        pieces.append((data_start + offset + k, target[to + k:to + k + n]))
        else:
            request.buffer = self._buffer(request.nbytes, 64)
            view = memoryview(request.buffer.numpy())
            pos = 0
            for item in request.boxes:
                starts, length = _run_starts(item)
                for offset in starts:
                    for at in range(0, length, CHUNK_BYTES):
                        n = min(CHUNK_BYTES, length - at)
                        pieces.append((data_start + offset + at, view[pos + at:pos + at + n]))
                    pos += length
        # one task per chunk-sized group of pieces, so a big request is read by several threads
        groups: list[list[tuple[int, memoryview]]] = [[]]
        size = 0
        for piece in pieces:
            if size >= CHUNK_BYTES:
                groups.append([])
                size = 0
            groups[-1].append(piece)
            size += len(piece[1])
        compact = self._compact_outputs(request) if len(groups) == 1 else None
        for group in groups:
            request.futures.append(self._submit(self._pread, fd, request.file, group, request, compact))

    def _start_direct(self, request: _Request, fd: int, dfd: int, data_start: int) -> None:
        """Read the request's range rounded out to ``ALIGN`` into an aligned buffer; hand on the range itself."""
        begin, end, low, high = _aligned_cover(request, data_start)
        cover = self._buffer(high - low, ALIGN)
        request.buffer = cover[begin - low:end - low]
        view = memoryview(cover.numpy())
        compact = self._compact_outputs(request) if high - low <= CHUNK_BYTES else None
        for at in range(0, high - low, CHUNK_BYTES):  # CHUNK_BYTES is a multiple of ALIGN: every piece aligned
            piece = view[at:at + CHUNK_BYTES]
            needed = min(len(piece), end - (low + at))  # the cover's tail may lie past the end of the file
            request.futures.append(self._submit(self._pread_direct, fd, dfd, request.file, low + at, piece,
                                                     needed, request, compact))

    def _start_staged(self, request: _Request, fd: int, data_start: int) -> None:
        """Cut the request's runs into pieces of at most a slot (runs back to back), for ``_issue_pieces``."""
        assert self._ring is not None and self.device is not None
        slot = self._ring.slot_bytes
        request.staged = True
        request.buffer = torch.empty(request.nbytes, dtype=torch.uint8, device=self.device)
        runs: list[tuple[int, int]] = []
        first = pos = size = 0  # the piece's first byte in the buffer; the next run's; the piece's bytes
        for item in request.boxes:
            starts, length = _run_starts(item)
            for offset in starts:
                for at in range(0, length, slot):
                    n = min(slot, length - at)
                    if size + n > slot:
                        request.pieces.append(_Piece(request, first, size, runs=runs))
                        runs, first, size = [], pos, 0
                    runs.append((data_start + offset + at, n))
                    pos += n
                    size += n
        if runs:
            request.pieces.append(_Piece(request, first, size, runs=runs))
        self._unissued.extend(request.pieces)
        self._fds_of[id(request)] = (fd, None)

    def _start_staged_direct(self, request: _Request, fd: int, dfd: int, data_start: int) -> None:
        """``_start_direct`` in slot-sized pieces: the aligned cover read piece by piece with O_DIRECT into slots
        (page-aligned), each piece's part of the cover copied into a device buffer of the cover."""
        assert self._ring is not None and self.device is not None
        begin, end, low, high = _aligned_cover(request, data_start)
        request.staged = True
        cover = torch.empty(high - low, dtype=torch.uint8, device=self.device)
        request.buffer = cover[begin - low:end - low]
        slot = self._ring.slot_bytes  # a multiple of ALIGN: every piece aligned
        for at in range(0, high - low, slot):
            n = min(slot, high - low - at)
            needed = min(n, end - (low + at))  # the cover's tail may lie past the end of the file
            request.pieces.append(_Piece(request, at, needed, direct=(low + at, n)))
        request.cover = cover
        self._unissued.extend(request.pieces)
        self._fds_of[id(request)] = (fd, dfd)

    def _fill(self, piece: _Piece) -> None:
        """On a reader thread: wait for the slot's last copy, then read the piece into it."""
        assert piece.slot is not None
        piece.slot.ready()
        view = piece.slot.bytes
        request = piece.request
        fd, dfd = self._fds_of[id(request)]
        if piece.direct is not None:
            assert dfd is not None
            offset, n = piece.direct
            self._pread_direct_piece(fd, dfd, request.file, offset, view[:n], piece.nbytes)
            return
        assert piece.runs is not None
        at = 0
        for offset, n in piece.runs:
            self._read_into(fd, request.file, offset, view[at:at + n])
            at += n
        with self._lock:
            self.bytes_fetched += piece.nbytes

    def _copy_pieces(self, request: _Request) -> None:
        """Queue the copies of the request's pieces into its device buffer on the current stream, in order (a piece
        not issued yet takes a slot first: every slot this reader held went to earlier pieces, copied by now), and
        give each slot back with its copy's event."""
        assert self._ring is not None and self.device is not None
        target = request.cover if request.cover is not None else request.buffer
        assert target is not None
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        while request.copied < len(request.pieces):
            piece = request.pieces[request.copied]
            if piece.future is None:
                assert self._unissued and self._unissued[0] is piece
                self._issue_piece(self._unissued.popleft(), self._staging_slot())
            assert piece.slot is not None and piece.future is not None
            slot, event = piece.slot, None
            try:
                began = time.perf_counter()
                piece.future.result()  # an interrupt here leaves the slot to close(), once its read has ended
                self.wait_seconds += time.perf_counter() - began
                target[piece.at:piece.at + piece.nbytes].copy_(slot.buffer[:piece.nbytes], non_blocking=True)
                if stream is not None:
                    event = torch.cuda.Event()
                    event.record(stream)
            finally:
                if piece.future.done():
                    del self._held[id(slot)]
                    piece.slot = None
                    self._ring.give(slot, event)
            request.copied += 1
            self._issue_pieces()
        self._fds_of.pop(id(request), None)
        request.pieces.clear()  # no cycle (piece -> request) keeps the device buffer past its last box
        request.copied = 0
        request.cover = None  # the boxes' views keep what they need

    # -- landing: boxes read by the reading threads and copied into tensors on the device -----------------------

    def finish(self) -> None:
        """Queue the copies of every box expected with a tensor on the reader's device, on the current stream, as
        their pieces are read; raise the first failure."""
        self._drain(block=True)
        if self._land_error is not None:
            raise self._land_error

    def _start_landing(self, boxes: list[tuple[FileBox, torch.Tensor]]) -> None:
        assert self._ring is not None
        starts = {file: self._fd(file)[1] for file in dict.fromkeys(fb.file for fb, _ in boxes)}
        packed = [file for file in starts if self._cached(file)]
        self._landing.extend(kept_landing(boxes, self._how, starts, self._ring.slot_bytes, packed))
        self._pump()

    def _cached(self, file: str) -> bool:
        """Whether a landing packs ``file``'s pieces full (``plan_landing``'s ``packed``): where none of it is read
        with O_DIRECT (``direct`` False, or the file refuses it), or (auto) where at least ``PACKED_CACHED_SHARE``
        of its sampled data pages are in the page cache, or ``mincore`` cannot tell (auto then reads it through the
        page cache too)."""
        if self.direct is False or self._direct_fd(file) is None:
            return True
        if self.direct is True:
            return False
        fd, start = self._fd(file)
        pages = self._page_map(file, fd)
        share = pages.share(start, pages.size - start, _AUTO_SAMPLES)
        return share is None or share >= PACKED_CACHED_SHARE

    def _how(self, fb: FileBox) -> str:
        """How a landing box is read (``plan_landing``): its runs packed, or its span (shared: its pages hold a
        peer's bytes too), as ``_describe`` decides for any box."""
        how = self._describe(fb)
        return "runs" if how.runs is not None else "shared" if how.compact else "span"

    def _pump(self) -> None:
        """Start reading the next landing pieces, in order, into the ring's free slots."""
        ring = self._ring
        while self._landing and self._land_error is None:
            assert ring is not None
            slot = ring.try_take()
            if slot is None:
                return
            self._issue_landing(slot)

    def _issue_landing(self, slot: Slot) -> None:
        piece = self._landing.popleft()
        self._land_issued[id(slot)] = (self._submit(self._land_read, piece, slot), slot)

    def _drain(self, block: bool) -> None:
        """On the loading thread: queue the copies of the pieces read so far, in the order their reads end (their
        places are disjoint), giving each slot back with its copy's event and starting the next reads; ``block``:
        until every piece is copied."""
        ring = self._ring
        stream = self._current_stream() if self._land_issued or (block and self._landing) else None
        while self._land_error is None and (self._land_issued or (block and self._landing)):
            assert ring is not None
            if not self._land_issued:  # every slot is held elsewhere (another reader of this process): wait for one
                began = time.perf_counter()
                self._issue_landing(ring.take())
                self.wait_seconds += time.perf_counter() - began
                continue
            if not self._copy_landed(block, stream):
                return
            self._pump()

    def _copy_landed(self, block: bool, stream: torch.cuda.Stream | None) -> bool:
        """Queue the copies of the next landing piece whose read has ended (waiting for one if ``block``) and give
        its slot back with their event; False: none had ended. A failure is kept in ``_land_error``."""
        ring = self._ring
        assert ring is not None
        try:
            piece, slot, failure = self._land_ended.get(block=False)
        except queue.Empty:
            if not block:
                return False
            began = time.perf_counter()
            piece, slot, failure = self._land_ended.get()
            self.wait_seconds += time.perf_counter() - began
        del self._land_issued[id(slot)]
        try:
            if failure is not None:
                raise failure
            self._land_copy(piece, slot)
        except Exception as exc:
            self._land_error = self._land_error or exc
        finally:  # after whatever was queued out of the slot, even by a copy that then failed
            event = None
            try:
                event = self._copied(slot, stream)
            except Exception as exc:  # a broken device: the load fails, the slot goes back all the same
                self._land_error = self._land_error or exc
            ring.give(slot, event)
        return True

    def _staging_slot(self) -> Slot:
        """A slot for the next piece of a box read into a device buffer: a free one; else, while landing pieces
        hold slots (they give them back only when this thread copies them out), the slot of the next one copied;
        else one another reader of this process gives back."""
        ring = self._ring
        assert ring is not None
        while True:
            slot = ring.try_take()
            if slot is not None:
                return slot
            if not self._land_issued:
                began = time.perf_counter()
                slot = ring.take()
                self.wait_seconds += time.perf_counter() - began
                return slot
            self._copy_landed(True, self._current_stream())  # no _pump: the slot it gives back is for this piece

    def _land_read(self, piece: LandingPiece, slot: Slot) -> None:
        """On a reader thread: read the piece into the slot, then tell the loading thread (``_land_ended``)."""
        failure: BaseException | None = None
        try:
            self._land_fill(piece, slot)
        except BaseException as exc:  # the loading thread raises it
            failure = exc
        self._land_ended.put((piece, slot, failure))

    def _land_fill(self, piece: LandingPiece, slot: Slot) -> None:
        """Once the slot's last copy has run, read the piece into it (its solid range's aligned cover with
        O_DIRECT where ``direct`` says so)."""
        slot.ready()
        fd, _ = self._fd(piece.file)
        view = slot.bytes
        if piece.solid is not None and self._cold(piece.file, fd, piece.solid[0], piece.nbytes):
            dfd = self._direct_fd(piece.file)
            if dfd is not None:
                begin, end = piece.solid
                low, high = begin // ALIGN * ALIGN, -(-end // ALIGN) * ALIGN
                self._pread_direct_piece(fd, dfd, piece.file, low, view[:high - low], end - low)
                return
        for offset, at, n in piece.reads:
            self._read_into(fd, piece.file, offset, view[at:at + n])
        with self._lock:
            self.bytes_fetched += piece.nbytes

    def _land_copy(self, piece: LandingPiece, slot: Slot) -> None:
        """Queue the piece's copies out of the slot on the current stream: straight into a part's tensor where the
        slot holds that tensor's bytes in order, else the slot's used bytes into a buffer on the device and each part
        from there with one (strided, casting) copy. That buffer comes from the caching allocator on the current
        stream and is let go once the copies are queued: they run before anything queued later on the stream, so the
        next piece's buffer is the same memory, and a load holds no GPU memory of its own beyond one slot."""
        assert self.device is not None
        parts = piece.parts
        if len(parts) == 1 and parts[0].direct:
            p = parts[0]
            p.dest.copy_(_place(slot.typed(p.dtype), p), non_blocking=True)
            return
        if self.device.type == "cpu":
            for p in parts:
                p.dest.copy_(_place(slot.typed(p.dtype), p))
            return
        staged = torch.empty(slot.buffer.numel(), dtype=torch.uint8, device=self.device)
        staged[:piece.used].copy_(slot.buffer[:piece.used], non_blocking=True)
        typed: dict[torch.dtype, torch.Tensor] = {}
        for p in parts:
            view = typed.get(p.dtype)
            if view is None:
                view = typed[p.dtype] = as_dtype(staged, p.dtype)
            p.dest.copy_(_place(view, p))

    def _copied(self, slot: Slot, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """The slot's event recorded on ``stream`` (the current one) after what was queued out of it (None on the
        CPU): the slot is read into again only once it has run."""
        if stream is None:
            return None
        assert self.device is not None
        event = slot.done_event(self.device)
        event.record(stream)
        return event

    def _current_stream(self) -> torch.cuda.Stream | None:
        """The calling thread's current stream on the reader's device, which the copies it queues run on (None on
        the CPU): asked once per drain, not once per piece."""
        assert self.device is not None
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _stop_landing(self) -> None:
        """Drop the pieces not started; the slots of those started go back once their reads have ended."""
        self._landing.clear()
        issued, self._land_issued = self._land_issued, {}
        for future, _ in issued.values():
            future.cancel()
        wait([f for f, _ in issued.values()])
        for _, slot in issued.values():
            assert self._ring is not None
            self._ring.give(slot)
        while not self._land_ended.empty():
            self._land_ended.get()

    def _submit(self, fn: Callable[..., None], *args: object) -> Future:
        if self._pool is None:  # no reading threads: run it now, on the calling thread
            future: Future = Future()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # raised where the future's result is asked for, as from a thread
                future.set_exception(exc)
            return future
        future = self._pool.submit(fn, *args)
        self._futures.append(future)
        return future

    def _compact_outputs(self, request: _Request) -> dict[int, torch.Tensor] | None:
        """Where the request's compact boxes and boxes with a tensor to land in go, for the one task that reads the
        request to copy them into: that tensor, or a buffer made here (the slabs are not shared with the threads).
        None: no such box."""
        out = {i: b.into if b.into is not None else self._buffer(math.prod(b.sizes) * b.dtype.itemsize, 64)
               for i, b in enumerate(request.boxes) if b.compact or b.into is not None}
        return out or None

    def _pread(self, fd: int, file: str, pieces: list[tuple[int, memoryview]], request: _Request,
               compact: dict[int, torch.Tensor] | None) -> None:
        for offset, view in pieces:
            self._read_into(fd, file, offset, view)
        with self._lock:
            self.bytes_fetched += sum(len(v) for _, v in pieces)
        if compact:
            self._compact_all(request, compact)

    def _compact_all(self, request: _Request, outputs: dict[int, torch.Tensor]) -> None:
        """Copy the request's compact boxes (and those with a tensor to land in) out of its buffer, on the thread
        that read all of it."""
        if request.landed:
            return
        assert request.buffer is not None
        at = 0
        for i, b in enumerate(request.boxes):
            if i in outputs:
                _copy_out(request.buffer[at:at + b.length], b, outputs[i])
            at += b.length
        request.compacted = outputs

    def _pread_direct(self, fd: int, dfd: int, file: str, offset: int, view: memoryview, needed: int,
                      request: _Request, compact: dict[int, torch.Tensor] | None) -> None:
        """One aligned piece with O_DIRECT (then the compact boxes of a request read by this one task)."""
        self._pread_direct_piece(fd, dfd, file, offset, view, needed)
        if compact:
            self._compact_all(request, compact)

    def _pread_direct_piece(self, fd: int, dfd: int, file: str, offset: int, view: memoryview, needed: int) -> None:
        """One aligned piece with O_DIRECT; on ``EINVAL`` the rest of it, and the file from then on, buffered."""
        done = direct = 0
        try:
            while done < needed:
                try:
                    n = os.preadv(dfd, [view[done:]], offset + done)
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                        raise CheckpointError(f"{self.index.path_of(file)}: reading byte {offset + done} with "
                                              f"O_DIRECT failed: {exc}") from exc
                    self._refuse(file, f"reading with O_DIRECT: {exc}")
                    self._read_into(fd, file, offset + done, view[done:needed])
                    done = needed
                    break
                if n <= 0 or (n % ALIGN and done + n < needed):  # an unaligned short read: the end of the file
                    path = self.index.path_of(file)
                    raise CheckpointError(f"{path}: short read at byte {offset + done + max(n, 0)} (file truncated?)")
                done += n
                direct += n
        finally:
            with self._lock:
                self.bytes_fetched += done
                self.bytes_direct += direct

    def _read_into(self, fd: int, file: str, offset: int, view: memoryview) -> None:
        """``pread`` into all of ``view``; a read that ends early is a truncated file."""
        done = 0
        while done < len(view):
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                raise CheckpointError(f"{self.index.path_of(file)}: reading byte {offset + done} failed: "
                                      f"{exc}") from exc
            if n <= 0:
                path = self.index.path_of(file)
                raise CheckpointError(f"{path}: short read at byte {offset + done} (file truncated?)")
            done += n

    def _take(self, item: _Box, request: _Request) -> torch.Tensor:
        if request.staged:
            self._copy_pieces(request)
        began = time.perf_counter()
        for future in request.futures:
            future.result()
        self.wait_seconds += time.perf_counter() - began
        if request.landed:
            assert item.into is not None
            return item.into
        assert request.buffer is not None
        i = at = 0  # the box's place in the request and in its buffer
        for b in request.boxes:
            if b is item:
                break
            i += 1
            at += b.length
        # a compact box: contiguous (and pinned) again, so that a copy to a GPU needs no staging and can overlap
        # (staged, it is on the device already: handed out with its strides); or in the consumer's tensor
        if (item.compact and not request.staged) or item.into is not None:
            out = request.compacted.get(i)
            if out is None:  # read by several tasks: copied out here
                out = item.into if item.into is not None else self._buffer(
                    math.prod(item.sizes) * item.dtype.itemsize, 64)
                _copy_out(request.buffer[at:at + item.length], item, out)
            return out if item.into is not None else out.view(item.dtype).view(item.sizes)
        raw = request.buffer[at:at + item.length]
        if raw.storage_offset() % item.dtype.itemsize:  # a key of another dtype before it left it unaligned
            raw = raw.clone()
        return raw.view(item.dtype).as_strided(item.sizes, item.strides)

    def _buffer(self, nbytes: int, align: int) -> torch.Tensor:
        """``nbytes`` of (pinned) memory starting at a multiple of ``align``: carved from the current slab of
        ``SLAB_BYTES`` when small, so a load of thousands of small boxes pins memory a few times, not thousands
        (a slab goes back to torch's caching allocator once nothing views it)."""
        if nbytes + align > SLAB_BYTES // 4:
            raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=self.pin_memory)
            skip = -raw.data_ptr() % align
            return raw[skip:skip + nbytes]
        slab = self._slab
        if slab is not None:
            at = -(-(slab.data_ptr() + self._slab_used) // align) * align - slab.data_ptr()
        if slab is None or at + nbytes > slab.numel():
            slab = self._slab = torch.empty(SLAB_BYTES, dtype=torch.uint8, pin_memory=self.pin_memory)
            at = -slab.data_ptr() % align
        self._slab_used = at + nbytes
        return slab[at:at + nbytes]

    # -- O_DIRECT ----------------------------------------------------------------------------------------------------

    def _wants_direct(self, request: _Request, fd: int, data_start: int) -> bool:
        if self.direct == "auto" and any(b.compact for b in request.boxes):
            return False  # a span that shares its pages with a peer's box: one read of them serves both
        return self._cold(request.file, fd, data_start + request.boxes[0].start, request.nbytes)

    def _cold(self, file: str, fd: int, begin: int, nbytes: int) -> bool:
        """Whether ``direct`` reads the absolute range ``[begin, begin + nbytes)`` of ``file`` with O_DIRECT: always
        (True), never (False, or the file refused it), or (auto) when it is large and its sampled pages are not
        cached."""
        if self.direct is False or file in self.direct_refused:
            return False
        if self.direct is True:
            return True
        if nbytes < DIRECT_MIN_BYTES:
            return False
        region = (file, begin // COLD_REGION_BYTES)
        known = self._cold_regions.get(region)
        if known is not None:
            return known
        share = self._page_map(file, fd).share(begin, nbytes, _AUTO_SAMPLES)
        cold = self._cold_regions[region] = share is not None and share <= DIRECT_COLD_SHARE  # unknown: page cache
        return cold

    def _page_map(self, file: str, fd: int) -> _PageMap:
        """The file's mapping that ``mincore`` asks which pages are cached (made once per reader)."""
        with self._lock:
            pages = self._maps.get(file)
            if pages is None:
                pages = self._maps[file] = _PageMap(fd)
            return pages

    def _direct_fd(self, file: str) -> int | None:
        """The file opened with O_DIRECT (once), or None where it was refused."""
        with self._lock:
            if file in self.direct_refused:
                return None
            fd = self._direct_fds.get(file)
            if fd is not None:
                return fd
            path = self.index.path_of(file)
            flag = getattr(os, "O_DIRECT", 0)
            if not flag:
                self.direct_refused[file] = "this platform has no O_DIRECT"
                return None
            try:
                fd = os.open(path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise CheckpointError(f"{path}: cannot open with O_DIRECT: {exc}") from exc
                self.direct_refused[file] = f"opening with O_DIRECT: {exc}"
                return None
            self._check_opened(file, fd)  # opened by path again: it must be the file the other fd reads
            self._direct_fds[file] = fd
            return fd

    def _refuse(self, file: str, why: str) -> None:
        with self._lock:
            self.direct_refused.setdefault(file, why)
            fd = self._direct_fds.pop(file, None)
            if fd is not None:  # other threads may still be reading with it: closed at close()
                self._closing.append(fd)

    # -- describing boxes ------------------------------------------------------------------------------------------

    def _expected(self, entry: tuple[str, Box] | FileBox | tuple[FileBox, torch.Tensor]) -> _Box:
        if isinstance(entry, FileBox):
            return self._describe(entry)
        if isinstance(entry[0], FileBox):
            fb, into = entry
            return self._describe(fb, into=_checked_into(fb, into))
        key, box = entry
        return self._describe_key(key, box)

    def _describe_key(self, key: str, box: Box) -> _Box:
        info = self._info(key)
        dtype = torch_dtype(info.dtype)
        index = _fit(info, _normal(box), self.index)
        size = dtype.itemsize
        strides = tuple(size * math.prod(info.shape[d + 1:]) for d in range(len(info.shape)))
        offset = info.data_offsets[0] + sum(s.start * st for s, st in zip(index, strides))
        sizes = tuple(s.stop - s.start for s in index)
        return self._describe(FileBox(info.file, offset, sizes, strides, dtype), (key, _normal(box)))

    def _describe(self, fb: FileBox, ident: object = None, into: torch.Tensor | None = None) -> _Box:
        """How ``fb`` is read: straight into ``into`` run by run where the runs are long, else its span (viewed with
        its strides, or copied out compact where its runs only touch every page) or its runs packed one after the
        other."""
        ident = fb if ident is None else ident
        if into is not None and fb.numel:
            size = fb.dtype.itemsize
            steps = tuple(s * size for s in into.stride())
            k, run = len(fb.sizes), size  # runs contiguous in the file and in the tensor
            while k > 0 and fb.strides[k - 1] == run and (steps[k - 1] == run or fb.sizes[k - 1] == 1):
                k -= 1
                run *= fb.sizes[k]
            if run >= LANDING_RUN_BYTES:
                needed = math.prod(fb.sizes[:k]) * run
                return _Box(ident, fb.file, fb.offset, needed, fb.sizes, _contiguous(fb.sizes), fb.dtype,
                            runs=_Runs(run, fb.sizes[:k], fb.strides[:k]), into=into,
                            landing=(into.storage_offset() * size, steps[:k]), solid=needed == fb.span)
            box = self._describe(fb, ident)
            return _Box(box.ident, box.file, box.start, box.length, box.sizes, box.strides, box.dtype, box.compact,
                        box.runs, into=into)
        size = fb.dtype.itemsize
        if len(fb.sizes) != len(fb.strides) or any(s <= 0 for s in fb.strides):
            raise CheckpointError(f"{fb}: a box of a file needs one positive byte stride per dim")
        if not fb.numel:
            return _Box(ident, fb.file, fb.offset, 0, fb.sizes, _contiguous(fb.sizes), fb.dtype)
        k, run = len(fb.sizes), size  # the longest run: the trailing dims contiguous in the file, folded
        while k > 0 and fb.strides[k - 1] == run:
            k -= 1
            run *= fb.sizes[k]
        outer, steps = fb.sizes[:k], fb.strides[:k]
        needed = math.prod(outer) * run
        span = fb.span
        dense = needed >= DENSE_FILL * span
        viewable = all(s % size == 0 for s in fb.strides)
        if viewable and (dense or _gap_pages(run, outer, steps) <= (1 - DENSE_FILL) * span / ALIGN):
            # one span, viewed with its own strides (copied out where the runs only touch every page)
            return _Box(ident, fb.file, fb.offset, span, fb.sizes, tuple(s // size for s in fb.strides), fb.dtype,
                        compact=not dense)
        # runs packed one after the other: the box's own contiguous strides
        return _Box(ident, fb.file, fb.offset, needed, fb.sizes, _contiguous(fb.sizes), fb.dtype,
                    runs=_Runs(run, tuple(outer), tuple(steps)))

    def _info(self, key: str) -> KeyInfo:
        try:
            return self.index.keys[key]
        except KeyError:
            raise CheckpointError(f"key {key!r} is not in checkpoint {self.index.directory} "
                                  f"({len(self.index.keys)} keys)") from None

    def _fd(self, file: str) -> tuple[int, int]:
        got = self._fds.get(file)  # opened already (a dict read needs no lock): most calls, from every thread
        if got is not None:
            return got
        with self._lock:
            got = self._fds.get(file)
            if got is None:
                path = self.index.path_of(file)
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError as exc:
                    raise CheckpointError(f"{path}: cannot open: {exc}") from exc
                self._check_opened(file, fd)
                if hasattr(os, "posix_fadvise"):  # no readahead: the reads are large and parallel already, and
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # readahead reads bytes nobody owns
                head = os.pread(fd, 8, 0)
                if len(head) < 8:
                    os.close(fd)
                    raise CheckpointError(f"{path}: truncated file: no 8-byte header length")
                got = (fd, 8 + int.from_bytes(head, "little"))
                self._fds[file] = got
            return got

    def _changed(self, file: str, fd: int) -> str | None:
        """Why the open file ``fd`` is not the ``file`` whose header the index holds, or None."""
        return changed_since_parsed(self.index, file, os.fstat(fd))

    def _check_opened(self, file: str, fd: int) -> None:
        """Close the just-opened ``fd`` and raise where it is not the ``file`` the index parsed."""
        changed = self._changed(file, fd)
        if changed:
            os.close(fd)
            raise CheckpointError(changed)

    def check_unchanged(self, files: Collection[str] | None = None) -> None:
        """Raise where a file this reader read (of ``files``, if given) is no longer the one its index was parsed
        from (rewritten in place while it was read: the bytes read may be from both versions). Call after the last
        read has ended."""
        opened = [(file, fd) for file, (fd, _) in list(self._fds.items())] + list(self._direct_fds.items())
        for file, fd in opened:
            if files is not None and file not in files:
                continue
            changed = self._changed(file, fd)
            if changed:
                raise CheckpointError(changed)


_POOLS: dict[int, ThreadPoolExecutor] = {}  # reading threads by count, shared by every reader of this process
_POOLS_LOCK = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    """The process's pool of ``threads`` reading threads, made once: a load of a few hundred requests started 16
    threads each time, which cost up to a third of a warm load on a loaded 2-core machine."""
    with _POOLS_LOCK:
        pool = _POOLS.get(threads)
        if pool is None:
            pool = _POOLS[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="wb-read")
        return pool


def _forget_pools() -> None:  # a forked child has the pools but not their threads
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def cached_share(fd: int, offset: int, length: int, samples: int = _SAMPLES) -> float | None:
    """The share of up to ``samples`` pages, spread evenly over ``[offset, offset + length)`` of the open file
    ``fd``, that are in the page cache (``mincore`` of a mapping that touches no page); None where it cannot tell."""
    pages = _PageMap(fd)
    try:
        return pages.share(offset, length, samples)
    finally:
        pages.close()


class _PageMap:
    """A read-only mapping of a whole file, never touched, to ask ``mincore`` which of its pages are cached. One per
    file for a reader's life: mapping and unmapping per request cost a millisecond while 16 threads fault pages."""

    def __init__(self, fd: int) -> None:
        self.libc = _libc()
        self.size = os.fstat(fd).st_size
        self.addr: int | None = None
        if self.libc is not None and self.size:
            addr = self.libc.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is not None and addr != ctypes.c_void_p(-1).value:
                self.addr = addr

    def share(self, offset: int, length: int, samples: int = _SAMPLES) -> float | None:
        if self.addr is None or self.libc is None or length <= 0 or offset >= self.size:
            return None
        page = mmap.PAGESIZE
        first, last = offset // page, (min(offset + length, self.size) - 1) // page
        if last - first >= 2:  # the edge pages may hold a neighbour's bytes (the header, the box read before)
            first, last = first + 1, last - 1
        count = last - first + 1
        picks = sorted({first + i * (count - 1) // max(1, samples - 1) for i in range(min(samples, count))})
        vec = ctypes.c_ubyte()
        hits = 0
        for i in picks:
            if self.libc.mincore(ctypes.c_void_p(self.addr + i * page), page, ctypes.byref(vec)):
                return None
            hits += vec.value & 1
        return hits / len(picks)

    def close(self) -> None:
        if self.addr is not None and self.libc is not None:
            self.libc.munmap(ctypes.c_void_p(self.addr), self.size)
        self.addr = None


_LIBC: list[ctypes.CDLL | None] = []  # loaded once, on first use


def _libc() -> ctypes.CDLL | None:
    if not _LIBC:
        try:
            # PyDLL keeps the GIL through the call: mincore takes microseconds, and giving the GIL to 16 reading
            # threads and waiting to get it back made each of a request's 32 calls cost 30 us
            lib = ctypes.PyDLL(ctypes.util.find_library("c") or None, use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_long]
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            _LIBC.append(lib)
        except (OSError, AttributeError):
            _LIBC.append(None)
    return _LIBC[0]


def _copy_out(raw: torch.Tensor, item: _Box, out: torch.Tensor) -> None:
    """The box's elements out of its bytes ``raw`` (its buffer, with the box's strides) into ``out``: a contiguous
    buffer of its bytes, or a tensor of its shape with any strides. Copied with numpy on the calling thread, where
    torch's copy ran on its intra-op thread pool (on 2 ranks of 16 cores beside 32 reading threads a 512 KiB copy
    could wait milliseconds for that pool); numpy lets go of the GIL while it copies."""
    size = item.dtype.itemsize
    if out.dtype == torch.uint8 and out.dim() == 1:  # a buffer: the box's contiguous bytes
        target, start, steps = out.numpy(), 0, tuple(s * size for s in _contiguous(item.sizes))
    else:
        target, start, steps = _storage_bytes(out), out.storage_offset() * size, tuple(s * size for s in out.stride())
    shape, src, dst = list(item.sizes), [s * size for s in item.strides], list(steps)
    if src[-1] == size and dst[-1] == size:  # the last dim is contiguous on both sides: copied as bytes
        shape[-1] *= size
        src[-1] = dst[-1] = 1
    else:
        shape.append(size)
        src.append(1)
        dst.append(1)
    source = np.lib.stride_tricks.as_strided(raw.numpy(), shape, src, writeable=False)
    np.copyto(np.lib.stride_tricks.as_strided(target[start:], shape, dst), source)


def _place(typed: torch.Tensor, part: LandingPart) -> torch.Tensor:
    """``part``'s bytes in a slot (or its copy on the device) seen as ``typed``: one view. The packer places every
    part at a multiple of its element size; one that is not would be read shifted, so it is refused."""
    if part.at % part.dtype.itemsize:
        raise CheckpointError(f"internal: a landing part of {part.dtype} at byte {part.at} of its slot is not at a "
                              "multiple of its element size")
    return typed.as_strided(part.sizes, part.strides, typed.storage_offset() + part.at // part.dtype.itemsize)


def _storage_bytes(t: torch.Tensor) -> np.ndarray:
    """Every byte of the storage under ``t`` (a CPU tensor), as numpy sees them."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()


def _staging_device(device: torch.device | str | None, ring: StagingRing | None) -> torch.device | None:
    """The device a reader stages into: a CUDA device (with its index), or the CPU through an unpinned ring given
    (the staged path without a GPU: its pieces, slots and landing, with copies that run at once)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda":
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu" and ring is not None and not ring.pinned:
        return device
    raise ValueError(f"BoxReader stages reads into a CUDA device, not {device}")


def _lands_on(entry: object, device: torch.device) -> bool:
    """Whether an expected entry is a box with a tensor on ``device`` to land in."""
    return (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], FileBox)
            and isinstance(entry[1], torch.Tensor) and entry[1].device == device)


def _checked_into(fb: FileBox, into: torch.Tensor) -> torch.Tensor:
    if into.device.type != "cpu" or into.dtype != fb.dtype or tuple(into.shape) != fb.sizes:
        raise ValueError(f"a box of {fb.dtype} {list(fb.sizes)} cannot be read into a {into.device.type} tensor of "
                         f"{into.dtype} {list(into.shape)}: the same shape and dtype on the CPU are needed")
    if any(s < 0 for s in into.stride()):
        raise ValueError(f"a box cannot be read into a tensor of strides {into.stride()}")
    return into


def _run_starts(item: _Box) -> tuple[list[int], int]:
    """The file offsets (from the data section) of a box's runs, packed in its buffer one after the other, and
    their length: its one range, or its runs."""
    if item.runs is None:
        return [item.start], item.length
    return item.runs.offsets(item.start).tolist(), item.runs.length


def _aligned_cover(request: _Request, data_start: int) -> tuple[int, int, int, int]:
    """A contiguous request's absolute file range ``[begin, end)`` and that range rounded out to ``ALIGN``."""
    begin = data_start + request.boxes[0].start
    end = begin + request.nbytes
    return begin, end, begin // ALIGN * ALIGN, -(-end // ALIGN) * ALIGN


def _contiguous(sizes: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(sizes[d + 1:]) for d in range(len(sizes)))


def _direct_mode(direct: Direct | None) -> Direct:
    if direct is None:
        text = os.environ.get(DIRECT_ENV, "auto").strip().lower()
        modes: dict[str, Direct] = {"auto": "auto", "1": True, "true": True, "on": True, "0": False, "false": False,
                                    "off": False}
        if text not in modes:
            raise ValueError(f"{DIRECT_ENV}={os.environ[DIRECT_ENV]!r}: expected auto, 1 or 0")
        return modes[text]
    if direct not in (True, False, "auto") or (direct != "auto" and not isinstance(direct, bool)):
        raise ValueError(f"direct={direct!r}: expected True, False or 'auto'")
    return direct


def _normal(box: Box) -> Box:
    if box is None:
        return None
    return tuple(slice(s.start, s.stop, s.step) for s in box)


def _fit(info: KeyInfo, box: Box, index: CheckpointIndex) -> tuple[slice, ...]:
    """``box`` with every dim's bounds made explicit, checked against the key's shape."""
    where = f"key {info.hf_key!r} ({info.dtype}{list(info.shape)}) in {index.directory}"
    box = box or ()
    if len(box) > len(info.shape):
        raise CheckpointError(f"index has {len(box)} slices but {where} has {len(info.shape)} dims")
    out = []
    for dim, size in enumerate(info.shape):
        s = box[dim] if dim < len(box) else slice(None)
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise CheckpointError(f"index[{dim}] = {s!r} must be a slice with step 1, for {where}")
        start = 0 if s.start is None else int(s.start)
        stop = size if s.stop is None else int(s.stop)
        if not 0 <= start <= stop <= size:
            raise CheckpointError(f"index[{dim}] = {s} does not fit dim {dim} of size {size} of {where}")
        out.append(slice(start, stop))
    return tuple(out)


def _merge(boxes: list[_Box]) -> list[_Request]:
    """Group consecutive boxes of one file whose bytes touch into one request of at most ``MERGE_BYTES`` (packed
    boxes stay alone): many small keys in few reads, while the pieces of a large transfer stay requests of their
    own, each in one buffer of the slabs."""
    requests: list[_Request] = []
    for b in boxes:
        last = requests[-1] if requests else None
        prev = last.boxes[-1] if last is not None else None
        if (last is not None and prev is not None and last.file == b.file and b.runs is None
                and prev.runs is None and b.length and prev.start + prev.length == b.start
                and last.nbytes + b.length <= MERGE_BYTES):
            last.boxes.append(b)
            last.nbytes += b.length
            last.remaining += 1
        else:
            requests.append(_Request(b.file, [b]))
    return requests
