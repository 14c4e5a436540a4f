"""Shared look of workbench figures: text sizes, the figure factory (hi-dpi PNGs), fills and readable text colours.

Rules every figure follows: text is at least ``MIN_PT`` points; figures are laid out at ``DPI`` dots per inch
and shown at that size in CSS pixels, rendered at ``HIDPI`` times the pixels (sharp on hi-dpi screens); the
background is opaque white (readable in a dark notebook theme); text on a fill is black or white, whichever
contrasts more (WCAG contrast ratio).
"""

from __future__ import annotations

import functools
import io
import threading
from collections.abc import Sequence
from typing import Any

__all__ = [
    "DPI",
    "HIDPI",
    "LABEL_PT",
    "MIN_PT",
    "TITLE_PT",
    "amount_cmap",
    "artists_svg",
    "contrast",
    "ellipsize",
    "format_bytes",
    "lane_colours",
    "matplotlib",
    "new_figure",
    "png_bytes",
    "text_on",
    "text_width_pt",
    "wrap_parts",
]

MIN_PT = 8.0  # the smallest text any figure draws
LABEL_PT = 9.0  # axis labels, legends
TITLE_PT = 10.0  # titles
DPI = 100  # CSS pixels per figure inch in a notebook
HIDPI = 2  # rendered pixels per CSS pixel
OVER = "#d62728"  # over budget, oversized: the one red of every figure
_SVG_LOCK = threading.Lock()


def matplotlib() -> Any:
    """The matplotlib module, or an ImportError that names what to install."""
    try:
        import matplotlib as mpl
    except ImportError as exc:  # pragma: no cover - matplotlib is a dependency
        raise ImportError("workbench.viz needs matplotlib: pip install matplotlib") from exc
    return mpl


def new_figure(figsize: tuple[float, float], *, constrained: bool = True) -> Any:
    """A Figure on an Agg canvas, not registered with pyplot (no GUI, no global state, garbage-collected).

    It lays itself out with matplotlib's constrained layout (titles, legends, colour bars and labels outside the
    data get room), and shows itself in any notebook front end (``_repr_png_``) whatever backend is active.
    """
    matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = _figure_class()(figsize=figsize, dpi=DPI, facecolor="white",
                          layout="constrained" if constrained else None)
    if constrained:
        fig.get_layout_engine().set(w_pad=0.06, h_pad=0.06, wspace=0.04, hspace=0.04)
    FigureCanvasAgg(fig)
    return fig


@functools.cache
def _figure_class() -> type:
    from matplotlib.figure import Figure

    class WorkbenchFigure(Figure):
        """A matplotlib Figure that notebooks display as a hi-dpi PNG, at ``DPI`` CSS pixels per inch."""

        def _repr_png_(self) -> tuple[bytes, dict[str, int]]:
            data = png_bytes(self)
            width, height = _png_size(data)
            return data, {"width": width // HIDPI, "height": height // HIDPI}

    return WorkbenchFigure


def png_bytes(fig: Any, scale: int = HIDPI) -> bytes:
    """The figure as a PNG of ``scale`` pixels per CSS pixel (``DPI * scale`` dots per inch), white background."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI * scale, facecolor="white")
    return buffer.getvalue()


def artists_svg(fig: Any, artists: Any) -> bytes:
    """Only ``artists`` of ``fig``, drawn where the figure draws them, as an SVG of the figure's size with a
    transparent background: shown over the figure's PNG (same CSS size), the two look like the figure drawn
    with them. Vector, so sharp at any pixel density; text is drawn as paths (no font needed to show it). The
    output is deterministic (fixed ids, no date)."""
    from matplotlib.backends.backend_svg import RendererSVG

    mpl = matplotlib()
    dpi = fig.dpi
    out = io.StringIO()
    settings = {"svg.fonttype": "path", "svg.hashsalt": "workbench", "svg.id": None}
    # one at a time: the settings are global (the explorer also draws in a background thread). Only these three
    # are saved and restored: rc_context copies every setting (~1 ms, a third of a small SVG's time)
    with _SVG_LOCK:
        saved = {key: mpl.rcParams[key] for key in settings}
        mpl.rcParams.update(settings)
        fig.dpi = 72  # SVG user units are points, as in savefig(format="svg")
        try:
            width, height = fig.get_size_inches() * 72
            renderer = RendererSVG(width, height, out, metadata={"Date": None, "Creator": None})
            for artist in artists:
                artist.draw(renderer)
            renderer.finalize()
        finally:
            fig.dpi = dpi
            mpl.rcParams.update(saved)
    return out.getvalue().encode()


def _png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def amount_cmap() -> Any:
    """Colour map of every "how much a rank holds" fill (elements, bytes): light (little) to dark (much)."""
    return matplotlib().colormaps["YlGnBu"]


def lane_colours(n: int) -> list[Any]:
    """A distinct colour per schedule lane (red is kept for over budget and oversized)."""
    cmap = matplotlib().colormaps["tab10"]
    usable = [cmap(i) for i in range(10) if i != 3]
    return [usable[i % len(usable)] for i in range(n)]


def _luminance(rgba: Any) -> float:
    """WCAG relative luminance of an sRGB colour."""
    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(float(c)) for c in matplotlib().colors.to_rgb(rgba))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: Any, b: Any) -> float:
    """WCAG contrast ratio of two colours (1 to 21; text wants >= 4.5)."""
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def text_on(rgba: Any) -> str:
    """Black or white, whichever contrasts more with ``rgba``."""
    return "black" if contrast(rgba, "black") >= contrast(rgba, "white") else "white"


def ellipsize(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with an ellipsis in the middle (for names only, never numbers)."""
    if len(text) <= limit:
        return text
    half = (limit - 3) // 2
    return text[:half] + "..." + text[-(limit - 3 - half):]


def wrap_parts(parts: Sequence[str], sep: str, room_pt: float, size: float = MIN_PT) -> str:
    """``parts`` joined by ``sep``, broken into lines (after a separator) each at most ``room_pt`` wide if it can."""
    lines: list[str] = []
    for part in parts:
        if lines and text_width_pt(lines[-1] + sep + part, size) <= room_pt:
            lines[-1] += sep + part
        else:
            if lines:
                lines[-1] += sep.rstrip()
            lines.append(part)
    return "\n".join(lines)


def text_width_pt(text: str, size: float = MIN_PT) -> float:
    """Width of the widest line of ``text`` in points at ``size``, as Agg draws it (matplotlib's default font)."""
    from matplotlib.font_manager import FontProperties

    prop = FontProperties(size=size)
    return max((_line_width(line, prop.get_size_in_points(), prop) for line in text.split("\n")), default=0.0)


@functools.lru_cache(maxsize=4096)
def _line_width(line: str, size: float, prop: Any) -> float:
    if not line:
        return 0.0
    renderer = _measuring_renderer()
    width, _, _ = renderer.get_text_width_height_descent(line, prop, ismath=False)
    return width * 72.0 / renderer.dpi


@functools.cache
def _measuring_renderer() -> Any:
    from matplotlib.backends.backend_agg import RendererAgg

    return RendererAgg(10, 10, 72)


def format_bytes(n: float) -> str:
    """Human binary units, the same everywhere in workbench (``workbench.report.units``)."""
    from workbench.report.units import format_bytes as shared

    return shared(n)
