"""LoadSpec: the stable facts of one runtime parameter (HF keys, shapes, ordered shard descriptors).

A LoadSpec is the map; plans are routes compiled from it for one rank by ``workbench.plan``
(``plan_hf_load(spec, rank)``, ``plan_hf_save(spec, rank, policy)``), a layer above this one. It needs no process
group: every question (``local_shape(rank)``, ``runs(rank)``, ``key_regions(rank)``, ``coverage()``) is
answered for any rank from the ``MeshSpec`` alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from workbench import _compat
from workbench.display import html_of
from workbench.errors import LayoutError
from workbench.layout.chunking import local_sizes
from workbench.layout.coverage import CoverageReport, check_coverage
from workbench.layout.descriptors import ShardDescriptor
from workbench.layout.normalize import normalize_placements
from workbench.layout.runs import Run, Segment, cached_dim_segments, runs_from_segments
from workbench.mesh import MeshDimRef, MeshSpec, format_mesh_dim

_T = TypeVar("_T")

__all__ = ["KeyRegion", "LoadSpec", "compute_runs"]


@dataclass(frozen=True, slots=True)
class KeyRegion:
    """A box of one HF key held by a rank: ``sizes`` elements at ``key_offset`` in the key's tensor,
    found at ``local_offset`` in the rank's local tensor."""

    hf_key: str
    key_offset: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offset: tuple[int, ...]

    def __str__(self) -> str:
        key = ", ".join(f"{o}:{o + s}" for o, s in zip(self.key_offset, self.sizes))
        local = ", ".join(f"{o}:{o + s}" for o, s in zip(self.local_offset, self.sizes))
        return f"{self.hf_key}[{key}] -> local[{local}]"


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSpec:
    """How one runtime parameter relates to its HF keys and to every rank's local tensor.

    Args:
        name: runtime parameter name (FQN).
        hf_keys: HF keys of the full tensor, in concatenation order along ``fused_dim``.
        global_shape: full runtime shape before any shard (may include FP8 tail padding).
        mesh: the device mesh, as plain data.
        shards: shard descriptors in forward order (full tensor -> local tensor).
        fused_dim: the dim the HF keys are concatenated on; set iff there are several keys.
        origin_shape: checkpoint-visible full shape when ``global_shape`` carries tail padding.

    Example: ``experts.fused_w1w3`` of the toy layout, 2 experts x (gate 4 + up 4) rows on
    (fsdp=2, ep=2, tp=2), shards ``S(0)@ep -> IS(0,2)@tp -> S(0)@fsdp``:

    ====  ===========  ====================================
    rank  (f, e, t)    rows held
    ====  ===========  ====================================
    0     (0, 0, 0)    0, 1   (experts.0.gate_proj rows 0-1)
    4     (1, 0, 0)    4, 5   (experts.0.up_proj rows 0-1)
    7     (1, 1, 1)    14, 15 (experts.1.up_proj rows 2-3)
    ====  ===========  ====================================
    """

    name: str
    hf_keys: tuple[str, ...]
    global_shape: tuple[int, ...]
    mesh: MeshSpec
    shards: tuple[ShardDescriptor, ...] = ()
    fused_dim: int | None = None
    origin_shape: tuple[int, ...] | None = None
    _cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = f"parameter {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(f"LoadSpec name must be a non-empty string, got {self.name!r}")
        keys = (self.hf_keys,) if isinstance(self.hf_keys, str) else tuple(self.hf_keys)
        if not keys or any(not isinstance(k, str) or not k for k in keys):
            raise LayoutError(f"{where}: hf_keys must be a non-empty list of key names, got {self.hf_keys!r}")
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise LayoutError(f"{where}: hf_keys repeat {dup[:3]}")
        shape = _shape(self.global_shape, where, "global_shape")
        object.__setattr__(self, "hf_keys", keys)
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "shards", tuple(self.shards))
        ndim = len(shape)
        if self.origin_shape is not None:
            origin = _shape(self.origin_shape, where, "origin_shape")
            if len(origin) != ndim or any(o > g for o, g in zip(origin, shape)):
                raise LayoutError(
                    f"{where}: origin_shape {origin} must have the rank of global_shape {shape} and no "
                    "larger dim (it is the checkpoint-visible shape without tail padding)"
                )
            object.__setattr__(self, "origin_shape", None if origin == shape else origin)
        if len(keys) > 1:
            if self.fused_dim is None:
                raise LayoutError(
                    f"{where}: {len(keys)} hf_keys {_preview(keys)} need fused_dim, the dim they are "
                    "concatenated on"
                )
            fused = self.fused_dim + (ndim if self.fused_dim < 0 else 0)
            if not 0 <= fused < ndim:
                raise LayoutError(f"{where}: fused_dim {self.fused_dim} is out of range for shape {shape}")
            object.__setattr__(self, "fused_dim", fused)
            visible = self.visible_shape[fused]
            if visible % len(keys):
                raise LayoutError(
                    f"{where}: {len(keys)} hf_keys cannot split fused dim {fused} of checkpoint-visible "
                    f"length {visible} evenly (shape {self.visible_shape})"
                )
        elif self.fused_dim is not None:
            raise LayoutError(
                f"{where}: fused_dim={self.fused_dim} is set but there is one HF key {keys[0]!r}; "
                "fused_dim is only for several keys"
            )
        self._check_shards(where)

    def _check_shards(self, where: str) -> None:
        resolved, used = [], {}
        for d in self.shards:
            if not isinstance(d, ShardDescriptor):
                raise LayoutError(f"{where}: shards must be ShardDescriptors, got {d!r}")
            if d.dim >= len(self.global_shape):
                raise LayoutError(f"{where}: shard {d} cuts dim {d.dim} of a {len(self.global_shape)}-d tensor")
            try:
                ref = self.mesh.resolve(d.mesh_dim)
            except LayoutError as exc:
                raise LayoutError(f"{where}: shard {d}: {exc}") from None
            for index in self.mesh.dim_indices(ref):
                if index in used:
                    raise LayoutError(
                        f"{where}: mesh dim {self.mesh.dim_names[index]!r} cuts the tensor twice "
                        f"({used[index]} and {d}); one mesh dim can make one cut"
                    )
                used[index] = d
            resolved.append(ShardDescriptor(d.dim, ref, d.interleave_factor))
        object.__setattr__(self, "shards", tuple(resolved))
        for dim, length in enumerate(self.global_shape):
            sizes = {length}
            for d in self.shards_of_dim(dim):
                world = self.mesh.group_size(d.mesh_dim)
                if d.is_interleaved and world > 1:
                    bad = sorted(n for n in sizes if n % (world * d.interleave_factor))
                    if bad:
                        raise LayoutError(
                            f"{where}: shard {d} needs dim {dim} length N={bad[0]} to be a multiple of "
                            f"W*F={world}*{d.interleave_factor}={world * d.interleave_factor} (W: size of mesh "
                            f"dim {format_mesh_dim(d.mesh_dim)!r}, F: interleave factor); global_shape "
                            f"{self.global_shape}"
                        )
                sizes = set().union(*(local_sizes(n, world, d.interleave_factor) for n in sizes))

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_placements(
        cls,
        name: str,
        hf_keys: Sequence[str] | str,
        global_shape: Sequence[int],
        mesh: MeshSpec,
        placements: Sequence[Any],
        *,
        fused_dim: int | None = None,
        origin_shape: Sequence[int] | None = None,
        mesh_dims: Sequence[MeshDimRef] | None = None,
        fsdp_mesh_dims: Sequence[MeshDimRef] = (),
    ) -> LoadSpec:
        """Spec of a tensor of ``global_shape`` laid out with DTensor ``placements`` on ``mesh``.

        ``mesh_dims`` names the mesh dim (or flattened group) of each placement when the tensor lives
        on a sub-mesh; unlisted mesh dims replicate it. ``fsdp_mesh_dims``: mesh dims FSDP2 shards over, whose
        strided shards are applied last (see ``normalize_placements``).
        """
        shape = _shape(global_shape, f"parameter {name!r}", "global_shape")
        shards = normalize_placements(placements, mesh, ndim=len(shape), mesh_dims=mesh_dims, name=name,
                                      last_mesh_dims=fsdp_mesh_dims)
        return cls(
            name=name,
            hf_keys=tuple([hf_keys] if isinstance(hf_keys, str) else hf_keys),
            global_shape=shape,
            mesh=mesh,
            shards=shards,
            fused_dim=fused_dim,
            origin_shape=None if origin_shape is None else tuple(origin_shape),
        )

    @classmethod
    def from_tensor(
        cls,
        name: str,
        hf_keys: Sequence[str] | str,
        tensor: Any,
        *,
        fused_dim: int | None = None,
        origin_shape: Sequence[int] | None = None,
        mesh: MeshSpec | None = None,
        rank: int | None = None,
        fsdp_mesh_dims: Sequence[str] = (),
    ) -> LoadSpec:
        """Spec of a runtime tensor, read from its metadata only (works on a fake process group).

        A DTensor gives its mesh, placements and global shape; the derived local shape is checked
        against the rank's real local tensor. A plain tensor is replicated on ``mesh`` (default: one
        rank). When ``mesh`` is given for a DTensor, it is the root mesh and the DTensor's mesh dims
        are looked up in it by name.
        """
        if not _compat.is_dtensor(tensor):
            return cls(
                name=name,
                hf_keys=tuple([hf_keys] if isinstance(hf_keys, str) else hf_keys),
                global_shape=tuple(tensor.shape),
                mesh=mesh or MeshSpec((1,), ("world",)),
                fused_dim=fused_dim,
                origin_shape=None if origin_shape is None else tuple(origin_shape),
            )
        device_mesh = tensor.device_mesh
        own = MeshSpec.from_device_mesh(device_mesh)
        mesh_dims = None
        if mesh is not None:
            missing = [n for n in own.dim_names if n not in mesh.dim_names]
            if missing:
                raise LayoutError(
                    f"parameter {name!r}: its DTensor mesh dims {own.dim_names} are not all in the root "
                    f"{mesh!r} (missing {missing}); name the sub-mesh dims like the root mesh"
                )
            mesh_dims = own.dim_names
        spec = cls.from_placements(
            name,
            hf_keys,
            tuple(tensor.shape),
            mesh or own,
            tuple(tensor.placements),
            fused_dim=fused_dim,
            origin_shape=origin_shape,
            mesh_dims=mesh_dims,
            fsdp_mesh_dims=fsdp_mesh_dims,
        )
        me = device_mesh.get_rank() if rank is None else rank
        local = tuple(_compat.dtensor_local(tensor).shape)
        expected = spec.local_shape(me)
        if local != expected:
            raise LayoutError(
                f"parameter {name!r}: rank {me} holds a local tensor of shape {local}, but placements "
                f"{tuple(str(p) for p in tensor.placements)} on {spec.mesh!r} give {expected} for global "
                f"shape {spec.global_shape} (descriptors: {spec.describe_shards()}). The DTensor's "
                "metadata does not describe its data; was it built with from_local(run_check=False)?"
            )
        return spec

    # -- derived facts -----------------------------------------------------------------------
    @property
    def is_fused(self) -> bool:
        """True when several HF keys make up this tensor."""
        return len(self.hf_keys) > 1

    @property
    def is_sharded(self) -> bool:
        """True when any descriptor cuts the tensor."""
        return bool(self.shards)

    @property
    def is_interleaved(self) -> bool:
        """True when any descriptor is an interleave."""
        return any(d.is_interleaved for d in self.shards)

    @property
    def visible_shape(self) -> tuple[int, ...]:
        """Checkpoint-visible full shape (``origin_shape`` or ``global_shape``)."""
        return self.origin_shape or self.global_shape

    @property
    def key_size(self) -> int | None:
        """Length of each HF key along ``fused_dim`` (None when not fused)."""
        if self.fused_dim is None:
            return None
        return self.visible_shape[self.fused_dim] // len(self.hf_keys)

    def shards_of_dim(self, dim: int) -> tuple[ShardDescriptor, ...]:
        """Descriptors that cut ``dim``, in forward order."""
        return tuple(d for d in self.shards if d.dim == dim)

    def describe_shards(self) -> str:
        """Descriptors as ``S(0)@ep -> IS(0,2)@tp -> S(0)@fsdp`` (or ``replicated``)."""
        return " -> ".join(str(d) for d in self.shards) if self.shards else "replicated"

    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """Groups of ranks that together hold one full copy (ranks that differ only on sharding mesh dims)."""
        cutting = {i for d in self.shards for i in self.mesh.dim_indices(d.mesh_dim)}
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in self.mesh.all_ranks():
            coord = self.mesh.coordinate(rank)
            groups.setdefault(tuple(c for i, c in enumerate(coord) if i not in cutting), []).append(rank)
        return tuple(tuple(g) for g in groups.values())

    # -- per-rank answers --------------------------------------------------------------------
    def segments(self, rank: int) -> tuple[tuple[Segment, ...], ...]:
        """Per tensor dim, the ``(global_start, length)`` segments ``rank`` holds, in local order."""
        coord = self.mesh.coordinate(rank)
        out = []
        for dim, cuts in enumerate(self._cuts_by_dim()):
            index = tuple(sum(coord[i] * stride for i, stride in dims) for _, _, dims in cuts)
            if not cuts:
                length = self.global_shape[dim]
                out.append(((0, length),) if length else ())
                continue
            out.append(
                cached_dim_segments(self.global_shape[dim], tuple((d, w, i) for (d, w, _), i in zip(cuts, index)))
            )
        return tuple(out)

    def _cuts_by_dim(self) -> tuple[tuple[tuple[ShardDescriptor, int, tuple[tuple[int, int], ...]], ...], ...]:
        """Per tensor dim: (descriptor, group size, ((mesh dim index, stride), ...)) for group-rank math."""
        cached = self._cache.get("cuts")
        if cached is None:
            per_dim = []
            for dim in range(len(self.global_shape)):
                cuts = []
                for d in self.shards_of_dim(dim):
                    indices = self.mesh.dim_indices(d.mesh_dim)
                    strides, stride = [], 1
                    for i in reversed(indices):
                        strides.append((i, stride))
                        stride *= self.mesh.shape[i]
                    cuts.append((d, stride, tuple(reversed(strides))))
                per_dim.append(tuple(cuts))
            cached = tuple(per_dim)
            self._cache["cuts"] = cached
        return cached

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s local tensor (runtime, padding included)."""
        return self.memo(("local_shape", rank),
                         lambda: tuple(sum(n for _, n in segs) for segs in self.segments(rank)))

    def runs(self, rank: int) -> tuple[Run, ...]:
        """Boxes of the global tensor ``rank`` holds, contiguous globally and locally, in local order."""
        return runs_from_segments(self.segments(rank))

    def memo(self, what: Hashable, compute: Callable[[], _T]) -> _T:
        """``compute()`` once per spec and ``what`` (a spec never changes; derived facts are kept with it)."""
        try:
            return self._cache[what]
        except KeyError:
            value = self._cache[what] = compute()
            return value

    def key_regions(self, rank: int) -> tuple[KeyRegion, ...]:
        """The region of every HF key that ``rank`` holds, in key coordinates (padding excluded)."""
        return self.memo(("key_regions", rank), lambda: self._key_regions(rank))

    def _key_regions(self, rank: int) -> tuple[KeyRegion, ...]:
        visible = self.visible_shape
        out: list[KeyRegion] = []
        for run in self.runs(rank):
            stop = tuple(min(o + s, v) for o, s, v in zip(run.global_offset, run.sizes, visible))
            if any(b <= a for a, b in zip(run.global_offset, stop)):
                continue
            sizes = tuple(b - a for a, b in zip(run.global_offset, stop))
            if self.fused_dim is None:
                out.append(KeyRegion(self.hf_keys[0], run.global_offset, sizes, run.local_offset))
                continue
            fd, ks = self.fused_dim, self.key_size or 1
            start, end = run.global_offset[fd], stop[fd]
            for k in range(start // ks, math.ceil(end / ks)):
                lo, hi = max(start, k * ks), min(end, (k + 1) * ks)
                key_offset = list(run.global_offset)
                key_offset[fd] = lo - k * ks
                piece = list(sizes)
                piece[fd] = hi - lo
                local = list(run.local_offset)
                local[fd] += lo - start
                out.append(KeyRegion(self.hf_keys[k], tuple(key_offset), tuple(piece), tuple(local)))
        return tuple(out)

    def coverage(self) -> CoverageReport:
        """Prove every element is held exactly once per replica group, or list holes and overlaps."""
        groups = self.replica_groups()
        boxes = {
            rank: [(r.global_offset, r.sizes) for r in self.runs(rank)] for g in groups for rank in g
        }
        return check_coverage(self.name, self.global_shape, boxes, groups)

    def _repr_html_(self) -> str | None:
        """HTML for notebooks, from the renderer ``workbench.viz`` registers (``workbench.display``)."""
        return html_of(self)

    def __repr__(self) -> str:
        keys = repr(self.hf_keys[0]) if len(self.hf_keys) == 1 else f"{len(self.hf_keys)} keys"
        extra = f", fused_dim={self.fused_dim}" if self.fused_dim is not None else ""
        extra += f", origin_shape={self.origin_shape}" if self.origin_shape else ""
        return (
            f"LoadSpec({self.name!r}, hf_keys={keys}, global_shape={self.global_shape}{extra}, "
            f"shards=[{self.describe_shards()}], mesh={self.mesh!r})"
        )


def _shape(value: Any, where: str, what: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in value)
    except (TypeError, ValueError):
        raise LayoutError(f"{where}: {what} must be a sequence of ints, got {value!r}") from None
    if any(s < 0 for s in shape):
        raise LayoutError(f"{where}: {what} {shape} has a negative size")
    return shape


def _preview(keys: Sequence[str]) -> str:
    return repr(list(keys)) if len(keys) <= 3 else f"[{keys[0]!r}, ..., {keys[-1]!r}]"


def compute_runs(
    global_shape: Sequence[int],
    mesh: MeshSpec,
    placements: Sequence[Any],
    rank: int,
    *,
    mesh_dims: Sequence[str] | None = None,
) -> tuple[Run, ...]:
    """Runs that ``rank`` holds of a tensor of ``global_shape`` placed with ``placements`` on ``mesh``.

    A convenience over ``LoadSpec.from_placements(...).runs(rank)`` for one-off questions.
    """
    spec = LoadSpec.from_placements(
        "<tensor>", ("<tensor>",), global_shape, mesh, placements, mesh_dims=mesh_dims
    )
    return spec.runs(rank)
