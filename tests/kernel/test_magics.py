"""The kernel's magics: what each asks for, and errors that name the bad argument."""

from __future__ import annotations

import pytest

from workbench.kernel.magics import MagicError, check_ranks, parse_cell, parse_ranks


@pytest.mark.parametrize(
    ("text", "ranks"),
    [("0,2", (0, 2)), ("1-3", (1, 2, 3)), ("3, 0-1", (0, 1, 3)), ("2,2", (2,))],
)
def test_parse_ranks(text: str, ranks: tuple[int, ...]) -> None:
    assert parse_ranks(text, 4) == ranks


@pytest.mark.parametrize(
    ("text", "message"),
    [("4", "rank(s) [4] out of range; this kernel has world_size 4"), ("a", "'a' is not a rank"),
     ("", "needs ranks"), ("3-1", "range '3-1' ends before it starts; write it as 1-3"),
     ("0-1,3,9-12", "rank(s) [9-12] out of range")],
)
def test_parse_ranks_errors(text: str, message: str) -> None:
    with pytest.raises(MagicError) as info:
        parse_ranks(text, 4)
    assert message in str(info.value)


def test_a_mistyped_huge_range_is_refused_at_once_in_a_short_message() -> None:
    # a typo such as 0-30000000 was expanded first (3 GiB in the kernel), then listed rank by rank in the error
    for world_size, message in ((2, "rank(s) [2-30000000] out of range; this kernel has world_size 2 (ranks 0-1)"),
                                (None, "rank(s) [1048576-30000000] out of range; this kernel has world_size not")):
        with pytest.raises(MagicError) as info:
            parse_ranks("0-30000000", world_size)
        assert message in str(info.value) and len(str(info.value)) < 200
    with pytest.raises(MagicError) as info:
        check_ranks(tuple(range(0, 1000)), 2)
    assert "rank(s) [2-999] out of range" in str(info.value)


def test_cell_magics_are_stripped_and_the_rest_runs() -> None:
    d = parse_cell("%%ranks 0,2\nx = 1\nprint(x)", 4)
    assert d.ranks == (0, 2) and d.code == "x = 1\nprint(x)" and d.output is None and not d.timeout_given


def test_line_magics_before_code() -> None:
    d = parse_cell("%rank_output all\n%hang_timeout 5 interrupt\n\nrun()", 2)
    assert (d.output, d.hang_timeout, d.hang_action, d.timeout_given, d.code) == ("all", 5.0, "interrupt", True,
                                                                                  "run()")
    assert parse_cell("%hang_timeout off", 2).hang_timeout is None


def test_join_timeout_and_dead_after() -> None:
    d = parse_cell("%join_timeout 600\n%dead_after 45\nx = 1", 2)
    assert (d.join_timeout, d.dead_after, d.code) == (600.0, 45.0, "x = 1")
    assert parse_cell("x = 1", 2).join_timeout is None and parse_cell("x = 1", 2).dead_after is None


def test_ipython_magics_are_left_to_the_ranks() -> None:
    assert parse_cell("%time x = 1", 2).code == "%time x = 1"


@pytest.mark.parametrize(
    ("cell", "message"),
    [("%rank_output 3", "'3': use one of folded, 0, all"), ("%hang_timeout soon", "'soon': give seconds"),
     ("%hang_timeout 5 kill", "action 'kill' must be report or interrupt"), ("%hang_timeout -1", "must be > 0"),
     ("%hang_timeout nan", "must be > 0 and finite"), ("%hang_timeout 0", "must be > 0"),
     ("%hang_timeout inf", "must be > 0 and finite"),
     ("%join_timeout later", "%join_timeout 'later': give seconds"),
     ("%dead_after 1", "%dead_after 1: seconds must be > 1"), ("%join_timeout 0", "must be > 0")],
)
def test_magic_errors(cell: str, message: str) -> None:
    with pytest.raises(MagicError, match=message):
        parse_cell(cell, 2)


def test_ranks_are_checked_once_the_world_size_is_known() -> None:
    # a cluster kernel before its ranks joined (or after it ended a job) does not know its world size yet
    assert parse_cell("%%ranks 1,3\nx", None).ranks == (1, 3)
    with pytest.raises(MagicError, match=r"rank\(s\) \[3\] out of range; this kernel has world_size 2 \(ranks 0-1\)"):
        check_ranks(parse_cell("%%ranks 1,3\nx", None).ranks, 2)
    assert check_ranks((0, 1), 2) == (0, 1)
