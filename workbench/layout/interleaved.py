"""InterleavedShard: the DTensor placement of expert-TP column-parallel weights."""

from __future__ import annotations

from typing import Any

from workbench._compat import HAS_TORCH_STRIDED_SHARD, StridedShardBase

__all__ = ["InterleavedShard"]


class InterleavedShard(StridedShardBase):  # type: ignore[misc, valid-type]
    """Split each of the ``num_local_stripes`` stripes already on a rank across a mesh dim.

    A rank's tensor often holds several logical stripes stacked on one dim (each local expert's gate
    and up projection). A plain ``Shard`` would hand one TP rank whole stripes; column-parallel expert
    TP instead needs every TP rank to hold the same slice of *every* stripe. With ``F`` stripes and
    ``W`` TP ranks, the dim is cut into ``W * F`` equal runs and TP rank ``r`` holds runs
    ``r, r + W, ..., r + (F-1) W``.

    Example: 16 rows = 2 experts x (gate 4 + up 4), placements ``(Shard(0), InterleavedShard(0, 2))``
    on mesh (ep=2, tp=2):

    =======  ==================
    (ep,tp)  global rows held
    =======  ==================
    (0, 0)   0, 1, 4, 5
    (0, 1)   2, 3, 6, 7
    (1, 0)   8, 9, 12, 13
    (1, 1)   10, 11, 14, 15
    =======  ==================

    It subclasses torch's ``_StridedShard`` (through ``workbench._compat``) with
    ``split_factor = num_local_stripes``, so ``DTensor.from_local`` accepts it and FSDP2 prepends its
    own strided shard on top. torch rebuilds bare ``_StridedShard`` objects in places; workbench's
    placement normalization recognizes those too.
    """

    def __init__(self, dim: int, num_local_stripes: int) -> None:
        if HAS_TORCH_STRIDED_SHARD:
            super().__init__(dim, split_factor=num_local_stripes)
        else:  # pragma: no cover - the fallback base is a frozen dataclass
            object.__setattr__(self, "dim", dim)
            object.__setattr__(self, "split_factor", num_local_stripes)

    @property
    def num_local_stripes(self) -> int:
        """Number of stripes on each rank before this cut (the interleave factor ``F``)."""
        return int(self.split_factor)

    def __eq__(self, other: object) -> bool:
        # not equal to a bare _StridedShard with the same numbers: normalization reads a bare one as FSDP's deferred
        # cut when cuts to its right explain its split factor, so the two may mean different layouts
        if not isinstance(other, InterleavedShard):
            return NotImplemented if not isinstance(other, StridedShardBase) else False
        return (self.dim, self.num_local_stripes) == (other.dim, other.num_local_stripes)

    def __hash__(self) -> int:
        return hash(("InterleavedShard", self.dim, self.num_local_stripes))

    def __reduce__(self) -> tuple[Any, ...]:
        return (InterleavedShard, (self.dim, self.num_local_stripes))

    def __deepcopy__(self, memo: dict[int, Any]) -> InterleavedShard:
        return InterleavedShard(self.dim, self.num_local_stripes)

    def __copy__(self) -> InterleavedShard:
        return InterleavedShard(self.dim, self.num_local_stripes)

    def __repr__(self) -> str:
        return f"InterleavedShard(dim={self.dim}, num_local_stripes={self.num_local_stripes})"

    def __str__(self) -> str:
        return f"IS({self.dim},{self.num_local_stripes})"
