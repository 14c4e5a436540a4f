"""MeshSpec: a device mesh as plain data (shape, dim names, rank <-> coordinate, groups).

Vocabulary: a *mesh dim* is an axis of the device mesh, named by a string; a tensor dim is called
``dim``. A *mesh dim ref* names one mesh dim (``"tp"``) or several mesh dims flattened into one group
(``("dp", "ep")``, row-major over the listed dims). ``rank`` is always a global rank; ``group_rank``
is a rank's index inside the group a mesh dim ref gives it.

No process group is needed: every answer is integer arithmetic, so a laptop can reason about a
1024-rank mesh.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from workbench.display import html_of
from workbench.errors import LayoutError

_T = TypeVar("_T")
_PER_DEVICE_MESH: dict[int, tuple[Any, dict[Any, Any]]] = {}  # id(DeviceMesh) -> (weak ref, {(what, rank): value})


def per_device_mesh(mesh: Any, what: str, compute: Callable[[], _T]) -> _T:
    """``compute()`` once per DeviceMesh object, ``what`` and this process's global rank now.

    A DeviceMesh's answers are fixed for one rank (reading its rank tensor is most of the cost of reading a model's
    layout, once per parameter), but not across ranks: a sliced mesh's ``.mesh`` is the slice through the current
    rank, and a process that plays rank after rank on a fake process group (planning a job on a laptop) is handed
    the very same DeviceMesh object again by torch (FSDP2's cached meshes)."""
    known = _PER_DEVICE_MESH.get(id(mesh))
    if known is None or known[0]() is not mesh:
        try:
            ref = weakref.ref(mesh)
        except TypeError:  # not weak-referenceable: not remembered
            return compute()
        known = _PER_DEVICE_MESH[id(mesh)] = (ref, {})
        weakref.finalize(mesh, _PER_DEVICE_MESH.pop, id(mesh), None)
    get_rank = getattr(mesh, "get_rank", None)
    key = (what, get_rank() if callable(get_rank) else None)
    values = known[1]
    if key not in values:
        values[key] = compute()
    return values[key]

__all__ = ["MeshDimRef", "MeshSpec", "format_mesh_dim"]

MeshDimRef = str | tuple[str, ...]


def format_mesh_dim(ref: MeshDimRef) -> str:
    """Print a mesh dim ref: ``"tp"`` or ``"dp+ep"`` for a flattened group."""
    return ref if isinstance(ref, str) else "+".join(ref)


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """Shape and dim names of a device mesh; ranks laid out row-major unless ``ranks`` is given.

    Example, ``MeshSpec((2, 2, 2), ("fsdp", "ep", "tp"))``:

    ====  ===============  ==================  ===================
    rank  (fsdp, ep, tp)   group_rank("tp")    group_ranks("ep")
    ====  ===============  ==================  ===================
    0     (0, 0, 0)        0                   (0, 2)
    5     (1, 0, 1)        1                   (5, 7)
    ====  ===============  ==================  ===================

    Args:
        shape: size of every mesh dim.
        dim_names: a unique name per mesh dim; defaults to ``("dim0", "dim1", ...)``.
        ranks: the mesh's rank array flattened row-major, when it is not ``range(size)`` (a DeviceMesh
            built over a subset or a permutation of the world).
    """

    shape: tuple[int, ...]
    dim_names: tuple[str, ...] = ()
    ranks: tuple[int, ...] | None = None
    _position: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _coordinates: dict[int, tuple[int, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape)
        if not shape or any(s < 1 for s in shape):
            raise LayoutError(f"MeshSpec shape must be a non-empty tuple of positive sizes, got {self.shape!r}")
        names = tuple(self.dim_names) or tuple(f"dim{i}" for i in range(len(shape)))
        if len(names) != len(shape):
            raise LayoutError(
                f"MeshSpec has {len(shape)} mesh dims {shape} but {len(names)} dim names {names}"
            )
        if len(set(names)) != len(names) or any(not n or "+" in n for n in names):
            raise LayoutError(f"MeshSpec dim names must be unique, non-empty and free of '+', got {names}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dim_names", names)
        if self.ranks is not None:
            ranks = tuple(int(r) for r in self.ranks)
            if len(ranks) != math.prod(shape) or len(set(ranks)) != len(ranks) or min(ranks) < 0:
                raise LayoutError(
                    f"MeshSpec ranks must list {math.prod(shape)} distinct non-negative ranks for shape "
                    f"{shape}, got {len(ranks)} entries"
                )
            if ranks == tuple(range(len(ranks))):
                ranks = None
            object.__setattr__(self, "ranks", ranks)
            if ranks is not None:
                self._position.update({r: i for i, r in enumerate(ranks)})

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_device_mesh(cls, mesh: Any) -> MeshSpec:
        """Read shape, dim names and rank array of a ``torch.distributed.DeviceMesh`` (no collectives).

        Remembered per DeviceMesh object (``per_device_mesh``)."""
        def read() -> MeshSpec:
            rank_array = mesh.mesh
            names = tuple(mesh.mesh_dim_names or ())
            return cls(tuple(rank_array.shape), names, tuple(int(r) for r in rank_array.flatten().tolist()))

        return per_device_mesh(mesh, "spec", read)

    # -- sizes --------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """Number of mesh dims."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of ranks in the mesh."""
        return math.prod(self.shape)

    def all_ranks(self) -> tuple[int, ...]:
        """Every rank of the mesh, in row-major mesh order."""
        return self.ranks if self.ranks is not None else tuple(range(self.size))

    def mesh_dim_index(self, mesh_dim: str | int) -> int:
        """Index of a mesh dim given by name (or by index, checked)."""
        if isinstance(mesh_dim, int) and not isinstance(mesh_dim, bool):
            if 0 <= mesh_dim < self.ndim:
                return mesh_dim
        elif mesh_dim in self.dim_names:
            return self.dim_names.index(mesh_dim)
        raise LayoutError(f"mesh dim {mesh_dim!r} is not in {self!r}; known mesh dims: {self.dim_names}")

    def resolve(self, ref: MeshDimRef | int | Sequence[str | int]) -> MeshDimRef:
        """Canonical form of a mesh dim ref: a name, or a tuple of two or more names (flattened)."""
        if isinstance(ref, (str, int)):
            return self.dim_names[self.mesh_dim_index(ref)]
        names = tuple(self.dim_names[self.mesh_dim_index(r)] for r in ref)
        if not names or len(set(names)) != len(names):
            raise LayoutError(f"flattened mesh dim ref {ref!r} must list distinct mesh dims of {self!r}")
        return names[0] if len(names) == 1 else names

    def dim_indices(self, ref: MeshDimRef) -> tuple[int, ...]:
        """Mesh dim indices a ref spans (one for a plain mesh dim)."""
        if isinstance(ref, str):
            return (self.mesh_dim_index(ref),)
        return tuple(self.mesh_dim_index(r) for r in ref)

    def group_size(self, ref: MeshDimRef) -> int:
        """Number of ranks in each group of ``ref``."""
        return math.prod(self.shape[i] for i in self.dim_indices(ref))

    # -- rank arithmetic ----------------------------------------------------------------------
    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinate of a global rank."""
        cached = self._coordinates.get(rank)
        if cached is not None:
            return cached
        if self.ranks is None:
            if not 0 <= rank < self.size:
                raise LayoutError(f"rank {rank} is not in {self!r} (ranks 0..{self.size - 1})")
            flat = rank
        else:
            if rank not in self._position:
                raise LayoutError(f"rank {rank} is not in {self!r}")
            flat = self._position[rank]
        coord = []
        for s in reversed(self.shape):
            flat, c = divmod(flat, s)
            coord.append(c)
        result = tuple(reversed(coord))
        self._coordinates[rank] = result
        return result

    def rank_at(self, coordinate: Sequence[int]) -> int:
        """Global rank at a mesh coordinate."""
        if len(coordinate) != self.ndim or any(not 0 <= c < s for c, s in zip(coordinate, self.shape)):
            raise LayoutError(f"coordinate {tuple(coordinate)} is outside {self!r}")
        flat = 0
        for c, s in zip(coordinate, self.shape):
            flat = flat * s + c
        return flat if self.ranks is None else self.ranks[flat]

    def group_rank(self, rank: int, ref: MeshDimRef) -> int:
        """Index of ``rank`` inside its group along ``ref`` (row-major over flattened dims)."""
        coord = self.coordinate(rank)
        index = 0
        for i in self.dim_indices(ref):
            index = index * self.shape[i] + coord[i]
        return index

    def group_ranks(self, rank: int, ref: MeshDimRef) -> tuple[int, ...]:
        """Global ranks of the group along ``ref`` that contains ``rank``, in group-rank order."""
        coord = list(self.coordinate(rank))
        dims = self.dim_indices(ref)
        out = []
        for sub in _row_major(tuple(self.shape[i] for i in dims)):
            for i, c in zip(dims, sub):
                coord[i] = c
            out.append(self.rank_at(coord))
        return tuple(out)

    def groups(self, ref: MeshDimRef) -> tuple[tuple[int, ...], ...]:
        """Every group along ``ref``, each in group-rank order; groups ordered by their first rank."""
        covered: set[int] = set()
        found = []
        for rank in self.all_ranks():
            if rank not in covered:  # each group built once, not once per member
                group = self.group_ranks(rank, ref)
                covered.update(group)
                found.append(group)
        return tuple(sorted(found, key=lambda g: g[0]))

    def _repr_html_(self) -> str | None:
        """HTML for notebooks, from the renderer ``workbench.viz`` registers (``workbench.display``)."""
        return html_of(self)

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        extra = "" if self.ranks is None else ", custom ranks"
        return f"MeshSpec({dims}{extra})"


def _row_major(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """All coordinates of ``shape`` in row-major order."""
    if not shape:
        yield ()
        return
    for head in range(shape[0]):
        for tail in _row_major(shape[1:]):
            yield (head, *tail)
