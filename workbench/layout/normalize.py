"""Placement normalization: DTensor placements -> ShardDescriptors in forward (application) order.

This is the one place that knows how torch's placements map to physical cuts:

* ``Shard(d)`` cuts ``d`` contiguously. Several plain shards of one dim apply left to right.
* ``InterleavedShard(d, F)`` cuts ``d`` as an even interleave with factor ``F``, at its position.
* ``_StridedShard(d, split_factor=k)`` is a contiguous cut applied *after* the cuts to its right on
  ``d`` whose group sizes multiply to ``k``. FSDP2 prepends exactly such a placement with
  ``k = product of the inner cuts of d``, so its cut is applied last: FSDP2 physically chunks the
  already TP/EP-local tensor. This also holds for uneven sizes, where torch's own offset helper
  disagrees (pytorch issue 168134) and FSDP2's behaviour wins.
* A ``_StridedShard`` that no cut to its right explains (FSDP and torch rebuild bare strided shards,
  dropping the InterleavedShard subclass) is an interleave of factor ``k`` at its position, which is
  exactly torch's literal strided split.
* ``Replicate`` cuts nothing (HSDP's outer mesh dim); ``Partial`` is an error: its values are pending
  a reduction and do not describe a checkpoint.

Worked example, FSDP2 on top of expert TP, mesh (fsdp=2, ep=2, tp=2) and placements
``(_StridedShard(0, sf=4), Shard(0), InterleavedShard(0, 2))``:
``S(0)@ep -> IS(0,2)@tp -> S(0)@fsdp``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from workbench import _compat
from workbench.errors import LayoutError
from workbench.layout.descriptors import ShardDescriptor
from workbench.layout.interleaved import InterleavedShard
from workbench.mesh import MeshDimRef, MeshSpec, format_mesh_dim

__all__ = ["normalize_placements"]


@dataclass(frozen=True, slots=True)
class _Cut:
    descriptor: ShardDescriptor
    position: int  # index of the placement in the placements list
    deferred: bool  # a strided shard applied after cuts to its right


def normalize_placements(
    placements: Sequence[Any],
    mesh: MeshSpec,
    *,
    ndim: int,
    mesh_dims: Sequence[MeshDimRef] | None = None,
    name: str = "<tensor>",
    last_mesh_dims: Collection[MeshDimRef] = (),
) -> tuple[ShardDescriptor, ...]:
    """Ordered shard descriptors that reproduce what every rank of ``mesh`` physically holds.

    Args:
        placements: one torch placement per entry of ``mesh_dims``.
        mesh: the mesh the placements live on.
        ndim: number of dims of the tensor (to check shard dims).
        mesh_dims: the mesh dim (or flattened group) each placement applies to; defaults to every mesh
            dim in order. Mesh dims that are not listed replicate the tensor.
        name: the parameter name, for error messages.
        last_mesh_dims: mesh dims (or flattened refs) known to be FSDP's (``Layout.from_model`` finds them): a
            Shard or strided shard
            over one of them is applied after every other cut of its dim, whatever its split factor says. torch
            2.11's FSDP2 leaves interleaved cuts out of the split factor (2.13 counts them), and prepends a plain
            Shard when it counts none; FSDP2 physically chunks the local tensor last in both.

    Returns:
        Descriptors in forward order: per tensor dim in the order the cuts apply; across dims,
        placements in mesh order with deferred (FSDP-style) cuts last.

    Raises:
        LayoutError: wrong placement count, a shard dim out of range, or a Partial placement.
    """
    try:
        refs = tuple(mesh.resolve(r) for r in (mesh_dims if mesh_dims is not None else mesh.dim_names))
    except LayoutError as exc:
        raise LayoutError(f"parameter {name!r}: mesh_dims {list(mesh_dims or ())}: {exc}") from None
    if len(placements) != len(refs):
        raise LayoutError(
            f"parameter {name!r}: expected one placement per mesh dim, but found {len(placements)} "
            f"placements {tuple(str(p) for p in placements)} and {len(refs)} mesh dims "
            f"{tuple(format_mesh_dim(r) for r in refs)}"
        )
    per_dim: dict[int, list[_Cut]] = {}
    for position in range(len(placements) - 1, -1, -1):
        p, ref = placements[position], refs[position]
        if _compat.is_partial(p):
            raise LayoutError(
                f"parameter {name!r}: placement {p} on mesh dim {format_mesh_dim(ref)!r} is Partial; its "
                "values are pending a reduction, so no checkpoint can be derived from them. Reduce first "
                "(redistribute to Replicate or Shard) and then save."
            )
        if _compat.is_replicate(p):
            continue
        if not (_compat.is_shard(p) or _compat.is_strided_shard(p)):
            raise LayoutError(f"parameter {name!r}: unsupported placement {p!r} on mesh dim {ref!r}")
        dim = int(p.dim) + (ndim if p.dim < 0 else 0)
        if not 0 <= dim < ndim:
            raise LayoutError(
                f"parameter {name!r}: placement {p} on mesh dim {format_mesh_dim(ref)!r} shards dim {p.dim}, "
                f"but the tensor has {ndim} dims"
            )
        cuts = per_dim.setdefault(dim, [])
        if ref in last_mesh_dims and not isinstance(p, InterleavedShard):
            cuts.append(_Cut(ShardDescriptor(dim, ref), position, bool(cuts)))  # FSDP2 chunks what is left
        elif isinstance(p, InterleavedShard):
            factor = p.num_local_stripes
            cuts.insert(0, _Cut(ShardDescriptor(dim, ref, factor), position, False))
        elif _compat.is_shard(p):
            cuts.insert(0, _Cut(ShardDescriptor(dim, ref), position, False))
        else:
            split = _compat.strided_split_factor(p)
            at = _explained_position(cuts, split, mesh)
            if at is None:  # nothing to its right explains it: torch's literal strided split
                cuts.insert(0, _Cut(ShardDescriptor(dim, ref, split), position, False))
            else:
                cuts.insert(at, _Cut(ShardDescriptor(dim, ref), position, at > 0))
    return _merge(per_dim)


def _explained_position(cuts: list[_Cut], split_factor: int, mesh: MeshSpec) -> int | None:
    """Index after the leading cuts whose group sizes multiply to ``split_factor`` (None if none do).

    Cuts over size-1 mesh dims do not change the product; the strided cut goes after them too (FSDP2
    chunks last), so an interleave over a size-1 dim keeps the tensor length it was defined on.
    """
    product, found = 1, None
    for index in range(len(cuts) + 1):
        if product == split_factor:
            found = index
        elif product > split_factor:
            break
        if index < len(cuts):
            product *= mesh.group_size(cuts[index].descriptor.mesh_dim)
    return found


def _merge(per_dim: dict[int, list[_Cut]]) -> tuple[ShardDescriptor, ...]:
    """Interleave the per-dim chains into one forward order: mesh order first, deferred cuts last."""
    heads = {dim: 0 for dim in per_dim}
    out: list[ShardDescriptor] = []

    def rank(cut: _Cut) -> tuple[bool, int]:
        return (cut.deferred, -cut.position if cut.deferred else cut.position)

    while True:
        ready = [(rank(per_dim[d][i]), d) for d, i in heads.items() if i < len(per_dim[d])]
        if not ready:
            return tuple(out)
        _, dim = min(ready)
        out.append(per_dim[dim][heads[dim]].descriptor)
        heads[dim] += 1
