"""ShardDescriptor: one cut of a tensor dim over one mesh dim (or a flattened group of mesh dims)."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.errors import LayoutError
from workbench.layout.chunking import Interval, chunk_interval, interleave_intervals
from workbench.mesh import MeshDimRef, format_mesh_dim

__all__ = ["ShardDescriptor"]


@dataclass(frozen=True, slots=True)
class ShardDescriptor:
    """One cut applied to the current tensor, listed in forward order (full tensor -> local tensor).

    It names a mesh dim, never a live process group: its group size and a rank's index in the group
    come from a ``MeshSpec``. ``interleave_factor == 1`` is a contiguous cut with PyTorch's chunk
    rule; ``F > 1`` is an even interleave where each rank holds ``F`` runs one stripe apart.

    Args:
        dim: tensor dim this cut applies to.
        mesh_dim: mesh dim name, or a tuple of names flattened into one group.
        interleave_factor: ``F``, the number of stripes already in each rank's tensor (expert TP).
    """

    dim: int
    mesh_dim: MeshDimRef
    interleave_factor: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.mesh_dim, list):
            object.__setattr__(self, "mesh_dim", tuple(self.mesh_dim))
        if isinstance(self.mesh_dim, tuple) and len(self.mesh_dim) == 1:
            object.__setattr__(self, "mesh_dim", self.mesh_dim[0])
        if not isinstance(self.dim, int) or self.dim < 0:
            raise LayoutError(f"ShardDescriptor dim must be a non-negative int, got {self.dim!r}")
        if not isinstance(self.interleave_factor, int) or self.interleave_factor < 1:
            raise LayoutError(
                f"ShardDescriptor interleave_factor must be an int >= 1, got {self.interleave_factor!r}"
            )

    @property
    def is_interleaved(self) -> bool:
        """True when each rank holds ``interleave_factor > 1`` runs."""
        return self.interleave_factor > 1

    def local_intervals(self, n: int, world: int, index: int, *, what: str = "tensor") -> tuple[Interval, ...]:
        """Intervals of the current ``n``-long dim that group rank ``index`` of ``world`` keeps, in local order.

        Empty intervals are dropped; a rank that holds nothing gets ``()``.
        """
        if self.interleave_factor == 1:
            start, stop = chunk_interval(n, world, index)
            return ((start, stop),) if stop > start else ()
        runs = interleave_intervals(n, world, index, self.interleave_factor, what=what)
        return tuple((a, b) for a, b in runs if b > a)

    def __str__(self) -> str:
        where = format_mesh_dim(self.mesh_dim)
        if self.interleave_factor > 1:
            return f"IS({self.dim},{self.interleave_factor})@{where}"
        return f"S({self.dim})@{where}"
