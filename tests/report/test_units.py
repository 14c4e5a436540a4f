"""Human units: bytes, counts, rank lists (expected values worked out by hand)."""

from __future__ import annotations

import pytest

from workbench.report.units import format_bytes, format_count, format_ranks, parse_bytes, parse_ranks, rank_phrase

FORMAT_BYTES = [
    (0, "0 B"),
    (512, "512 B"),
    (1023, "1023 B"),
    (1024, "1 KiB"),
    (1536, "1.5 KiB"),  # 1.5 * 1024
    (888_832, "868 KiB"),  # 868 * 1024: three digits, no decimals
    (2 << 30, "2 GiB"),  # trailing zeros dropped
    (15_267_266_560, "14.2 GiB"),  # the predicted peak: 14.219 GiB
    (1_369_188_535_968, "1.25 TiB"),  # the bytes moved: 1.2453 TiB
    (1_048_575, "1 MiB"),  # 1023.999 KiB rounds up to the next unit, not '1024 KiB'
    (-3 << 20, "-3 MiB"),
]


@pytest.mark.parametrize(("n", "text"), FORMAT_BYTES)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_format_bytes_exact() -> None:
    assert format_bytes(15_267_266_560, exact=True) == "14.2 GiB (15,267,266,560 B)"
    assert format_bytes(100, exact=True) == "100 B"  # no repeat under 1 KiB


PARSE_BYTES = [
    ("4GiB", 4 * 2**30),
    ("4 GiB", 4 * 2**30),
    ("4G", 4 * 2**30),  # single letters are binary
    ("1.5GB", 1_500_000_000),  # decimal units
    ("200B", 200),
    ("1024", 1024),
    ("256mib", 256 * 2**20),
]


@pytest.mark.parametrize(("text", "n"), PARSE_BYTES)
def test_parse_bytes(text: str, n: int) -> None:
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["four GiB", "4 parsecs", "-1GiB"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"byte count|cannot read"):
        parse_bytes(text)


PARSE_RANKS = [
    ("5", (5,)),
    ("0,5", (0, 5)),
    ("0-7", tuple(range(8))),
    ("8-9,0, 3", (0, 3, 8, 9)),  # sorted, spaces allowed
    ("2,2,1-2", (1, 2)),  # no repeats
]


@pytest.mark.parametrize(("text", "ranks"), PARSE_RANKS)
def test_parse_ranks(text: str, ranks: tuple[int, ...]) -> None:
    assert parse_ranks(text) == ranks


@pytest.mark.parametrize(("text", "needle"), [("a", "'a' is not a rank"), ("7-3", "empty or negative"),
                                              (",", "names no rank"), ("0,9", "outside the world of 8 ranks")])
def test_parse_ranks_errors(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_ranks(text, world=8)


def test_format_ranks_and_counts() -> None:
    assert format_ranks([7, 0, 1, 2, 3]) == "0-3, 7"
    assert format_ranks([0, 2, 4, 6], limit=2) == "0, 2, ..."
    assert rank_phrase([5]) == "rank 5" and rank_phrase([1, 2]) == "ranks 1-2"
    assert format_count(46183) == "46,183"
