"""Matplotlib figures: shard offsets of a tensor, the device mesh, and the unshard schedule with its memory.

Every function returns a ``matplotlib.figure.Figure`` built without pyplot (headless-safe, nothing is shown
or kept alive by a global figure manager). Large tensors are drawn by runs (one rectangle per box a rank
holds), never element by element; the data comes from ``workbench.viz.views``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshDimRef, MeshSpec
from workbench.viz import _style
from workbench.viz.views import (
    MeshView,
    ShardView,
    format_ranks,
    mesh_view,
    resolve_spec,
    schedule_view,
    shard_view,
)

__all__ = ["measured_of", "plot_mesh", "plot_schedule", "plot_shard_offsets"]

_LABEL_LIMIT = 48  # boxes / cells labelled with their rank up to this many


def plot_shard_offsets(
    spec_or_layout: LoadSpec | Layout,
    key: str | None = None,
    rank: int | None = None,
    dims: Sequence[int] = (0, 1),
    index: int | Sequence[int] | Mapping[int, int] | None = None,
    *,
    figsize: tuple[float, float] = (7.0, 4.8),
) -> Any:
    """Draw the global tensor (or one HF key of a fused tensor) coloured by the rank that holds each part.

    Interleaved runs show as stripes, HF key boundaries as dashed lines with the key names, FP8 tail padding
    hatched, replicas with an ``xK`` mark (K ranks hold it), ranks holding nothing listed under the plot.

    Args:
        spec_or_layout: a LoadSpec, or a Layout (then ``key`` picks a parameter or an HF key; default: the
            largest parameter).
        key: a parameter name or an HF key; an HF key of a fused tensor draws only that key.
        rank: outline this rank's boxes (others are faded).
        dims: the tensor dims drawn as rows and columns (N-D tensors).
        index: position on the undrawn dims (e.g. the expert of a 3-D tensor); see ``views.shard_view``.

    Returns:
        The Figure; ``fig.owners`` is an int array of the drawn view, the lowest rank holding each element
        (-1: none). Views over 2**20 elements give it per cell of the grid ``fig.owner_edges`` (row edges, col
        edges) instead, each cell held uniformly. ``fig.view`` is the full ``ShardView``.
    """
    spec, hf_key = resolve_spec(spec_or_layout, key)
    view = shard_view(spec, hf_key=hf_key, dims=dims, index=index)
    if rank is not None:
        spec.mesh.coordinate(rank)  # a clear error for a rank outside the mesh
    fig = _style.new_figure(figsize)
    ax = fig.add_subplot(1, 1, 1)
    _draw_view(ax, view, spec, rank)
    fig.owners = view.owners()
    fig.owner_edges = (view.row_edges, view.col_edges)
    fig.view = view
    fig.tight_layout()
    return fig


def _draw_view(ax: Any, view: ShardView, spec: LoadSpec, rank: int | None) -> None:
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    colour = _style.rank_colours(spec.mesh.size)
    rows, cols = view.shape
    mine = [b for b in view.boxes if b.rank == rank]
    patches = [Rectangle((b.col0, b.row0), b.col1 - b.col0, b.row1 - b.row0) for b in reversed(view.boxes)]
    faces = [colour(b.rank) for b in reversed(view.boxes)]
    edge = 0.6 if len(patches) <= 256 else 0.0
    boxes = PatchCollection(patches, facecolors=faces, edgecolors="white", linewidths=edge,
                            alpha=0.45 if rank is not None else 1.0)
    boxes.set_gid("boxes")
    ax.add_collection(boxes)
    for b in mine:
        ax.add_patch(Rectangle((b.col0, b.row0), b.col1 - b.col0, b.row1 - b.row0, facecolor=colour(b.rank),
                               edgecolor="black", linewidth=2.0, gid=f"rank-{rank}"))
    holders = view.cell_holders
    cells = holders.shape[0] * holders.shape[1]
    if cells <= _LABEL_LIMIT:
        for i in range(holders.shape[0]):
            for j in range(holders.shape[1]):
                owner = int(view.cell_owners[i, j])
                if owner < 0:
                    continue
                text = f"r{owner}" + (f" x{holders[i, j]}" if holders[i, j] > 1 else "")
                x = (view.col_edges[j] + view.col_edges[j + 1]) / 2
                y = (view.row_edges[i] + view.row_edges[i + 1]) / 2
                faded = rank is not None and owner != rank
                ax.text(x, y, text, ha="center", va="center", fontsize=7,
                        color="black" if faded else _style.text_on(colour(owner)))
    elif view.replicated:
        top = int(holders.max())
        ax.text(0.99, 0.01, f"replicated: up to x{top} ranks hold an element", transform=ax.transAxes,
                ha="right", va="bottom", fontsize=7, bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
    _draw_keys(ax, view)
    if view.padding is not None:
        pr, pc = view.padding
        if pr is not None:
            ax.add_patch(Rectangle((0, pr), cols, rows - pr, fill=False, hatch="///", edgecolor="0.3", lw=0,
                                   gid="padding"))
            ax.axhline(pr, color="0.2", lw=1.2)
            ax.text(cols, pr, " FP8 padding", va="top", ha="left", fontsize=7, clip_on=False)
        if pc is not None:
            ax.add_patch(Rectangle((pc, 0), cols - pc, rows, fill=False, hatch="///", edgecolor="0.3", lw=0,
                                   gid="padding"))
            ax.axvline(pc, color="0.2", lw=1.2)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_aspect("auto")
    ax.ticklabel_format(style="plain", useOffset=False)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    d0, d1 = view.dims
    ax.set_xlabel(f"dim {d1}" + (f" (global +{view.origin[1]})" if view.origin[1] else ""))
    ax.set_ylabel("" if d0 is None else f"dim {d0}" + (f" (global +{view.origin[0]})" if view.origin[0] else ""))
    if d0 is None:
        ax.set_yticks([])
    fixed = [f"dim {d}={i}" for d, i in enumerate(view.index) if i is not None]
    width = int(ax.figure.get_figwidth() * 12)  # characters that fit at this font size
    title = _style.ellipsize(view.hf_key or view.name, width)
    detail = f"{spec.global_shape}  {spec.describe_shards()}" + ("  [" + ", ".join(fixed) + "]" if fixed else "")
    ax.set_title(f"{title}\n{_style.ellipsize(detail, width)}", fontsize=8)
    notes = []
    if rank is not None:
        coord = ", ".join(f"{n}={c}" for n, c in zip(spec.mesh.dim_names, spec.mesh.coordinate(rank)))
        held = " ".join(f"[{b.row0}:{b.row1}, {b.col0}:{b.col1}]" for b in mine[:4]) or "nothing here"
        notes.append(f"rank {rank} ({coord}) holds {held}" + (" ..." if len(mine) > 4 else ""))
    if view.empty_ranks:
        notes.append(f"empty shards on {len(view.empty_ranks)} rank(s): {format_ranks(view.empty_ranks)}")
    uneven = {s for r, s in view.local_sizes.items() if r not in view.empty_ranks}
    if len(uneven) > 1:
        notes.append("uneven local sizes " + ", ".join(f"{a}x{b}" for a, b in sorted(uneven)[:5]))
    if notes:
        ax.text(0.0, -0.14, "\n".join(notes), transform=ax.transAxes, fontsize=7, va="top", ha="left")
    if spec.mesh.size > _style.DISCRETE_LIMIT:
        _style.rank_colourbar(ax, spec.mesh.size)


def _draw_keys(ax: Any, view: ShardView) -> None:
    """Dashed lines at HF key boundaries, with short key names when few enough to read."""
    if view.key_axis is None:
        return
    from matplotlib.collections import LineCollection

    rows, cols = view.shape
    bounds = view.key_bounds
    step = max(1, -(-len(bounds) // 64))  # at most 64 boundary lines: more would hide the boxes
    segs = []
    for start, _ in bounds[step::step]:
        segs.append([(0, start), (cols, start)] if view.key_axis == 0 else [(start, 0), (start, rows)])
    lines = LineCollection(segs, colors="black", linestyles="dashed", linewidths=0.8 if step == 1 else 0.5)
    lines.set_gid("key-bounds")
    ax.add_collection(lines)
    if step > 1:
        ax.text(1.0, -0.1, f"{len(bounds)} HF keys; every {step}th boundary drawn", transform=ax.transAxes,
                fontsize=6, va="top", ha="right")
    every = max(1, len(bounds) // 16)
    size = (bounds[1][0] - bounds[0][0]) if len(bounds) > 1 else (rows if view.key_axis == 0 else cols)
    for start, label in bounds[::every]:
        if view.key_axis == 0:
            ax.text(cols, start + size / 2, f" {label}", va="center", ha="left", fontsize=6, clip_on=False)
        else:
            ax.text(start + size / 2, 0, label, va="bottom", ha="center", fontsize=6, rotation=30, clip_on=False)


def plot_mesh(
    mesh: MeshSpec | Layout,
    spec: LoadSpec | str | None = None,
    highlight: int | tuple[int, MeshDimRef] | None = None,
    *,
    figsize: tuple[float, float] | None = None,
) -> Any:
    """Draw the device mesh as a grid of ranks (N-D meshes as small multiples over the leading mesh dims).

    Each rank is labelled with its number and what it holds of ``spec`` (its global ranges on every cut dim),
    and coloured by how many elements it holds (grey: nothing). ``highlight`` outlines a rank, or with
    ``(rank, mesh_dim)`` the rank's group along that mesh dim (a tuple of dims for a flattened group).

    Returns:
        The Figure; ``fig.held`` (elements held per rank, in mesh shape), ``fig.highlighted`` (ranks outlined).
    """
    if isinstance(mesh, Layout):
        layout = mesh
        mesh = layout.mesh
        if isinstance(spec, str):
            spec = resolve_spec(layout, spec)[0]
    view = mesh_view(mesh, spec if isinstance(spec, LoadSpec) else None, highlight)
    panels = _panels(mesh)
    ncols = min(len(panels), 4)
    nrows = -(-len(panels) // ncols)
    r, c = (mesh.shape[-2], mesh.shape[-1]) if mesh.ndim >= 2 else (1, mesh.shape[0])
    if figsize is None:
        w = min(11.0, max(3.0, ncols * (1.0 + 0.55 * c)))
        h = min(8.0, max(1.8, nrows * (0.6 + 0.45 * r)))
        figsize = (w, h + 0.6)
    fig = _style.new_figure(figsize)
    top = max(int(view.held.max()), 1)
    for n, (prefix, ranks) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, n + 1)
        # inches per rank cell (axes take about 70% x 60% of the figure); label only where text fits
        cell = (0.7 * figsize[0] / (ncols * ranks.shape[1]), 0.6 * figsize[1] / (nrows * ranks.shape[0]))
        labels = ranks.size <= 128 and cell[0] >= 0.45 and cell[1] >= (0.3 if spec is not None else 0.18)
        _draw_mesh_panel(ax, view, ranks, top, spec is not None, labels)
        if prefix:
            ax.set_title(", ".join(f"{k}={v}" for k, v in prefix), fontsize=8)
    width = int(figsize[0] * 13)
    heading = f"{mesh!r}" + (f"\nholding {_style.ellipsize(spec.name, width)}" if isinstance(spec, LoadSpec) else "")
    if view.highlight_text:
        heading += f"\nhighlight: {view.highlight_text}"
    fig.suptitle(heading, fontsize=8)
    fig.held = view.held
    fig.highlighted = view.highlighted
    fig.view = view
    fig.tight_layout()
    return fig


def _panels(mesh: MeshSpec) -> list[tuple[tuple[tuple[str, int], ...], np.ndarray]]:
    ranks = np.array(mesh.all_ranks()).reshape(mesh.shape)
    if mesh.ndim <= 2:
        return [((), ranks.reshape(1, -1) if mesh.ndim == 1 else ranks)]
    out = []
    for lead in np.ndindex(*mesh.shape[:-2]):
        prefix = tuple(zip(mesh.dim_names[:-2], (int(i) for i in lead)))
        out.append((prefix, ranks[lead]))
    return out


def _draw_mesh_panel(ax: Any, view: MeshView, ranks: np.ndarray, top: int, with_spec: bool, labels: bool) -> None:
    from matplotlib.patches import Rectangle

    mesh = view.mesh
    held = np.zeros(ranks.shape)
    for idx in np.ndindex(*ranks.shape):
        held[idx] = view.held[mesh.coordinate(int(ranks[idx]))]
    cmap = _style.heat_cmap()
    if with_spec:
        image = np.ma.masked_equal(held, 0)
        # the top of the scale stays orange so black labels read on every cell
        ax.pcolormesh(image / top, cmap=cmap, vmin=-0.1, vmax=1.6, edgecolors="white", linewidth=0.5)
        ax.set_facecolor("0.85")
    else:
        colour = _style.rank_colours(mesh.size)
        for idx in np.ndindex(*ranks.shape):
            ax.add_patch(Rectangle((idx[1], idx[0]), 1, 1, facecolor=colour(int(ranks[idx])), edgecolor="white"))
    rows, cols = ranks.shape
    outline = set(view.highlighted)
    for idx in np.ndindex(*ranks.shape):
        rank = int(ranks[idx])
        if rank in outline:
            ax.add_patch(Rectangle((idx[1], idx[0]), 1, 1, fill=False, edgecolor="black", linewidth=2.2,
                                   gid=f"highlight-{rank}"))
    if labels:
        for idx in np.ndindex(*ranks.shape):
            rank = int(ranks[idx])
            label = f"r{rank}"
            if with_spec:
                label += "\n" + _style.ellipsize(view.labels.get(rank, ""), 12)
            ax.text(idx[1] + 0.5, idx[0] + 0.5, label, ha="center", va="center", fontsize=6 if with_spec else 7)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    names = mesh.dim_names
    col_name = names[-1]
    row_name = names[-2] if mesh.ndim >= 2 else ""
    tick = max(1, cols // 16)
    ax.set_xticks(np.arange(0, cols, tick) + 0.5, [str(i) for i in range(0, cols, tick)], fontsize=6)
    ax.set_xlabel(col_name, fontsize=7)
    if row_name:
        tick = max(1, rows // 16)
        ax.set_yticks(np.arange(0, rows, tick) + 0.5, [str(i) for i in range(0, rows, tick)], fontsize=6)
        ax.set_ylabel(row_name, fontsize=7)
    else:
        ax.set_yticks([])


def measured_of(measured: Any) -> dict[str, Any]:
    """Normalize what ``plot_schedule`` overlays: a SaveResult, a mapping, or None.

    Understood fields: ``call_seconds`` (one per call), ``peak_bytes`` (measured peak), ``seconds`` (total).
    A SaveResult today carries ``seconds`` only (and ``predicted_peak_bytes``); per-call times come from
    ``workbench.viz.measure.TimedCommunicator``.
    """
    if measured is None:
        return {}
    if isinstance(measured, Mapping):
        data = dict(measured)
    else:
        data = {k: getattr(measured, k) for k in ("call_seconds", "peak_bytes", "seconds") if hasattr(measured, k)}
    return {k: v for k, v in data.items() if v is not None and not (isinstance(v, (tuple, list)) and not v)}


def plot_schedule(schedule: Any, measured: Any = None, *, figsize: tuple[float, float] = (9.0, 5.2)) -> Any:
    """Draw an UnshardSchedule as a timeline and its predicted memory waterline against the budget.

    Top: one bar per all-gather call, in execution order along a byte axis (width = the bytes the call gathers,
    ``GatherCall.bytes_out``), one lane per (mesh dim, dtype), waves separated by vertical lines, oversized
    tensors hatched red. Bottom: the modeled live memory through the save, with the budget and predicted peak.
    ``measured`` (a SaveResult or a mapping with ``call_seconds``, ``peak_bytes``, ``seconds``) adds measured
    per-call times and the measured peak.

    Returns:
        The Figure; each call's bar is a Rectangle with gid ``call-<index>``; ``fig.view`` is the
        ``ScheduleView``.
    """
    from matplotlib.patches import Rectangle

    view = schedule_view(schedule)
    meas = measured_of(measured)
    times = meas.get("call_seconds")
    fig = _style.new_figure(figsize)
    heights = [2.2, 1.6] + ([1.2] if times is not None else [])
    axes = fig.subplots(len(heights), 1, sharex=True, gridspec_kw={"height_ratios": heights})
    ax, mem = axes[0], axes[1]
    palette = _style.lane_colours(len(view.lanes))
    total = max(view.total_bytes, 1)
    for bar in view.bars:
        ax.add_patch(Rectangle(
            (bar.x, bar.lane + 0.1), bar.width, 0.8, facecolor="#d62728" if bar.oversized else palette[bar.lane],
            edgecolor="white", linewidth=0.4, hatch="xx" if bar.oversized else None, gid=f"call-{bar.call}",
        ))
    if len(view.bars) <= 40:
        for bar in view.bars:
            if bar.width / total > 0.03:
                ax.text(bar.x + bar.width / 2, bar.lane + 0.5, f"w{bar.wave}r{bar.round}", ha="center",
                        va="center", fontsize=6, color="white")
    for start in view.wave_starts[1:]:
        for a in axes:
            a.axvline(start, color="0.6", lw=0.5, ls=":")
    ax.set_ylim(len(view.lanes), 0)
    ax.set_yticks(np.arange(len(view.lanes)) + 0.5, view.lanes, fontsize=7)
    ax.set_xlim(0, total)
    budget = "unbounded" if view.budget_bytes is None else _style.format_bytes(view.budget_bytes)
    ax.set_title(
        f"rank {schedule.rank}: {len(schedule.waves)} wave(s), {len(schedule.rounds)} round(s), "
        f"{schedule.num_calls} call(s), gathers {_style.format_bytes(view.total_bytes)}; budget {budget}",
        fontsize=9,
    )
    mem.step(view.water_x, view.water_y, where="post", color="#1f77b4", lw=1.2, label="modeled live memory",
             gid="waterline")
    mem.axhline(view.peak_bytes, color="#1f77b4", ls="--", lw=0.8,
                label=f"predicted peak {_style.format_bytes(view.peak_bytes)}")
    if view.budget_bytes is not None:
        mem.axhline(view.budget_bytes, color="#d62728", lw=1.2, label=f"budget {budget}", gid="budget")
    if meas.get("peak_bytes") is not None:
        mem.axhline(meas["peak_bytes"], color="black", ls="-.", lw=1.0,
                    label=f"measured peak {_style.format_bytes(int(meas['peak_bytes']))}", gid="measured-peak")
    mem.set_ylabel("bytes", fontsize=7)
    mem.yaxis.set_major_formatter(_style.bytes_formatter())
    mem.legend(fontsize=6, loc="upper right")
    mem.set_ylim(bottom=0)
    last = axes[-1]
    if times is not None:
        tax = axes[2]
        times = list(times)
        for bar, sec in zip(view.bars, times):
            tax.add_patch(Rectangle((bar.x, 0), bar.width, sec, facecolor=palette[bar.lane], gid=f"time-{bar.call}"))
        tax.set_ylim(0, max(times, default=0) * 1.15 or 1)
        tax.set_ylabel("s / call", fontsize=7)
        note = f"measured: {len(times)} call(s), {sum(times):.3f} s in gathers"
        if meas.get("seconds") is not None:
            note += f", {meas['seconds']:.3f} s save"
        tax.set_title(note, fontsize=8)
        if len(times) != len(view.bars):
            tax.text(0.5, 0.5, f"{len(times)} measured calls vs {len(view.bars)} planned", transform=tax.transAxes,
                     ha="center", color="#d62728")
    elif meas.get("seconds") is not None:
        mem.set_title(f"measured save: {meas['seconds']:.3f} s", fontsize=8)
    last.set_xlabel("bytes gathered, in call order", fontsize=7)
    last.xaxis.set_major_formatter(_style.bytes_formatter())
    for a in axes:
        a.tick_params(labelsize=6)
    fig.view = view
    fig.tight_layout()
    return fig
