"""TorchCommunicator: the Communicator of a real torch.distributed job (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from workbench import _compat
from workbench.errors import PlanError
from workbench.mesh import MeshDimRef, MeshSpec, format_mesh_dim

__all__ = ["TorchCommunicator"]


class TorchCommunicator:
    """Binds the layout's mesh dims (and flattened groups) to process groups of the default world.

    Groups are created at construction for every mesh dim ref the caller will gather over, in one sorted order,
    with ``new_subgroups_by_enumeration``: every rank must construct the communicator with the same refs (it is
    a collective). A group of one rank needs no process group: its gather is the identity.

    .. note:: SPMD: call the constructor on every rank of the world, with the same ``mesh`` and ``mesh_dims``.
    """

    def __init__(self, mesh: MeshSpec, mesh_dims: Iterable[MeshDimRef], *, device: torch.device | str | None = None):
        if not dist.is_initialized():
            raise PlanError("TorchCommunicator needs an initialized default process group (use wb.launch or torchrun)")
        if dist.get_world_size() != mesh.size:
            raise PlanError(
                f"the world has {dist.get_world_size()} ranks but the layout's mesh {mesh!r} has {mesh.size}"
            )
        self.mesh = mesh
        self.rank = dist.get_rank()
        self.device = torch.device(device) if device is not None else None
        self._groups: dict[MeshDimRef, Any] = {}
        self._sizes: dict[MeshDimRef, int] = {}
        for ref in sorted({mesh.resolve(r) for r in mesh_dims}, key=format_mesh_dim):
            groups = mesh.groups(ref)
            self._sizes[ref] = len(groups[0])
            if len(groups[0]) == 1:
                continue
            mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups])
            self._groups[ref] = mine

    def __repr__(self) -> str:
        refs = ", ".join(f"{format_mesh_dim(r)}={n}" for r, n in self._sizes.items())
        return f"TorchCommunicator(rank={self.rank}, backend={dist.get_backend()}, groups=[{refs}])"

    def all_gather(self, send: torch.Tensor, mesh_dim: MeshDimRef) -> torch.Tensor:
        """``W x send`` in group-rank order, through one flat all-gather over the group."""
        ref = self.mesh.resolve(mesh_dim)
        if ref not in self._sizes:
            raise PlanError(f"rank {self.rank}: no process group was made for mesh dim {format_mesh_dim(ref)!r}")
        world = self._sizes[ref]
        if world == 1:
            return send
        send = send.contiguous()
        out = send.new_empty(world * send.numel())
        _compat.all_gather_flat(out, send, self._groups[ref])
        return out

    def barrier(self) -> None:
        """Wait for every rank of the world."""
        dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Small Python objects from every rank, in rank order."""
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
