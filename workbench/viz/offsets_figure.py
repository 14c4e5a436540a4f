"""The shard-offsets figure: which rank holds which part of a tensor, with a zoom on the chosen rank.

Boxes take each rank's colour (``workbench.viz.colours``: the same in every view), HF key boundaries are
dashed with the key names on a side axis, FP8 tail padding is hatched, replicas are marked ``xK``. When the
chosen rank's region is too thin to see (a 1,024-row slice of a 1,048,576-row tensor), a second panel shows a
window around it at a readable size, linked to the overview, where the window is outlined.

``OffsetsFigure`` keeps the pieces apart: the static overview (drawn once) and what depends on the rank (its
outline, the window, the zoom panel, the notes), so the explorer redraws only the latter.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.viz import _style
from workbench.viz.colours import rank_colours
from workbench.viz.views import ShardView, format_ranks, resolve_spec, shard_view, zoom_window
from workbench.viz.zoom import ZoomScene, zoom_scene

__all__ = ["OffsetsFigure", "needs_zoom", "plot_shard_offsets"]

_LABEL_LIMIT = 48  # overview cells labelled with their rank up to this many (when the text fits)
_READABLE = 0.05  # a box under this fraction of an axis gets a zoom panel
_VECTOR_BOXES = 4096  # more boxes than this are drawn as one raster image in vector output (SVG, PDF)


def plot_shard_offsets(
    spec_or_layout: LoadSpec | Layout,
    key: str | None = None,
    rank: int | None = None,
    dims: Sequence[int] = (0, 1),
    index: int | Sequence[int] | Mapping[int, int] | None = None,
    *,
    figsize: tuple[float, float] | None = None,
) -> Any:
    """Draw the global tensor (or one HF key of a fused tensor) coloured by the rank that holds each part.

    Interleaved runs show as stripes, HF key boundaries as dashed lines with the key names, FP8 tail padding
    hatched, replicas with an ``xK`` mark (K ranks hold it), ranks holding nothing listed under the plot. With
    ``rank``, its boxes are outlined, and when they are too thin to read a second panel zooms on the first of
    them (the window is outlined on the overview).

    Args:
        spec_or_layout: a LoadSpec, or a Layout (then ``key`` picks a parameter or an HF key; default: the
            largest parameter).
        key: a parameter name or an HF key; an HF key of a fused tensor draws only that key.
        rank: outline this rank's boxes (and zoom on them when needed).
        dims: the tensor dims drawn as rows and columns (N-D tensors).
        index: position on the undrawn dims (e.g. the expert of a 3-D tensor); see ``views.shard_view``.

    Returns:
        The Figure; ``fig.owners`` is an int array of the drawn view, the lowest rank holding each element
        (-1: none). Views over 2**20 elements give it per cell of the grid ``fig.owner_edges`` (row edges, col
        edges) instead, each cell held uniformly. ``fig.view`` is the full ``ShardView``; ``fig.zoom`` the
        zoomed window ``((row0, row1), (col0, col1))`` in view coordinates, or None.
    """
    spec, hf_key = resolve_spec(spec_or_layout, key)
    view = shard_view(spec, hf_key=hf_key, dims=dims, index=index)
    if rank is not None:
        spec.mesh.coordinate(rank)  # a clear error for a rank outside the mesh
    window = zoom_window(view, rank, readable=_READABLE) if rank is not None else None
    drawing = OffsetsFigure(spec, view, rank=rank, zoom_panel=window is not None, figsize=figsize)
    fig = drawing.fig
    fig.owners = view.owners()
    fig.owner_edges = (view.row_edges, view.col_edges)
    fig.view = view
    fig.zoom = window
    return fig


def needs_zoom(view: ShardView) -> bool:
    """True when some rank's box is too thin to read on the overview (the figure then has a zoom panel)."""
    rows, cols = view.shape
    return any(b.row1 - b.row0 < _READABLE * rows or b.col1 - b.col0 < _READABLE * cols for b in view.boxes)


class OffsetsFigure:
    """The figure of one view: the static overview and colour key at once, the rank's parts by ``show_rank``.

    ``zoom_panel``: False (no zoom), True (a second panel beside the overview, linked to its window) or
    ``"separate"`` (the zoom in a figure of its own, ``zoom_fig``: the explorer shows it as a second image).
    The layout is computed once, in ``__init__``, and then kept (a redraw for another rank moves nothing).

    Attributes:
        fig: the Figure; ``overview`` and ``zoom`` (or None) its panels, ``key`` the colour key.
        dynamic: the artists ``show_rank`` added last (what a redraw for another rank replaces).
    """

    def __init__(self, spec: LoadSpec, view: ShardView, *, rank: int | None = None, zoom_panel: bool | str,
                 figsize: tuple[float, float] | None = None, rank_note: bool = True) -> None:
        self.spec, self.view, self.rank_note = spec, view, rank_note
        self.colours = rank_colours(spec.mesh)
        beside = zoom_panel is True
        if figsize is None:
            figsize = (10.0, 5.0) if beside else (7.5, 5.0)
        fig = self.fig = _style.new_figure(figsize)
        key_width = 0.3 if self.colours.discrete else 0.16
        ratios = [1.0, 1.25, key_width] if beside else [1.0, key_width * 0.8]
        grid = fig.add_gridspec(1, len(ratios), width_ratios=ratios)
        self.overview = fig.add_subplot(grid[0, 0])
        self.overview.set_label("overview")
        self.zoom_fig = fig
        self.zoom = None
        self._last_scene: ZoomScene | None = None
        if beside:
            self.zoom = fig.add_subplot(grid[0, 1])
        elif zoom_panel == "separate":
            self.zoom_fig = _style.new_figure((3.6, figsize[1]))
            self.zoom = self.zoom_fig.add_subplot(1, 1, 1)
        if self.zoom is not None:
            self._prepare_zoom()
        self.key = fig.add_subplot(grid[0, -1])
        self.key.set_label("colour key")
        self.colours.draw_key(self.key)
        self.dynamic: list[Any] = []
        self._static_notes: list[str] = []
        self._draw_overview(figsize, beside)
        self._title()
        self._notes = fig.supxlabel("", x=0.01, ha="left", fontsize=_style.MIN_PT)
        self._set_notes(rank, [b for b in view.boxes if b.rank == rank] if rank is not None else [])
        for figure in {id(fig): fig, id(self.zoom_fig): self.zoom_fig}.values():
            _laid_out(figure)
            figure.set_layout_engine("none")  # laid out for good: nothing moves when the rank changes
        if self.zoom is not None:
            if not self.columns_fixed:
                self.zoom.set_xticks([])
            self.zoom.set_yticks([])
        self._cell_labels()
        self.show_rank(rank)

    def _prepare_zoom(self) -> None:
        """The zoom panel's frame; its edge labels are drawn per rank, room for the widest is kept here."""
        ax = self.zoom
        ax.set_label("zoom")
        rows, cols = self.view.shape
        # every rank's columns readable on the overview: the zoom keeps all columns, with ordinary ticks
        self.columns_fixed = all(b.col1 - b.col0 >= _READABLE * cols for b in self.view.boxes)
        ax.yaxis.tick_right()
        ax.set_yticks([0.5], [f"{rows:,}"], fontsize=_style.MIN_PT)  # placeholders for the layout only
        if self.columns_fixed:
            ax.set_xlim(0, cols)
            ax.xaxis.set_major_locator(_ticker().MaxNLocator(nbins=3, integer=True, min_n_ticks=2))
            ax.xaxis.set_major_formatter(_ticker().FuncFormatter(lambda v, _: f"{round(v):,}"))
            ax.tick_params(axis="x", labelsize=_style.MIN_PT)
        else:
            ax.set_xticks([0.5], [f"{cols:,}"], fontsize=_style.MIN_PT)
        ax.set_title("zoom on the rank", fontsize=_style.LABEL_PT)

    # -- static ------------------------------------------------------------------------------------------
    def _draw_overview(self, figsize: tuple[float, float], beside: bool) -> None:
        import numpy as np
        from matplotlib.collections import PolyCollection

        ax, view = self.overview, self.view
        rows, cols = view.shape
        # one polygon per box from an array (Rectangle patches cost ~0.2 ms each: 65,536 interleaved runs took 11 s)
        corners = np.array([(b.col0, b.row0, b.col1, b.row1) for b in reversed(view.boxes)], dtype=float)
        corners = corners.reshape(-1, 4)
        x0, y0, x1, y1 = corners.T
        verts = np.stack([np.stack([x0, y0], 1), np.stack([x1, y0], 1), np.stack([x1, y1], 1),
                          np.stack([x0, y1], 1)], 1)
        faces = [self.colours(b.rank) for b in reversed(view.boxes)]
        edge = 0.6 if len(verts) <= 256 else 0.0
        boxes = PolyCollection(verts, facecolors=faces, edgecolors="white", linewidths=edge)
        boxes.set_gid("boxes")
        boxes.set_rasterized(len(verts) > _VECTOR_BOXES)  # an SVG of 65,536 paths was 11 MB
        ax.add_collection(boxes)
        ax.set_xlim(0, cols or 1)  # a 0-length dim keeps a unit range (no singular limits, one tick at 0)
        ax.set_ylim(rows or 1, 0)
        _draw_padding(ax, view)
        # the overview's share of the figure, before layout: for thinning the key names
        share = 1.0 / (2.4 if beside else 1.3)
        estimate = (figsize[0] * 72 * share - 60, figsize[1] * 72 - 110)
        note = _draw_keys(ax, view, estimate)
        if note:
            self._static_notes.append(note)
        _integer_ticks(ax)
        for size, axis in ((rows, ax.yaxis), (cols, ax.xaxis)):
            if not size:
                axis.set_ticks([0])
        d0, d1 = view.dims
        ax.set_xlabel(f"dim {d1}" + (f" (global +{view.origin[1]:,})" if view.origin[1] else ""),
                      fontsize=_style.LABEL_PT)
        if d0 is None:
            ax.set_yticks([])
        else:
            ax.set_ylabel(f"dim {d0}" + (f" (global +{view.origin[0]:,})" if view.origin[0] else ""),
                          fontsize=_style.LABEL_PT)
        if view.empty_ranks:
            self._static_notes.append(
                f"empty shards on {len(view.empty_ranks)} rank(s): {format_ranks(view.empty_ranks)}")
        uneven = {s for r, s in view.local_sizes.items() if r not in view.empty_ranks}
        if len(uneven) > 1:
            shown = ", ".join(f"{a}x{b}" for a, b in sorted(uneven)[:5])
            more = f" and {len(uneven) - 5} more" if len(uneven) > 5 else ""
            self._static_notes.append(f"{len(uneven)} uneven local sizes: {shown}{more}")
        if view.replicated:
            self._static_notes.append(f"replicated: up to x{int(view.cell_holders.max())} ranks hold an element"
                                      " (cells marked xK)")
        self._static_notes.append(f"colours: {self.colours.describe()}")

    def _cell_labels(self) -> None:
        """``r5`` (``x2`` for replicas) in each cell of a small grid, where the text fits the cell."""
        view, ax = self.view, self.overview
        holders = view.cell_holders
        if holders.size > _LABEL_LIMIT:
            return
        width_pt, height_pt = _axes_size_pt(ax)
        rows, cols = view.shape
        for i in range(holders.shape[0]):
            for j in range(holders.shape[1]):
                owner = int(view.cell_owners[i, j])
                if owner < 0:
                    continue
                text = f"r{owner}" + (f" x{holders[i, j]}" if holders[i, j] > 1 else "")
                w = (view.col_edges[j + 1] - view.col_edges[j]) / cols * width_pt
                h = (view.row_edges[i + 1] - view.row_edges[i]) / rows * height_pt
                if _style.text_width_pt(text) + 3 > w or h < 1.35 * _style.MIN_PT:
                    continue
                x = (view.col_edges[j] + view.col_edges[j + 1]) / 2
                y = (view.row_edges[i] + view.row_edges[i + 1]) / 2
                ax.text(x, y, text, ha="center", va="center", fontsize=_style.MIN_PT,
                        color=_style.text_on(self.colours(owner)))

    def _title(self) -> None:
        view, spec = self.view, self.spec
        fixed = [f"dim {d}={i}" for d, i in enumerate(view.index) if i is not None]
        room = self.fig.get_figwidth() * 72 - 24
        name = _fit(view.hf_key or view.name, room, _style.TITLE_PT)
        detail = f"{spec.global_shape}  {spec.describe_shards()}" + ("  [" + ", ".join(fixed) + "]" if fixed else "")
        self.fig.suptitle(f"{name}\n{_fit(detail, room, _style.TITLE_PT)}", fontsize=_style.TITLE_PT)

    def _set_notes(self, rank: int | None, mine: list[Any]) -> None:
        notes = list(self._static_notes)
        if rank is not None and self.rank_note:
            spec, view = self.spec, self.view
            coord = ", ".join(f"{n}={c}" for n, c in zip(spec.mesh.dim_names, spec.mesh.coordinate(rank)))
            if mine:
                held = " ".join(f"[{b.row0:,}:{b.row1:,}, {b.col0:,}:{b.col1:,}]" for b in mine[:3])
                more = f" and {len(mine) - 3} more box(es)" if len(mine) > 3 else ""
                notes.insert(0, f"rank {rank} ({coord}) holds {held}{more}")
            else:
                notes.insert(0, f"rank {rank} ({coord}) holds none of {view.hf_key or view.name}")
        room = self.fig.get_figwidth() * 72 - 24
        self._notes.set_text("\n".join(_fit(n, room, _style.MIN_PT) for n in notes))

    # -- per rank ----------------------------------------------------------------------------------------
    def show_rank(self, rank: int | None, *, zoom: bool = True) -> list[Any]:
        """Draw what depends on ``rank`` (replacing the last rank's): outline, window, zoom panel, notes.

        ``zoom=False`` leaves the zoom panel empty (the explorer shows it as ``zoom_svg``) but still outlines
        its window on the overview."""
        for artist in self.dynamic:
            artist.remove()
        self.dynamic = []
        view = self.view
        mine = [b for b in view.boxes if b.rank == rank] if rank is not None else []
        for b in mine:
            self._add_outline(self.overview, b, rank)
        if self.zoom is not None:
            scene = self.zoom_scene(rank)
            if zoom:
                self._draw_zoom(scene)
            elif scene.window is not None:
                self.dynamic.append(self._window_marker(scene))
        if self.rank_note:
            self._set_notes(rank, mine)
        return self.dynamic

    def _add_outline(self, ax: Any, b: Any, rank: int | None) -> None:
        from matplotlib.patches import Rectangle

        xy, w, h = (b.col0, b.row0), b.col1 - b.col0, b.row1 - b.row0
        # add_artist, not add_patch: outlines never change the data limits (and skip their cost)
        halo = ax.add_artist(Rectangle(xy, w, h, fill=False, edgecolor="white", linewidth=3.6))
        line = ax.add_artist(Rectangle(xy, w, h, fill=False, edgecolor="black", linewidth=1.8, gid=f"rank-{rank}"))
        self.dynamic += [halo, line]

    def zoom_scene(self, rank: int | None) -> ZoomScene:
        """What the zoom panel shows for ``rank`` (only for a figure with a zoom panel)."""
        if self.zoom is None:
            raise ValueError(f"OffsetsFigure of {self.view.name}: no zoom panel (zoom_panel=False)")
        last = self._last_scene  # the overview's window marker and the zoom panel ask for the same rank
        if last is not None and last.rank == rank:
            return last
        view = self.view
        mesh = self.spec.mesh
        scene = self._last_scene = zoom_scene(
            view, rank, zoom_window(view, rank, readable=_READABLE) if rank is not None else None,
            size_pt=_axes_size_pt(self.zoom), colour=self.colours,
            coordinate=lambda r: ", ".join(f"{n}={c}" for n, c in zip(mesh.dim_names, mesh.coordinate(r))),
            columns_fixed=self.columns_fixed, fit=_fit,
        )
        return scene

    def zoom_svg(self, rank: int | None) -> bytes:
        """The zoom panel's part that depends on ``rank`` as an SVG of ``zoom_fig``'s size, to show over the
        panel drawn without it (``zoom_scene`` drawn by ``zoom_svg.scene_svg``)."""
        from workbench.viz.zoom_svg import panel_frame, scene_svg

        return scene_svg(self.zoom_scene(rank), panel_frame(self.zoom))

    def _draw_zoom(self, scene: ZoomScene) -> None:
        from matplotlib.patches import ConnectionPatch, Rectangle

        ax = self.zoom
        if scene.window is None:
            if not self.columns_fixed:
                ax.set_xlim(0, 1)
            ax.set_ylim(1, 0)
            self.dynamic.append(ax.text(0.5, 0.5, scene.message, ha="center", va="center",
                                        fontsize=_style.LABEL_PT, transform=ax.transAxes, gid="zoom-message"))
            return
        (r0, r1), (c0, c1) = scene.window
        ax.set_xlim(c0, c1)
        ax.set_ylim(r1, r0)
        for box in scene.boxes:
            x0, x1, y0, y1 = box.x0, box.x1, box.y0, box.y1
            self.dynamic.append(ax.add_artist(Rectangle((x0, y0), x1 - x0, y1 - y0, facecolor=box.fill,
                                                        edgecolor="white", linewidth=0.8)))
            if box.label is not None:
                self.dynamic.append(ax.text((x0 + x1) / 2, (y0 + y1) / 2, box.label, ha="center", va="center",
                                            fontsize=_style.MIN_PT, color=box.label_colour, clip_on=True))
        for b in scene.outlines:
            self._add_outline(ax, b, scene.rank)
        self.dynamic += _edge_labels(ax, 0, scene.row_values)
        self.dynamic += _edge_labels(ax, 1, scene.col_values)
        # the window on the overview, linked to the zoom panel when both are in one figure
        self.dynamic.append(self._window_marker(scene))
        if self.zoom_fig is self.fig:
            for (xa, ya), (xb, yb) in (((c1, r0), (0, 1)), ((c1, r1), (0, 0))):
                link = ConnectionPatch(xyA=(xa, ya), coordsA=self.overview.transData, xyB=(xb, yb),
                                       coordsB=ax.transAxes, color="0.35", linewidth=0.8, linestyle=":")
                link.set_in_layout(False)
                self.dynamic.append(self.fig.add_artist(link))

    def _window_marker(self, scene: ZoomScene) -> Any:
        from matplotlib.patches import Rectangle

        (r0, r1), (c0, c1) = scene.window  # type: ignore[misc]
        return self.overview.add_artist(Rectangle((c0, r0), c1 - c0, r1 - r0, fill=False, edgecolor="black",
                                                  linewidth=1.2, linestyle="--", gid="zoom-window"))

    def dynamic_on(self, figure: Any) -> list[Any]:
        """The rank's artists that ``figure`` (``fig`` or ``zoom_fig``) shows, in drawing order, with the zoom
        panel's spines last (its boxes cover them)."""
        if figure is not self.fig and figure is not self.zoom_fig:
            raise ValueError("OffsetsFigure.dynamic_on: the figure is neither this drawing's fig nor its zoom_fig")
        spines = list(self.zoom.spines.values()) if self.zoom is not None else []
        if self.zoom_fig is self.fig:
            return [*self.dynamic, *spines]
        if figure is self.zoom_fig:
            return [a for a in self.dynamic if a.axes is self.zoom] + spines
        return [a for a in self.dynamic if a.axes is not self.zoom]


def _edge_labels(ax: Any, axis: int, values: Sequence[int]) -> list[Any]:
    """Labels and tick marks at ``values`` along the right (rows) or bottom (columns) of the zoom panel."""
    from matplotlib.lines import Line2D
    from matplotlib.transforms import blended_transform_factory, offset_copy

    fig = ax.figure
    out: list[Any] = []
    if axis == 0:
        base = blended_transform_factory(ax.transAxes, ax.transData)
        place = offset_copy(base, fig=fig, x=4, y=0, units="points")
        for v in values:
            out.append(ax.add_artist(Line2D([1.0], [v], transform=base, marker=1, markersize=3.5, color="black",
                                            clip_on=False)))
            out.append(ax.text(1.0, v, f"{v:,}", transform=place, ha="left", va="center",
                               fontsize=_style.MIN_PT, clip_on=False))
    else:
        base = blended_transform_factory(ax.transData, ax.transAxes)
        place = offset_copy(base, fig=fig, x=0, y=-6, units="points")
        for v in values:
            out.append(ax.add_artist(Line2D([v], [0.0], transform=base, marker=3, markersize=3.5, color="black",
                                            clip_on=False)))
            out.append(ax.text(v, 0.0, f"{v:,}", transform=place, ha="center", va="top",
                               fontsize=_style.MIN_PT, clip_on=False))
    return out


def _laid_out(fig: Any) -> None:
    """Run the figure's layout engine now, so that axes positions are final (labels are fitted to them)."""
    engine = fig.get_layout_engine()
    if engine is not None and hasattr(engine, "execute"):
        engine.execute(fig)


def _axes_size_pt(ax: Any) -> tuple[float, float]:
    """The axes' size in points, as last laid out."""
    fig = ax.figure
    box = ax.get_position()
    return box.width * fig.get_figwidth() * 72, box.height * fig.get_figheight() * 72


def _fit(text: str, room_pt: float, size: float) -> str:
    """``text`` shortened in the middle until it is at most ``room_pt`` wide at ``size``."""
    limit = len(text)
    while limit > 12 and _style.text_width_pt(_style.ellipsize(text, limit), size) > room_pt:
        limit -= max(1, limit // 10)
    return _style.ellipsize(text, limit)


def _ticker() -> Any:
    import matplotlib.ticker

    return matplotlib.ticker


def _integer_ticks(ax: Any, nbins: int | str = "auto") -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(nbins=nbins, integer=True, min_n_ticks=2))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{round(v):,}"))
    ax.tick_params(labelsize=_style.MIN_PT)


def _draw_padding(ax: Any, view: ShardView) -> None:
    from matplotlib.patches import Rectangle

    if view.padding is None:
        return
    rows, cols = view.shape
    pr, pc = view.padding
    if pr is not None:
        ax.add_patch(Rectangle((0, pr), cols, rows - pr, fill=False, hatch="///", edgecolor="0.3", lw=0,
                               gid="padding"))
        ax.axhline(pr, color="0.2", lw=1.2)
    if pc is not None:
        ax.add_patch(Rectangle((pc, 0), cols - pc, rows, fill=False, hatch="///", edgecolor="0.3", lw=0,
                               gid="padding"))
        ax.axvline(pc, color="0.2", lw=1.2)


def _draw_keys(ax: Any, view: ShardView, size_pt: tuple[float, float]) -> str:
    """Dashed lines at HF key boundaries and key names on a side axis (as many as fit); returns a note or ''."""
    from matplotlib.collections import LineCollection

    rows, cols = view.shape
    extra: list[tuple[float, str]] = []
    if view.padding is not None and view.padding[0] is not None:
        pr = view.padding[0]
        extra.append((pr + (rows - pr) / 2, "FP8 padding"))
    if view.key_axis is None:
        if extra:
            _side_labels(ax, 0, extra, size_pt)
        return ""
    bounds = view.key_bounds
    step = max(1, -(-len(bounds) // 64))  # at most 64 boundary lines: more would hide the boxes
    segs = []
    for start, _ in bounds[step::step]:
        segs.append([(0, start), (cols, start)] if view.key_axis == 0 else [(start, 0), (start, rows)])
    lines = LineCollection(segs, colors="black", linestyles="dashed", linewidths=0.8 if step == 1 else 0.5)
    lines.set_gid("key-bounds")
    ax.add_collection(lines)
    size = (bounds[1][0] - bounds[0][0]) if len(bounds) > 1 else (rows if view.key_axis == 0 else cols)
    labels = [(start + size / 2, label) for start, label in bounds]
    _side_labels(ax, view.key_axis, labels + (extra if view.key_axis == 0 else []), size_pt)
    if view.key_axis == 1 and extra:
        _side_labels(ax, 0, extra, size_pt)
    return f"{len(bounds)} HF keys; every {step}th key boundary drawn" if step > 1 else ""


def _side_labels(ax: Any, axis: int, labels: list[tuple[float, str]], size_pt: tuple[float, float]) -> None:
    """Names along the right (rows) or top (columns) of ``ax``, thinned so that none touch."""
    length = size_pt[1] if axis == 0 else size_pt[0]
    lo, hi = sorted(ax.get_ylim() if axis == 0 else ax.get_xlim())
    per_unit = length / ((hi - lo) or 1)
    if axis == 0:
        def need(_: str) -> float:
            return 1.6 * _style.MIN_PT
    else:
        def need(text: str) -> float:
            return _style.text_width_pt(text) + 8
    ordered = sorted(labels)
    every = 1
    while every < len(ordered):
        shown = ordered[::every]
        if all((b[0] - a[0]) * per_unit >= (need(a[1]) + need(b[1])) / 2 * 1.15 for a, b in itertools.pairwise(shown)):
            break
        every += 1
    shown = ordered[::every]
    side = ax.secondary_yaxis("right") if axis == 0 else ax.secondary_xaxis("top")
    side.set_label("key names")
    (side.set_yticks if axis == 0 else side.set_xticks)([p for p, _ in shown], [t for _, t in shown])
    side.tick_params(labelsize=_style.MIN_PT, length=2)
