"""Layout: a mesh plus the LoadSpec (and dtype) of every parameter of a model."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from workbench.errors import LayoutError
from workbench.layout.coverage import CoverageReport
from workbench.layout.key_map import KeyMap, clean_name, resolve_key_map
from workbench.layout.load_spec import LoadSpec
from workbench.mesh import MeshSpec

__all__ = ["Layout", "local_tensors"]


@dataclass(frozen=True, slots=True)
class Layout:
    """Every parameter's LoadSpec on one mesh, in model order, with its runtime dtype.

    Args:
        mesh: the device mesh every spec refers to.
        specs: ``{parameter name: LoadSpec}`` in model (state-dict) order.
        dtypes: ``{parameter name: dtype name}``, e.g. ``"bfloat16"``; missing names default to float32.
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
        replicated. The key map gives each (cleaned) name its HF key(s); a name it maps to None is not part of
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
        for raw, tensor in tensors.items():
            param = clean_name(raw)
            keys = lookup(param)
            if keys is None:
                if key_map is not None and not callable(key_map):
                    unmapped.append(param)
                continue
            specs[param] = LoadSpec.from_tensor(
                param, keys.keys, tensor, fused_dim=keys.fused_dim, mesh=mesh,
                origin_shape=(origin_shapes or {}).get(param), fsdp_mesh_dims=fsdp_dims,
            )
            dtypes[param] = str(tensor.dtype).removeprefix("torch.")
        if unmapped:
            raise LayoutError(
                f"the key map covers no HF key for {len(unmapped)} parameter(s): {unmapped[:5]}; add a pattern "
                "for them, or map them to None in a callable key map to leave them out of the checkpoint"
            )
        return cls(mesh, specs, dtypes, name=name or type(model).__name__)

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
        """Runtime dtype of a parameter (float32 when the layout does not say)."""
        return getattr(torch, self.dtypes.get(name, "float32"))

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

    def _repr_html_(self) -> str:
        """HTML for notebooks: a table and a small picture (``workbench.viz.html``)."""
        from workbench.viz.html import render_html

        return render_html(self)

    def __repr__(self) -> str:
        import math

        from workbench.report.units import format_bytes

        keys = sum(len(s.hf_keys) for s in self.specs.values())
        total = sum(math.prod(s.visible_shape) * self.dtype(n).itemsize for n, s in self.specs.items())
        return (f"Layout({self.name!r}, mesh={self.mesh!r}, params={len(self.specs)}, hf_keys={keys}, "
                f"size={format_bytes(total)})")


def _named_tensors(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of a module (state-dict order), or a state dict as given."""
    if isinstance(model, torch.nn.Module):
        return dict(model.state_dict(keep_vars=True))
    return dict(model)


def local_tensors(model: torch.nn.Module | Mapping[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """``{parameter name: this rank's local tensor}`` for every parameter of ``layout`` (views: writing into one
    writes into the model).

    Raises:
        LayoutError: the layout names a parameter the model does not have.
    """
    from workbench import _compat

    out = {}
    for raw, tensor in _named_tensors(model).items():
        name = clean_name(raw)
        if name in layout.specs:
            local = _compat.dtensor_local(tensor) if _compat.is_dtensor(tensor) else tensor
            out[name] = local.detach()
    missing = [n for n in layout.specs if n not in out]
    if missing:
        raise LayoutError(f"the layout names {len(missing)} parameter(s) the model does not have: {missing[:5]}")
    return out


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
    """True when ``sub`` (a DeviceMesh) is a slice of ``root`` along its dim names, around this rank."""
    spec = MeshSpec.from_device_mesh(sub)
    if not set(spec.dim_names) <= set(root.dim_names):
        return False
    if spec.shape != tuple(root.shape[root.mesh_dim_index(n)] for n in spec.dim_names):
        return False
    rank = sub.get_rank()
    if rank not in root.all_ranks() or rank not in spec.all_ranks():
        return False
    return root.group_ranks(rank, spec.dim_names if spec.ndim > 1 else spec.dim_names[0]) == spec.all_ranks()


def _renamed(report: CoverageReport, name: str) -> CoverageReport:
    from dataclasses import replace

    return replace(report, name=name)
