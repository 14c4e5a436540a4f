"""Notebook HTML reprs: a compact table and a small inline SVG picture for every workbench object.

``render_html(obj)`` is what each class's ``_repr_html_`` calls: this module registers it with
``workbench.display`` for every class it draws when it is imported (``import workbench`` does). Output is
self-contained (inline styles, no scripts, no CDN), bounded in size (pictures are rasterized to at most a few
thousand rectangles, tables elide past a few dozen rows, repeated layers are grouped) and never raises: on an
error it warns and shows the escaped ``repr``.
"""

from __future__ import annotations

import html
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from workbench.display import register_html
from workbench.io.hf.load import LoadReport
from workbench.io.hf.save_session import SaveResult
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec
from workbench.plan.load_plan import HFLoadPlan
from workbench.plan.save_plan import HFSavePlan
from workbench.plan.schedule import UnshardSchedule

__all__ = ["render_html"]

_MAX_ROWS = 24
_BOX = "font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; line-height: 1.35"
# no fixed text colours: text follows the notebook theme (light or dark); secondary text is dimmed by opacity
_DIM = "opacity: 0.72"
_TH = ("text-align: left; white-space: nowrap; padding: 1px 8px 1px 0; opacity: 0.72; font-weight: normal; "
       "vertical-align: top")
_TD = "text-align: left; white-space: nowrap; padding: 1px 8px 1px 0; vertical-align: top"


def render_html(obj: Any) -> str:
    """HTML of a workbench object (MeshSpec, LoadSpec, Layout, HFLoadPlan, HFSavePlan, UnshardSchedule,
    SaveResult, LoadReport); the escaped repr, with a warning, if rendering fails."""
    try:
        renderer = _renderer(obj)
        body = renderer(obj)
    except Exception as exc:
        warnings.warn(f"workbench could not render {type(obj).__name__} as HTML ({type(exc).__name__}: {exc}); "
                      "showing its repr", RuntimeWarning, stacklevel=2)
        return f'<pre style="{_BOX}">{_e(repr(obj))}</pre>'
    return f'<div class="workbench-repr" style="{_BOX}">{body}</div>'


def _renderer(obj: Any) -> Callable[[Any], str]:
    for cls in type(obj).__mro__:
        if cls in _RENDERERS:
            return _RENDERERS[cls]
    raise TypeError(f"no HTML renderer for {type(obj).__name__}")


# -- building blocks ------------------------------------------------------------------------------------
def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _bytes(n: float) -> str:
    from workbench.viz._style import format_bytes

    return format_bytes(n)


def _title(text: str) -> str:
    return f'<div style="font-weight: bold; margin-bottom: 2px">{_e(text)}</div>'


def _kv(rows: Iterable[tuple[str, Any]]) -> str:
    cells = "".join(f'<tr><th style="{_TH}">{_e(k)}</th><td style="{_TD}">{_e(v)}</td></tr>' for k, v in rows)
    return f'<table style="border-collapse: collapse; margin: 2px 0">{cells}</table>'


def _grid(header: Sequence[str], rows: Sequence[Sequence[Any]], total: int | None = None) -> str:
    head = "".join(f'<th style="{_TH}; border-bottom: 1px solid #ccc">{_e(h)}</th>' for h in header)
    shown = rows if len(rows) <= _MAX_ROWS else [*rows[: _MAX_ROWS - 4], None, *rows[-3:]]
    body = []
    hidden = (total or len(rows)) - (len(shown) - (1 if None in shown else 0))
    for row in shown:
        if row is None:
            body.append(f'<tr><td colspan="{len(header)}" style="{_TD}; {_DIM}">... {hidden} more</td></tr>')
            continue
        body.append("<tr>" + "".join(f'<td style="{_TD}">{_e(c)}</td>' for c in row) + "</tr>")
    return f'<table style="border-collapse: collapse; margin: 4px 0"><tr>{head}</tr>{"".join(body)}</table>'


def _side(table: str, picture: str) -> str:
    if not picture:
        return table
    return (f'<div style="display: flex; gap: 16px; align-items: flex-start; flex-wrap: wrap">'
            f"<div>{table}</div><div>{picture}</div></div>")


def _hex(rgba: Sequence[float]) -> str:
    return "#" + "".join(f"{round(255 * c):02x}" for c in rgba[:3])


def _rgb(hex_colour: str) -> tuple[float, float, float]:
    return tuple(int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5))  # type: ignore[return-value]


def _rank_hex(mesh: Any) -> Callable[[int], str]:
    """Each rank's colour, the same as in every figure (``workbench.viz.colours``); -1 (nobody) light grey."""
    from workbench.viz.colours import rank_colours

    return rank_colours(mesh).hex


def _amount_rgba(value: float) -> tuple[float, ...]:
    """Fill of a held amount (``value`` a fraction of the largest), the figures' map; grey for nothing."""
    from workbench.viz._style import amount_cmap

    return (0.85, 0.85, 0.85, 1.0) if value <= 0 else amount_cmap()(min(value, 1.0))


def _amount_hex(value: float) -> str:
    return _hex(_amount_rgba(value))


def _text_hex(fill: Sequence[float]) -> str:
    from workbench.viz._style import text_on

    return "#000000" if text_on(tuple(fill)) == "black" else "#ffffff"


def _svg(width: int, height: int, body: str, label: str = "") -> str:
    caption = f'<div style="{_DIM}; font-size: 11px">{_e(label)}</div>' if label else ""
    return (f'{caption}<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" style="border: 1px solid #ddd">{body}</svg>')


def _raster_rects(raster: np.ndarray, cw: float, ch: float, colour: Callable[[int], str]) -> str:
    """Rectangles of a 2-D int raster: runs of equal values per row, identical consecutive rows merged."""
    out = []
    rows, _ = raster.shape
    i = 0
    while i < rows:
        j = i + 1
        while j < rows and np.array_equal(raster[j], raster[i]):
            j += 1
        row = raster[i]
        start = 0
        for k in range(1, len(row) + 1):
            if k == len(row) or row[k] != row[start]:
                out.append(f'<rect x="{start * cw:.1f}" y="{i * ch:.1f}" width="{(k - start) * cw:.1f}" '
                           f'height="{(j - i) * ch:.1f}" fill="{colour(int(row[start]))}"/>')
                start = k
        i = j
    return "".join(out)


# -- mesh -----------------------------------------------------------------------------------------------
def _mesh_picture(mesh: Any, values: np.ndarray | None = None, highlight: Sequence[int] = ()) -> str:
    """The mesh as a grid of ranks (leading dims as side-by-side panels); coloured by rank or by ``values``."""
    shape = mesh.shape
    rows, cols = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[0])
    panels = math.prod(shape[:-2]) if len(shape) > 2 else 1
    shown = min(panels, 8)
    cell = max(3, min(26, 320 // max(cols * shown, 1), 180 // max(rows, 1)))
    ranks = np.array(mesh.all_ranks()).reshape(panels, rows, cols)
    colour = _rank_hex(mesh)
    top = float(values.max()) if values is not None and values.size and values.max() > 0 else 1.0
    flat_values = values.reshape(panels, rows, cols) if values is not None else None
    parts = []
    for p in range(shown):
        x0 = p * (cols * cell + 8)
        raster = ranks[p] if flat_values is None else np.round(flat_values[p] / top * 1000).astype(np.int64)
        fill = colour if flat_values is None else (lambda v: _amount_hex(v / 1000))
        parts.append(f'<g transform="translate({x0},0)">{_raster_rects(raster, cell, cell, fill)}</g>')
        if cell >= 24 and rows * cols <= 64:  # rank numbers at 11 px, in a colour that reads on the fill
            for (i, j), r in np.ndenumerate(ranks[p]):
                back = colour(int(r)) if flat_values is None else _amount_hex(flat_values[p][i, j] / top)
                parts.append(f'<text x="{x0 + j * cell + cell / 2:.1f}" y="{i * cell + cell * 0.62:.1f}" '
                             f'font-size="11" text-anchor="middle" fill="{_text_hex(_rgb(back))}">{r}</text>')
    marked = set(highlight)
    for p in range(shown):
        for (i, j), r in np.ndenumerate(ranks[p]):
            if int(r) in marked:
                parts.append(f'<rect x="{p * (cols * cell + 8) + j * cell}" y="{i * cell}" width="{cell}" '
                             f'height="{cell}" fill="none" stroke="black" stroke-width="2"/>')
    width = shown * (cols * cell + 8)
    from workbench.viz.colours import rank_colours

    label = f"{' x '.join(mesh.dim_names)}" + (f" ({shown} of {panels} panels)" if shown < panels else "")
    if values is None:
        label += f"; colours: {rank_colours(mesh).describe()}"
    return _svg(width, rows * cell, "".join(parts), label)


def _mesh(mesh: Any) -> str:
    rows = [(name, size) for name, size in zip(mesh.dim_names, mesh.shape)]
    table = _title(f"MeshSpec: {mesh.size} ranks") + _grid(("mesh dim", "size"), rows)
    if mesh.ranks is not None:
        table += _kv([("ranks", "custom rank array")])
    return _side(table, _mesh_picture(mesh))


# -- spec -----------------------------------------------------------------------------------------------
def _spec_picture(spec: Any, width: int = 240, height: int = 120) -> str:
    from workbench.viz.views import shard_view

    if not spec.global_shape:  # a scalar (0-d): nothing to draw (the table says its shape)
        return ""
    view = shard_view(spec)
    rows, cols = view.shape
    if not rows or not cols:  # a 0-size tensor: no element to draw (the table says its shape)
        return ""
    h = height if view.dims[0] is not None else 24
    ph, pw = min(h, rows), min(width, cols)
    ys = ((np.arange(ph) + 0.5) * rows / ph).astype(np.int64)
    xs = ((np.arange(pw) + 0.5) * cols / pw).astype(np.int64)
    ri = np.searchsorted(view.row_edges, ys, side="right") - 1
    ci = np.searchsorted(view.col_edges, xs, side="right") - 1
    raster = view.cell_owners[np.ix_(ri, ci)]
    body = _raster_rects(raster, width / pw, h / ph, _rank_hex(spec.mesh))
    if view.key_axis is not None and len(view.key_bounds) <= 64:
        for start, _ in view.key_bounds[1:]:
            if view.key_axis == 0:
                y = start / rows * h
                body += f'<line x1="0" x2="{width}" y1="{y:.1f}" y2="{y:.1f}" stroke="black" stroke-dasharray="3,2"/>'
            else:
                x = start / cols * width
                body += f'<line y1="0" y2="{h}" x1="{x:.1f}" x2="{x:.1f}" stroke="black" stroke-dasharray="3,2"/>'
    if view.padding is not None and view.padding[0] is not None:  # tail padding along the rows
        y = view.padding[0] / rows * h
        body += (f'<rect x="0" y="{y:.1f}" width="{width}" height="{h - y:.1f}" fill="#999" fill-opacity="0.5"/>')
    if view.padding is not None and view.padding[1] is not None:  # and along the columns
        x = view.padding[1] / cols * width
        body += (f'<rect x="{x:.1f}" y="0" width="{width - x:.1f}" height="{h}" fill="#999" fill-opacity="0.5"/>')
    from workbench.viz.colours import rank_colours

    notes = f"owner of each element by rank colour ({rank_colours(spec.mesh).describe()})"
    if view.padding is not None:
        notes += ", grey: tail padding"
    if view.replicated:
        notes += f", x{int(view.cell_holders.max())} replicas"
    if view.key_axis is not None:
        notes += ", dashed: HF key bounds"
    return _svg(width, h, body, notes)


def _spec(spec: Any) -> str:
    from workbench.viz.views import format_ranks

    empty = [r for r in spec.mesh.all_ranks() if 0 in spec.local_shape(r)]
    keys = spec.hf_keys
    rows = [
        ("hf keys", keys[0] if len(keys) == 1 else f"{len(keys)}: {keys[0]} ... {keys[-1]}"),
        ("global shape", spec.global_shape),
    ]
    if spec.origin_shape:
        rows.append(("origin shape", f"{spec.origin_shape} (tail padding)"))
    if spec.fused_dim is not None:
        rows.append(("fused dim", f"{spec.fused_dim} ({spec.key_size} per key)"))
    rows += [("shards", spec.describe_shards()), ("mesh", repr(spec.mesh))]
    sizes = {spec.local_shape(r) for r in spec.mesh.all_ranks()}
    rows.append(("local shapes", ", ".join(map(str, sorted(sizes)[:4])) + (" ..." if len(sizes) > 4 else "")))
    if empty:
        rows.append(("empty on", f"{len(empty)} rank(s): {format_ranks(empty)}"))
    return _side(_title(f"LoadSpec {spec.name}") + _kv(rows), _spec_picture(spec))


# -- layout ---------------------------------------------------------------------------------------------
def _layout_bytes_per_rank(layout: Any) -> np.ndarray:
    """Bytes every rank holds of the whole layout (each distinct geometry computed once)."""
    import torch

    mesh = layout.mesh
    per_geometry: dict[tuple, np.ndarray] = {}
    total = np.zeros(mesh.size, dtype=np.float64)
    for name, spec in layout.specs.items():
        geometry = (spec.global_shape, spec.shards)
        numel = per_geometry.get(geometry)
        if numel is None:
            numel = np.array([math.prod(spec.local_shape(r)) for r in mesh.all_ranks()], dtype=np.float64)
            per_geometry[geometry] = numel
        total += numel * getattr(torch, layout.dtypes.get(name, "float32")).itemsize
    return total


def _layout(layout: Any) -> str:
    import torch

    from workbench.name_patterns import group_by_pattern

    def geometry(name: str) -> tuple:
        spec = layout.specs[name]
        return spec.global_shape, spec.describe_shards(), layout.dtypes.get(name, "float32")

    groups = group_by_pattern(list(layout.specs), key=geometry)
    rows = []
    total = 0
    for group in groups:
        for part in (group, *group.exceptions):
            names = part.names
            shape, shards, dtype = part.value
            size = sum(math.prod(layout.specs[n].global_shape) for n in names) * getattr(torch, dtype).itemsize
            total += size
            keys = sum(len(layout.specs[n].hf_keys) for n in names)
            rows.append((part.pattern, len(names), keys, shape, shards, dtype, _bytes(size)))
    per_rank = _layout_bytes_per_rank(layout)
    table = _title(f"Layout {layout.name}") + _kv([
        ("mesh", repr(layout.mesh)),
        ("parameters", f"{len(layout)} in {len(rows)} pattern(s)"),
        ("hf keys", len(layout.hf_keys)),
        ("total", _bytes(total)),
        ("per rank", f"{_bytes(per_rank.min())} .. {_bytes(per_rank.max())}"),
    ]) + _grid(("parameter pattern", "count", "keys", "global shape", "shards", "dtype", "bytes"), rows)
    values = per_rank.reshape(layout.mesh.shape)
    return _side(table, _mesh_picture(layout.mesh, values) +
                 f'<div style="{_DIM}; font-size: 11px">bytes held per rank (light: little, dark: much; '
                 f"{_bytes(per_rank.min())} .. {_bytes(per_rank.max())})</div>")


# -- plans ----------------------------------------------------------------------------------------------
def _load_plan(plan: Any) -> str:
    reads = [(r.hf_key, _slices(r.key_offset, r.sizes), _slices(r.local_offset, r.sizes)) for r in plan.reads]
    table = _title(f"HFLoadPlan {plan.name} rank {plan.rank}") + _kv([
        ("local shape", plan.target_shape),
        ("key shape", plan.key_shape),
        ("reads", f"{len(plan.reads)} ({plan.numel_read} elements)"),
        ("zero fill", "yes (tail padding)" if plan.zero_fill else "no"),
    ]) + _grid(("hf key", "key slice", "local slice"), reads)
    return _side(table, _local_picture(plan))


def _local_picture(plan: Any, width: int = 200, height: int = 100) -> str:
    shape = plan.target_shape
    if not plan.reads or not shape or 0 in shape:
        return ""
    # the two dims drawn: those the reads cut (dim 0 and the last cut one), so that no read hides another
    cut = [d for d in range(len(shape)) if any(r.local_offset[d] or r.sizes[d] != shape[d] for r in plan.reads)]
    if len(shape) < 2:
        row_dim, col_dim = None, 0
    elif len(cut) >= 2:
        row_dim, col_dim = cut[0], cut[-1]
    else:
        row_dim, col_dim = 0, cut[0] if cut and cut[0] > 0 else 1
    rows, cols = (shape[row_dim] if row_dim is not None else 1), shape[col_dim]
    keys = {k: i for i, k in enumerate(plan.hf_keys)}
    from workbench.viz._style import lane_colours

    palette = lane_colours(len(keys))
    body = f'<rect x="0" y="0" width="{width}" height="{height}" fill="#bbbbbb"/>'
    for r in plan.reads[:400]:
        y0, h = (r.local_offset[row_dim], r.sizes[row_dim]) if row_dim is not None else (0, 1)
        x0, w = r.local_offset[col_dim], r.sizes[col_dim]
        body += (f'<rect x="{x0 / cols * width:.1f}" y="{y0 / rows * height:.1f}" width="{w / cols * width:.1f}" '
                 f'height="{h / rows * height:.1f}" fill="{_hex(palette[keys[r.hf_key]])}" stroke="white"/>')
    drawn = f"dim {col_dim}" if row_dim is None else f"dims {row_dim} (down) and {col_dim} (across)"
    hidden = [d for d in cut if d not in (row_dim, col_dim)]
    note = f"local tensor, {drawn}: colour per HF key, grey = zeroed padding"
    if hidden:
        note += f"; cut along dims {', '.join(map(str, hidden))} too, not drawn (reads overlap here)"
    if len(plan.reads) > 400:
        note += f"; the first 400 of {len(plan.reads)} reads"
    return _svg(width, height, body, note)


def _slices(offset: Sequence[int], sizes: Sequence[int]) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offset, sizes)) + "]"


def _save_plan(plan: Any) -> str:
    rows = [(n, "gather", str(s.descriptor), s.world, s.shape_before) for n, s in enumerate(plan.pending, 1)]
    rows += [("-", "keep", str(s.descriptor), s.world, s.shape_before) for s in plan.steps if s.preserved]
    table = _title(f"HFSavePlan {plan.name} rank {plan.rank} [{plan.policy}]") + _kv([
        ("local shape", plan.local_shape),
        ("runtime output", plan.runtime_output_shape),
        ("output", plan.output_shape),
        ("hf keys", plan.hf_keys[0] if len(plan.hf_keys) == 1 else f"{len(plan.hf_keys)} keys"),
        ("gather dtype", str(plan.gather_dtype).removeprefix("torch.")),
    ]) + _grid(("step", "action", "shard", "W", "shape after undo"), rows)
    stages = [("local", plan.local_shape)] + [(str(s.descriptor), s.shape_before) for s in plan.pending]
    stages.append(("output", plan.output_shape))
    top = max(math.prod(s) for _, s in stages) or 1
    body = []
    for i, (label, shape) in enumerate(stages):
        w = max(2.0, 180 * math.prod(shape) / top)
        body.append(f'<rect x="0" y="{i * 18 + 2}" width="{w:.1f}" height="12" fill="#4c72b0"/>'
                    f'<text x="{w + 4:.1f}" y="{i * 18 + 12}" font-size="11" fill="currentColor">{_e(label)} '
                    f"{_e(shape)}</text>")
    return _side(table, _svg(330, len(stages) * 18 + 4, "".join(body), "elements after each step"))


def _schedule(schedule: Any) -> str:
    from workbench.viz.views import schedule_view

    view = schedule_view(schedule)
    budget = "unbounded" if schedule.budget_bytes is None else _bytes(schedule.budget_bytes)
    lanes: dict[int, list[int]] = {}
    for bar in view.bars:
        lanes.setdefault(bar.lane, []).append(bar.width)
    rows = [(view.lanes[k], len(v), _bytes(sum(v))) for k, v in lanes.items()]
    oversized = sum(c.oversized for c in schedule.calls)
    table = _title(f"UnshardSchedule rank {schedule.rank}") + _kv([
        ("waves / rounds / calls", f"{len(schedule.waves)} / {len(schedule.rounds)} / {schedule.num_calls}"),
        ("budget", budget),
        ("predicted peak", _bytes(schedule.peak_bytes)),
        ("receives", _bytes(schedule.bytes_moved)),
        *([("oversized calls", oversized)] if oversized else []),
    ]) + _grid(("mesh dim, dtype", "calls", "gathers"), rows)
    return _side(table, _schedule_picture(view))


def _schedule_picture(view: Any, width: int = 320) -> str:
    from workbench.viz._style import lane_colours

    total = max(view.total_bytes, 1)
    lane_h = 10
    top_h = max(1, len(view.lanes)) * lane_h
    mem_h = 50
    palette = lane_colours(len(view.lanes))
    # one rectangle per (lane, pixel column) at most: bounded whatever the number of calls
    raster = np.full((max(1, len(view.lanes)), width), -1, dtype=np.int64)
    for bar in view.bars:
        x0 = int(bar.x / total * width)
        x1 = max(x0 + 1, int((bar.x + bar.width) / total * width))
        raster[bar.lane, x0:x1] = bar.lane if not bar.oversized else 1000

    def colour(v: int) -> str:
        return "#ffffff" if v < 0 else "#d62728" if v == 1000 else _hex(palette[v])

    body = _raster_rects(raster, 1, lane_h, colour)
    top = max(max(view.water_y, default=1), view.budget_bytes or 0, 1)
    step = max(1, len(view.water_x) // 600)
    points = " ".join(
        f"{x / total * width:.1f},{top_h + 4 + mem_h - y / top * mem_h:.1f}"
        for x, y in zip(view.water_x[::step], view.water_y[::step])
    )
    body += f'<polyline points="{points}" fill="none" stroke="#1f77b4" stroke-width="1"/>'
    if view.budget_bytes is not None:
        y = top_h + 4 + mem_h - view.budget_bytes / top * mem_h
        body += f'<line x1="0" x2="{width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#d62728"/>'
    return _svg(width, top_h + mem_h + 6, body, "calls by (mesh dim, dtype), width = bytes; memory vs budget (red)")


# -- results --------------------------------------------------------------------------------------------
def _save_result(result: Any) -> str:
    rows = [
        ("path", result.path),
        ("files", f"{len(result.files)}: {', '.join(result.files[:3])}{' ...' if len(result.files) > 3 else ''}"),
        ("bytes written", _bytes(result.bytes_written)),
        ("gather calls", result.calls),
        ("seconds", f"{result.seconds:.3f}"),
        ("predicted peak", _bytes(result.predicted_peak_bytes)),
    ]
    extras = {  # fields newer SaveResults carry; shown when present and set
        "blocked_seconds": lambda v: f"{v:.3f}",
        "snapshot_bytes": _bytes,
        "peak_bytes": _bytes,
        "call_seconds": lambda v: f"{sum(v):.3f} s in {len(v)} calls",
        "timings": str,
    }
    for extra, show in extras.items():
        value = getattr(result, extra, None)
        if value:
            rows.append((extra.replace("_", " "), show(value)))
    rate = result.bytes_written / result.seconds if result.seconds else 0
    rows.append(("write rate", f"{_bytes(rate)}/s"))
    return _title(f"SaveResult rank {result.rank}") + _kv(rows)


def _load_report(report: Any) -> str:
    verdict = "ok" if report.ok else "PROBLEMS"
    rows = [
        ("path", report.path),
        ("parameters", report.parameters),
        ("bytes read / owned", f"{_bytes(report.bytes_read)} / {_bytes(report.bytes_owned)} "
                               f"({report.read_ratio:.3f}x)"),
        ("seconds", f"{report.seconds:.3f}"),
        ("verdict", verdict),
    ]
    for what in ("missing", "unexpected", "mismatched"):
        keys = getattr(report, what)
        if keys:
            rows.append((what, f"{len(keys)}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"))
    ratio = min(report.read_ratio, 2.0)
    bar = _svg(200, 16, f'<rect x="0" y="3" width="{ratio * 100:.1f}" height="10" '
                        f'fill="{"#2ca02c" if report.read_ratio <= 1.0001 else "#ff7f0e"}"/>'
                        '<line x1="100" x2="100" y1="0" y2="16" stroke="black"/>', "bytes read / owned (line: 1.0)")
    return _side(_title(f"LoadReport rank {report.rank}: {verdict}") + _kv(rows), bar)


_RENDERERS: dict[type, Callable[[Any], str]] = {
    MeshSpec: _mesh,
    LoadSpec: _spec,
    Layout: _layout,
    HFLoadPlan: _load_plan,
    HFSavePlan: _save_plan,
    UnshardSchedule: _schedule,
    SaveResult: _save_result,
    LoadReport: _load_report,
}
for _cls in _RENDERERS:
    register_html(_cls, render_html)  # every _repr_html_ of these classes comes here (workbench.display)
