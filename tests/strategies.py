"""Hypothesis strategies and independent oracles for the layout tests.

The oracles here never call workbench's layout code: they are torch's own helpers (through
``workbench._compat``), torch.chunk arithmetic, or plain index bookkeeping, so a test that compares
workbench with them compares two independent derivations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Replicate, Shard

from workbench import _compat
from workbench.layout import LoadSpec
from workbench.mesh import MeshSpec

__all__ = [
    "FsdpLayout",
    "assemble_local",
    "fsdp_layouts",
    "fsdp_physical_slices",
    "global_array",
    "interleave_indices",
    "local_cover_counts",
    "meshes",
    "torch_slices",
]


# -- plain helpers --------------------------------------------------------------------------------
def global_array(shape: Sequence[int]) -> np.ndarray:
    """A tensor whose every element is its own flat global index."""
    return np.arange(math.prod(shape), dtype=np.int64).reshape(tuple(shape))


def assemble_local(spec: LoadSpec, rank: int, full: np.ndarray) -> np.ndarray:
    """The local tensor ``rank`` would hold, built only from ``spec.runs(rank)`` (unset cells are -1)."""
    local = np.full(spec.local_shape(rank), -1, dtype=full.dtype)
    for run in spec.runs(rank):
        local[run.local_slices()] = full[run.global_slices()]
    return local


def local_cover_counts(spec: LoadSpec, rank: int) -> np.ndarray:
    """How often each local element is written by ``spec.runs(rank)`` (exact tiling = all ones)."""
    counts = np.zeros(spec.local_shape(rank), dtype=np.int64)
    for run in spec.runs(rank):
        counts[run.local_slices()] += 1
    return counts


def torch_slices(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> tuple[slice, ...]:
    """The contiguous box torch's ``_compute_local_shape_and_global_offset`` says a rank holds."""
    shape, offset = _compat.torch_local_shape_and_offset(global_shape, mesh_shape, coordinate, placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def interleave_indices(n: int, world: int, index: int, factor: int) -> list[int]:
    """Brute force: the indices group rank ``index`` holds when ``n`` is cut into ``world * factor``
    equal runs and the rank takes runs ``index, index + world, ...`` (expert-TP interleave)."""
    chunks = np.array_split(np.arange(n), world * factor)  # even by construction in the tests
    out: list[int] = []
    for j in range(factor):
        out.extend(int(i) for i in chunks[j * world + index])
    return out


# -- meshes ---------------------------------------------------------------------------------------
@st.composite
def meshes(draw: st.DrawFn, max_dims: int = 3, max_size: int = 8, min_dims: int = 1) -> MeshSpec:
    """A mesh of min_dims..max_dims dims, each of size 1..max_size, named m0, m1, ..."""
    ndim = draw(st.integers(min_dims, max_dims))
    shape = tuple(draw(st.integers(1, max_size)) for _ in range(ndim))
    return MeshSpec(shape, tuple(f"m{i}" for i in range(ndim)))


# -- FSDP2-shaped layouts -------------------------------------------------------------------------
@dataclass(frozen=True)
class FsdpLayout:
    """A tensor placed the way FSDP2 places it on top of random TP/EP-style placements.

    ``kind``: ``"plain"`` (Shard/Replicate only, no FSDP), ``"fsdp"`` (FSDP on mesh dim 0) or
    ``"hsdp"`` (Replicate on mesh dim 0, FSDP on mesh dim 1).
    """

    mesh: MeshSpec
    global_shape: tuple[int, ...]
    placements: tuple[Any, ...]
    kind: str
    fsdp_mesh_dim: int | None = None
    fsdp_dim: int | None = None

    def inner_placements(self) -> tuple[Any, ...]:
        """The placements before ``fully_shard``: the FSDP mesh dim replicates."""
        if self.fsdp_mesh_dim is None:
            return self.placements
        out = list(self.placements)
        out[self.fsdp_mesh_dim] = Replicate()
        return tuple(out)

    def has_strided_shard(self) -> bool:
        return any(_compat.is_strided_shard(p) for p in self.placements)

    def has_uneven_strided_shard(self) -> bool:
        """True when a strided-sharded dim is not divisible by every mesh size that cuts it."""
        for p in self.placements:
            if _compat.is_strided_shard(p):
                cut = math.prod(
                    self.mesh.shape[i]
                    for i, q in enumerate(self.placements)
                    if (_compat.is_shard(q) or _compat.is_strided_shard(q)) and q.dim == p.dim
                )
                if self.global_shape[p.dim] % cut:
                    return True
        return False

    def spec(self) -> LoadSpec:
        return LoadSpec.from_placements("w", ("w",), self.global_shape, self.mesh, self.placements)


def _inner(draw: st.DrawFn, ndim: int, favourite: int = 0) -> Any:
    """Replicate, Shard of the favourite dim (the FSDP dim: makes strided shards) or Shard of any dim."""
    return draw(st.one_of(st.just(Replicate()), st.just(Shard(favourite)), st.integers(0, ndim - 1).map(Shard)))


@st.composite
def fsdp_layouts(
    draw: st.DrawFn, max_mesh_size: int = 8, max_len: int = 20, strided_only: bool = False
) -> FsdpLayout:
    """Random uneven tensors on random meshes, placed like FSDP2 (or HSDP, or no FSDP at all).

    FSDP2's rule (``_fsdp_param.py``): its placement on shard dim ``d`` is
    ``_StridedShard(d, split_factor=k)`` with ``k`` the product of the inner mesh sizes that shard
    ``d``, when ``k > 1``; otherwise a plain ``Shard(d)``. ``strided_only`` draws only layouts where
    FSDP2 builds a ``_StridedShard`` (an inner mesh dim of size >= 2 shards the FSDP dim).
    """
    ndim = draw(st.integers(1, 3))
    global_shape = tuple(draw(st.integers(0, max_len)) for _ in range(ndim))
    if strided_only:
        kind = draw(st.sampled_from(["fsdp", "fsdp", "hsdp"]))
        mesh = draw(meshes(max_size=max_mesh_size, min_dims=2 if kind == "fsdp" else 3))
        forced = draw(st.integers(2 if kind == "hsdp" else 1, mesh.ndim - 1))  # this inner dim shards the FSDP dim
        shape = list(mesh.shape)
        shape[forced] = max(shape[forced], 2)
        mesh = MeshSpec(tuple(shape), mesh.dim_names)
    else:
        mesh = draw(meshes(max_size=max_mesh_size))
        kinds = ["plain"] + ["fsdp"] * 3 + (["hsdp"] * 2 if mesh.ndim >= 2 else [])
        kind = draw(st.sampled_from(kinds))
        forced = -1
    if kind == "plain":
        placements = tuple(_inner(draw, ndim) for _ in range(mesh.ndim))
        return FsdpLayout(mesh, global_shape, placements, kind)
    fsdp_mesh_dim = 0 if kind == "fsdp" else 1
    fsdp_dim = draw(st.one_of(st.just(0), st.integers(0, ndim - 1)))  # FSDP2 shards dim 0 by default
    placements_list: list[Any] = [Replicate()] * (fsdp_mesh_dim + 1)
    placements_list += [
        Shard(fsdp_dim) if i == forced else _inner(draw, ndim, fsdp_dim) for i in range(fsdp_mesh_dim + 1, mesh.ndim)
    ]
    split = math.prod(
        mesh.shape[i] for i, p in enumerate(placements_list) if _compat.is_shard(p) and p.dim == fsdp_dim
    )
    placements_list[fsdp_mesh_dim] = _compat.make_strided_shard(fsdp_dim, split) if split > 1 else Shard(fsdp_dim)
    cut = split * mesh.shape[fsdp_mesh_dim]
    if split > 1 and cut <= 3 * max_len and draw(st.booleans()):
        # an even strided shard now and then: the case where torch's own offsets are right
        shape_list = list(global_shape)
        shape_list[fsdp_dim] = cut * draw(st.integers(0, max(1, max_len // cut)))
        global_shape = tuple(shape_list)
    return FsdpLayout(mesh, global_shape, tuple(placements_list), kind, fsdp_mesh_dim, fsdp_dim)


def fsdp_physical_slices(layout: FsdpLayout, coordinate: Sequence[int]) -> tuple[slice, ...]:
    """What FSDP2 physically stores: torch's box for the inner placements, then ``torch.chunk`` of
    that box along the FSDP shard dim over the FSDP mesh dim (``_chunk_with_empty`` semantics)."""
    inner = torch_slices(layout.global_shape, layout.mesh.shape, coordinate, layout.inner_placements())
    if layout.fsdp_mesh_dim is None or layout.fsdp_dim is None:
        return inner
    d, m = layout.fsdp_dim, layout.fsdp_mesh_dim
    box = inner[d]
    size, offset = _compat.chunk_size_and_offset(box.stop - box.start, layout.mesh.shape[m], coordinate[m])
    out = list(inner)
    out[d] = slice(box.start + offset, box.start + offset + size)
    return tuple(out)
