"""The two cut rules: PyTorch's contiguous chunk rule and the even expert-TP interleave."""

from __future__ import annotations

import pytest

from workbench import _compat
from workbench.errors import LayoutError
from workbench.layout import ShardDescriptor
from workbench.layout.chunking import chunk_interval, chunk_sizes, interleave_intervals, local_sizes

CHUNK_CASES = [
    # (n, world, sizes by rank)
    (10, 3, (4, 4, 2)),  # uneven: last rank short
    (10, 4, (3, 3, 3, 1)),  # uneven: ceil chunk 3, not numpy's 3,3,2,2
    (3, 4, (1, 1, 1, 0)),  # more ranks than elements: empty trailing rank
    (1, 2, (1, 0)),  # a single element over two ranks
    (5, 3, (2, 2, 1)),  # uneven, one short rank
    (8, 2, (4, 4)),  # even
    (0, 3, (0, 0, 0)),  # empty dim: every rank empty
    (7, 1, (7,)),  # world of one holds everything
    (9, 6, (2, 2, 2, 2, 1, 0)),  # ceil chunk leaves a short rank AND an empty one
    (2, 5, (1, 1, 0, 0, 0)),  # several empty trailing ranks
]


@pytest.mark.parametrize(("n", "world", "sizes"), CHUNK_CASES)
def test_chunk_sizes(n: int, world: int, sizes: tuple[int, ...]) -> None:
    assert chunk_sizes(n, world) == sizes
    # intervals tile [0, n) in rank order, and torch agrees on every rank
    start = 0
    for index, size in enumerate(sizes):
        a, b = chunk_interval(n, world, index)
        assert b - a == size
        if size:
            assert a == start
        start += size
        assert _compat.chunk_size_and_offset(n, world, index)[0] == size
    assert start == n


def test_empty_trailing_rank_interval_sits_at_the_end() -> None:
    # 3 over 4: rank 3 is empty; its (empty) interval starts at n, not at 4 * ceil(3/4)
    assert chunk_interval(3, 4, 3) == (3, 3)
    assert ShardDescriptor(0, "tp").local_intervals(3, 4, 3) == ()


@pytest.mark.parametrize(("n", "world", "factor", "rank", "expected"), [
    (8, 2, 2, 0, ((0, 2), (4, 6))),  # the worked example: run 2, rank 0 holds runs 0 and 2
    (8, 2, 2, 1, ((2, 4), (6, 8))),  # rank 1 holds runs 1 and 3
    (12, 3, 2, 1, ((2, 4), (8, 10))),  # W=3: runs j*3 + 1
    (6, 1, 3, 0, ((0, 6),)),  # W=1: the identity, one interval
    (6, 3, 2, 2, ((2, 3), (5, 6))),  # run length 1
    (64, 4, 8, 3, tuple(((8 * s + 6), (8 * s + 8)) for s in range(8))),  # DCP geometry: 8 runs of 2 rows
])
def test_interleave_intervals(n: int, world: int, factor: int, rank: int, expected: tuple) -> None:
    assert interleave_intervals(n, world, rank, factor) == expected
    assert ShardDescriptor(0, "tp", factor).local_intervals(n, world, rank) == expected


@pytest.mark.parametrize(("n", "world", "factor"), [
    (10, 2, 3),  # 10 % 6: the XTuner case (10, 4) with F=3 over 2 ranks
    (6, 4, 2),  # 6 % 8: fewer elements than runs
    (9, 3, 2),  # 9 % 6: divisible by W but not by W*F
])
def test_uneven_interleave_names_n_w_f(n: int, world: int, factor: int) -> None:
    with pytest.raises(LayoutError) as err:
        interleave_intervals(n, world, 0, factor, what="parameter 'experts.w13'")
    msg = str(err.value)
    assert "'experts.w13'" in msg
    assert f"N={n}" in msg
    assert f"W={world}" in msg
    assert f"F={factor}" in msg
    assert f"W*F={world}*{factor}={world * factor}" in msg


@pytest.mark.parametrize(("n", "world", "factor", "expected"), [
    (10, 3, 1, {4, 2}),  # contiguous: every chunk size
    (3, 4, 1, {1, 0}),  # contiguous with an empty rank
    (8, 2, 2, {4}),  # even interleave: one size
    (10, 2, 3, set()),  # uneven interleave: no valid size
])
def test_local_sizes(n: int, world: int, factor: int, expected: set[int]) -> None:
    assert local_sizes(n, world, factor) == expected


@pytest.mark.parametrize(("n", "factor"), [(8, 3), (1, 2), (4, 4)])
def test_interleave_over_one_rank_is_the_identity_even_when_uneven(n: int, factor: int) -> None:
    # a group of one rank keeps the whole dim whatever F is (ETP=1 under FSDP: the FSDP-local length
    # need not be a multiple of F)
    assert interleave_intervals(n, 1, 0, factor) == ((0, n),)
    assert ShardDescriptor(0, "tp", factor).local_intervals(n, 1, 0) == ((0, n),)
    assert local_sizes(n, 1, factor) == {n}


@pytest.mark.parametrize(("world", "factor"), [(2, 2), (1, 4)])
def test_interleave_of_an_empty_dim_holds_nothing(world: int, factor: int) -> None:
    # local_intervals drops empty intervals for interleaves too (regression: it returned ((0, 0), (0, 0)))
    assert ShardDescriptor(0, "tp", factor).local_intervals(0, world, 0) == ()


def test_local_sizes_closed_form_equals_enumeration() -> None:
    # local_sizes computes the set of chunk sizes without enumerating ranks; check it on a grid
    for n in range(0, 60):
        for world in range(1, 20):
            assert local_sizes(n, world, 1) == set(chunk_sizes(n, world)), (n, world)
            for factor in (2, 3):
                enumerated = {sum(b - a for a, b in interleave_intervals(n, world, r, factor)) for r in range(world)} \
                    if world == 1 or n % (world * factor) == 0 else set()
                assert local_sizes(n, world, factor) == enumerated, (n, world, factor)


def test_descriptor_validation_and_text() -> None:
    d = ShardDescriptor(0, ["dp", "ep"], 2)  # a list mesh dim becomes a tuple
    assert d.mesh_dim == ("dp", "ep")
    assert d.is_interleaved
    assert str(d) == "IS(0,2)@dp+ep"
    assert ShardDescriptor(1, ("tp",)).mesh_dim == "tp"  # a one-name tuple is the name
    assert str(ShardDescriptor(1, "tp")) == "S(1)@tp"
    assert not ShardDescriptor(1, "tp").is_interleaved
    with pytest.raises(LayoutError, match=r"dim must be a non-negative int, got -1"):
        ShardDescriptor(-1, "tp")
    with pytest.raises(LayoutError, match=r"interleave_factor must be an int >= 1, got 0"):
        ShardDescriptor(0, "tp", 0)
