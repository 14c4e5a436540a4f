"""Plot data, computed by pure functions: what a figure draws, with no matplotlib involved.

``shard_view`` turns a LoadSpec into the boxes every rank holds of a 2-D view of the tensor (or of one HF key
of a fused tensor), plus the exact ownership of that view on the grid of box boundaries: a DeepSeek-V3 expert
tensor of 1,048,576 x 7,168 elements on 1,024 ranks is a 1,024 x 1 grid, never 7.5 billion cells.
``mesh_view`` gives what each rank of a mesh holds; ``schedule_view`` places an UnshardSchedule's calls on a
byte axis with the modeled memory waterline.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.errors import LayoutError
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshDimRef, MeshSpec, format_mesh_dim

__all__ = [
    "DrawnBox",
    "MeshView",
    "ScheduleBar",
    "ScheduleView",
    "ShardView",
    "format_ranks",
    "mesh_view",
    "resolve_spec",
    "schedule_view",
    "shard_view",
    "short_keys",
    "zoom_window",
]

ELEMENT_LIMIT = 1 << 20  # views up to this many elements get per-element ``owners``


@dataclass(frozen=True, slots=True)
class DrawnBox:
    """A run of one rank clipped to the view: rows ``[row0, row1)`` x cols ``[col0, col1)`` in view coordinates."""

    rank: int
    row0: int
    row1: int
    col0: int
    col1: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardView:
    """A 2-D view of one tensor (or one HF key of it) and which rank holds which part.

    Attributes:
        name: the parameter name.
        hf_key: the HF key drawn, or None for the whole runtime tensor.
        dims: tensor dims on the (row, col) axes; ``(None, 0)`` for a 1-D tensor (one row).
        index: per tensor dim, the fixed global index of an undrawn dim, None for a drawn dim.
        origin: global offset of view cell (0, 0) on the drawn dims.
        shape: (rows, cols) of the view.
        boxes: every rank's runs clipped to the view, in rank order.
        row_edges, col_edges: the grid of every box boundary (view coordinates, ascending, from 0 to the size).
        cell_owners: lowest rank holding each grid cell (-1: nobody).
        cell_holders: number of ranks holding each grid cell (> 1: replicas).
        key_axis: 0 or 1 when the fused dim is drawn (HF key boundaries run across that axis), else None.
        key_bounds: ``(start, label)`` of every HF key along ``key_axis`` in view coordinates.
        padding: first padded (row, col) in view coordinates (FP8 tail padding past ``origin_shape``), or None.
        empty_ranks: ranks whose local tensor is empty.
        local_sizes: per rank, its local shape on the drawn dims.
    """

    name: str
    hf_key: str | None
    dims: tuple[int | None, int]
    index: tuple[int | None, ...]
    origin: tuple[int, int]
    shape: tuple[int, int]
    boxes: tuple[DrawnBox, ...]
    row_edges: np.ndarray
    col_edges: np.ndarray
    cell_owners: np.ndarray
    cell_holders: np.ndarray
    key_axis: int | None
    key_bounds: tuple[tuple[int, str], ...]
    padding: tuple[int | None, int | None] | None
    empty_ranks: tuple[int, ...]
    local_sizes: Mapping[int, tuple[int, int]]

    @property
    def per_element(self) -> bool:
        """True when ``owners()`` has one entry per element (the view is small)."""
        return self.shape[0] * self.shape[1] <= ELEMENT_LIMIT

    def owners(self) -> np.ndarray:
        """Lowest rank holding each element of the view (-1: none); per grid cell when the view is large."""
        if not self.per_element:
            return self.cell_owners
        return np.repeat(np.repeat(self.cell_owners, np.diff(self.row_edges), axis=0), np.diff(self.col_edges), axis=1)

    def holders(self) -> np.ndarray:
        """Number of ranks holding each element (per grid cell when the view is large)."""
        if not self.per_element:
            return self.cell_holders
        return np.repeat(np.repeat(self.cell_holders, np.diff(self.row_edges), axis=0), np.diff(self.col_edges), axis=1)

    def owner_at(self, row: int, col: int = 0) -> int:
        """Lowest rank holding view element (row, col), or -1."""
        i = int(np.searchsorted(self.row_edges, row, side="right")) - 1
        j = int(np.searchsorted(self.col_edges, col, side="right")) - 1
        return int(self.cell_owners[i, j])

    @property
    def replicated(self) -> bool:
        """True when some element is held by more than one rank."""
        return bool((self.cell_holders > 1).any())


def resolve_spec(spec_or_layout: LoadSpec | Layout, key: str | None) -> tuple[LoadSpec, str | None]:
    """The spec to draw and the HF key to restrict it to (None: whole tensor).

    ``key`` is a parameter name or an HF key; a Layout with no key draws its largest parameter.
    """
    if isinstance(spec_or_layout, LoadSpec):
        spec = spec_or_layout
        if key is None or key == spec.name:
            return spec, None
        if key in spec.hf_keys:
            return spec, key if spec.is_fused else None
        raise LayoutError(f"{key!r} is neither parameter {spec.name!r} nor one of its {len(spec.hf_keys)} HF keys")
    layout = spec_or_layout
    if key is None:
        if not len(layout):
            raise LayoutError(f"{layout!r} has no parameters to draw")
        return max(layout.specs.values(), key=lambda s: math.prod(s.global_shape)), None
    if key in layout.specs:
        return layout.specs[key], None
    owner = layout.hf_keys.get(key)
    if owner is None:
        raise LayoutError(f"{key!r} is neither a parameter nor an HF key of {layout!r}")
    spec = layout.specs[owner]
    return spec, key if spec.is_fused else None


def shard_view(
    spec: LoadSpec,
    *,
    hf_key: str | None = None,
    dims: Sequence[int] = (0, 1),
    index: int | Sequence[int] | Mapping[int, int] | None = None,
) -> ShardView:
    """Which rank holds which part of a 2-D view of ``spec`` (see ``ShardView``).

    Args:
        spec: the parameter.
        hf_key: draw only this HF key of a fused tensor (view coordinates are the key's).
        dims: the two tensor dims drawn as rows and columns (ignored for a 1-D tensor).
        index: the position on every other dim (in the view's coordinates: the key's, when ``hf_key`` is
            given): an int for a 3-D tensor, a sequence in dim order, or ``{dim: index}``; default 0.

    Raises:
        LayoutError: a dim or index out of range, naming the parameter and its shape.
    """
    shape = spec.global_shape
    ndim = len(shape)
    where = f"parameter {spec.name!r} of shape {shape}"
    window = [(0, n) for n in shape]
    if hf_key is not None:
        if hf_key not in spec.hf_keys:
            raise LayoutError(f"{where}: {hf_key!r} is not one of its HF keys")
        if spec.is_fused:
            k, ks = spec.hf_keys.index(hf_key), spec.key_size or 0
            window[spec.fused_dim] = (k * ks, (k + 1) * ks)  # type: ignore[index]
        else:
            window = [(0, n) for n in spec.visible_shape]
    if ndim == 0:
        raise LayoutError(f"{where}: a 0-d tensor has nothing to draw")
    if ndim == 1:
        drawn: tuple[int | None, int] = (None, 0)
    else:
        d0, d1 = (int(d) for d in dims)
        if len(tuple(dims)) != 2 or d0 == d1 or not (0 <= d0 < ndim and 0 <= d1 < ndim):
            raise LayoutError(f"{where}: dims must name two different dims of {ndim}, got {tuple(dims)}")
        drawn = (d0, d1)
    fixed = _fixed_index(index, ndim, drawn, window, where)
    rows_dim, cols_dim = drawn
    rlo, rhi = window[rows_dim] if rows_dim is not None else (0, 1)
    clo, chi = window[cols_dim]
    view_shape = (rhi - rlo, chi - clo)

    boxes: list[DrawnBox] = []
    sizes: dict[int, tuple[int, int]] = {}
    empty: list[int] = []
    for rank in spec.mesh.all_ranks():
        local = spec.local_shape(rank)
        sizes[rank] = (local[rows_dim] if rows_dim is not None else 1, local[cols_dim])
        if 0 in local:
            empty.append(rank)
            continue
        for run in spec.runs(rank):
            if any(
                f is not None and not run.global_offset[d] <= f < run.global_offset[d] + run.sizes[d]
                for d, f in enumerate(fixed)
            ):
                continue
            if rows_dim is None:
                r0, r1 = 0, 1
            else:
                r0 = max(run.global_offset[rows_dim], rlo) - rlo
                r1 = min(run.global_offset[rows_dim] + run.sizes[rows_dim], rhi) - rlo
            c0 = max(run.global_offset[cols_dim], clo) - clo
            c1 = min(run.global_offset[cols_dim] + run.sizes[cols_dim], chi) - clo
            if r1 > r0 and c1 > c0:
                boxes.append(DrawnBox(rank, r0, r1, c0, c1))
    row_edges = np.unique(np.array([0, view_shape[0], *(b.row0 for b in boxes), *(b.row1 for b in boxes)]))
    col_edges = np.unique(np.array([0, view_shape[1], *(b.col0 for b in boxes), *(b.col1 for b in boxes)]))
    owners = np.full((len(row_edges) - 1, len(col_edges) - 1), -1, dtype=np.int64)
    holders = np.zeros(owners.shape, dtype=np.int64)
    for b in sorted(boxes, key=lambda b: -b.rank):  # the lowest rank is written last
        i0, i1 = np.searchsorted(row_edges, (b.row0, b.row1))
        j0, j1 = np.searchsorted(col_edges, (b.col0, b.col1))
        owners[i0:i1, j0:j1] = b.rank
        holders[i0:i1, j0:j1] += 1

    key_axis, key_bounds = None, ()
    if spec.is_fused and hf_key is None and spec.fused_dim in drawn:
        key_axis = drawn.index(spec.fused_dim)
        ks = spec.key_size or 1
        labels = short_keys(spec.hf_keys)
        key_bounds = tuple((k * ks, label) for k, label in enumerate(labels))
    padding = None
    if spec.origin_shape is not None and hf_key is None:
        pr = spec.origin_shape[rows_dim] - rlo if rows_dim is not None and spec.origin_shape[rows_dim] < rhi else None
        pc = spec.origin_shape[cols_dim] - clo if spec.origin_shape[cols_dim] < chi else None
        padding = (pr, pc) if pr is not None or pc is not None else None
    return ShardView(
        name=spec.name, hf_key=hf_key, dims=drawn, index=fixed, origin=(rlo, clo), shape=view_shape,
        boxes=tuple(boxes), row_edges=row_edges, col_edges=col_edges, cell_owners=owners, cell_holders=holders,
        key_axis=key_axis, key_bounds=key_bounds, padding=padding, empty_ranks=tuple(empty), local_sizes=sizes,
    )


def _fixed_index(
    index: int | Sequence[int] | Mapping[int, int] | None,
    ndim: int,
    drawn: tuple[int | None, int],
    window: list[tuple[int, int]],
    where: str,
) -> tuple[int | None, ...]:
    others = [d for d in range(ndim) if d not in drawn]
    if index is None:
        given: dict[int, int] = {}
    elif isinstance(index, Mapping):
        given = {int(d): int(i) for d, i in index.items()}
    elif isinstance(index, int):
        given = {others[0]: index} if others else {}
        if not others:
            raise LayoutError(f"{where}: index={index} given but every dim is drawn")
    else:
        values = [int(i) for i in index]
        if len(values) != len(others):
            raise LayoutError(f"{where}: index needs one position per undrawn dim {others}, got {values}")
        given = dict(zip(others, values))
    out: list[int | None] = [None] * ndim
    for d in others:
        lo, hi = window[d]
        i = given.pop(d, 0)
        if not 0 <= i < hi - lo:
            raise LayoutError(f"{where}: index {i} on dim {d} is outside 0..{hi - lo - 1}")
        out[d] = lo + i
    if given:
        raise LayoutError(f"{where}: index names drawn or unknown dims {sorted(given)}")
    return tuple(out)


def short_keys(keys: Sequence[str]) -> tuple[str, ...]:
    """HF keys with their common prefix and a common ``.weight``-like suffix removed, for labels."""
    if len(keys) == 1:
        return (keys[0],)
    parts = [k.split(".") for k in keys]
    head = 0
    while all(len(p) > head + 1 for p in parts) and len({p[head] for p in parts}) == 1:
        head += 1
    tail = 0
    while all(len(p) > head + tail + 1 for p in parts) and len({p[-1 - tail] for p in parts}) == 1:
        tail += 1
    return tuple(".".join(p[head : len(p) - tail]) for p in parts)


def format_ranks(ranks: Sequence[int], limit: int = 6) -> str:
    """``0-3, 8, 10-12`` (``workbench.report.units.format_ranks``, at most ``limit`` ranges)."""
    from workbench.report.units import format_ranks as shared

    return shared(ranks, limit=limit)


def zoom_window(
    view: ShardView, rank: int, *, readable: float = 0.05, context: float = 3.0
) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The part of ``view`` to enlarge so that ``rank``'s first box is readable, or None when it already is.

    On each axis where the box covers less than ``readable`` of the view, the window is ``context`` times the
    box, centred on it and kept inside the view (so the box fills about 1/``context`` of the zoomed axis and
    its neighbours show around it); on other axes it is the whole view. None also when the rank holds nothing
    of the view.

    Returns:
        ``((row0, row1), (col0, col1))`` in view coordinates.
    """
    mine = sorted((b for b in view.boxes if b.rank == rank), key=lambda b: (b.row0, b.col0))
    if not mine:
        return None
    first = mine[0]
    window: list[tuple[int, int]] = []
    zoomed = False
    for lo, hi, n in ((first.row0, first.row1, view.shape[0]), (first.col0, first.col1, view.shape[1])):
        size = hi - lo
        if size >= readable * n:
            window.append((0, n))
            continue
        span = min(n, max(math.ceil(size * context), size + 2))
        start = min(max(lo - (span - size) // 2, 0), n - span)
        window.append((start, start + span))
        zoomed = True
    return (window[0], window[1]) if zoomed else None


# -- mesh ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class MeshView:
    """What each rank of a mesh holds, laid out on the mesh.

    Attributes:
        mesh: the mesh.
        ranks: the rank at every mesh coordinate (an array of the mesh's shape).
        held: elements of ``spec`` each rank holds (same shape; all zero without a spec).
        labels: per rank, a short text of what it holds (the global ranges it holds on each cut dim).
        regions: per rank, per cut dim (``cut_dims``), the global ``(start, stop)`` ranges it holds.
        cut_dims: the tensor dims the spec cuts, in order.
        highlighted: ranks outlined (a rank, or its group along a mesh dim).
        highlight_text: what the outline means.
    """

    mesh: MeshSpec
    ranks: np.ndarray
    held: np.ndarray
    labels: Mapping[int, str]
    highlighted: tuple[int, ...]
    highlight_text: str
    regions: Mapping[int, tuple[tuple[tuple[int, int], ...], ...]] = dataclasses.field(default_factory=dict)
    cut_dims: tuple[int, ...] = ()


def mesh_view(
    mesh: MeshSpec, spec: LoadSpec | None = None, highlight: int | tuple[int, MeshDimRef] | None = None
) -> MeshView:
    """Per rank, its coordinate and what it holds of ``spec``; ``highlight`` a rank or ``(rank, mesh_dim)``."""
    ranks = np.array(mesh.all_ranks(), dtype=np.int64).reshape(mesh.shape)
    held = np.zeros(mesh.shape, dtype=np.int64)
    labels: dict[int, str] = {}
    regions: dict[int, tuple[tuple[tuple[int, int], ...], ...]] = {}
    cut: list[int] = []
    if spec is not None:
        if spec.mesh != mesh:
            raise LayoutError(f"parameter {spec.name!r} is on {spec.mesh!r}, not on {mesh!r}")
        cut = sorted({d.dim for d in spec.shards})
        for rank in mesh.all_ranks():
            local = spec.local_shape(rank)
            held[mesh.coordinate(rank)] = math.prod(local)
            if 0 in local:
                labels[rank] = "empty"
                continue
            segs = spec.segments(rank)
            regions[rank] = tuple(tuple((g, g + n) for g, n in segs[d]) for d in cut)
            text = []
            for d in cut:
                ranges = [f"{g}:{g + n}" for g, n in segs[d]]
                text.append("|".join(ranges) if len(ranges) <= 2 else f"{ranges[0]}|..x{len(ranges)}")
            labels[rank] = ", ".join(text) if text else "all"
    highlighted: tuple[int, ...] = ()
    text = ""
    if highlight is not None:
        if isinstance(highlight, tuple):
            rank, ref = highlight
            ref = mesh.resolve(ref)
            highlighted = mesh.group_ranks(int(rank), ref)
            text = f"group of rank {rank} along {format_mesh_dim(ref)}: ranks {format_ranks(highlighted)}"
        else:
            mesh.coordinate(int(highlight))  # checks the rank
            highlighted = (int(highlight),)
            text = f"rank {highlight}"
    return MeshView(mesh=mesh, ranks=ranks, held=held, labels=labels, highlighted=highlighted, highlight_text=text,
                    regions=regions, cut_dims=tuple(cut))


# -- schedule --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ScheduleBar:
    """One call on the byte axis: ``[x, x + width)`` where ``width`` is the bytes it gathers (``bytes_out``)."""

    call: int
    wave: int
    round: int
    lane: int
    x: int
    width: int
    oversized: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleView:
    """An UnshardSchedule on a byte axis, with the modeled memory at every step.

    Attributes:
        bars: one per call, in execution order.
        lanes: ``(mesh dim, dtype)`` label of every lane.
        wave_starts: x where each wave starts.
        water_x, water_y: the gathers' modeled live memory (bytes) as a step curve over x.
        gather_peak_bytes: the modeled peak of the gathers alone (the largest wave peak): what the budget bounds.
        queued_bytes: the writer queue the save may hold on top (``schedule_unshard``'s ``queued_bytes``).
        peak_bytes: the schedule's predicted peak: the gathers plus what the writer queue holds meanwhile.
        scratch: the waterline counts a receive scratch buffer per call (gloo's ``gather_scratch``).
        budget_bytes: the budget (None: unbounded); total_bytes: bytes gathered by every call.
    """

    bars: tuple[ScheduleBar, ...]
    lanes: tuple[str, ...]
    wave_starts: tuple[int, ...]
    water_x: tuple[int, ...]
    water_y: tuple[int, ...]
    peak_bytes: int
    gather_peak_bytes: int
    queued_bytes: int
    scratch: bool
    budget_bytes: int | None
    total_bytes: int

    @property
    def over_budget(self) -> bool:
        """True when the predicted peak exceeds the budget."""
        return self.budget_bytes is not None and self.peak_bytes > self.budget_bytes


def schedule_view(schedule: Any) -> ScheduleView:
    """Place every call of ``schedule`` on a byte axis and replay the scheduler's memory model call by call.

    The waterline follows ``workbench.plan.schedule``'s model (the last reply kept until the next call, the send
    buffer, the receive buffer and its scratch copy when the backend needs one, merged outputs; a wave's outputs
    handed out at its end; a look-ahead output kept until its own wave). It leaves out the copies of tensors cast
    to another gather dtype and of trimmed FP8 tails, which the schedule does not record; ``gather_peak_bytes``
    is the schedule's own figure, which counts them. Whether calls received into a scratch buffer is read from
    the schedule when it says, else from its wave peaks (the replay that reproduces them).
    """
    lanes: dict[str, int] = {}
    bars: list[ScheduleBar] = []
    wave_starts: list[int] = []
    x = 0
    wave = None
    for n, call in enumerate(schedule.calls):
        if call.wave != wave:
            wave = call.wave
            wave_starts.append(x)
        lane = lanes.setdefault(f"{format_mesh_dim(call.mesh_dim)} {str(call.dtype).removeprefix('torch.')}",
                                len(lanes))
        bars.append(ScheduleBar(n, call.wave, call.round, lane, x, call.bytes_out, call.oversized))
        x += call.bytes_out
    wave_peaks = tuple(getattr(schedule, "wave_peaks", ()) or ())
    scratch = getattr(schedule, "gather_scratch", None)
    if scratch is None:
        plain = _replay(schedule, scratch=False)
        scratch = bool(wave_peaks) and plain[2] != list(wave_peaks) and _replay(schedule, True)[2] == list(wave_peaks)
    xs, ys, peaks = _replay(schedule, scratch=bool(scratch))
    gather_peak = max(wave_peaks, default=max(peaks, default=0))
    return ScheduleView(
        bars=tuple(bars), lanes=tuple(lanes), wave_starts=tuple(wave_starts), water_x=tuple(xs), water_y=tuple(ys),
        peak_bytes=int(schedule.peak_bytes), gather_peak_bytes=int(gather_peak),
        queued_bytes=int(getattr(schedule, "queued_bytes", 0) or 0), scratch=bool(scratch),
        budget_bytes=schedule.budget_bytes, total_bytes=x,
    )


def _replay(schedule: Any, scratch: bool) -> tuple[list[int], list[int], list[int]]:
    """The memory model over the calls: waterline points (x, bytes) and the peak of every wave."""
    xs, ys, peaks = [0], [0], []
    held: dict[str, int] = {}
    live = reply = 0
    x = 0
    by_wave: dict[int, list[Any]] = {}
    for call in schedule.calls:
        by_wave.setdefault(call.wave, []).append(call)
    for w, names in enumerate(schedule.waves):
        reply = 0  # the previous wave's outputs were handed out: the driver dropped its last reply
        xs.append(x)
        ys.append(live)
        peak = live
        for call in by_wave.get(w, []):
            size = call.dtype.itemsize
            out = sum(i.bound_numel for i in call.items) * size
            send = out // call.world
            freed = sum(held.get(i.name, 0) for i in call.items)
            in_place = len(call.items) == 1 and call.items[0].dim == 0 and call.items[0].interleave_factor == 1
            merged = 0 if in_place else out
            staged = out if scratch else 0
            levels = (live + reply + send, live - freed + send + out + staged, live - freed + out + merged)
            third = call.bytes_out / 3
            for k, level in enumerate(levels):
                xs.append(round(x + k * third))
                ys.append(level)
            peak = max(peak, *levels)
            live = live - freed + (out if in_place else merged)
            reply = 0 if in_place else out
            for i in call.items:
                held[i.name] = i.bound_numel * size
            x += call.bytes_out
            xs.append(x)
            ys.append(live)
        for name in names:
            live -= held.pop(name, 0)
        xs.append(x)
        ys.append(live)
        peaks.append(peak)
    return xs, ys, peaks
