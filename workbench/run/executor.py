"""The unshard executor: runs an UnshardSchedule on one rank, as a generator that yields its collectives.

The executor never talks to a network. At each call it yields a ``GatherRequest`` (the flat send buffer
and the mesh dim to gather over) and is resumed with the gathered buffer. A driver answers the requests:
``torch.distributed`` for real runs, ``SimulatedWorld`` for all ranks in one process. Both therefore run
the very same code on the very same schedule.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass

import torch

from workbench.errors import PlanError
from workbench.mesh import MeshDimRef
from workbench.plan.save_plan import HFSavePlan
from workbench.plan.schedule import GatherCall, UnshardSchedule
from workbench.run.unshard_ops import finalize, merge, merge_in_place, pack, unpack

__all__ = ["GatherRequest", "WaveOutput", "unshard"]


class GatherRequest:
    """An all-gather the executor needs: ``send`` from this rank over ``mesh_dim``; answer ``W x send``.

    The send buffer belongs to the executor: it is released when the executor is resumed (a driver that keeps
    the request does not keep the buffer alive; ``send`` then raises).
    """

    __slots__ = ("_send", "call")

    def __init__(self, call: GatherCall, send: torch.Tensor) -> None:
        self.call = call
        self._send: torch.Tensor | None = send

    @property
    def send(self) -> torch.Tensor:
        """The flat send buffer (valid until the executor is resumed)."""
        if self._send is None:
            raise PlanError(f"the send buffer of {self.call} was released when the executor resumed")
        return self._send

    @property
    def mesh_dim(self) -> MeshDimRef:
        """The mesh dim (group) to gather over."""
        return self.call.mesh_dim

    def release(self) -> None:
        """Drop the send buffer (the executor calls it when resumed)."""
        self._send = None

    def __repr__(self) -> str:
        state = "released" if self._send is None else f"send={tuple(self._send.shape)}"
        return f"GatherRequest({self.call}, {state})"


@dataclass(frozen=True, slots=True)
class WaveOutput:
    """Checkpoint-visible outputs of one finished wave, ``{name: tensor}``; written, then dropped.

    ``tensors`` is emptied when the executor is resumed: keep what you need (a reference to a tensor, not to
    the dict) inside the callback.
    """

    wave: int
    tensors: dict[str, torch.Tensor]


def unshard(
    schedule: UnshardSchedule,
    plans: Sequence[HFSavePlan],
    local_tensors: Mapping[str, torch.Tensor],
) -> Generator[GatherRequest | WaveOutput, torch.Tensor | None, None]:
    """Run ``schedule`` on this rank's ``local_tensors``; yields requests and finished waves.

    Drive it with ``send``: after a ``GatherRequest`` send the gathered buffer; after a ``WaveOutput``
    send ``None``. Tensors are cast to their plan's gather dtype when their wave starts, or when a call of an
    earlier wave gathers their first step ahead (look-ahead); such an intermediate output is kept until its
    own wave. Buffers are dropped in the order ``schedule_unshard``'s memory model assumes.
    """
    by_name = {p.name: p for p in plans}
    calls_by_wave: dict[int, list[GatherCall]] = {}
    for call in schedule.calls:
        calls_by_wave.setdefault(call.wave, []).append(call)
    work: dict[str, torch.Tensor] = {}  # tensors in flight, look-ahead ones across waves

    def start(name: str) -> None:
        if name in work:
            return
        plan = by_name[name]
        local = local_tensors[name]
        if tuple(local.shape) != plan.local_shape:
            raise PlanError(
                f"parameter {name!r}, rank {plan.rank}: local tensor has shape {tuple(local.shape)}, but the "
                f"plan expects {plan.local_shape} (layout: {[str(s.descriptor) for s in plan.steps]})"
            )
        work[name] = local.to(plan.gather_dtype)

    for w, names in enumerate(schedule.waves):
        for name in names:
            start(name)
        for call in calls_by_wave.get(w, ()):
            for item in call.items:
                start(item.name)
            inputs = [work.pop(i.name) for i in call.items]
            request = GatherRequest(call, pack(inputs, call.items, call.dtype))
            del inputs
            gathered = yield request
            request.release()
            if gathered is None:
                raise PlanError(f"executor expected the gathered buffer of {call}, got None")
            alone = merge_in_place(gathered, call.items[0], call.world) if len(call.items) == 1 else None
            if alone is not None:  # the gathered buffer is the tensor: no copy
                work[call.items[0].name] = alone
                del gathered, alone  # held by ``work`` alone: freed with the wave, as the memory model says
                continue
            for item, item_chunks in zip(call.items, unpack(gathered, call.items, call.world)):
                work[item.name] = merge(item_chunks, item)
            del gathered, item_chunks, alone
        out = WaveOutput(w, {name: finalize(work.pop(name), by_name[name]) for name in names})
        yield out
        out.tensors.clear()
