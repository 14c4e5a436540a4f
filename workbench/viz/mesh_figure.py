"""The mesh figure: the device mesh as a grid of ranks, N-D meshes as small multiples over the leading dims.

Without a parameter, each cell takes its rank's colour (``workbench.viz.colours``, the same as in the offsets
figure). With one, a cell's fill says how much the rank holds (one light-to-dark map for every amount, with a
colour bar) and a strip along its top keeps the rank's colour. Cells are labelled with the rank and what it
holds, shortened to what fits (all ranges, the first range and a count, or the count of ranges), never cut
mid-number. ``amount_figure`` draws any per-rank amount (the explorer's bytes per rank) the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshDimRef, MeshSpec
from workbench.viz import _style
from workbench.viz.colours import rank_colours
from workbench.viz.ticks import index_ticks, use_byte_ticks
from workbench.viz.views import MeshView, mesh_view, resolve_spec

__all__ = ["MeshFigure", "amount_figure", "format_count_short", "mesh_panels", "plot_mesh"]

_LABEL_LIMIT = 256  # cells labelled up to this many (where the text fits)
_STRIP = 0.24  # height of the rank-colour strip, as a fraction of a cell


def plot_mesh(
    mesh: MeshSpec | Layout,
    spec: LoadSpec | str | None = None,
    highlight: int | tuple[int, MeshDimRef] | None = None,
    *,
    figsize: tuple[float, float] | None = None,
) -> Any:
    """Draw the device mesh as a grid of ranks (N-D meshes as small multiples over the leading mesh dims).

    Each rank is labelled with its number and what it holds of ``spec`` (its global ranges on every cut dim,
    shortened to what fits), filled by how many elements it holds (grey: nothing; a colour bar gives the
    scale) under a strip of the rank's own colour. Without ``spec`` cells take the rank colours. ``highlight``
    outlines a rank, or with ``(rank, mesh_dim)`` the rank's group along that mesh dim (a tuple of dims for a
    flattened group).

    Returns:
        The Figure; ``fig.held`` (elements held per rank, in mesh shape), ``fig.highlighted`` (ranks outlined).
    """
    if isinstance(mesh, Layout):
        layout = mesh
        mesh = layout.mesh
        if isinstance(spec, str):
            spec = resolve_spec(layout, spec)[0]
    elif isinstance(spec, str):
        raise TypeError(f"plot_mesh: spec {spec!r} is a name; pass a Layout as the first argument to look it up")
    spec = spec if isinstance(spec, LoadSpec) else None
    view = mesh_view(mesh, spec, highlight)
    heading = f"{mesh!r}"
    if spec is not None:
        heading += f"\nholding {spec.name}"
    if view.highlight_text:
        heading += f"\nhighlight: {view.highlight_text}"
    drawing = MeshFigure(
        mesh, heading, values=view.held if spec is not None else None, what="elements held",
        labels=_region_labeller(view) if spec is not None else None, figsize=figsize,
    )
    drawing.outline(view.highlighted)
    fig = drawing.fig
    fig.drawing = drawing
    fig.held = view.held
    fig.highlighted = view.highlighted
    fig.view = view
    return fig


def amount_figure(mesh: MeshSpec, values: np.ndarray, heading: str, *, in_bytes: bool = True,
                  figsize: tuple[float, float] | None = None) -> Any:
    """A per-rank amount over the mesh (``values`` in mesh shape), labelled with the value where it fits."""
    unit = _style.format_bytes if in_bytes else format_count_short
    drawing = MeshFigure(mesh, heading, values=np.asarray(values).reshape(mesh.shape),
                         what="bytes held" if in_bytes else "elements held", in_bytes=in_bytes,
                         labels=lambda rank, v: [[unit(v)]], figsize=figsize)
    drawing.fig.drawing = drawing
    return drawing.fig


def mesh_panels(mesh: MeshSpec) -> list[tuple[tuple[tuple[str, int], ...], np.ndarray]]:
    """Each panel's leading coordinates and its 2-D array of ranks (rows: the next-to-last mesh dim)."""
    ranks = np.array(mesh.all_ranks()).reshape(mesh.shape)
    if mesh.ndim <= 2:
        return [((), ranks.reshape(1, -1) if mesh.ndim == 1 else ranks)]
    out = []
    for lead in np.ndindex(*mesh.shape[:-2]):
        prefix = tuple(zip(mesh.dim_names[:-2], (int(i) for i in lead)))
        out.append((prefix, ranks[lead]))
    return out


# labels: rank, value -> lines, each a list of variants from the most to the least detailed
Labeller = Callable[[int, float], list[list[str]]]


class MeshFigure:
    """A mesh drawn as grids of cells; ``panels`` are its axes (in mesh order), ``outline`` marks ranks."""

    def __init__(self, mesh: MeshSpec, heading: str, *, values: np.ndarray | None, what: str,
                 labels: Labeller | None, in_bytes: bool = False,
                 figsize: tuple[float, float] | None = None) -> None:
        self.mesh = mesh
        self.colours = rank_colours(mesh)
        panels = mesh_panels(mesh)
        ncols = min(len(panels), 4)
        nrows = -(-len(panels) // ncols)
        r, c = panels[0][1].shape
        if figsize is None:
            cw, ch = (0.8, 0.55) if labels is not None else (0.42, 0.34)
            w = min(11.0, max(4.5, ncols * (c * cw + 0.7) + 1.6))
            h = min(8.0, max(2.8, nrows * (r * ch + 0.6) + 0.35 * (heading.count("\n") + 1) + 0.4))
            figsize = (w, h)
        fig = self.fig = _style.new_figure(figsize)
        side = 0.05 * ncols if values is not None else (0.3 if self.colours.discrete else 0.16)
        grid = fig.add_gridspec(nrows, ncols + 1, width_ratios=[1.0] * ncols + [max(side, 0.06)])
        self.panels: list[Any] = []
        self.ranks: list[np.ndarray] = []
        top = float(values.max()) if values is not None and values.size else 0.0
        self._values = values
        self._norm = (0.0, max(top, 1.0))
        image = None
        # panel titles name their dims when the longest fits the panel's width, else only the coordinates
        lead = mesh.dim_names[:-2]
        longest = ", ".join(f"{k}={n - 1}" for k, n in zip(lead, mesh.shape[:-2]))
        named_titles = _style.text_width_pt(longest, _style.LABEL_PT) <= figsize[0] * 72 / (ncols + 0.3) - 24
        if len(panels) > 1 and not named_titles:
            heading += f"\npanels: ({', '.join(lead)})"
        for n, (prefix, ranks) in enumerate(panels):
            ax = fig.add_subplot(grid[n // ncols, n % ncols])
            ax.set_label("panel")
            self.panels.append(ax)
            self.ranks.append(ranks)
            image = self._draw_cells(ax, ranks)
            if prefix:
                ax.set_title(", ".join(f"{k}={v}" for k, v in prefix) if named_titles else
                             "(" + ", ".join(str(v) for _, v in prefix) + ")", fontsize=_style.LABEL_PT)
        if values is not None and image is not None:
            bar = fig.colorbar(image, cax=fig.add_subplot(grid[:, -1]))
            bar.ax.set_label("<colorbar>")
            bar.set_label(what, fontsize=_style.LABEL_PT)
            bar.ax.tick_params(labelsize=_style.MIN_PT)
            if in_bytes:
                use_byte_ticks(bar)
            else:
                from matplotlib.ticker import FuncFormatter, MaxNLocator

                bar.locator = MaxNLocator(nbins=5, integer=True)
                bar.formatter = FuncFormatter(lambda v, _: format_count_short(v))
            self.colourbar = bar
        else:
            key = fig.add_subplot(grid[0, -1])
            key.set_label("colour key")
            self.colours.draw_key(key)
        fig.suptitle(heading, fontsize=_style.TITLE_PT)
        self._label_axes()
        if labels is not None and mesh.size <= _LABEL_LIMIT:
            from workbench.viz.offsets_figure import _laid_out

            _laid_out(fig)
            for ax, ranks in zip(self.panels, self.ranks):
                self._draw_labels(ax, ranks, labels)
        self.outlines: list[Any] = []
        self.outlined: tuple[int, ...] = ()

    def _fill(self, rank: int) -> tuple[float, ...]:
        if self._values is None:
            return self.colours(rank)
        value = float(self._values[self.mesh.coordinate(rank)])
        if value <= 0:
            return (0.85, 0.85, 0.85, 1.0)
        return _style.amount_cmap()(value / self._norm[1])

    def _draw_cells(self, ax: Any, ranks: np.ndarray) -> Any:
        rows, cols = ranks.shape
        image = None
        if self._values is None:
            rgba = np.array([[self.colours(int(r)) for r in row] for row in ranks])
            ax.imshow(rgba, extent=(0, cols, rows, 0), interpolation="nearest", aspect="auto")
        else:
            held = np.array([[self._values[self.mesh.coordinate(int(r))] for r in row] for row in ranks], float)
            cmap = _style.amount_cmap().with_extremes(bad="0.85")
            image = ax.imshow(np.ma.masked_less_equal(held, 0), extent=(0, cols, rows, 0), cmap=cmap,
                              vmin=self._norm[0], vmax=self._norm[1], interpolation="nearest", aspect="auto")
            self._strips(ax, ranks)
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        # white lines between cells
        if rows * cols <= 4096:
            ax.hlines(np.arange(1, rows), 0, cols, colors="white", linewidth=0.6)
            ax.vlines(np.arange(1, cols), 0, rows, colors="white", linewidth=0.6)
        return image

    def _strips(self, ax: Any, ranks: np.ndarray) -> None:
        """The rank's colour along the top of each cell, where a cell is tall enough to show it."""
        from matplotlib.collections import PatchCollection
        from matplotlib.patches import Rectangle

        rows = ranks.shape[0]
        panel_rows = -(-len(mesh_panels(self.mesh)) // 4)
        if self.fig.get_figheight() * 0.6 / (rows * panel_rows) * 72 * _STRIP < 2.5:
            return
        cells = [(i, j, int(r)) for (i, j), r in np.ndenumerate(ranks)]
        strips = PatchCollection([Rectangle((j, i), 1, _STRIP) for i, j, _ in cells],
                                 facecolors=[self.colours(r) for _, _, r in cells], edgecolors="none")
        strips.set_gid("rank-strips")
        ax.add_collection(strips)

    def _label_axes(self) -> None:
        mesh = self.mesh
        names = mesh.dim_names
        fig = self.fig
        for ax, ranks in zip(self.panels, self.ranks):
            rows, cols = ranks.shape
            box = ax.get_position()
            width_pt = box.width * fig.get_figwidth() * 72
            height_pt = box.height * fig.get_figheight() * 72
            xt = index_ticks(cols, width_pt * 0.8, labels_wide=True)
            ax.set_xticks(np.array(xt) + 0.5, [str(i) for i in xt], fontsize=_style.MIN_PT)
            ax.set_xlabel(names[-1], fontsize=_style.LABEL_PT)
            if mesh.ndim >= 2:
                yt = index_ticks(rows, height_pt * 0.8)
                ax.set_yticks(np.array(yt) + 0.5, [str(i) for i in yt], fontsize=_style.MIN_PT)
                ax.set_ylabel(names[-2], fontsize=_style.LABEL_PT)
            else:
                ax.set_yticks([])
            ax.tick_params(length=2)

    def _draw_labels(self, ax: Any, ranks: np.ndarray, labels: Labeller) -> None:
        fig = self.fig
        box = ax.get_position()
        rows, cols = ranks.shape
        cell_w = box.width * fig.get_figwidth() * 72 / cols
        cell_h = box.height * fig.get_figheight() * 72 / rows
        strip = _STRIP * cell_h if self._values is not None else 0.0
        room_w, room_h = cell_w - 5, cell_h - strip - 3
        line_h = 1.25 * _style.MIN_PT
        for (i, j), r in np.ndenumerate(ranks):
            rank = int(r)
            value = float(self._values[self.mesh.coordinate(rank)]) if self._values is not None else 0.0
            lines = [f"r{rank}"]
            if _style.text_width_pt(lines[0]) > room_w or line_h > room_h:
                continue
            for variants in labels(rank, value):
                fitting = next((v for v in variants if _style.text_width_pt(v) <= room_w
                                and (len(lines) + v.count("\n") + 1) * line_h <= room_h), None)
                if fitting is None:
                    break
                lines.append(fitting)
            fill = self._fill(rank)
            y = i + (_STRIP + (1 - _STRIP) / 2 if self._values is not None else 0.5)
            ax.text(j + 0.5, y, "\n".join(lines), ha="center", va="center", fontsize=_style.MIN_PT,
                    color=_style.text_on(fill), linespacing=1.1)

    def cell(self, rank: int) -> tuple[int, int, int]:
        """(panel index, row, column) of ``rank``."""
        coord = self.mesh.coordinate(rank)
        if self.mesh.ndim == 1:
            return 0, 0, coord[0]
        lead = coord[:-2]
        panel = int(np.ravel_multi_index(lead, self.mesh.shape[:-2])) if lead else 0
        return panel, coord[-2], coord[-1]

    def outline(self, ranks: Sequence[int]) -> list[Any]:
        """Outline ``ranks``, replacing earlier outlines: one rank black on white (visible on any fill); a group
        each cell thinly and, per panel, its block boldly when its cells form one. ``outlined`` lists them."""
        from matplotlib.collections import PatchCollection
        from matplotlib.patches import Rectangle

        for artist in self.outlines:
            artist.remove()
        self.outlines = []
        self.outlined = tuple(int(r) for r in ranks)
        single = len(ranks) == 1
        cells: dict[int, list[tuple[int, int]]] = {}
        for rank in self.outlined:
            panel, i, j = self.cell(rank)
            cells.setdefault(panel, []).append((i, j))
        for panel, members in cells.items():
            ax = self.panels[panel]
            boxes = [Rectangle((j, i), 1, 1) for i, j in members]
            styles = (("white", 3.8), ("black", 2.0)) if single else (("black", 0.9),)
            for colour, width in styles:
                outline = PatchCollection(boxes, facecolors="none", edgecolors=colour, linewidths=width)
                outline.set_gid("highlight")
                self.outlines.append(ax.add_collection(outline, autolim=False))
            if single:
                continue
            rows = [i for i, _ in members]
            cols = [j for _, j in members]
            i0, i1, j0, j1 = min(rows), max(rows) + 1, min(cols), max(cols) + 1
            if (i1 - i0) * (j1 - j0) != len(set(members)):
                continue  # not one block: the cells' own outlines say it
            for colour, width in (("white", 4.2), ("black", 2.2)):
                self.outlines.append(ax.add_patch(Rectangle((j0, i0), j1 - j0, i1 - i0, fill=False,
                                                            edgecolor=colour, linewidth=width, gid="group")))
        return self.outlines


def _region_labeller(view: MeshView) -> Labeller:
    """Per cut dim, the rank's ranges: all of them, the first and how many more, or how many (exact numbers,
    never cut)."""
    def labels(rank: int, _: float) -> list[list[str]]:
        if view.labels.get(rank) == "empty":
            return [["empty"]]
        out = []
        for ranges in view.regions.get(rank, ()):
            spans = [f"{a}:{b}" for a, b in ranges]
            if len(spans) == 1:
                a, b = ranges[0]
                variants = [spans[0], f"{a}:\n{b}"]  # the same range on two lines when one is too wide
            else:
                variants = [" ".join(spans)] if len(spans) <= 2 else []
                variants += [f"{spans[0]} +{len(spans) - 1}", f"{len(spans)} ranges"]
            out.append(variants)
        return out or [["all"]]

    return labels


def format_count_short(v: float) -> str:
    """``12,345`` up to 99,999, then ``123k``, ``1.2M``, ``3.4G`` (three significant digits)."""
    v = float(v)
    if abs(v) < 1e5:
        return f"{v:,.0f}"
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            x = v / scale
            digits = max(0, 2 - math.floor(math.log10(abs(x))))
            text = f"{x:.{digits}f}"
            return (text.rstrip("0").rstrip(".") if "." in text else text) + suffix
    return f"{v:,.0f}"  # pragma: no cover
