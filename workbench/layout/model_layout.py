"""Layout: a mesh plus the LoadSpec (and dtype) of every parameter of a model."""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.display import html_of
from workbench.errors import LayoutError
from workbench.layout.coverage import CoverageReport
from workbench.layout.key_map import KeyMap, clean_names, resolve_key_map
from workbench.layout.layout_toml import layout_to_toml
from workbench.layout.load_spec import LoadSpec
from workbench.memo import LRU, remember_by_identity
from workbench.mesh import MeshDimRef, MeshSpec

__all__ = ["Layout", "held_whole_by_every_rank", "layout_and_locals", "local_tensors", "replicated_on", "sub_mesh_refs"]


@dataclass(frozen=True, slots=True)
class Layout:
    """Every parameter's LoadSpec on one mesh, in model order, with its runtime dtype.

    Args:
        mesh: the device mesh every spec refers to.
        specs: ``{parameter name: LoadSpec}`` in model (state-dict) order.
        dtypes: ``{parameter name: dtype name}``, e.g. ``"bfloat16"``. A name left out has no given dtype
            (``given_dtype`` is None): planning without tensors (``workbench plan``, ``SimulatedWorld``) counts
            it as float32 (``dtype``), while a real save takes the dtype of the tensor it writes
            (``with_tensor_dtypes``).
        name: a label for reports (the file it came from, the model family).
    """

    mesh: MeshSpec
    specs: Mapping[str, LoadSpec]
    dtypes: Mapping[str, str] = field(default_factory=dict)
    name: str = "layout"

    def __post_init__(self) -> None:
        specs = dict(self.specs)
        owner: dict[str, str] = {}
        for name, spec in specs.items():
            if spec.name != name:
                raise LayoutError(f"Layout: spec stored under {name!r} is named {spec.name!r}")
            if spec.mesh != self.mesh:
                raise LayoutError(f"Layout: parameter {name!r} is on {spec.mesh!r}, the layout on {self.mesh!r}")
            for key in spec.hf_keys:
                if key in owner:
                    raise LayoutError(f"Layout: HF key {key!r} belongs to both {owner[key]!r} and {name!r}")
                owner[key] = name
        dtypes = {k: str(v).removeprefix("torch.") for k, v in dict(self.dtypes).items()}
        for name, dtype in dtypes.items():
            if name not in specs:
                raise LayoutError(f"Layout: dtype given for unknown parameter {name!r}")
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise LayoutError(f"Layout: parameter {name!r} has unknown dtype {dtype!r}")
        object.__setattr__(self, "specs", specs)
        object.__setattr__(self, "dtypes", dtypes)

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        key_map: KeyMap | None = None,
        *,
        mesh: MeshSpec | None = None,
        origin_shapes: Mapping[str, Sequence[int]] | None = None,
        name: str | None = None,
    ) -> Layout:
        """The layout of a live model (or state dict) whose tensors are DTensors or plain tensors.

        Reads only metadata: each DTensor's mesh, placements and global shape, checked against its local
        tensor. Every tensor must be on one root mesh (sub-meshes are matched by dim name); plain tensors are
        replicated. A sub-mesh dim flattened from several root dims (torchtitan's ``dp_shard_cp``, made by
        ``mesh["dp_shard", "cp"]._flatten()``) becomes the flattened ref ``("dp_shard", "cp")``, found from its
        ranks; HSDP (``Replicate`` on the replica dim, FSDP's shard on the other) replicates over the first.
        The key map gives each (cleaned) name its HF key(s); a name it maps to None is not part of
        the checkpoint.

        Raises:
            LayoutError: the key map misses a parameter, or a tensor's layout is not what its data says.
        """
        from workbench import _compat

        tensors = _named_tensors(model)
        lookup = resolve_key_map(key_map)
        mesh = mesh or _root_mesh(tensors.values())
        fsdp_dims = tuple(sorted(_compat.fsdp_shard_mesh_dims(model))) if isinstance(model, torch.nn.Module) else ()
        specs: dict[str, LoadSpec] = {}
        dtypes: dict[str, str] = {}
        unmapped = []
        names = clean_names(tensors)
        for raw, tensor in tensors.items():
            param = names[raw]
            keys = lookup(param)
            if keys is None:
                if key_map is not None and not callable(key_map):
                    unmapped.append(param)
                continue
            specs[param] = _spec_of(
                param, keys.keys, tensor, mesh, fused_dim=keys.fused_dim,
                origin_shape=(origin_shapes or {}).get(param), fsdp_dims=fsdp_dims,
            )
            dtypes[param] = str(tensor.dtype).removeprefix("torch.")
        if unmapped:
            raise LayoutError(
                f"the key map covers no HF key for {len(unmapped)} parameter(s): {unmapped[:5]}; add a pattern "
                "for them, or map them to None in a callable key map to leave them out of the checkpoint"
            )
        # a module by its class (``Qwen3MoeForCausalLM``); a mapping's class says nothing of the model ("dict")
        default = type(model).__name__ if isinstance(model, torch.nn.Module) else "state_dict"
        return cls(mesh, specs, dtypes, name=name or default)

    def __getitem__(self, name: str) -> LoadSpec:
        try:
            return self.specs[name]
        except KeyError:
            raise KeyError(f"no parameter {name!r} in {self!r}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def dtype(self, name: str) -> torch.dtype:
        """Runtime dtype of a parameter for planning without tensors: the given one, else float32 (a documented
        default for sizes in reports and plans; a save takes each tensor's own dtype, see ``with_tensor_dtypes``)."""
        return getattr(torch, self.dtypes.get(name, "float32"))

    def given_dtype(self, name: str) -> torch.dtype | None:
        """The dtype this layout was given for a parameter, or None when it was not told (unknown)."""
        given = self.dtypes.get(name)
        return None if given is None else getattr(torch, given)

    def with_tensor_dtypes(self, tensors: Mapping[str, torch.Tensor]) -> Layout:
        """This layout with every parameter's dtype taken from its tensor in ``tensors`` (``{name: tensor}``, e.g.
        this rank's local tensors): what a save writes. The layout itself when it already says exactly that.

        Raises:
            LayoutError: a dtype the layout was given disagrees with the tensor (naming the parameter and both
                dtypes), or a parameter has no tensor.
        """
        return _with_tensor_dtypes(self, tensors)

    def to_toml(self) -> str:
        """This layout as a layout file's TOML text, which ``wb.load_layout`` (``parse_layout``) reads back into an
        equal layout; ``wb.save_layout(layout, path)`` writes it to a file (see ``layout_toml.layout_to_toml``)."""
        return layout_to_toml(self)

    def fingerprint(self) -> str:
        """A short hash of everything that decides where bytes go: mesh, names, keys, shapes, cuts, dtypes."""
        import hashlib

        digest = hashlib.sha256(repr((self.mesh.shape, self.mesh.dim_names)).encode())
        for name, spec in self.specs.items():
            row = (name, spec.hf_keys, spec.global_shape, spec.origin_shape, spec.fused_dim,
                   tuple(str(d) for d in spec.shards), self.dtypes.get(name))
            digest.update(repr(row).encode())
        return digest.hexdigest()[:16]

    @property
    def hf_keys(self) -> dict[str, str]:
        """``{hf_key: parameter name}`` over the whole layout, in model order."""
        return {key: name for name, spec in self.specs.items() for key in spec.hf_keys}

    def coverage(self) -> dict[str, CoverageReport]:
        """Coverage verdict of every parameter (computed once per distinct geometry)."""
        seen: dict[tuple, CoverageReport] = {}
        out = {}
        for name, spec in self.specs.items():
            geometry = (spec.global_shape, spec.shards)
            if geometry not in seen:
                seen[geometry] = spec.coverage()
            report = seen[geometry]
            out[name] = report if report.name == name else _renamed(report, name)
        return out

    def _repr_html_(self) -> str | None:
        """HTML for notebooks, from the renderer ``workbench.viz`` registers (``workbench.display``)."""
        return html_of(self)

    def __repr__(self) -> str:
        import math

        from workbench.units import format_bytes

        keys = sum(len(s.hf_keys) for s in self.specs.values())
        total = sum(math.prod(s.visible_shape) * self.dtype(n).itemsize for n, s in self.specs.items())
        return (f"Layout({self.name!r}, mesh={self.mesh!r}, params={len(self.specs)}, hf_keys={keys}, "
                f"size={format_bytes(total)})")


_FILLED = LRU(8)  # id(layout) -> (layout, dtypes it was filled with, the filled layout)


def _with_tensor_dtypes(layout: Layout, tensors: Mapping[str, torch.Tensor]) -> Layout:
    dtypes: dict[str, str] = {}
    wrong = []
    for name in layout.specs:
        tensor = tensors.get(name)
        if tensor is None:
            raise LayoutError(f"the layout names parameter {name!r}, which has no tensor to save")
        own = _DTYPE_NAMES.get(tensor.dtype) or str(tensor.dtype).removeprefix("torch.")
        given = layout.dtypes.get(name)
        if given is not None and given != own:
            wrong.append(f"{name!r}: the layout says {given}, the tensor is {own}")
        dtypes[name] = own
    if wrong:
        raise LayoutError(
            f"{len(wrong)} parameter(s) whose layout dtype disagrees with the tensor: {'; '.join(wrong[:5])}. A save "
            "writes each tensor in its own dtype (fp32_keys_pattern picks keys saved in float32): correct the layout's "
            "dtypes or leave them out"
        )
    if dtypes == layout.dtypes:
        return layout
    hit = _FILLED.get(id(layout))
    if hit is not None and hit[0] is layout and hit[1] == dtypes:
        return hit[2]
    filled = Layout(layout.mesh, layout.specs, dtypes, name=layout.name)
    _FILLED.put(id(layout), (layout, dtypes, filled))
    return filled


_DTYPE_NAMES = {d: str(d).removeprefix("torch.") for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


def _named_tensors(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of a module (state-dict order), or a state dict as given."""
    if isinstance(model, torch.nn.Module):
        return dict(model.state_dict(keep_vars=True))
    return dict(model)


def local_tensors(model: torch.nn.Module | Mapping[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """``{parameter name: this rank's local tensor}`` for every parameter of ``layout`` (views: writing into one
    writes into the model).

    Raises:
        LayoutError: the layout names a parameter the model does not have, or a tensor is on the meta device.
    """
    return _locals_of(_named_tensors(model), layout)


@dataclass(frozen=True, slots=True)
class _Remembered:
    """A module's layout, valid while the module holds the very same tensors under the same names.

    It names each tensor by ``id`` and keeps no reference to it, not even a weak one: torch converts a module's
    parameters in place (``swap_tensors`` in ``Module._apply``: ``model.to(dtype)``, ``to_empty``, FSDP2's
    parameters always) and refuses a tensor that has a weak reference. An ``id`` outlives nothing it names, so an
    entry also holds what the layout read of each tensor (dtype, shape, placements, device mesh), and weak references
    to the DTensors' meshes: a mesh gone makes the entry stale, so its ``id`` cannot name a new mesh."""

    key_map: Any  # a callable key map itself; a table's entries, frozen (``_frozen_map``)
    # per state-dict entry: its name, the tensor's id (an entry keeps no model alive, and no tensor unswappable),
    # what the layout read of it, and its parameter name in the layout (None: not in the checkpoint)
    tensors: tuple[tuple[str, int, tuple[Any, ...], str | None], ...]
    meshes: tuple[weakref.ref, ...]  # the DTensors' meshes, whose ids the rows' metadata holds
    layout: Layout

    @staticmethod
    def of(key_map: KeyMap | None, tensors: Mapping[str, torch.Tensor], layout: Layout) -> _Remembered:
        """The entry for ``layout``, derived from ``tensors``."""
        rows = []
        meshes: dict[int, weakref.ref] = {}
        names = clean_names(tensors)
        for raw, tensor in tensors.items():
            name = names[raw]
            rows.append((raw, id(tensor), _meta(tensor), name if name in layout.specs else None))
            mesh = getattr(tensor, "device_mesh", None)
            if mesh is not None and id(mesh) not in meshes:
                meshes[id(mesh)] = weakref.ref(mesh)
        return _Remembered(_frozen_map(key_map), tuple(rows), tuple(meshes.values()), layout)

    def locals_if_same(self, key_map: KeyMap | None, tensors: Mapping[str, torch.Tensor]) -> dict | None:
        """The layout's local tensors when ``tensors`` are the very objects the layout was read from, with the same
        metadata, under the same key map; else None."""
        if self.key_map != _frozen_map(key_map) or len(tensors) != len(self.tensors):
            return None
        if any(mesh() is None for mesh in self.meshes):
            return None
        from workbench._compat import dtensor_local

        out = {}
        for (raw, ident, meta, name), (now, tensor) in zip(self.tensors, tensors.items()):
            if raw != now or ident != id(tensor) or meta != _meta(tensor):
                return None
            if name is not None:  # a DTensor is the one with placements
                out[name] = (dtensor_local(tensor) if meta[2] is not None else tensor).detach()
        return out


def _frozen_map(key_map: KeyMap | None) -> Any:
    """What a layout remembers of its key map: a table's entries as they are now (a table the caller edits in place
    afterwards is another map: remembering the object would keep a layout of the old entries), a callable itself
    (compared by identity: a callable must map alike on every call)."""
    if isinstance(key_map, Mapping):
        return tuple((k, v if isinstance(v, str) else tuple(v)) for k, v in key_map.items())
    return key_map


def _meta(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What ``Layout.from_model`` reads of a tensor that can change while the object stays (``param.data =``, a
    conversion that swaps the tensor's contents): dtype, shape, placements and the device mesh's id (both None for a
    plain tensor)."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return (tensor.dtype, tuple(tensor.shape), None, None)
    return (tensor.dtype, tuple(tensor.shape), tuple(placements), id(tensor.device_mesh))


_MODEL_LAYOUTS = LRU(8)  # id(module) -> (weak reference to the module, _Remembered)


def layout_and_locals(
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    key_map: KeyMap | None = None,
    *,
    layout: Layout | None = None,
    refuse_unlisted: bool = False,
) -> tuple[Layout, dict[str, torch.Tensor]]:
    """``Layout.from_model(model, key_map)`` and ``local_tensors(model, layout)`` from one walk of the model (a
    ``layout`` given is used as it is: only the local tensors are read). ``refuse_unlisted``: a save's check that a
    ``layout`` given lists every tensor of the model that ``key_map`` does not leave out (one it lacks would be
    missing from the checkpoint, with no word said).

    A module's layout is remembered while it holds the very same tensor objects under the same names, with the
    same shapes, dtypes, placements and meshes, and the key map is the same (checked on every call; a weak reference
    to the module and the ids of its tensors: nothing is kept alive, and torch may still swap a tensor's contents):
    a training loop's repeat save walks the module once and derives nothing. Resharding
    (FSDP2's unshard, a ``redistribute``) installs new tensor objects, so a changed layout is a miss.

    Raises:
        LayoutError: as ``Layout.from_model``; or a local tensor is on the meta device (a model built under
            ``torch.device("meta")`` and never materialized: it has no data to save, nor room to load into); or
            (``refuse_unlisted``) the model holds a tensor the layout does not list.
    """
    tensors = _named_tensors(model)
    if layout is not None:
        if refuse_unlisted:
            _refuse_unlisted(tensors, layout, key_map)
        return layout, _locals_of(tensors, layout)
    if not isinstance(model, torch.nn.Module):
        layout = Layout.from_model(tensors, key_map)
        return layout, _locals_of(tensors, layout)
    hit = _MODEL_LAYOUTS.get(id(model))
    if hit is not None and hit[0]() is model:
        locals_ = hit[1].locals_if_same(key_map, tensors)
        if locals_ is not None:
            _refuse_meta(locals_)  # never remembered with a meta tensor; checked anyway (one flag per tensor)
            return hit[1].layout, locals_
    layout = Layout.from_model(model, key_map)
    locals_ = _locals_of(tensors, layout)  # checked before it is remembered: no meta model is remembered
    _MODEL_LAYOUTS.put(id(model), (weakref.ref(model), _Remembered.of(key_map, tensors, layout)))
    return layout, locals_


def replicated_on(layout: Layout, mesh: MeshSpec) -> Layout:
    """``layout``'s parameters, each held whole by every rank of ``mesh`` (no cut), with their keys and dtypes."""
    specs = {name: LoadSpec(name=name, hf_keys=spec.hf_keys, global_shape=spec.global_shape, mesh=mesh,
                            fused_dim=spec.fused_dim, origin_shape=spec.origin_shape)
             for name, spec in layout.specs.items()}
    return Layout(mesh, specs, dict(layout.dtypes), name=layout.name)


_WORLD_LAYOUTS = LRU(8)


def held_whole_by_every_rank(layout: Layout, world: int) -> Layout:
    """The layout of a model of plain tensors (one rank, no cut) that every rank of a world of ``world`` holds whole
    (DDP, or a model each rank builds alike): every parameter replicated over the whole world, on a mesh
    ``("world",)`` of ``world`` ranks, so a save spreads its writers and a load reads each key once. Any other
    layout, or a world of one, as it is. Remembered per layout object."""
    if world == 1 or layout.mesh.size != 1 or any(spec.shards for spec in layout.specs.values()):
        return layout
    return remember_by_identity(_WORLD_LAYOUTS, (layout,), world,
                                lambda: replicated_on(layout, MeshSpec((world,), ("world",))))


def remembered_locals(model: Any, layout: Layout) -> dict[str, torch.Tensor] | None:
    """The local tensors of ``layout``'s parameters when ``model`` still holds the tensors it held when ``layout``
    was derived (the same objects under the same names; their metadata is not checked here); None when that is not
    remembered or a tensor was replaced. For speculative work that is checked later (``io/hf/early_snapshot.py``)."""
    from workbench._compat import dtensor_local

    hit = _MODEL_LAYOUTS.get(id(model))
    if hit is None or hit[0]() is not model or hit[1].layout is not layout:
        return None
    tensors = _named_tensors(model)
    out = {}
    for raw, ident, meta, name in hit[1].tensors:
        if name is None:
            continue
        tensor = tensors.get(raw)
        if tensor is None or id(tensor) != ident or tensor.is_meta:
            return None
        out[name] = (dtensor_local(tensor) if meta[2] is not None else tensor).detach()
    return out


def _locals_of(tensors: Mapping[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    from workbench import _compat

    out = {}
    names = clean_names(tensors)
    for raw, tensor in tensors.items():
        name = names[raw]
        if name in layout.specs:
            local = _compat.dtensor_local(tensor) if _compat.is_dtensor(tensor) else tensor
            out[name] = local.detach()
    missing = [n for n in layout.specs if n not in out]
    if missing:
        raise LayoutError(f"the layout names {len(missing)} parameter(s) the model does not have: {missing[:5]}")
    _refuse_meta(out)
    return out


def _refuse_unlisted(tensors: Mapping[str, torch.Tensor], layout: Layout, key_map: KeyMap | None) -> None:
    """Raise a LayoutError naming the model's tensors that ``layout`` does not list, unless a callable ``key_map``
    leaves them out of the checkpoint (maps them to None; a table cannot: one it does not cover is a gap, as
    ``Layout.from_model`` says) or they are a listed tensor under another name (tied weights: HF's
    ``tie_word_embeddings`` saves one key of the tie). A state dict's entry that is no tensor (a module's
    ``get_extra_state``) has no place in a safetensors file and is not asked about."""
    lookup = resolve_key_map(key_map)
    names = clean_names(tensors)
    deliberate = callable(key_map)  # only a callable says None; a table's None is a pattern it lacks
    unlisted = [raw for raw, name in names.items() if name not in layout.specs
                and isinstance(tensors[raw], torch.Tensor) and (not deliberate or lookup(name) is not None)]
    if unlisted:
        listed = {_view_of(t) for raw, t in tensors.items()
                  if names[raw] in layout.specs and isinstance(t, torch.Tensor)}
        unlisted = [names[raw] for raw in unlisted if _view_of(tensors[raw]) not in listed]
    if unlisted:
        more = f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else ""
        raise LayoutError(
            f"the model holds {len(unlisted)} tensor(s) that the layout {layout.name!r} does not list: "
            f"{unlisted[:5]}{more}; they would be missing from the checkpoint. Add them to the layout, or leave them "
            "out on purpose with a callable key map that maps them to None"
        )


def _view_of(tensor: torch.Tensor) -> tuple:
    """What makes two tensors the same values: the local tensor's memory and view (the same object under two names,
    or two views of one storage alike)."""
    from workbench import _compat

    local = _compat.dtensor_local(tensor) if _compat.is_dtensor(tensor) else tensor
    if local.is_meta or not local.numel():
        return (id(tensor),)
    return (local.device, local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
            local.stride(), local.dtype)


def _refuse_meta(locals_: Mapping[str, torch.Tensor]) -> None:
    """Raise a LayoutError naming the tensors on the meta device (they have no data to save and no memory to load
    into; a save of one otherwise fails late, naming no parameter)."""
    meta = [name for name, tensor in locals_.items() if tensor.is_meta]
    if meta:
        more = f" and {len(meta) - 5} more" if len(meta) > 5 else ""
        raise LayoutError(
            f"{len(meta)} parameter(s) are on the meta device (no data): {meta[:5]}{more}; materialize the model "
            "first (module.to_empty(device=...), then load or initialize its weights)"
        )


def _root_mesh(tensors: Iterable[torch.Tensor]) -> MeshSpec:
    """The mesh every DTensor lives on (its root when on a sub-mesh); one rank when there is none.

    torch caches sliced sub-meshes by their ranks, so a sub-mesh of one mesh can report another mesh with the
    same ranks as its root. Among the roots found, the one that agrees with every DTensor's own mesh (same dim
    names, same ranks in this rank's group) wins.
    """
    from workbench import _compat

    subs, roots = {}, {}
    for tensor in tensors:
        if _compat.is_dtensor(tensor):
            sub = tensor.device_mesh
            subs[id(sub)] = sub
            root = _compat.root_mesh(sub)
            roots[id(root)] = root
    if not roots:
        return MeshSpec((1,), ("world",))
    candidates = {MeshSpec.from_device_mesh(r) for r in roots.values()}
    fitting = [c for c in candidates if all(_fits(c, sub) for sub in subs.values())]
    if len(fitting) != 1:
        found = sorted(map(repr, fitting or candidates))
        raise LayoutError(f"cannot tell which mesh the model's DTensors live on (candidates {found}); pass mesh=")
    return fitting[0]


def _fits(root: MeshSpec, sub: object) -> bool:
    """True when ``sub`` (a DeviceMesh) is a slice of ``root`` along its dim names (flattened dims resolved to the
    root dims they span), around this rank."""
    spec = MeshSpec.from_device_mesh(sub)
    rank = sub.get_rank()
    if rank not in root.all_ranks() or rank not in spec.all_ranks():
        return False
    refs = sub_mesh_refs(root, spec, rank)
    if refs is None:
        return False
    dims = tuple(n for ref in refs for n in ((ref,) if isinstance(ref, str) else ref))
    if len(set(dims)) != len(dims):
        return False
    return root.group_ranks(rank, dims if len(dims) > 1 else dims[0]) == spec.all_ranks()


def sub_mesh_refs(root: MeshSpec, sub: MeshSpec, rank: int) -> tuple[MeshDimRef, ...] | None:
    """The root mesh dim ref of every dim of a sub-mesh around ``rank``: its own name when the root has it, else the
    root dims it was flattened from (None when some dim is neither).

    A flattened dim is matched by its ranks: the root dims whose row-major group through ``rank`` lists exactly the
    sub-mesh dim's ranks. torch names a flattened dim ``"_".join(dims)`` unless told otherwise, so the dims spelled
    by the name are tried first; then the fewest root dims of size > 1 (size-1 dims change no group).

    ====================  =====================  =====================================
    root mesh             sub-mesh dim           ref
    ====================  =====================  =====================================
    (dp_shard=2, cp=2)    dp_shard_cp (4 ranks)  ("dp_shard", "cp")
    (rep=2, shard=2)      shard                  "shard"
    (a=2, b=1, c=2)       flat (ranks of a, c)   ("a", "c")
    ====================  =====================  =====================================
    """
    refs: list[MeshDimRef] = []
    for name in sub.dim_names:
        along = sub.group_ranks(rank, name)
        if name in root.dim_names:
            if root.group_size(name) != len(along):  # same name, other size: a slice of another mesh
                return None
            refs.append(name)
            continue
        ref = _flattened_ref(root, name, along, rank)
        if ref is None:
            return None
        refs.append(ref)
    return tuple(refs)


def _flattened_ref(root: MeshSpec, name: str, along: tuple[int, ...], rank: int) -> MeshDimRef | None:
    import itertools

    def matches(dims: tuple[str, ...]) -> bool:
        if math.prod(root.group_size(d) for d in dims) != len(along):
            return False
        return root.group_ranks(rank, dims if len(dims) > 1 else dims[0]) == along

    names = root.dim_names
    spelled = [names[i:j] for i in range(len(names)) for j in range(i + 2, len(names) + 1)
               if "_".join(names[i:j]) == name]
    wide = [n for n in names if root.group_size(n) > 1]
    searched = [c for k in range(1, len(wide) + 1) for c in itertools.combinations(wide, k)]
    for dims in [*spelled, *searched]:
        if matches(dims):
            return dims if len(dims) > 1 else dims[0]
    return None


_SPECS = LRU(1 << 16)  # every input of _derive_spec -> its spec


def _spec_of(name: str, keys: Sequence[str], tensor: torch.Tensor, mesh: MeshSpec, **options: Any) -> LoadSpec:
    """``_derive_spec`` (``options``: its ``fused_dim``, ``origin_shape`` and ``fsdp_dims``), remembered by
    everything it reads (name, keys, meshes, placements, global and local shapes), so a repeat save of a model
    reuses its specs and what they computed (key regions, cuts)."""
    from workbench import _compat

    if _compat.is_dtensor(tensor):
        device_mesh = tensor.device_mesh
        meta: tuple[Any, ...] = (
            MeshSpec.from_device_mesh(device_mesh), device_mesh.get_rank(),
            tuple(tensor.placements), tuple(tensor.shape), tuple(_compat.dtensor_local(tensor).shape),
        )
    else:
        meta = (tuple(tensor.shape),)
    frozen = tuple((k, tuple(v) if isinstance(v, Sequence) else v) for k, v in sorted(options.items()))
    memo = (name, tuple(keys), mesh, meta, frozen)
    spec = _SPECS.get(memo)
    if spec is None:
        spec = _derive_spec(name, keys, tensor, mesh, **options)
        _SPECS.put(memo, spec)
    return spec


def _derive_spec(
    name: str,
    keys: Sequence[str],
    tensor: torch.Tensor,
    mesh: MeshSpec,
    *,
    fused_dim: int | None,
    origin_shape: Sequence[int] | None,
    fsdp_dims: Sequence[str],
) -> LoadSpec:
    """``LoadSpec.from_tensor`` on the root mesh, with a DTensor's flattened sub-mesh dims resolved to root refs."""
    from workbench import _compat

    if not _compat.is_dtensor(tensor):
        return LoadSpec.from_tensor(name, keys, tensor, fused_dim=fused_dim, mesh=mesh, origin_shape=origin_shape)
    device_mesh = tensor.device_mesh
    own = MeshSpec.from_device_mesh(device_mesh)
    if set(own.dim_names) <= set(mesh.dim_names):
        return LoadSpec.from_tensor(name, keys, tensor, fused_dim=fused_dim, mesh=mesh, origin_shape=origin_shape,
                                    fsdp_mesh_dims=fsdp_dims, rank=device_mesh.get_rank())
    # not remembered per DeviceMesh: one process playing rank after rank on a fake process group gets the same
    # DeviceMesh object back for every rank (and get_rank costs no more than a lookup)
    rank = device_mesh.get_rank()
    refs = sub_mesh_refs(mesh, own, rank)
    if refs is None:
        raise LayoutError(
            f"parameter {name!r}: its DTensor mesh dims {own.dim_names} (ranks {own.all_ranks()}) are neither dims "
            f"of the root {mesh!r} nor flattened from them around rank {rank}; pass mesh="
        )
    # FSDP2 names the sub-mesh dim it shards over (torchtitan's "dp_shard_cp"): the root ref it stands for
    fsdp_refs = [ref for own_name, ref in zip(own.dim_names, refs) if own_name in fsdp_dims]
    spec = LoadSpec.from_placements(
        name, keys, tuple(tensor.shape), mesh, tuple(tensor.placements), fused_dim=fused_dim,
        origin_shape=origin_shape, mesh_dims=refs, fsdp_mesh_dims=[*fsdp_dims, *fsdp_refs],
    )
    local, expected = tuple(_compat.dtensor_local(tensor).shape), spec.local_shape(rank)
    if local != expected:
        raise LayoutError(
            f"parameter {name!r}: rank {rank} holds a local tensor of shape {local}, but placements "
            f"{tuple(str(p) for p in tensor.placements)} over {tuple(map(str, refs))} give {expected} for global "
            f"shape {spec.global_shape} ({spec.describe_shards()})"
        )
    return spec


def _renamed(report: CoverageReport, name: str) -> CoverageReport:
    from dataclasses import replace

    return replace(report, name=name)
