"""Which ranks a region of a checkpoint came from, by the layout it was saved with.

A save writes every element of an HF key from the shard of the rank (or replica group) that held it; the layout
says which box of the key each rank holds (``LoadSpec.key_regions``). So once a key is known to differ from its
reference, streaming both once in row blocks counts the differing elements inside each rank's box, and the report
can say ``rows 512:1024 of model.layers.3.mlp.experts.3.up_proj.weight were written from rank 5 (ep=1, tp=1)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workbench.debug.views import TensorView, bits
from workbench.layout.model_layout import Layout
from workbench.layout.pipeline import PipelineLayout
from workbench.memo import LRU, remember_by_identity
from workbench.units import format_ranks

__all__ = ["KeyShard", "differing_shards", "held_by", "key_shards", "ranks_text", "region_text", "same_shape",
           "written_from"]

_MAX_NAMED = 3  # differing shards named one by one; more are counted
MAX_RANKS = 1 << 17  # meshes larger than this are not walked rank by rank (a hostile layout file could claim any)


@dataclass(frozen=True, slots=True)
class KeyShard:
    """A box of one HF key (``[start, stop)`` per dim) and the ranks that hold it (several: replicas)."""

    box: tuple[tuple[int, int], ...]
    ranks: tuple[int, ...]


def key_shards(layout: Layout, key: str) -> tuple[KeyShard, ...] | None:
    """Every rank's box of ``key`` under ``layout``, replicas merged; None when the layout has no such key (or has
    more than ``MAX_RANKS`` ranks). Computed once per parameter of a layout (every key of it at once)."""
    name = _owners(layout).get(key)
    if name is None or layout.mesh.size > MAX_RANKS:
        return None
    return remember_by_identity(_SHARDS, (layout,), name, lambda: _param_shards(layout, name)).get(key, ())


_OWNERS = LRU(4)  # layout -> {hf_key: parameter}
_SHARDS = LRU(1 << 12)  # (layout, parameter) -> {hf_key: its shards}


def _owners(layout: Layout | PipelineLayout) -> dict[str, str]:
    if isinstance(layout, PipelineLayout):
        return remember_by_identity(_OWNERS, (layout,), None,
                                    lambda: {k: name for k, (_, name) in layout.hf_keys.items()})
    return remember_by_identity(_OWNERS, (layout,), None, lambda: layout.hf_keys)


def _holding(layout: Layout | PipelineLayout, name: str) -> tuple[Layout, tuple[int, ...]]:
    """The one-mesh layout that holds parameter ``name`` and its ranks as global ranks, by its own rank order: a
    pipeline stage's layout and the stage's ranks (no other stage holds the parameter), or the layout itself."""
    if isinstance(layout, PipelineLayout):
        stage = layout.stage_of(name)
        return layout.stages[stage], layout.stage_ranks(stage)
    return layout, layout.mesh.all_ranks()


def _param_shards(layout: Layout | PipelineLayout, name: str) -> dict[str, tuple[KeyShard, ...]]:
    part, ranks = _holding(layout, name)
    spec = part.specs[name]
    boxes: dict[str, dict[tuple[tuple[int, int], ...], list[int]]] = {}
    for local, rank in zip(part.mesh.all_ranks(), ranks):
        for region in spec.key_regions(local):
            if all(region.sizes):
                box = tuple((o, o + s) for o, s in zip(region.key_offset, region.sizes))
                boxes.setdefault(region.hf_key, {}).setdefault(box, []).append(rank)
    return {key: tuple(KeyShard(box, tuple(ranks)) for box, ranks in sorted(by_box.items()))
            for key, by_box in boxes.items()}


def _cutting_dims(layout: Layout | PipelineLayout, name: str) -> tuple[int, ...]:
    spec = _holding(layout, name)[0].specs[name]
    dims = {i for d in spec.shards for i in layout.mesh.dim_indices(layout.mesh.resolve(d.mesh_dim))}
    if isinstance(layout, PipelineLayout):  # the stage is part of where a shard came from
        dims.add(layout.mesh.mesh_dim_index(layout.pp_dim))
    return tuple(sorted(dims)) or tuple(range(layout.mesh.ndim))


def ranks_text(layout: Layout, key: str, ranks: Sequence[int]) -> str:
    """``'rank 5 (ep=1, tp=1)'``, or ``'ranks 5, 13 (ep=1, tp=1; replicas)'``: the coordinates along the mesh dims
    that cut the key's parameter (every dim for a replicated one)."""
    mesh = layout.mesh
    dims = _cutting_dims(layout, _owners(layout)[key])
    coords = [mesh.coordinate(r) for r in ranks]
    shared = [i for i in dims if len({c[i] for c in coords}) == 1]
    where = ", ".join(f"{mesh.dim_names[i]}={coords[0][i]}" for i in shared)
    if len(ranks) == 1:
        return f"rank {ranks[0]} ({where})" if where else f"rank {ranks[0]}"
    listed = format_ranks(ranks, limit=8)
    return f"ranks {listed} ({where}; replicas)" if where else f"ranks {listed}"


def region_text(box: Sequence[tuple[int, int]], shape: Sequence[int]) -> str:
    """``'rows 512:1024'``, ``'columns 0:64'``, ``'rows 0:2, columns 4:8'`` or ``'the whole key'``."""
    names = ("rows", "columns")
    parts = []
    for d, ((a, b), n) in enumerate(zip(box, shape)):
        if (a, b) != (0, n):
            parts.append(f"{names[d] if d < 2 else f'dim {d}'} {a}:{b}")
    return ", ".join(parts) or "the whole key"


def differing_shards(ref: TensorView, act: TensorView, shards: Sequence[KeyShard], block_bytes: int
                     ) -> list[tuple[KeyShard, int]]:
    """``(shard, differing elements)`` for every shard with at least one element whose bits differ, read in row
    blocks of at most ``block_bytes`` (``ref`` and ``act``: one key each, same shape and dtype)."""
    shape = act.shape
    counts = [0] * len(shards)
    step = act.rows_per_block(block_bytes, 4)
    for a in range(0, shape[0], step):
        b = min(shape[0], a + step)
        mask = bits(ref.read_rows(a, b)) != bits(act.read_rows(a, b))
        if not bool(mask.any()):
            continue
        for i, shard in enumerate(shards):
            box = shard.box if shard.box else ((0, 1),)
            lo, hi = max(a, box[0][0]), min(b, box[0][1])
            if lo >= hi:
                continue
            piece = mask[lo - a : hi - a]
            for d, (s, e) in enumerate(box[1:], start=1):
                piece = piece.narrow(d, s, e - s)
            counts[i] += int(piece.sum())
    return [(s, n) for s, n in zip(shards, counts) if n]


def written_from(layout: Layout, key: str, ref: TensorView, act: TensorView, block_bytes: int) -> dict[str, Any]:
    """Evidence naming the ranks whose shards of ``key`` differ: ``written_from`` (text) and ``differing_ranks``;
    {} when the layout does not know the key or its shape is not the key's."""
    shards = key_shards(layout, key)
    shape = act.metas[0].shape or (1,)
    if not shards or any(len(s.box) != len(act.metas[0].shape) for s in shards):
        return {}
    if any(b > n for s in shards for (_, b), n in zip(s.box, shape)):
        return {}
    bad = differing_shards(ref, act, shards, block_bytes)
    if not bad:
        return {}
    ranks = sorted({r for s, _ in bad for r in s.ranks})
    if len(bad) == len(shards) and len(shards) > 1:
        text = f"every one of the {len(shards)} shards of {key} differs ({len(ranks)} ranks)"
    else:
        named = [f"{region_text(s.box, shape)} of {key} were written from {ranks_text(layout, key, s.ranks)}"
                 + f" ({n} of {math.prod(e - a for a, e in s.box)} elements differ)" for s, n in bad[:_MAX_NAMED]]
        text = "; ".join(named) + (f"; and {len(bad) - _MAX_NAMED} more shard(s)" if len(bad) > _MAX_NAMED else "")
        if len(bad) < len(shards):
            text += f"; the other {len(shards) - len(bad)} shard(s) are right"
    return {"written_from": text, "differing_ranks": ranks, "some_right": len(bad) < len(shards)}


def held_by(layout: Layout, key: str) -> dict[str, Any]:
    """Evidence naming the ranks that held a key (for a key missing from a checkpoint): ``held_by``; {} when the
    layout does not know it."""
    shards = key_shards(layout, key)
    if not shards:
        return {}
    ranks = sorted({r for s in shards for r in s.ranks})
    if len(ranks) == layout.mesh.size:
        return {"held_by": f"every rank ({len(ranks)})"}
    mesh = layout.mesh
    coords = [mesh.coordinate(r) for r in ranks]
    shared = ", ".join(f"{n}={coords[0][i]}" for i, n in enumerate(mesh.dim_names) if len({c[i] for c in coords}) == 1)
    listed = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks, limit=8)}"
    return {"held_by": f"{listed} ({shared})" if shared else listed}


def same_shape(layout: Layout | PipelineLayout, key: str, shape: Sequence[int]) -> bool:
    """Whether the layout's checkpoint shape of ``key`` is ``shape``."""
    name = _owners(layout).get(key)
    if name is None:
        return False
    spec = _holding(layout, name)[0].specs[name]
    want = list(spec.visible_shape)
    if spec.fused_dim is not None:
        want[spec.fused_dim] //= len(spec.hf_keys)
    return tuple(want) == tuple(shape)
