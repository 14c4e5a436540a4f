"""Shared look of workbench figures: colours per rank, byte formatting, a headless figure factory."""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from typing import Any

__all__ = [
    "DISCRETE_LIMIT",
    "bytes_formatter",
    "ellipsize",
    "format_bytes",
    "heat_cmap",
    "lane_colours",
    "matplotlib",
    "new_figure",
    "rank_colourbar",
    "rank_colours",
    "text_on",
]

DISCRETE_LIMIT = 20  # up to this many ranks, each gets a distinct qualitative colour


def matplotlib() -> Any:
    """The matplotlib module, or an ImportError that names what to install."""
    try:
        import matplotlib as mpl
    except ImportError as exc:  # pragma: no cover - matplotlib is a dependency
        raise ImportError("workbench.viz needs matplotlib: pip install matplotlib") from exc
    return mpl


def new_figure(figsize: tuple[float, float]) -> Any:
    """A Figure on an Agg canvas, not registered with pyplot (no GUI, no global state, garbage-collected).

    It shows itself in any notebook front end (``_repr_png_``), whatever matplotlib backend is active.
    """
    matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = _figure_class()(figsize=figsize, dpi=100)
    FigureCanvasAgg(fig)
    return fig


@functools.cache
def _figure_class() -> type:
    from matplotlib.figure import Figure

    class WorkbenchFigure(Figure):
        """A matplotlib Figure that notebooks display as a PNG."""

        def _repr_png_(self) -> bytes:
            buffer = io.BytesIO()
            self.savefig(buffer, format="png", bbox_inches="tight")
            return buffer.getvalue()

    return WorkbenchFigure


def rank_colours(size: int) -> Callable[[int], tuple[float, float, float, float]]:
    """Colour of each rank: tab20 for small meshes, a continuous map over rank order otherwise."""
    mpl = matplotlib()
    if size <= 10:
        cmap = mpl.colormaps["tab10"]
        return lambda r: cmap(r % 10)
    if size <= DISCRETE_LIMIT:
        cmap = mpl.colormaps["tab20"]
        return lambda r: cmap(r % 20)
    cmap = mpl.colormaps["turbo"]
    top = max(size - 1, 1)
    return lambda r: cmap(0.05 + 0.9 * r / top)


def rank_colourbar(ax: Any, size: int) -> None:
    """A colour bar mapping the continuous rank colours back to rank numbers."""
    mpl = matplotlib()
    from matplotlib.colors import LinearSegmentedColormap, Normalize

    colour = rank_colours(size)
    cmap = LinearSegmentedColormap.from_list("ranks", [colour(r) for r in range(0, size, max(1, size // 64))])
    bar = ax.figure.colorbar(mpl.cm.ScalarMappable(Normalize(0, size - 1), cmap), ax=ax, fraction=0.04, pad=0.12)
    bar.set_label("rank", fontsize=7)
    bar.ax.tick_params(labelsize=6)


def heat_cmap() -> Any:
    """Colour map of the bytes-held heat maps."""
    return matplotlib().colormaps["YlOrRd"]


def lane_colours(n: int) -> list[Any]:
    """A distinct colour per schedule lane."""
    cmap = matplotlib().colormaps["tab10"]
    usable = [cmap(i) for i in range(10) if i != 3]  # red (3) marks oversized calls
    return [usable[i % len(usable)] for i in range(n)]


def text_on(rgba: tuple[float, ...]) -> str:
    """Black or white, whichever reads better on ``rgba``."""
    r, g, b = rgba[:3]
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def ellipsize(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with an ellipsis in the middle."""
    if len(text) <= limit:
        return text
    half = (limit - 3) // 2
    return text[:half] + "..." + text[-(limit - 3 - half):]


def format_bytes(n: float) -> str:
    """Human binary units, the same everywhere in workbench (``workbench.report.units``)."""
    from workbench.report.units import format_bytes as shared

    return shared(n)


def bytes_formatter() -> Any:
    """A matplotlib tick formatter printing bytes in human units."""
    matplotlib()
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: format_bytes(v))
