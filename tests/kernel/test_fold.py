"""Folding ranks' text: the pure rules and the streaming folder."""

from __future__ import annotations

import pytest

from workbench.kernel.fold import Folder, fold_lines, format_ranks


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([1, 3], "1,3"),  # two apart: listed
        ([0, 1], "0,1"),  # a run of two stays a list
        ([0, 1, 2, 3, 5], "0-3,5"),  # a run of three or more becomes a range
        ([7, 2, 2, 3, 4], "2-4,7"),  # unsorted, repeated
        ([4], "4"),
    ],
)
def test_format_ranks(ranks: list[int], text: str) -> None:
    assert format_ranks(ranks) == text


def test_fold_lines_identical_everywhere_appears_once() -> None:
    assert fold_lines({0: "loss 0.25", 1: "loss 0.25", 2: "loss 0.25"}, (0, 1, 2)) == ["loss 0.25"]


def test_fold_lines_groups_differing_lines_by_text_lowest_rank_first() -> None:
    lines = {0: "shard (4, 16)", 1: "shard (3, 16)", 2: "shard (4, 16)", 3: "shard (3, 16)"}
    assert fold_lines(lines, (0, 1, 2, 3)) == ["[0,2] shard (4, 16)", "[1,3] shard (3, 16)"]


def test_fold_lines_a_line_missing_on_some_rank_is_prefixed() -> None:
    # identical text, but rank 2 printed nothing at this position: not "every rank"
    assert fold_lines({0: "x", 1: "x"}, (0, 1, 2)) == ["[0,1] x"]


def test_folder_waits_for_every_rank_then_folds() -> None:
    folder = Folder((0, 1), stale_after=10)
    assert folder.push(0, "a\nb\n", now=0) == []  # rank 1 has printed nothing yet
    assert folder.push(1, "a\nc", now=0) == ["a"]  # line 1 folds; "c" is not a whole line yet
    assert folder.push(1, "\n", now=0) == ["[0] b", "[1] c"]


def test_folder_finish_releases_a_rank_that_printed_less() -> None:
    folder = Folder((0, 1), stale_after=10)
    folder.push(0, "same\nonly on 0\n", now=0)
    assert folder.push(1, "same\n", now=0) == ["same"]
    assert folder.finish(1) == ["[0] only on 0"]


def test_folder_lets_stale_lines_through_when_a_rank_is_silent() -> None:
    folder = Folder((0, 1, 2), stale_after=1.0)
    folder.push(0, "step 1\n", now=0)
    folder.push(1, "step 1\n", now=0)
    assert folder.flush_stale(now=0.5) == []
    assert folder.flush_stale(now=1.5) == ["[0,1] step 1"]


def test_folder_drain_keeps_unterminated_text() -> None:
    folder = Folder((0, 1))
    folder.push(0, "partial", now=0)
    folder.push(1, "partial", now=0)
    assert folder.drain() == ["partial"]
