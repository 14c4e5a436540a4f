"""A zoom scene (``workbench.viz.zoom``) written as a small SVG, shown over the zoom panel's static PNG.

The explorer's zoom changes with every rank: drawing its labels with matplotlib and encoding the panel as a PNG
took ~30 ms a rank (each label is ~2.7 ms of text shaping and glyph rendering). Written directly, the boxes,
the rank's outline, the tick marks and the labels are a few KiB of SVG made in well under a millisecond, and the
browser draws the text (``<text>`` in matplotlib's font, placed where matplotlib places it: the same horizontal
anchor, and baselines from matplotlib's own line metrics). Sizes are in points (the SVG's user unit, as in
matplotlib's SVGs), so it lies exactly over the figure's PNG shown at the figure's CSS size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from workbench.viz import _style
from workbench.viz.zoom import ZoomScene

__all__ = ["PanelFrame", "baselines", "panel_frame", "scene_svg"]

_TICK_PT = 3.5  # tick marks along the edges (matplotlib's markersize of the figure's ticks)
_ROW_GAP_PT = 4.0  # row labels start this far right of the panel
_COL_GAP_PT = 6.0  # column labels hang this far below it


@dataclass(frozen=True, slots=True)
class PanelFrame:
    """Where the zoom panel lies in its figure, in points from the figure's top left corner.

    Attributes:
        width, height: the figure's size.
        box: the panel's ``(x0, y0, x1, y1)``.
        spine_width, spine_colour: the panel's frame (drawn over the boxes, as the figure draws it).
        font: the CSS font family of the figure's text.
    """

    width: float
    height: float
    box: tuple[float, float, float, float]
    spine_width: float
    spine_colour: str
    font: str


def panel_frame(ax: Any) -> PanelFrame:
    """The frame of the laid-out axes ``ax`` (its position must not change afterwards)."""
    mpl = _style.matplotlib()
    fig = ax.figure
    width, height = fig.get_figwidth() * 72, fig.get_figheight() * 72
    pos = ax.get_position()
    spine = next(iter(ax.spines.values()))
    families = [*mpl.rcParams["font.sans-serif"], "sans-serif"]
    return PanelFrame(
        width=width, height=height,
        box=(pos.x0 * width, (1 - pos.y1) * height, pos.x1 * width, (1 - pos.y0) * height),
        spine_width=float(spine.get_linewidth()), spine_colour=mpl.colors.to_hex(spine.get_edgecolor()),
        font=", ".join(f"'{f}'" if " " in f else f for f in dict.fromkeys(families)),
    )


def scene_svg(scene: ZoomScene, frame: PanelFrame) -> bytes:
    """``scene`` drawn in ``frame`` as a transparent SVG of the figure's size (deterministic bytes)."""
    x0, y0, x1, y1 = frame.box
    w, h = frame.width, frame.height
    # the clip's id names its box: the explorer puts this SVG inline in the page, where ids are the page's (two
    # explorers' panels share an id only where they share the box)
    clip = "zoom-panel-" + "-".join(_n(v).replace(".", "_") for v in frame.box)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_n(w)}pt" height="{_n(h)}pt" '
           f'viewBox="0 0 {_n(w)} {_n(h)}" font-family={quoteattr(frame.font)}>',
           f'<defs><clipPath id="{clip}"><rect x="{_n(x0)}" y="{_n(y0)}" width="{_n(x1 - x0)}" '
           f'height="{_n(y1 - y0)}"/></clipPath></defs>']
    frame_rect = (f'<rect x="{_n(x0)}" y="{_n(y0)}" width="{_n(x1 - x0)}" height="{_n(y1 - y0)}" fill="none" '
                  f'stroke="{frame.spine_colour}" stroke-width="{_n(frame.spine_width)}"/>')
    if scene.window is None:
        out.append(_text(scene.message or "", (x0 + x1) / 2, (y0 + y1) / 2, "middle", "center", _style.LABEL_PT,
                         "#000000", gid="zoom-message"))
        out += [frame_rect, "</svg>"]
        return "".join(out).encode()
    (r0, r1), (c0, c1) = scene.window

    def px(col: float) -> float:
        return x0 + (col - c0) / (c1 - c0) * (x1 - x0)

    def py(row: float) -> float:
        return y0 + (row - r0) / (r1 - r0) * (y1 - y0)

    out.append(f'<g clip-path="url(#{clip})">')
    for box in scene.boxes:
        left, top, right, bottom = px(box.x0), py(box.y0), px(box.x1), py(box.y1)
        out.append(f'<rect x="{_n(left)}" y="{_n(top)}" width="{_n(right - left)}" height="{_n(bottom - top)}" '
                   f'fill="{_hex(box.fill)}" stroke="#ffffff" stroke-width="0.8"/>')
        if box.label is not None:
            out.append(_text(box.label, (left + right) / 2, (top + bottom) / 2, "middle", "center",
                             _style.MIN_PT, box.label_colour))
    for b in scene.outlines:  # a white halo under a black line, as on the overview
        left, top, right, bottom = px(b.col0), py(b.row0), px(b.col1), py(b.row1)
        shape = f'x="{_n(left)}" y="{_n(top)}" width="{_n(right - left)}" height="{_n(bottom - top)}" fill="none"'
        out.append(f'<rect {shape} stroke="#ffffff" stroke-width="3.6"/>')
        out.append(f'<rect id="rank-{scene.rank}" {shape} stroke="#000000" stroke-width="1.8"/>')
    out.append("</g>")
    out.append(frame_rect)
    ticks = [f"M{_n(x1)} {_n(py(v))}h{_TICK_PT}" for v in scene.row_values]
    ticks += [f"M{_n(px(v))} {_n(y1)}v{_TICK_PT}" for v in scene.col_values]
    if ticks:
        out.append(f'<path d="{"".join(ticks)}" stroke="#000000" stroke-width="1"/>')
    for v in scene.row_values:
        out.append(_text(f"{v:,}", x1 + _ROW_GAP_PT, py(v), "start", "center", _style.MIN_PT, "#000000"))
    for v in scene.col_values:
        out.append(_text(f"{v:,}", px(v), y1 + _COL_GAP_PT, "middle", "top", _style.MIN_PT, "#000000"))
    out.append("</svg>")
    return "".join(out).encode()


def _text(text: str, x: float, y: float, anchor: str, va: str, size: float, colour: str, gid: str = "") -> str:
    """A ``<text>`` of one or more lines anchored at (x, y) as matplotlib anchors a Text with ``va``."""
    lines = text.split("\n")
    ident = f' id="{gid}"' if gid else ""
    spans = "".join(f'<tspan x="{_n(x)}" y="{_n(y + dy)}">{escape(line)}</tspan>'
                    for line, dy in zip(lines, baselines(size, len(lines), va)))
    return f'<text{ident} font-size="{_n(size)}" text-anchor="{anchor}" fill="{colour}">{spans}</text>'


@functools.cache
def baselines(size: float, lines: int, va: str) -> tuple[float, ...]:
    """Where matplotlib puts the baselines of a text of ``lines`` lines at ``size`` points, anchored with
    vertical alignment ``va``: offsets in points below the anchor (the SVG's y runs down).

    Read from matplotlib's own layout of a text of digits, through the text's extent only: with the baseline
    anchored the extent gives the line pitch and the descent, with ``va`` it gives the top of the first line.
    Lines of ordinary text (no glyph taller than the font's ascender) have the same metrics."""
    mpl = _style.matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.transforms import IdentityTransform

    fig = Figure(dpi=72)  # display units are points
    FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    text = "\n".join(["0"] * lines)
    with mpl.rc_context({"text.usetex": False}):
        anchored = fig.text(0, 0, text, fontsize=size, va="baseline", transform=IdentityTransform())
        placed = fig.text(0, 0, text, fontsize=size, va=va, transform=IdentityTransform())
        base, box = anchored.get_window_extent(renderer), placed.get_window_extent(renderer)
    pitch = base.height / lines
    ascent = pitch + base.y0  # a line is its ascent over its descent (-base.y0 below the last baseline)
    first = box.y1 - ascent  # y up, from the anchor
    return tuple(-(first - i * pitch) for i in range(lines))


def _hex(rgba: Sequence[float]) -> str:
    return "#" + "".join(f"{round(255 * float(c)):02x}" for c in rgba[:3])


def _n(value: float) -> str:
    """A coordinate with two decimals at most (a hundredth of a point is below a pixel at any zoom)."""
    return f"{value:.2f}".rstrip("0").rstrip(".")
