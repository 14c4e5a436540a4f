"""Boxes of file bytes read into tensors on a device, planned as pieces of one staging slot each.

A load into GPU memory knows, before anything is read, where every byte of the checkpoint goes: a parameter's
coalesced transfers (``transfers.py``) name a box of a file and the view of the local tensor it fills. So the
copies need no buffer of their own and no word from the loading thread: a reader thread reads a piece into a pinned
slot, queues the slot's copy into the tensor (straight into it where the piece is one contiguous run of it, else
into a buffer of the slot's size on the device and from there with one strided copy per part), and gives the slot
back with the event of that copy. ``plan_landing`` cuts the boxes into such pieces; ``BoxReader`` runs them
(``box_reads.py``).

A box is cut along its leading dim into parts whose bytes fit a piece (a row too long for one is cut along its own
leading dim, down to runs of elements; a contiguous run is cut at page boundaries of the file, so the pieces of a
large tensor read with ``O_DIRECT`` read every page once), and parts that follow each other are packed into one
piece while they fit. A part is read as its span (viewed with the file's strides: the bytes between its runs come
along) or as its runs packed one after the other, as the caller says (``BoxReader`` keeps its own rule: the span
where it is dense or its gaps hold no whole page). Where a piece's parts are one range of the file, each at its own
place relative to the page the range starts in, the piece is ``solid``: its aligned cover fits the slot and can be
read with ``O_DIRECT`` straight into it. A solid piece of ``_KEEP_SOLID`` bytes is joined by no part from elsewhere
(it stays O_DIRECT-able), except in files the caller names ``packed`` (cached: read through the page cache, where
fewer, fuller pieces cost the loading thread less; a warm MoE load planned half as many).

Pure arithmetic on offsets and views: nothing is read here. ``kept_landing`` keeps a plan for its geometry (boxes and
the dtype, shape, strides and offset of each tensor they land in), so a repeat load into the same model plans
nothing: it makes each part's place again as a view of the tensor given now.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from workbench.io.files.transfers import FileBox
from workbench.memo import LRU

__all__ = ["LandingPart", "LandingPiece", "kept_landing", "plan_landing"]

ALIGN = 4096  # O_DIRECT's alignment of offsets and lengths (a page)
_PAD = 64  # a part that does not sit at its place in the file starts at a multiple of this in the slot
_KEEP_SOLID = 1 << 20  # a solid piece this long is not joined by a part from elsewhere (it stays O_DIRECT-able)


@dataclass(frozen=True, slots=True)
class LandingPart:
    """Bytes at ``at`` in a slot, viewed as ``dtype`` with ``sizes`` and element ``strides``, copied into ``dest``
    (a view of the target of the same sizes, any dtype: a copy casts). ``nbytes``: from ``at`` to its last byte;
    ``box``: which of the planned boxes it belongs to."""

    at: int
    nbytes: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    dest: torch.Tensor = field(compare=False, repr=False)
    box: int = -1  # the index of the box it is part of, in the boxes planned

    @property
    def direct(self) -> bool:
        """Whether its bytes are ``dest``'s own bytes in order: one copy from the slot into it, no buffer between."""
        return (self.dest.dtype == self.dtype and self.strides == _contiguous(self.sizes)
                and self.dest.is_contiguous())


@dataclass(frozen=True, slots=True)
class LandingPiece:
    """What one slot carries: ``reads`` (absolute file offset, offset in the slot, bytes) of ``file``, then the copy
    of each part. ``used``: slot bytes from 0 to the end of the last part. ``solid``: the absolute range
    ``(begin, end)`` the reads make when they are one range of the file laid at ``begin % ALIGN`` in the slot
    (O_DIRECT reads its aligned cover into the slot instead), else None."""

    file: str
    reads: tuple[tuple[int, int, int], ...]
    parts: tuple[LandingPart, ...]
    used: int
    solid: tuple[int, int] | None

    @property
    def nbytes(self) -> int:
        """Bytes the reads ask for."""
        return sum(n for _, _, n in self.reads)


def plan_landing(
    boxes: Sequence[tuple[FileBox, torch.Tensor, str]],
    data_start: Mapping[str, int],
    slot_bytes: int,
    packed: Collection[str] = (),
) -> list[LandingPiece]:
    """The pieces that read ``boxes`` into slots of ``slot_bytes``, in order. Each is ``(box, dest, how)``: a box of
    a file, the view of its sizes it lands in, and how it is read: ``"runs"`` (its runs packed one after the other),
    ``"span"`` (its span, viewed with the file's strides) or ``"shared"`` (its span, whose pages hold a peer's bytes
    too: never in a solid piece, so O_DIRECT does not read for one rank what the page cache reads once for both).

    ``data_start`` is each file's first data byte (after its header). Every part's bytes end at most ``ALIGN``
    before the slot's end, so a solid piece's aligned cover always fits. In the files of ``packed`` each keeps its own
    open piece, and a solid piece there is joined by parts from elsewhere whatever its size.

    Raises:
        ValueError: ``dest`` does not have the box's sizes, or the slot cannot hold a page and one element.
    """
    if slot_bytes < 3 * ALIGN:
        raise ValueError(f"a landing slot of {slot_bytes} bytes is too small: at least {3 * ALIGN}")
    limit = slot_bytes - 2 * ALIGN  # a part's bytes; with its place in its first page and its last page's rest
    packer = _Packer(slot_bytes, frozenset(packed))
    for i, (fb, dest, how) in enumerate(boxes):
        if tuple(dest.shape) != fb.sizes:
            raise ValueError(f"{fb} cannot land in a tensor of shape {tuple(dest.shape)}")
        if how not in ("runs", "span", "shared"):
            raise ValueError(f"how={how!r}: expected runs, span or shared")
        if not fb.numel:
            continue
        base = data_start[fb.file]
        span = how != "runs"
        for sub, offset, strides in _split(fb, dest.storage_offset(), dest.stride(), span, limit, base):
            view = dest.as_strided(sub.sizes, strides, offset)
            packer.add(sub, view, span, base, shared=how == "shared", box=i)
    return packer.done()


_KEPT = LRU(4)  # the geometry of a landing -> its pieces, every part's dest as (box, storage offset, strides)


def kept_landing(
    boxes: Sequence[tuple[FileBox, torch.Tensor]],
    how: Callable[[FileBox], str],
    data_start: Mapping[str, int],
    slot_bytes: int,
    packed: Collection[str] = (),
) -> Iterator[LandingPiece]:
    """``plan_landing`` of ``(box, dest, how(box))`` for each of ``boxes``, kept for the same geometry: the same
    boxes, each landing in a tensor of the same dtype, shape, strides and storage offset, the same data starts, slot
    size and ``packed`` files (a repeat load into the same model). A hit plans nothing and calls no ``how``: its
    parts' places are made again as views of the tensors given now, so the memo holds no tensor (it keeps no model's
    memory alive). The pieces come one at a time, as the caller takes them: on a hit, a piece's views are made only
    when it is taken, so the first reads start before the last piece is made (a reader takes pieces as slots free)."""
    key = (slot_bytes, tuple(sorted(data_start.items())), tuple(sorted(packed)),
           tuple((fb, dest.dtype, tuple(dest.shape), dest.stride(), dest.storage_offset()) for fb, dest in boxes))
    kept = _KEPT.get(key)
    if kept is None:
        pieces = plan_landing([(fb, dest, how(fb)) for fb, dest in boxes], data_start, slot_bytes, packed)
        _KEPT.put(key, [(p.file, p.reads, p.used, p.solid,
                         tuple((q.at, q.nbytes, q.sizes, q.strides, q.dtype, q.box, q.dest.storage_offset(),
                                q.dest.stride()) for q in p.parts)) for p in pieces])
        return iter(pieces)
    return _remade(kept, [dest for _, dest in boxes])


def _remade(kept: list[tuple], dests: list[torch.Tensor]) -> Iterator[LandingPiece]:
    """The kept pieces, each part's place a view of ``dests`` made as the piece is taken."""
    for file, reads, used, solid, parts in kept:
        yield LandingPiece(file, reads, tuple(
            LandingPart(at, nbytes, sizes, strides, dtype, dests[box].as_strided(sizes, steps, offset), box)
            for at, nbytes, sizes, strides, dtype, box, offset, steps in parts), used, solid)


def _split(
    fb: FileBox, offset: int, strides: Sequence[int], span: bool, limit: int, base: int
) -> Iterator[tuple[FileBox, int, tuple[int, ...]]]:
    """``fb`` cut into boxes of at most ``limit`` bytes read, each with its element offset and strides in the
    destination's storage."""
    strides = tuple(strides)
    if _read_bytes(fb, span) <= limit:
        yield fb, offset, strides
        return
    size = fb.dtype.itemsize
    first = fb.sizes[0]
    if len(fb.sizes) == 1 and fb.strides[0] == size:  # one run: cut at pages of the file
        start = base + fb.offset
        step = limit // ALIGN * ALIGN
        cuts = [0]
        if start % size == 0:
            nxt = (start // ALIGN + 1) * ALIGN + step - ALIGN  # the first cut, then every ``step`` bytes
            while nxt - start < first * size:
                cuts.append((nxt - start) // size)
                nxt += step
        else:  # elements straddle pages anyway: cut every ``limit`` bytes
            cuts.extend(range(limit // size, first, limit // size))
        cuts.append(first)
        for a, b in itertools.pairwise(cuts):
            if b > a:
                yield (FileBox(fb.file, fb.offset + a * size, (b - a,), fb.strides, fb.dtype), offset + a * strides[0],
                       strides)
        return
    row = FileBox(fb.file, fb.offset, (1, *fb.sizes[1:]), fb.strides, fb.dtype)
    per_row = _read_bytes(row, span)
    if per_row <= limit:  # whole rows: as many as fit
        if span:
            rows = (limit - per_row) // fb.strides[0] + 1
        else:
            rows = limit // per_row
        for a in range(0, first, rows):
            n = min(rows, first - a)
            yield (FileBox(fb.file, fb.offset + a * fb.strides[0], (n, *fb.sizes[1:]), fb.strides, fb.dtype),
                   offset + a * strides[0], strides)
        return
    for a in range(first):  # a row is too long: each row on its own, cut along its next dim
        inner = FileBox(fb.file, fb.offset + a * fb.strides[0], fb.sizes[1:], fb.strides[1:], fb.dtype)
        yield from _split(inner, offset + a * strides[0], strides[1:], span, limit, base)


def _read_bytes(fb: FileBox, span: bool) -> int:
    return fb.span if span else fb.nbytes


def _runs(fb: FileBox) -> tuple[int, list[int]]:
    """The length of ``fb``'s runs (trailing dims contiguous in the file, folded) and their offsets, in order."""
    size = fb.dtype.itemsize
    k, run = len(fb.sizes), size
    while k > 0 and fb.strides[k - 1] == run:
        k -= 1
        run *= fb.sizes[k]
    starts = [fb.offset]
    for n, s in zip(fb.sizes[:k], fb.strides[:k]):
        starts = [a + i * s for a in starts for i in range(n)]
    return run, starts


class _Open:
    """The piece being packed for one file: its reads, its parts, the bytes used and its solid range."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.reads: list[tuple[int, int, int]] = []
        self.parts: list[LandingPart] = []
        self.used = 0
        self.solid: tuple[int, int] | None = None

    def piece(self) -> LandingPiece:
        return LandingPiece(self.file, tuple(self.reads), tuple(self.parts), self.used, self.solid)


class _Packer:
    """Parts packed into pieces in order, at most a slot each. A piece holds one file's parts; a part of another file
    ends it, except in the files of ``packed``, each of which keeps its own piece open until it is full (boxes next
    to each other in a load often sit in different files), and where a solid piece is joined by parts from elsewhere
    whatever its size. Without ``packed`` the pieces are those of one open piece at a time."""

    def __init__(self, slot_bytes: int, packed: frozenset[str] = frozenset()) -> None:
        self.slot_bytes = slot_bytes
        self.packed = packed
        self.pieces: list[LandingPiece] = []
        self._open: dict[str, _Open] = {}  # by file, in the order they were opened

    def add(self, fb: FileBox, dest: torch.Tensor, span: bool, base: int, shared: bool = False, box: int = -1
            ) -> None:
        size = fb.dtype.itemsize
        run, starts = (0, []) if span else _runs(fb)
        if span or len(starts) == 1:  # one range of the file
            begin = base + fb.offset
            nbytes = fb.span
            ranges = [(begin, nbytes)]
            strides = tuple(s // size for s in fb.strides) if span else _contiguous(fb.sizes)
        else:
            ranges = [(base + s, run) for s in starts]
            nbytes = run * len(starts)
            strides = _contiguous(fb.sizes)
        for other in [f for f in self._open if f != fb.file and f not in self.packed]:
            self._flush(other)
        piece = self._open.get(fb.file)
        at = None if piece is None else self._place(piece, ranges, nbytes, size, shared)
        if at is None:
            self._flush(fb.file)
            piece = self._open[fb.file] = _Open(fb.file)
            at = self._place(piece, ranges, nbytes, size, shared)
            assert at is not None, "a part larger than a slot"
        piece.parts.append(LandingPart(at, nbytes, fb.sizes, strides, fb.dtype, dest, box))
        pos = at
        for offset, n in ranges:
            last = piece.reads[-1] if piece.reads else None
            if last is not None and last[0] + last[2] == offset and last[1] + last[2] == pos:
                piece.reads[-1] = (last[0], last[1], last[2] + n)
            else:
                piece.reads.append((offset, pos, n))
            pos += n
        piece.used = at + nbytes

    def _place(self, piece: _Open, ranges: list[tuple[int, int]], nbytes: int, size: int, shared: bool) -> int | None:
        """Where the part goes in ``piece`` (None: it does not fit; start a new one); keeps its ``solid``."""
        one_range = len(ranges) == 1 and not shared
        begin = ranges[0][0]
        if not piece.parts:  # a new piece: at its place within its first page when that keeps it aligned
            natural = begin % ALIGN
            at = natural if one_range and natural % size == 0 else 0
            piece.solid = (begin, begin + nbytes) if one_range and at == natural else None
            return at
        solid = piece.solid
        if solid is not None and one_range and begin == solid[1] and piece.used % size == 0:
            at = piece.used  # the range goes on (a key whose elements would straddle their size does not: padded)
            if at + nbytes <= self.slot_bytes - ALIGN:
                piece.solid = (solid[0], begin + nbytes)
                return at
            return None
        if solid is not None and piece.used >= _KEEP_SOLID and piece.file not in self.packed:
            return None
        at = -(-piece.used // max(_PAD, size)) * max(_PAD, size)
        if at + nbytes > self.slot_bytes - ALIGN:
            return None
        piece.solid = None
        return at

    def _flush(self, file: str) -> None:
        piece = self._open.pop(file, None)
        if piece is not None and piece.parts:
            self.pieces.append(piece.piece())

    def done(self) -> list[LandingPiece]:
        for file in list(self._open):
            self._flush(file)
        return self.pieces


def _contiguous(sizes: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(sizes[d + 1:]) for d in range(len(sizes)))
