"""Round byte ticks (expected steps worked out by hand) and index ticks that never crowd."""

from __future__ import annotations

import pytest

from workbench.report.units import byte_tick_step, format_bytes_in
from workbench.viz.ticks import ByteFormatter, ByteLocator, index_ticks

MIB, GIB = 1 << 20, 1 << 30


@pytest.mark.parametrize(("span", "intervals", "step", "unit"), [
    (5 * MIB, 6, MIB, 2),  # 5/6 MiB a tick at least: 1 MiB
    (5 * MIB, 3, 2 * MIB, 2),
    (2.33 * GIB, 6, 0.4 * GIB, 3),  # the 2.33 GiB axis: 0.4 GiB steps
    (191 * MIB, 6, 40 * MIB, 2),
    (560, 6, 102.4, 1),  # 0.1 KiB
    (7, 8, 1, 0),  # never a fractional byte
    (1.27 * 2**40, 6, 0.4 * 2**40, 4),
])
def test_steps_are_round_in_one_unit(span: float, intervals: int, step: float, unit: int) -> None:
    assert byte_tick_step(span, intervals) == pytest.approx((step, unit))


def test_labels_share_the_unit() -> None:
    assert format_bytes_in(0, 2) == "0"
    assert format_bytes_in(3 << 19, 2, 1) == "1.5 MiB"
    assert format_bytes_in(3 * GIB, 3) == "3 GiB"
    with pytest.raises(ValueError, match="unit must index"):
        format_bytes_in(1, 9)
    with pytest.raises(ValueError, match="max_intervals must be >= 1"):
        byte_tick_step(10, 0)


def test_locator_and_formatter() -> None:
    locator = ByteLocator(max_ticks=5)
    ticks = locator.tick_values(0, 2.2 * GIB)
    assert ticks == pytest.approx([0, 0.5 * GIB, GIB, 1.5 * GIB, 2 * GIB])
    formatter = ByteFormatter(locator)
    assert formatter.format_ticks(ticks) == ["0", "0.5 GiB", "1.0 GiB", "1.5 GiB", "2.0 GiB"]


def test_index_ticks_fit_their_axis() -> None:
    assert index_ticks(8, 400) == list(range(8))  # 50 pt a cell: every one
    assert index_ticks(64, 200) == list(range(0, 64, 5))  # 3.1 pt a cell: every 5th (15.6 >= 12.8 pt apart)
    wide = index_ticks(1000, 300, labels_wide=True)
    assert wide[1] - wide[0] in (20, 50, 100) and len(wide) <= 20
    assert index_ticks(0, 100) == []
