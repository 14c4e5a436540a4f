"""Tick rules: round byte ticks in binary units, and index ticks on a grid of cells that never crowd.

``use_byte_ticks(axis)`` puts ticks at multiples of a round step (``workbench.report.units.byte_tick_step``:
0.1 to 50 of one binary unit) and labels them all in that unit (``0, 256 MiB, 512 MiB``). ``index_ticks`` picks
a step of 1, 2, 5, 10, 20, ... cells so that labels of ``size`` points fit the axis length.
"""

from __future__ import annotations

import math
from typing import Any

from workbench.viz import _style

__all__ = ["ByteFormatter", "ByteLocator", "index_ticks", "is_byte_axis", "use_byte_ticks"]


def _ticker() -> Any:
    _style.matplotlib()
    import matplotlib.ticker as ticker

    return ticker


class ByteLocator(_ticker().Locator):
    """Ticks at multiples of a round byte step; at most ``max_ticks`` intervals (default: what the axis fits)."""

    def __init__(self, max_ticks: int | None = None) -> None:
        self.max_ticks = max_ticks
        self.step = 1.0
        self.unit = 0
        self.decimals = 0

    def __call__(self) -> list[float]:
        vmin, vmax = self.axis.get_view_interval()
        return self.tick_values(vmin, vmax)

    def tick_values(self, vmin: float, vmax: float) -> list[float]:
        from workbench.report.units import byte_tick_step

        lo, hi = sorted((float(vmin), float(vmax)))
        room = self.max_ticks
        if room is None:
            room = self.axis.get_tick_space() if self.axis is not None else 6
            room = max(2, min(int(room), 8))
        self.step, self.unit = byte_tick_step(hi - lo, room)
        mantissa = self.step / 1024.0**self.unit
        self.decimals = 0 if abs(mantissa - round(mantissa)) < 1e-9 else 1
        first, last = math.ceil(lo / self.step - 1e-9), math.floor(hi / self.step + 1e-9)
        return [k * self.step for k in range(first, last + 1)]


class ByteFormatter(_ticker().Formatter):
    """Labels of a ``ByteLocator``'s ticks, every one in the locator's unit."""

    def __init__(self, locator: ByteLocator) -> None:
        self.locator = locator

    def __call__(self, x: float, pos: int | None = None) -> str:
        from workbench.report.units import format_bytes_in

        if pos is None:  # the cursor readout, not a tick
            return _style.format_bytes(x)
        return format_bytes_in(x, self.locator.unit, self.locator.decimals)


def use_byte_ticks(axis: Any, max_ticks: int | None = None) -> ByteLocator:
    """Round binary-unit ticks on a matplotlib ``Axis`` (or a colour bar); returns the locator."""
    locator = ByteLocator(max_ticks)
    formatter = ByteFormatter(locator)
    if hasattr(axis, "set_major_locator"):
        axis.set_major_locator(locator)
        axis.set_major_formatter(formatter)
    else:  # a Colorbar
        axis.locator = locator
        axis.formatter = formatter
        axis.minorticks_off()
    return locator


def is_byte_axis(axis: Any) -> bool:
    """True when ``axis`` carries workbench's byte ticks."""
    return isinstance(axis.get_major_locator(), ByteLocator)


def index_ticks(n: int, length_pt: float, labels_wide: bool = False, size: float = _style.MIN_PT) -> list[int]:
    """Indices ``0, s, 2s, ...`` of ``n`` cells to label on an axis ``length_pt`` long, ``s`` in 1, 2, 5, 10, ...

    ``labels_wide``: labels sit side by side (an x axis): each needs its text width, else its line height.
    """
    if n <= 0:
        return []
    need = (_style.text_width_pt(str(n - 1), size) + 0.8 * size) if labels_wide else 1.6 * size
    step = 1
    candidates = [m * 10**e for e in range(0, 8) for m in (1, 2, 5)]
    for step in candidates:
        if length_pt / n * step >= need:
            break
    return list(range(0, n, step))
