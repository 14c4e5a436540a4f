"""The written-range record and rank 0's coverage proof (``workbench/io/files/written_ranges.py``), against brute force:
a byte array counting every run of every record."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.io.files.written_ranges import WrittenRanges, compact, pack, tiling_problems, unpack


def counts(records, size: int) -> np.ndarray:
    """How many runs of ``records`` ((start, length, stride, count) rows) hold each byte of [0, size)."""
    out = np.zeros(size, dtype=np.int64)
    for start, length, stride, count in np.asarray(records, dtype=np.int64).reshape(-1, 4).tolist():
        for j in range(count):
            out[start + j * stride : start + j * stride + length] += 1
    return out


records_st = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 9), st.integers(0, 12), st.integers(0, 6)),
                      max_size=25)


@settings(max_examples=300)
@given(records=records_st)
def test_compact_keeps_every_byte_and_its_multiplicity(records) -> None:
    got = compact(np.array(records, dtype=np.int64).reshape(-1, 4))
    assert np.array_equal(counts(got, 200), counts(records, 200))
    assert len(got) <= sum(1 for _, n, _, c in records if n and c)


def test_compact_makes_regular_runs_one_record() -> None:
    # a rank's left half rows of 8 experts (rows of 64 bytes, halves of 32) written one pwrite per row
    starts = np.arange(8 * 16) * 64
    assert compact(np.stack([starts, np.full_like(starts, 32), np.full_like(starts, 32), np.ones_like(starts)], 1)
                   ).tolist() == [[0, 32, 64, 128]]
    # rows written whole one after another: one plain range
    starts = np.arange(100) * 10
    assert compact(np.stack([starts, np.full_like(starts, 10), np.full_like(starts, 10), np.ones_like(starts)], 1)
                   ).tolist() == [[0, 1000, 1000, 1]]
    # the same range twice stays twice
    assert counts(compact(np.array([[5, 4, 4, 1], [5, 4, 4, 1]])), 20)[5:9].tolist() == [2, 2, 2, 2]


@settings(max_examples=200)
@given(data=st.data())
def test_a_box_is_recorded_as_the_bytes_it_holds(data) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=0, max_size=4), label="shape"))
    itemsize = data.draw(st.sampled_from([1, 2, 4]), label="itemsize")
    offset = [data.draw(st.integers(0, n - 1)) for n in shape]
    sizes = [data.draw(st.integers(0, n - o)) for n, o in zip(shape, offset)]
    base = data.draw(st.integers(0, 16), label="base")
    strides = [itemsize * math.prod(shape[d + 1 :]) for d in range(len(shape))]
    first = base + sum(o * s for o, s in zip(offset, strides))
    ranges = WrittenRanges()
    ranges.add_box("f", first, strides, sizes, itemsize)
    size = base + math.prod(shape) * itemsize
    want = np.zeros(size, dtype=np.int64)
    flat = np.zeros(shape or (), dtype=np.int64)
    flat[tuple(slice(o, o + n) for o, n in zip(offset, sizes))] = 1
    want[base:] = np.repeat(flat.reshape(-1), itemsize)
    got = ranges.compacted().get("f", np.empty((0, 4), dtype=np.int64))
    assert np.array_equal(counts(got, size), want)
    # a box is a few records: one per index of the dims before its innermost cut one, at most
    assert len(got) <= max(1, math.prod(sizes[:-1]) if sizes else 1)


@st.composite
def tilings(draw: st.DrawFn) -> tuple[int, int, list[tuple[int, tuple[int, int, int, int]]]]:
    """A data region [lo, hi) tiled exactly: consecutive blocks, each one plain range or a grid of rows cut into
    column strips, each strip's rows split into pieces (a strided record each) of random ranks."""
    lo = draw(st.integers(0, 40))
    pos, pieces = lo, []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            n = draw(st.integers(1, 30))
            pieces.append((draw(st.integers(0, 3)), (pos, n, n, 1)))
            pos += n
            continue
        rows = draw(st.integers(1, 8))
        widths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
        width = sum(widths)
        column = 0
        for w in widths:
            row = 0
            while row < rows:
                take = draw(st.integers(1, rows - row))
                pieces.append((draw(st.integers(0, 3)), (pos + row * width + column, w, width, take)))
                row += take
            column += w
        pos += rows * width
    return lo, pos, pieces


def verdict(lo: int, hi: int, pieces) -> list[str]:
    by_rank: list[dict[str, np.ndarray]] = [{} for _ in range(4)]
    for rank in range(4):
        mine = [p for r, p in pieces if r == rank]
        if mine:
            by_rank[rank]["f"] = compact(np.array(mine, dtype=np.int64))
    return tiling_problems({"f": (lo, hi)}, by_rank)


@settings(max_examples=300)
@given(tiling=tilings(), change=st.sampled_from(["none", "drop", "twice", "shift", "longer", "shorter", "move"]),
       data=st.data())
def test_the_proof_accepts_exactly_the_writes_that_tile_the_region(tiling, change: str, data) -> None:
    lo, hi, pieces = tiling
    pieces = list(pieces)
    i = data.draw(st.integers(0, len(pieces) - 1), label="piece")
    rank, (start, length, stride, count) = pieces[i]
    if change == "drop":
        del pieces[i]
    elif change == "twice":
        pieces.append(((rank + data.draw(st.integers(0, 3))) % 4, pieces[i][1]))
    elif change == "shift":
        pieces[i] = (rank, (start + data.draw(st.sampled_from([-1, 1])), length, stride, count))
    elif change == "longer":
        pieces[i] = (rank, (start, length + 1, stride, count))
    elif change == "shorter":
        pieces[i] = (rank, (start, length - 1, stride, count))
    elif change == "move":  # another piece's bytes written in place of this one's: same count of bytes
        j = data.draw(st.integers(0, len(pieces) - 1), label="other")
        pieces[i] = (rank, pieces[j][1])
    size = max([hi] + [s + (c - 1) * st_ + n for _, (s, n, st_, c) in pieces]) + 1
    held = counts([p for _, p in pieces], size)
    exact = bool((held[lo:hi] == 1).all() and not held[:lo].any() and not held[hi:].any())
    problems = verdict(lo, hi, pieces)
    assert (problems == []) == exact, (problems, change)


def test_a_double_write_and_a_missing_piece_are_named_with_their_ranks() -> None:
    # bytes 0-63: four pieces of 16 B; rank 1 wrote its piece at 32 twice and never the one at 48
    pieces = [(0, (0, 16, 16, 1)), (0, (16, 16, 16, 1)), (1, (32, 16, 16, 1)), (1, (32, 16, 16, 1))]
    names = {0: "a", 16: "b", 32: "c", 48: "d"}
    problems = verdict(0, 64, pieces)
    assert problems == [] or len(problems) == 2
    by_rank = [{"f": compact(np.array([p for r, p in pieces if r == rank]))} for rank in (0, 1)]
    problems = tiling_problems({"f": (0, 64)}, by_rank, lambda f, s, e: f"key {names[s]!r}")
    assert problems == ["f: bytes 48-63 (16 B) written by no rank: key 'd'",
                        "f: bytes 32-47 (16 B) written 2 times (rank 1 twice): key 'c'"]
    # the byte count alone would have passed: 64 bytes written for 64 bytes of data
    assert sum(p[1] * p[3] for _, p in pieces) == 64


def test_a_file_nobody_wrote_and_writes_outside_the_data_are_problems() -> None:
    assert tiling_problems({"f": (8, 24), "g": (8, 8)}, [{}, None]) == ["f: bytes 8-23 (16 B) written by no rank"]
    problems = tiling_problems({"f": (8, 24)}, [{"f": np.array([[0, 24, 24, 1]])}])
    assert problems == ["f: bytes 0-23 (24 B) written by rank 0, outside the data region 8-23"]


@pytest.mark.parametrize("ranks", [2, 8, 64])
def test_interleaved_halves_of_many_ranks_fold_without_listing_rows(ranks: int) -> None:
    # every rank writes one column strip of 4096 rows of a ranks x 2-byte-wide row: one strided record each
    by_rank = [{"f": np.array([[100 + 2 * r, 2, 2 * ranks, 4096]])} for r in range(ranks)]
    assert tiling_problems({"f": (100, 100 + 2 * ranks * 4096)}, by_rank) == []
    by_rank[1] = {"f": np.array([[100, 2, 2 * ranks, 4096]])}  # rank 1 wrote rank 0's strip
    problems = tiling_problems({"f": (100, 100 + 2 * ranks * 4096)}, by_rank)
    # every row misses rank 1's strip and holds rank 0's twice: the first 3 of each, then a count of the rest
    assert problems[:4] == ["f: bytes 102-103 (2 B) written by no rank", f"f: bytes {102 + 2 * ranks}-"
                            f"{103 + 2 * ranks} (2 B) written by no rank", f"f: bytes {102 + 4 * ranks}-"
                            f"{103 + 4 * ranks} (2 B) written by no rank", "f: bytes 100-101 (2 B) written 2 times "
                            "(rank 0, rank 1)"]
    assert problems[-1] == f"... and {2 * 4096 - 6} more"


@settings(max_examples=100)
@given(by_file=st.dictionaries(st.sampled_from(["a", "b", "c"]), records_st.map(
    lambda r: compact(np.array(r, dtype=np.int64).reshape(-1, 4)))))
def test_pack_and_unpack_give_back_the_records(by_file) -> None:
    got = unpack(pack(by_file, ["a", "b", "c"]), ["a", "b", "c"])
    assert {f: r.tolist() for f, r in got.items()} == {f: r.tolist() for f, r in by_file.items() if len(r)}
