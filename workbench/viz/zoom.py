"""What the zoom panel of the shard-offsets figure shows for one rank, computed without drawing anything.

``zoom_scene`` decides the window around the rank's first box, the boxes shown in it (replicas once, marked
``xK``), which of them are labelled (only where the text fits), the rank's outlines and the row and column
values labelled along the panel's edges. Two renderers draw a scene: ``OffsetsFigure`` as matplotlib artists
(notebook figures, tests) and ``zoom_svg`` as a small SVG over the panel's static PNG (the explorer).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from workbench.viz import _style
from workbench.viz.views import DrawnBox, ShardView

__all__ = ["ZoomBox", "ZoomScene", "edge_values", "zoom_scene"]


@dataclass(frozen=True, slots=True)
class ZoomBox:
    """A box drawn in the zoom panel, clipped to the window (data coordinates: x columns, y rows).

    Attributes:
        rank: the rank whose colour fills it (the chosen rank when it is one of the replicas).
        x0, x1, y0, y1: its extent in the window.
        fill: the rank's RGBA colour.
        label: ``r5``, ``r5 x2`` or ``r5 (dp=0, ep=5)`` (text lines joined by newlines), None when none fits.
        label_colour: black or white, whichever reads better on ``fill``.
    """

    rank: int
    x0: int
    x1: int
    y0: int
    y1: int
    fill: tuple[float, ...]
    label: str | None
    label_colour: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ZoomScene:
    """The zoom panel of one rank (see ``zoom_scene``).

    Attributes:
        rank: the chosen rank, or None.
        window: ``((row0, row1), (col0, col1))`` shown, or None when a message replaces the picture.
        boxes: the boxes shown, in drawing order.
        outlines: the rank's boxes that meet the window, unclipped (the panel clips them).
        row_values, col_values: values labelled along the right and bottom edges (no column values when the
            panel keeps every column with ordinary ticks).
        message: the text shown instead of boxes (the rank holds none of the view, or no rank is chosen).
    """

    rank: int | None
    window: tuple[tuple[int, int], tuple[int, int]] | None
    boxes: tuple[ZoomBox, ...] = ()
    outlines: tuple[DrawnBox, ...] = ()
    row_values: tuple[int, ...] = ()
    col_values: tuple[int, ...] = ()
    message: str | None = None


def zoom_scene(
    view: ShardView,
    rank: int | None,
    window: tuple[tuple[int, int], tuple[int, int]] | None,
    *,
    size_pt: tuple[float, float],
    colour: Callable[[int], tuple[float, ...]],
    coordinate: Callable[[int], str],
    columns_fixed: bool,
    fit: Callable[[str, float, float], str],
) -> ZoomScene:
    """The zoom panel of ``rank`` on ``view``.

    Args:
        view: the view drawn.
        rank: the chosen rank (None: no rank chosen).
        window: ``views.zoom_window``'s window, or None when the rank's part is readable already (then the
            panel shows its first box with its neighbours).
        size_pt: the panel's (width, height) in points, as laid out: what fits is decided on it.
        colour: a rank's RGBA fill.
        coordinate: a rank's mesh coordinate as text (``dp=0, ep=5``).
        columns_fixed: the panel keeps every column (each rank's columns are readable on the overview).
        fit: ``fit(text, room_pt, size_pt)``: ``text`` shortened to fit ``room_pt`` at ``size_pt``.
    """
    rows, cols = view.shape
    mine = [b for b in view.boxes if b.rank == rank] if rank is not None else []
    if rank is None or not mine:
        what = view.hf_key or view.name
        held = f"rank {rank} holds none of\n{fit(what, 180, _style.LABEL_PT)}"
        return ZoomScene(rank=rank, window=None, message="no rank chosen" if rank is None else held)
    if window is None:
        first = min(mine, key=lambda b: (b.row0, b.col0))
        window = (widen(first.row0, first.row1, rows), widen(first.col0, first.col1, cols))
    (r0, r1), (c0, c1) = window
    if columns_fixed:
        c0, c1 = 0, cols
    width_pt, height_pt = size_pt
    shown = [b for b in view.boxes if b.row1 > r0 and b.row0 < r1 and b.col1 > c0 and b.col0 < c1]
    # replicas of one region are drawn once: the chosen rank's if it holds it, else the lowest, marked xK
    holders: dict[tuple[int, int, int, int], list[int]] = {}
    for b in shown:
        holders.setdefault((b.row0, b.row1, b.col0, b.col1), []).append(b.rank)
    boxes = []
    for (row0, row1, col0, col1), ranks in holders.items():
        drawn = rank if rank in ranks else min(ranks)
        x0, x1, y0, y1 = max(col0, c0), min(col1, c1), max(row0, r0), min(row1, r1)
        fill = colour(drawn)
        w = (x1 - x0) / (c1 - c0) * width_pt
        h = (y1 - y0) / (r1 - r0) * height_pt
        text = f"r{drawn}" + (f" x{len(ranks)}" if len(ranks) > 1 else "")
        if drawn == rank:
            coord = coordinate(rank)
            for candidate in (f"{text} ({coord})", f"{text}\n({coord})"):
                lines = candidate.count("\n") + 1
                if _style.text_width_pt(candidate) + 6 <= w and (lines + 0.5) * 1.2 * _style.MIN_PT <= h:
                    text = candidate
                    break
        fits = _style.text_width_pt(text) + 6 <= w and (text.count("\n") + 1.5) * 1.2 * _style.MIN_PT <= h
        boxes.append(ZoomBox(drawn, x0, x1, y0, y1, fill, text if fits else None, _style.text_on(fill)))
    outlines = tuple(b for b in mine if b.row1 > r0 and b.row0 < r1 and b.col1 > c0 and b.col0 < c1)
    row_values = edge_values(0, [e for b in shown for e in (b.row0, b.row1)], (r0, r1), height_pt)
    col_values = () if columns_fixed else edge_values(1, [e for b in shown for e in (b.col0, b.col1)], (c0, c1),
                                                       width_pt)
    return ZoomScene(rank=rank, window=((r0, r1), (c0, c1)), boxes=tuple(boxes), outlines=outlines,
                     row_values=row_values, col_values=col_values)


def edge_values(axis: int, edges: Sequence[int], window: tuple[int, int], length_pt: float) -> tuple[int, ...]:
    """Values labelled along the rows (``axis`` 0, right edge) or columns (1, bottom edge) of a panel
    ``length_pt`` long showing ``window``: the shown boxes' edges (where the rank's region starts and stops)
    when they are 2 to 8 and far enough apart for their labels, else round values, thinned until they are."""
    from matplotlib.ticker import MaxNLocator

    lo, hi = window
    per = length_pt / max(hi - lo, 1)

    def room(v: float) -> float:
        return (_style.text_width_pt(f"{int(v):,}") + 8) if axis == 1 else 1.6 * _style.MIN_PT

    def spaced(values: Sequence[float]) -> bool:
        return all((b - a) * per >= (room(a) + room(b)) / 2 for a, b in itertools.pairwise(values))

    values: list[Any] = sorted({e for e in edges if lo <= e <= hi})
    if not (2 <= len(values) <= 8 and spaced(values)):
        values = [v for v in MaxNLocator(nbins=4, integer=True).tick_values(lo, hi) if lo <= v <= hi]
        while len(values) > 2 and not spaced(values):
            values = values[::2]
    return tuple(int(v) for v in values)


def widen(lo: int, hi: int, n: int) -> tuple[int, int]:
    """``[lo, hi)`` widened to three times its size, kept inside ``[0, n)``."""
    size = hi - lo
    span = min(n, size * 3)
    start = min(max(lo - (span - size) // 2, 0), n - span)
    return start, start + span
