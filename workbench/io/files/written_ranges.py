"""The byte ranges a direct save wrote, and rank 0's proof that together they tile every file's data exactly once.

Every rank records each range it writes, at the write itself (the offsets a ``pwrite`` got, the box a memory map
copy filled). A record is ``(start, length, stride, count)``: ``count`` runs of ``length`` bytes, ``stride`` bytes
apart; a plain range has ``count == 1`` (and ``stride == length``). Before the status exchange each rank compacts
its records (``compact``): adjacent ranges merge, and equally long ranges at a constant step become one strided
record, so a rank's half rows of an expert-TP weight, or its rows of every layer's weight of one shape, are one
record each, not one per row. Records keep multiplicity: a range written twice stays twice.

Rank 0 then checks every file (``tiling_problems``): strided records of several ranks that interleave to fill
each period exactly (one rank's left half rows, another's right halves) fold into one plain range, and the plain
ranges, sorted, must follow each other from the first data byte to the last with no gap and no overlap. Anything
else (a piece written twice, one never written, a write outside the data) is reported with its file, bytes, key
and the ranks that wrote there.
"""

from __future__ import annotations

import heapq
import math
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np

__all__ = ["WrittenRanges", "compact", "pack", "packed_tiling_problems", "tiling_problems", "unpack", "unpack_rows"]

START, LENGTH, STRIDE, COUNT = range(4)


class WrittenRanges:
    """One rank's record of the bytes it wrote into each file (thread-safe: writer threads add to it)."""

    def __init__(self) -> None:
        self._chunks: dict[str, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def add_runs(self, file: str, starts: np.ndarray | Sequence[int], lengths: np.ndarray | int) -> None:
        """Record runs of bytes written at ``starts`` (byte offsets in ``file``), each ``lengths`` long."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        if not len(starts):
            return
        lengths = np.broadcast_to(np.asarray(lengths, dtype=np.int64), starts.shape)
        self._add(file, np.stack([starts, lengths, lengths, np.ones_like(starts)], axis=1))

    def add_box(self, file: str, first: int, strides: Sequence[int], sizes: Sequence[int], itemsize: int) -> None:
        """Record a box copied element by element: ``sizes`` elements along dims ``strides`` bytes apart, from byte
        ``first`` (what a strided copy into a memory map fills), as strided records without listing its runs."""
        if not sizes:
            self.add_runs(file, [first], itemsize)
            return
        if math.prod(sizes) == 0:
            return
        run, dim = itemsize, len(sizes) - 1
        while dim >= 0 and (sizes[dim] == 1 or strides[dim] == run):  # trailing dims laid out whole: one run
            run *= sizes[dim]
            dim -= 1
        if dim < 0:
            self.add_runs(file, [first], run)
            return
        outer = np.zeros(1, dtype=np.int64) + first
        for d in range(dim):
            outer = (outer[:, None] + np.arange(sizes[d], dtype=np.int64)[None, :] * strides[d]).reshape(-1)
        records = np.empty((len(outer), 4), dtype=np.int64)
        records[:, START], records[:, LENGTH] = outer, run
        records[:, STRIDE], records[:, COUNT] = strides[dim], sizes[dim]
        self._add(file, records)

    def _add(self, file: str, records: np.ndarray) -> None:
        with self._lock:
            self._chunks.setdefault(file, []).append(records)

    def compacted(self) -> dict[str, np.ndarray]:
        """``{file: records}``, each file's records compacted (``compact``): what the rank sends to rank 0."""
        with self._lock:
            chunks = {name: list(parts) for name, parts in self._chunks.items()}
        return {name: compact(np.concatenate(parts)) for name, parts in chunks.items()}


def pack(by_file: Mapping[str, np.ndarray], files: Sequence[str]) -> bytes:
    """A rank's compacted records as the bytes it sends: rows ``(file index in files, start, length, stride,
    count)``, file index and start stored as the change from the previous row, deflated (DeepSeek-V3 on 1,024 ranks:
    about 0.5-0.7 KiB a rank)."""
    index = {name: i for i, name in enumerate(files)}
    parts = [np.column_stack([np.full(len(r), index[name], dtype=np.int64), r])
             for name, r in sorted(by_file.items(), key=lambda item: index[item[0]]) if len(r)]
    rows = np.concatenate(parts) if parts else np.empty((0, 5), dtype=np.int64)
    rows[1:, :2] = rows[1:, :2] - rows[:-1, :2]
    return zlib.compress(rows.astype("<i8").tobytes(), 6)


def unpack(blob: bytes, files: Sequence[str]) -> dict[str, np.ndarray]:
    """``pack``'s input back from its bytes."""
    rows = unpack_rows(blob)
    heads = np.flatnonzero(np.concatenate([[True], rows[1:, 0] != rows[:-1, 0]])) if len(rows) else []
    ends = np.append(heads[1:], len(rows))
    return {files[int(rows[h, 0])]: rows[h:e, 1:] for h, e in zip(heads, ends)}


def unpack_rows(blob: bytes) -> np.ndarray:
    """``pack``'s rows: an ``(n, 5)`` array of ``(file index, start, length, stride, count)``, by file index."""
    rows = np.frombuffer(zlib.decompress(blob), dtype="<i8").reshape(-1, 5).astype(np.int64)
    rows[:, :2] = np.cumsum(rows[:, :2], axis=0)
    return rows


def compact(records: np.ndarray) -> np.ndarray:
    """The same bytes, with the same multiplicity, in as few records as this finds: sorted by start, adjacent plain
    ranges merged, equally long ranges at a constant step made strided records, records that continue one another
    joined. ``records``: an ``(n, 4)`` int64 array of ``(start, length, stride, count)``."""
    records = np.asarray(records, dtype=np.int64).reshape(-1, 4).copy()
    if len(records) == 1:  # most files of a rank: one piece
        start, length, stride, count = records[0].tolist()
        if length <= 0 or count <= 0:
            return records[:0]
        if count == 1 or stride == length:
            return np.array([[start, length * count, length * count, 1]], dtype=np.int64)
        return records
    records = records[(records[:, LENGTH] > 0) & (records[:, COUNT] > 0)]
    whole = (records[:, COUNT] > 1) & (records[:, STRIDE] == records[:, LENGTH])  # strided with no gaps: one range
    records[whole, LENGTH] *= records[whole, COUNT]
    records[whole, COUNT] = 1
    plain = records[:, COUNT] == 1
    records[plain, STRIDE] = records[plain, LENGTH]
    runs = _progressions(*_merge_adjacent(records[plain, START], records[plain, LENGTH]))
    merged = np.concatenate([runs, records[~plain]])
    merged = merged[np.lexsort((merged[:, LENGTH], merged[:, START]))]
    return _join(merged)


def _merge_adjacent(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Plain ranges sorted, each one that starts where the previous one ends merged into it (duplicates stay)."""
    order = np.lexsort((lengths, starts))
    starts, lengths = starts[order], lengths[order]
    if len(starts) < 2:
        return starts, lengths
    heads = np.flatnonzero(np.concatenate([[True], starts[1:] != starts[:-1] + lengths[:-1]]))
    ends = np.append(heads[1:], len(starts))
    last = ends - 1
    return starts[heads], starts[last] + lengths[last] - starts[heads]


def _progressions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Sorted plain ranges as strided records: maximal stretches of equal lengths at a constant step, each range
    in exactly one record (a range between two stretches goes to the earlier one)."""
    n = len(starts)
    if n == 0:
        return np.empty((0, 4), dtype=np.int64)
    steps = np.zeros(n, dtype=np.int64)
    steps[1:] = starts[1:] - starts[:-1]
    link = np.zeros(n, dtype=bool)  # link i joins range i - 1 and range i
    link[1:] = lengths[1:] == lengths[:-1]
    begins = link.copy()  # a link that starts a stretch: the one before it is no link or has another step
    begins[2:] &= ~link[1:-1] | (steps[2:] != steps[1:-1])
    stretch = np.cumsum(begins)
    opener = np.zeros(n, dtype=bool)  # range i opens the stretch of link i + 1 (no link of its own before it)
    opener[:-1] = ~link[:-1] & begins[1:]
    ids = np.where(link, stretch, -np.arange(1, n + 1))
    ids[:-1] = np.where(opener[:-1], stretch[1:], ids[:-1])
    heads = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))
    counts = np.diff(np.append(heads, n))
    pairs = counts == 2  # two ranges alike by chance (pieces of two far-apart keys) stay two plain ranges
    heads = np.sort(np.concatenate([heads, heads[pairs] + 1]))
    counts = np.diff(np.append(heads, n))
    out = np.empty((len(heads), 4), dtype=np.int64)
    out[:, START], out[:, LENGTH], out[:, COUNT] = starts[heads], lengths[heads], counts
    following = np.minimum(heads + 1, n - 1)
    out[:, STRIDE] = np.where(counts > 1, starts[following] - starts[heads], lengths[heads])
    return out


def _join(records: np.ndarray) -> np.ndarray:
    """Records sorted by start, each joined to the previous one when it continues it: a plain range right after a
    plain range, or a strided record one step on from a record of the same length and step (or a plain range
    one step before or after a strided record)."""
    out: list[list[int]] = []
    for start, length, stride, count in records.tolist():
        if out:
            cur = out[-1]
            if cur[COUNT] == 1 and count == 1 and start == cur[START] + cur[LENGTH]:
                cur[LENGTH] += length
                cur[STRIDE] = cur[LENGTH]
                continue
            if cur[COUNT] == 1 and count == 1:
                out.append([start, length, stride, count])
                continue
            step = cur[STRIDE] if cur[COUNT] > 1 else stride
            if (length == cur[LENGTH] and step != length and (cur[COUNT] == 1 or cur[STRIDE] == step)
                    and (count == 1 or stride == step) and start == cur[START] + cur[COUNT] * step):
                cur[STRIDE] = step
                cur[COUNT] += count
                continue
        out.append([start, length, stride, count])
    return np.array(out, dtype=np.int64).reshape(-1, 4)


def tiling_problems(
    regions: Mapping[str, tuple[int, int]],
    by_rank: Sequence[Mapping[str, np.ndarray] | None],
    describe: Callable[[str, int, int], str] | None = None,
    limit: int = 3,
) -> list[str]:
    """What keeps the ranks' writes from tiling each file's data region exactly once (empty: they do).

    Args:
        regions: ``{file: (first data byte, end of file)}``.
        by_rank: every rank's compacted records per file (``WrittenRanges.compacted``), in rank order.
        describe: ``describe(file, start, end)`` names what lies in those bytes (keys, elements).
        limit: problems reported per file and kind (writes outside the data, gaps, overlaps); at most
            ``4 * limit`` in all, then a line counting the rest.
    """
    files = list(regions)
    index = {name: i for i, name in enumerate(files)}
    parts = []
    for rank, records in enumerate(by_rank):
        for name, r in (records or {}).items():
            if name not in index:
                raise ValueError(f"rank {rank} reports writes into {name!r}, which is not a file of the save")
            r = np.asarray(r, dtype=np.int64).reshape(-1, 4)
            parts.append(np.column_stack([np.full((len(r), 2), (rank, index[name]), dtype=np.int64), r]))
    return _problems(files, regions, _rows(parts), describe, limit)


def packed_tiling_problems(
    regions: Mapping[str, tuple[int, int]],
    blobs: Sequence[bytes | None],
    describe: Callable[[str, int, int], str] | None = None,
    limit: int = 3,
) -> list[str]:
    """``tiling_problems`` of every rank's ``pack``ed records (packed against ``sorted(regions)``)."""
    files = sorted(regions)
    parts = []
    for rank, blob in enumerate(blobs):
        if blob is not None:
            rows = unpack_rows(blob)
            parts.append(np.column_stack([np.full(len(rows), rank, dtype=np.int64), rows]))
    return _problems(files, regions, _rows(parts), describe, limit)


def _rows(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty((0, 6), dtype=np.int64)


def _problems(
    files: Sequence[str], regions: Mapping[str, tuple[int, int]], rows: np.ndarray,
    describe: Callable[[str, int, int], str] | None, limit: int,
) -> list[str]:
    """``rows``: every rank's records as ``(rank, file index, start, length, stride, count)``, checked for every
    file at once: outside writes, then (after folding strided records) gaps and overlaps of the sorted ranges."""
    rows = rows[(rows[:, 3] > 0) & (rows[:, 5] > 0)]
    lo = np.array([regions[f][0] for f in files], dtype=np.int64)
    hi = np.array([regions[f][1] for f in files], dtype=np.int64)
    found: list[tuple[int, int, int, int, str]] = []  # (file, kind, start, end, what)
    rank, file, start = rows[:, 0], rows[:, 1], rows[:, 2]
    end = start + (rows[:, 5] - 1) * rows[:, 4] + rows[:, 3]
    for i in np.flatnonzero((start < lo[file]) | (end > hi[file])).tolist():
        f = int(file[i])
        found.append((f, 0, int(start[i]), int(end[i]),
                      f"written by rank {rank[i]}, outside the data region {lo[f]}-{hi[f] - 1}"))
    f, s, n = _fold(rows[:, 1:])
    order = np.lexsort((n, s, f))
    f, s, n = f[order], s[order], n[order]
    present = np.zeros(len(files), dtype=bool)
    present[f] = True
    for i in np.flatnonzero(~present & (hi > lo)).tolist():
        found.append((i, 1, int(lo[i]), int(hi[i]), "written by no rank"))
    if len(f):
        base = f * (int(max(hi.max(), (s + n).max())) + 1)  # files apart: a running maximum per file at once
        reach = np.maximum.accumulate(s + n + base) - base  # the furthest byte written so far in the file
        first = np.concatenate([[True], f[1:] != f[:-1]])
        last = np.concatenate([f[1:] != f[:-1], [True]])
        before = np.concatenate([[0], reach[:-1]])
        for i in np.flatnonzero(first & (s > lo[f])).tolist():
            found.append((int(f[i]), 1, int(lo[f[i]]), int(s[i]), "written by no rank"))
        for i in np.flatnonzero(~first & (s > before)).tolist():
            found.append((int(f[i]), 1, int(before[i]), int(s[i]), "written by no rank"))
        for i in np.flatnonzero(last & (reach < hi[f])).tolist():
            found.append((int(f[i]), 1, int(reach[i]), int(hi[f[i]]), "written by no rank"))
        for i in np.flatnonzero(~first & (s < before)).tolist():
            found.append((int(f[i]), 2, int(s[i]), int(min(before[i], s[i] + n[i])), ""))
    found.sort()
    out: list[str] = []
    shown: dict[tuple[int, int], int] = {}
    for fi, kind, a, b, what in found:
        if len(out) == 4 * limit or shown.get((fi, kind), 0) == limit:
            continue
        shown[(fi, kind)] = shown.get((fi, kind), 0) + 1
        if kind == 2:
            mine = rows[rows[:, 1] == fi]
            times = _writers_of(mine[:, 2:], mine[:, 0], a)
            who = ", ".join(f"rank {r}" + ("" if k == 1 else " twice" if k == 2 else f" {k} times")
                            for r, k in times.items())
            what = f"written {sum(times.values())} times ({who})"
        out.append(_say(files[fi], a, b, what, describe))
    if len(found) > len(out):
        out.append(f"... and {len(found) - len(out)} more")
    return out


def _fold(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plain ranges ``(file indices, starts, lengths)`` holding the same bytes with the same multiplicity as
    ``rows`` (``(file index, start, length, stride, count)``).

    Strided records of one file and step that start within one step of each other and whose first runs fill that
    step exactly, end to end, fill every step they share: those steps fold into one plain range, and what remains
    of the longer records is folded again. Records that start within a step of one another without filling it so
    are listed run by run (each record is looked at once: no quadratic retries)."""
    plain = rows[:, 4] == 1
    files, starts, lengths = [rows[plain, 0]], [rows[plain, 1]], [rows[plain, 2]]
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for file, start, length, stride, count in rows[~plain].tolist():
        groups.setdefault((file, stride), []).append((start, length, count))
    folded: list[tuple[int, int, int]] = []
    listed: list[tuple[int, int, int, int, int]] = []  # records listed run by run: (file, start, length, step, count)
    for (file, step), group in groups.items():
        heapq.heapify(group)
        while group:
            first = heapq.heappop(group)
            window = [first]
            while group and group[0][0] < first[0] + step:
                window.append(heapq.heappop(group))
            reach = first[0]
            for start, length, _ in window:  # sorted by start: each run must begin where the last one ended
                if start != reach:
                    reach = -1
                    break
                reach += length
            if reach != first[0] + step:  # they do not interleave exactly: list every run of the window's records
                listed.extend((file, start, length, step, count) for start, length, count in window)
                continue
            shared = min(count for _, _, count in window)
            folded.append((file, first[0], step * shared))
            for start, length, count in window:
                if count > shared:
                    heapq.heappush(group, (start + shared * step, length, count - shared))
    if listed:
        table = np.array(listed, dtype=np.int64)
        count = table[:, 4]
        run = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        files.append(np.repeat(table[:, 0], count))
        starts.append(np.repeat(table[:, 1], count) + run * np.repeat(table[:, 3], count))
        lengths.append(np.repeat(table[:, 2], count))
    if folded:
        extra = np.array(folded, dtype=np.int64)
        files.append(extra[:, 0])
        starts.append(extra[:, 1])
        lengths.append(extra[:, 2])
    return np.concatenate(files), np.concatenate(starts), np.concatenate(lengths)


def _writers_of(records: np.ndarray, owners: np.ndarray, byte: int) -> dict[int, int]:
    """``{rank: how many of its runs hold byte}``, from the records as the ranks sent them (runs ``j`` with
    ``j * stride <= byte - start < j * stride + length``; a step of 0 repeats one run ``count`` times)."""
    start, length, stride, count = (records[:, i] for i in range(4))
    offset = byte - start
    period = np.maximum(stride, 1)
    last = np.minimum(count - 1, offset // period)
    first = np.maximum(0, (offset - length) // period + 1)
    strided = np.maximum(0, last - first + 1) * (offset >= 0)
    repeated = np.where((offset >= 0) & (offset < length), count, 0)
    times = np.where(stride > 0, strided, repeated)
    out: dict[int, int] = {}
    for rank, n in zip(owners.tolist(), times.tolist()):
        if n:
            out[rank] = out.get(rank, 0) + n
    return dict(sorted(out.items()))


def _say(name: str, start: int, end: int, what: str, describe: Callable[[str, int, int], str] | None) -> str:
    where = f": {describe(name, start, end)}" if describe is not None else ""
    return f"{name}: bytes {start}-{end - 1} ({end - start} B) {what}{where}"
