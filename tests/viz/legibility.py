"""Legibility rules checked on a rendered figure, with nothing taken from the viz code but the figure itself.

``drawn_texts`` renders a figure with Agg and records every text matplotlib actually draws (tick labels of
ticks outside the view are not drawn, so they are not recorded) with its box in pixels. ``problems`` applies
the rules: size >= 8 pt, inside the figure, no two texts overlapping, no text over an axes it does not belong
to, and text colour against what is painted under it (the same figure rendered with its texts hidden) at a
WCAG contrast ratio of at least 4.5. ``byte_axis_problems`` checks round binary ticks.
"""

from __future__ import annotations

import math
from typing import Any
from unittest import mock

import matplotlib.colors
import numpy as np
from matplotlib.text import Text

MIN_PT = 8.0
MIN_CONTRAST = 4.5
UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def drawn_texts(fig: Any) -> list[tuple[Text, Any]]:
    """Every non-empty text drawn when ``fig`` renders, with its window extent (pixels)."""
    drawn: list[tuple[Text, Any]] = []
    original = Text.draw

    def spy(self: Text, renderer: Any) -> None:
        original(self, renderer)
        if self.get_visible() and self.get_text().strip():
            drawn.append((self, self.get_window_extent(renderer)))

    with mock.patch.object(Text, "draw", spy):
        fig.canvas.draw()
    return drawn


def _luminance(rgb: Any) -> float:
    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(float(c)) for c in rgb[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: Any, b: Any) -> float:
    """WCAG contrast ratio of two RGB colours (components 0..1)."""
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def _owner(text: Text) -> Any:
    """The axes a text belongs to (a secondary axis' labels belong to its parent), or None (figure text)."""
    ax = text.axes
    return getattr(ax, "_parent", ax) if ax is not None else None


def _overlap(a: Any, b: Any, slack: float = 1.0) -> bool:
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > slack) and (min(a.y1, b.y1) - max(a.y0, b.y0) > slack)


def problems(fig: Any, name: str = "") -> tuple[list[str], float]:
    """Every broken rule of ``fig`` (empty when legible) and the smallest text size drawn (points)."""
    texts = drawn_texts(fig)
    out: list[str] = []
    smallest = min((t.get_fontsize() for t, _ in texts), default=math.inf)
    width, height = fig.canvas.get_width_height()
    for text, box in texts:
        label = f"{name}: {text.get_text()!r}"
        if text.get_fontsize() < MIN_PT - 1e-6:
            out.append(f"{label} is {text.get_fontsize():.1f} pt (< {MIN_PT})")
        if box.x0 < -1 or box.y0 < -1 or box.x1 > width + 1 or box.y1 > height + 1:
            out.append(f"{label} is cut by the figure's edge ({box.x0:.0f}, {box.y0:.0f}, {box.x1:.0f}, "
                       f"{box.y1:.0f} in a {width} x {height} figure)")
    for i, (a, box_a) in enumerate(texts):
        for b, box_b in texts[i + 1 :]:
            if _overlap(box_a, box_b):
                out.append(f"{name}: {a.get_text()!r} overlaps {b.get_text()!r}")
    for text, box in texts:
        owner = _owner(text)
        for ax in fig.axes:
            if ax is owner or not ax.get_visible() or (not ax.axison and not ax.images):
                continue
            if _overlap(box, ax.bbox, slack=2.0):
                out.append(f"{name}: {text.get_text()!r} lies over the axes {ax.get_label() or ax.get_title()!r}")
    out += _contrast_problems(fig, texts, name)
    return out, smallest


def _contrast_problems(fig: Any, texts: list[tuple[Text, Any]], name: str) -> list[str]:
    hidden = [t for t, _ in texts]
    engine = fig.get_layout_engine()
    fig.set_layout_engine("none")  # the same positions without the texts (a layout engine would move axes)
    for t in hidden:
        t.set_visible(False)
    try:
        fig.canvas.draw()
        under = np.asarray(fig.canvas.buffer_rgba())[:, :, :3].copy()
    finally:
        for t in hidden:
            t.set_visible(True)
        if engine is not None:
            fig.set_layout_engine(engine)
    height = under.shape[0]
    out = []
    for text, box in texts:
        x0, x1 = max(int(box.x0), 0), min(math.ceil(box.x1), under.shape[1])
        y0, y1 = max(height - math.ceil(box.y1), 0), min(height - int(box.y0), height)
        if x1 <= x0 or y1 <= y0:
            continue
        patch = under[y0:y1, x0:x1].reshape(-1, 3)
        colours, counts = np.unique(patch, axis=0, return_counts=True)
        background = colours[np.argmax(counts)] / 255.0
        ink = matplotlib.colors.to_rgb(text.get_color())
        ratio = contrast(ink, background)
        if ratio < MIN_CONTRAST:
            out.append(f"{name}: {text.get_text()!r} in {matplotlib.colors.to_hex(ink)} on "
                       f"{matplotlib.colors.to_hex(background)}: contrast {ratio:.2f} < {MIN_CONTRAST}")
    return out


def round_step(step: float) -> tuple[int, int] | None:
    """``(unit index, decimals)`` when ``step`` is m x 10**e x 1024**k (m in 1, 2, 4, 5; e in -1..2), else None."""
    for k in range(len(UNITS)):
        mantissa = step / 1024.0**k
        for e in (-1, 0, 1, 2):
            for m in (1, 2, 4, 5):
                if k == 0 and e < 0:
                    continue
                if math.isclose(mantissa, m * 10.0**e, rel_tol=1e-9):
                    return k, max(0, -e)
    return None


def byte_axis_problems(axis: Any, name: str) -> list[str]:
    """A labelled byte axis' drawn ticks: at least two, evenly spaced by a round binary step, labelled in its
    unit (an axis sharing another's ticks without labels, like the upper panels of a column, has none)."""
    lo, hi = sorted(axis.get_view_interval())
    ticks = [(v, lab.get_text()) for v, lab in zip(axis.get_majorticklocs(), axis.get_majorticklabels())
             if lo - 1e-9 * abs(hi) <= v <= hi + 1e-9 * abs(hi)]
    if len(ticks) < 2:
        return [f"{name}: {len(ticks)} tick(s) on a byte axis spanning {lo:g}..{hi:g}"]
    values = [v for v, _ in ticks]
    steps = np.diff(values)
    step = float(steps[0])
    out = []
    if not np.allclose(steps, step, rtol=1e-9):
        out.append(f"{name}: uneven byte ticks {values}")
    found = round_step(step)
    if found is None:
        return [*out, f"{name}: byte tick step {step:g} B is not 1, 2, 4 or 5 x 10^e x a binary unit"]
    unit, decimals = found
    for value, text in ticks:
        expected = "0" if value == 0 else f"{value / 1024.0**unit:.{decimals}f} {UNITS[unit]}"
        if text != expected:
            out.append(f"{name}: tick at {value:g} B reads {text!r}, expected {expected!r}")
    return out
