"""Communicator: what an executor needs from a world of ranks, and the driver loop that uses it."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Protocol, runtime_checkable

import torch

from workbench.mesh import MeshDimRef
from workbench.run.executor import GatherRequest, WaveOutput

__all__ = ["Communicator", "FinishFailed", "PreparedGather", "drive", "own_prepare_gather"]


class FinishFailed(Exception):
    """This rank's work after a collective that every rank of its group completed (a reorder copy) failed: a local
    failure like any other, not a broken collective. The cause is ``__cause__``."""


@runtime_checkable
class PreparedGather(Protocol):
    """What ``prepare_gather`` made ready for one all-gather (the flat send, the receive buffer)."""


@runtime_checkable
class Communicator(Protocol):
    """One rank's view of the world: collectives over mesh dims named like the layout's."""

    rank: int

    def all_gather(self, send: torch.Tensor, mesh_dim: MeshDimRef) -> torch.Tensor:
        """Concatenate ``send`` of every rank in this rank's group along ``mesh_dim`` (group-rank order)."""
        ...

    # Optional: ``prepare_gather(send, mesh_dim) -> PreparedGather`` does all of an all-gather that can fail on this
    # rank alone (a contiguous copy, the receive buffer) before the ranks agree to make the call, and
    # ``all_gather(send, mesh_dim, prepared=...)`` then only calls the collective (``guard.drive_guarded``).

    def any_flag(self, mesh_dim: MeshDimRef, flag: bool) -> bool:
        """True on every rank of this rank's group along ``mesh_dim`` when any of them passes True."""
        ...

    def barrier(self) -> None:
        """Wait for every rank."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Small Python objects from every rank, in rank order."""
        ...


def own_prepare_gather(comm: Any) -> Callable[[torch.Tensor, MeshDimRef], Any] | None:
    """``comm.prepare_gather`` where ``comm``'s own class defines it, else None. A wrapper that forwards unknown names
    to the communicator it wraps (``__getattr__``) hands out the inner one's, whose buffer its own ``all_gather``
    would not take: only a class that defines both prepares a gather."""
    return comm.prepare_gather if getattr(type(comm), "prepare_gather", None) is not None else None


def drive(
    program: Generator[GatherRequest | WaveOutput, torch.Tensor | None, None],
    comm: Communicator,
    on_wave: Callable[[WaveOutput], None],
) -> None:
    """Run an executor generator on one rank: answer its gathers with ``comm``, hand waves to ``on_wave``."""
    reply: torch.Tensor | None = None
    while True:
        try:
            request = program.send(reply)
        except StopIteration:
            return
        reply = None  # the executor owns the gathered buffer now; do not keep it through the next call
        if isinstance(request, GatherRequest):
            reply = comm.all_gather(request.send, request.mesh_dim)
        else:
            on_wave(request)
            reply = None
