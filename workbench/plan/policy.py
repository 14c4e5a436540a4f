"""SavePolicy: which shards a save undoes (gathers) and which it keeps applied."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from workbench.layout.descriptors import ShardDescriptor
from workbench.mesh import MeshDimRef

__all__ = ["SavePolicy"]


def _names(ref: MeshDimRef) -> tuple[str, ...]:
    return (ref,) if isinstance(ref, str) else tuple(ref)


@dataclass(frozen=True, slots=True)
class SavePolicy:
    """What a save does with each shard of a tensor.

    * ``SavePolicy.full()``: undo every shard; every output is a whole HF tensor.
    * ``SavePolicy.preserve("ep")``: keep cuts over these mesh dims that split a *fused* tensor along its
      fused dim (each EP rank keeps its own experts, e.g. RL weight sync); everything else is gathered.
      The kept range must fall on HF key boundaries.
    * ``SavePolicy.gather_only("fsdp")``: undo only cuts over these mesh dims; keep all others (the output
      stays in runtime layout, e.g. layer-wise weight transfer).
    * ``SavePolicy.minimal()``: the same HF checkpoint as ``full``, gathering only what whole keys need: a
      tensor's outermost cuts of its fused dim stay applied wherever every rank's range falls on key boundaries
      (EP over whole experts), and the ranks holding a key write it. Far less traffic for MoE models.
    """

    mode: Literal["full", "preserve", "gather_only", "minimal"] = "full"
    mesh_dims: tuple[str, ...] = ()

    @classmethod
    def full(cls) -> SavePolicy:
        """Undo every shard."""
        return cls("full")

    @classmethod
    def preserve(cls, *mesh_dims: str) -> SavePolicy:
        """Keep fused-dim cuts over ``mesh_dims`` (key-aligned), gather the rest."""
        return cls("preserve", tuple(mesh_dims))

    @classmethod
    def minimal(cls) -> SavePolicy:
        """A full checkpoint that leaves key-aligned fused-dim cuts in place (each holder writes its keys)."""
        return cls("minimal")

    @classmethod
    def gather_only(cls, *mesh_dims: str) -> SavePolicy:
        """Undo only cuts over ``mesh_dims``; keep every other cut."""
        return cls("gather_only", tuple(mesh_dims))

    def keeps(self, descriptor: ShardDescriptor, fused_dim: int | None) -> bool:
        """True when a save under this policy leaves ``descriptor`` applied (``minimal`` decides per tensor, in
        ``plan_hf_save``, since it depends on every rank's range)."""
        names = set(_names(descriptor.mesh_dim))
        if self.mode == "preserve":
            return fused_dim is not None and descriptor.dim == fused_dim and bool(names & set(self.mesh_dims))
        if self.mode == "gather_only":
            return not names & set(self.mesh_dims)
        return False

    def __str__(self) -> str:
        return self.mode if self.mode in ("full", "minimal") else f"{self.mode}({', '.join(self.mesh_dims)})"
