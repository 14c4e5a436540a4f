"""Per-rank totals of a layout (and of a planned save), the outlier ranks, and uneven shards.

Parameters with the same geometry (global shape, cuts, fused dim, origin shape, number of keys: the layers of
a model) are measured once per rank, so every rank of a 1,024-rank DeepSeek-V3 layout is totalled in well
under a second.

======================  ===============================================================================
``RankTotals`` field    meaning
======================  ===============================================================================
``bytes_held``          local elements (tail padding included) x runtime itemsize: the rank's memory
``bytes_read``          checkpoint-visible elements the rank owns x runtime itemsize: what ``load_hf`` reads
``bytes_received``      save: bytes the rank's unshard schedule gathers from other ranks
``peak_bytes``          save: the schedule's predicted peak
``bytes_written``       save: bytes of the HF keys the rank writes (writers balanced by bytes)
======================  ===============================================================================

Example::

    totals = rank_totals(layout)                    # {rank: RankTotals}, every rank
    out = outlier_ranks(totals)                     # most / least bytes, empty ranks
    print(format_bytes(totals[0].bytes_held), out.most, format_bytes(out.most_value))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout

__all__ = ["RankOutliers", "RankTotals", "UnevenShard", "key_bytes", "outlier_ranks", "rank_totals", "uneven_shards"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankTotals:
    """What one rank holds, reads on load and (once a save is planned) receives, peaks at and writes.

    Save fields are None when no save was planned for the rank (``bytes_written`` is known for every rank
    once writers are assigned).
    """

    rank: int
    coordinate: tuple[int, ...]
    tensors: int
    empty_tensors: int
    bytes_held: int
    bytes_read: int
    hf_keys: int
    bytes_received: int | None = None
    peak_bytes: int | None = None
    bytes_written: int | None = None
    keys_written: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (exact byte counts)."""
        out = asdict(self)
        out["coordinate"] = list(self.coordinate)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RankOutliers:
    """The ranks that stand out on one measure of ``RankTotals`` (e.g. ``bytes_held``).

    Attributes:
        measure: the ``RankTotals`` field compared.
        ranks: how many ranks were compared.
        mean: mean value over the compared ranks.
        most, most_value: the ranks with the largest value, and that value.
        least, least_value: the ranks with the smallest value, and that value.
        empty: ranks whose value is 0.
        heavy: ranks whose value exceeds ``heavy_factor`` x the mean.
        heavy_factor: the threshold used for ``heavy``.
    """

    measure: str
    ranks: int
    mean: float
    most: tuple[int, ...]
    most_value: int
    least: tuple[int, ...]
    least_value: int
    empty: tuple[int, ...]
    heavy: tuple[int, ...]
    heavy_factor: float

    @property
    def spread(self) -> float:
        """``most_value / mean`` (1.0 when perfectly even; 0.0 for an all-zero measure)."""
        return self.most_value / self.mean if self.mean else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        out = asdict(self)
        for k in ("most", "least", "empty", "heavy"):
            out[k] = list(out[k])
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class UnevenShard:
    """A parameter whose ranks hold different amounts: the memory that sizing every rank for the largest
    shard (as collectives and FSDP2's padded buffers do) costs over the whole mesh.

    Attributes:
        name: parameter name.
        global_shape: its runtime shape.
        ranks: ranks of the mesh.
        empty_ranks: ranks holding none of it.
        max_bytes: the largest shard.
        waste_bytes: ``max_bytes x ranks - bytes held over all ranks``.
    """

    name: str
    global_shape: tuple[int, ...]
    ranks: int
    empty_ranks: int
    max_bytes: int
    waste_bytes: int


def _geometry(spec: LoadSpec) -> tuple:
    return (spec.global_shape, spec.shards, spec.fused_dim, spec.origin_shape, len(spec.hf_keys))


def _measure(spec: LoadSpec, rank: int) -> tuple[int, int, int]:
    """(local numel, visible numel owned, keys touched) of ``rank``."""
    regions = spec.key_regions(rank)
    return (math.prod(spec.local_shape(rank)), sum(math.prod(r.sizes) for r in regions),
            len({r.hf_key for r in regions}))


def _classes(layout: Layout) -> dict[tuple, tuple[LoadSpec, dict[int, int]]]:
    """``{geometry: (first spec, {itemsize: parameter count})}``."""
    out: dict[tuple, tuple[LoadSpec, dict[int, int]]] = {}
    for name, spec in layout.specs.items():
        entry = out.setdefault(_geometry(spec), (spec, {}))
        size = layout.dtype(name).itemsize
        entry[1][size] = entry[1].get(size, 0) + 1
    return out


def rank_totals(
    layout: Layout,
    ranks: Sequence[int] | None = None,
    *,
    save: Any = None,
    key_bytes: Mapping[str, int] | None = None,
) -> dict[int, RankTotals]:
    """``{rank: RankTotals}`` for ``ranks`` (default: every rank of the mesh).

    Args:
        layout: the layout.
        ranks: ranks to total.
        save: a planned save (``workbench.run.simulated.SavePlanSet`` or anything with ``schedules``
            ``{rank: UnshardSchedule}`` and ``writers`` ``{hf_key: rank}``) to fill the save fields.
        key_bytes: ``{hf_key: bytes on disk}`` for ``bytes_written`` (default: ``key_bytes(layout)``, at the
            runtime dtypes; pass the save's own sizes when fp32 patterns or a save dtype change them).
    """
    ranks = tuple(layout.mesh.all_ranks() if ranks is None else ranks)
    classes = _classes(layout)
    written: dict[int, list[int]] = {}
    if save is not None and save.writers:
        sizes = key_bytes if key_bytes is not None else _runtime_key_bytes(layout)
        for key, writer in save.writers.items():
            entry = written.setdefault(writer, [0, 0])
            entry[0] += sizes.get(key, 0)
            entry[1] += 1
    params = len(layout)
    out = {}
    for rank in ranks:
        held = read = keys = empty = 0
        for spec, sizes_count in classes.values():
            numel, visible, touched = _measure(spec, rank)
            for itemsize, count in sizes_count.items():
                held += numel * itemsize * count
                read += visible * itemsize * count
                keys += touched * count
                empty += count if numel == 0 else 0
        schedule = save.schedules.get(rank) if save is not None and rank in save.schedules else None
        out[rank] = RankTotals(
            rank=rank, coordinate=layout.mesh.coordinate(rank), tensors=params - empty, empty_tensors=empty,
            bytes_held=held, bytes_read=read, hf_keys=keys,
            bytes_received=None if schedule is None else schedule.bytes_moved,
            peak_bytes=None if schedule is None else schedule.peak_bytes,
            bytes_written=None if save is None else written.get(rank, [0, 0])[0],
            keys_written=None if save is None else written.get(rank, [0, 0])[1],
        )
    return out


def key_bytes(layout: Layout) -> dict[str, int]:
    """``{hf_key: bytes}`` of every key at its parameter's runtime dtype (checkpoint-visible shape)."""
    return _runtime_key_bytes(layout)


def _runtime_key_bytes(layout: Layout) -> dict[str, int]:
    out = {}
    for name, spec in layout.specs.items():
        numel = math.prod(spec.visible_shape) // len(spec.hf_keys)
        size = layout.dtype(name).itemsize
        out.update(dict.fromkeys(spec.hf_keys, numel * size))
    return out


def outlier_ranks(
    totals: Mapping[int, RankTotals],
    measure: str = "bytes_held",
    *,
    heavy_factor: float = 2.0,
    nonzero_only: bool = False,
) -> RankOutliers:
    """The ranks that stand out on ``measure`` (a ``RankTotals`` field).

    Args:
        totals: per-rank totals (e.g. ``rank_totals(layout)``).
        measure: the field to compare; ranks where it is None are skipped.
        heavy_factor: a rank is ``heavy`` above this multiple of the mean.
        nonzero_only: compare only ranks where the measure is non-zero (writers: ``bytes_written``); empty
            ranks are still listed.
    """
    values = {r: getattr(t, measure) for r, t in totals.items() if getattr(t, measure) is not None}
    empty = tuple(sorted(r for r, v in values.items() if v == 0))
    compared = {r: v for r, v in values.items() if v or not nonzero_only}
    if not compared:
        return RankOutliers(measure=measure, ranks=0, mean=0.0, most=(), most_value=0, least=(), least_value=0,
                            empty=empty, heavy=(), heavy_factor=heavy_factor)
    mean = sum(compared.values()) / len(compared)
    hi, lo = max(compared.values()), min(compared.values())
    return RankOutliers(
        measure=measure, ranks=len(compared), mean=mean,
        most=tuple(sorted(r for r, v in compared.items() if v == hi)), most_value=hi,
        least=tuple(sorted(r for r, v in compared.items() if v == lo)), least_value=lo, empty=empty,
        heavy=tuple(sorted(r for r, v in compared.items() if mean and v > heavy_factor * mean)),
        heavy_factor=heavy_factor,
    )


def uneven_shards(layout: Layout) -> tuple[UnevenShard, ...]:
    """Every parameter whose shards differ in size across the mesh, largest waste first."""
    world = layout.mesh.all_ranks()
    per_geometry: dict[tuple, tuple[int, int, int]] = {}
    out = []
    for name, spec in layout.specs.items():
        geometry = _geometry(spec)
        if geometry not in per_geometry:
            numels = [math.prod(spec.local_shape(r)) for r in world]
            per_geometry[geometry] = (max(numels), sum(numels), sum(1 for n in numels if n == 0))
        biggest, total, empty = per_geometry[geometry]
        waste = biggest * len(world) - total
        if waste:
            size = layout.dtype(name).itemsize
            out.append(UnevenShard(name=name, global_shape=spec.global_shape, ranks=len(world), empty_ranks=empty,
                                   max_bytes=biggest * size, waste_bytes=waste * size))
    return tuple(sorted(out, key=lambda u: -u.waste_bytes))
