"""The copies an async save starts before it has planned: its previous plan's pieces, copied at the call's first
step, so the device-to-host copies run while the save walks the model, agrees with its peers and plans.

A repeat async save of a GPU model writes what its previous one wrote, from the same tensors. ``take_early``
copies those pieces at once, from the tensors the model's remembered layout holds (no walk of the model, no
exchange). The save then plans as usual, and ``EarlySnapshot.claim`` hands the copies over only when they are
exactly what the plan would copy now: the same layout, key metadata and direct tensors (the very objects the
plan caches return), the same rank, and each piece copied from the same local tensor (same storage address,
dtype, shape and strides). Anything else (a resharded model, another save dtype, a tensor moved) releases them,
and the save copies afresh; a mismatch costs bandwidth, never a wrong byte.

The copies are taken on the caller's stream at the call's start, so they hold the values of call time, as the
copies an async save makes later in the call do.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.io.files.direct import DirectStep, box, direct_program
from workbench.io.files.snapshot import HostCopy, Snapshotter
from workbench.layout.model_layout import Layout, remembered_locals
from workbench.memo import LRU

__all__ = ["EarlySnapshot", "remember_direct_plan", "take_early", "take_step"]

_Anchors = tuple[Layout, Mapping[str, Any], tuple[str, ...], int]  # layout, key metadata, direct names, rank


def take_step(snapshot: Snapshotter, local: torch.Tensor, step: DirectStep,
              key_meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> tuple[HostCopy, ...]:
    """The host copies of one direct tensor's pieces (one copy of the whole local tensor when it is written
    whole), taken without events (``Snapshotter.mark`` records them)."""
    _, whole_dtype, pieces = step
    if whole_dtype is not None:
        return (snapshot.take(_as(local, whole_dtype), mark=False),)
    copies: list[HostCopy] = []
    try:
        for region in pieces:
            copies.append(snapshot.take(_as(local[box(region)], key_meta[region.hf_key][0]), mark=False))
    except BaseException:  # the copies taken so far are nobody's: given back once they have landed
        snapshot.mark()
        for copy in copies:
            copy.discard()
        raise
    return tuple(copies)


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def _source(local: torch.Tensor) -> tuple[Any, ...]:
    return (local.data_ptr(), local.dtype, tuple(local.shape), local.stride(), local.device)


@dataclass(eq=False)
class EarlySnapshot:
    """Copies taken for ``anchors``' plan before the save planned; ``claim`` them or ``release`` them."""

    snapshot: Snapshotter
    anchors: _Anchors
    program: tuple[DirectStep, ...]
    copies: list[tuple[HostCopy, ...]] = field(default_factory=list)
    sources: list[tuple[Any, ...]] = field(default_factory=list)
    claimed: bool = False

    def claim(self, anchors: _Anchors, program: tuple[DirectStep, ...],
              tensors: Mapping[str, torch.Tensor]) -> list[tuple[HostCopy, ...]] | None:
        """The copies, one tuple per step of ``program``, when they were taken for this very plan from these very
        tensors; else None, and they are released."""
        same = (
            not self.claimed and len(self.copies) == len(program) and program is self.program
            and all(a is b for a, b in zip(self.anchors[:3], anchors[:3])) and self.anchors[3] == anchors[3]
            and all(_source(tensors[name]) == src for (name, _, _), src in zip(program, self.sources))
        )
        if not same:
            self.release()
            return None
        self.claimed = True
        return self.copies

    def release(self) -> None:
        """Give back every copy not claimed (idempotent); a claimed copy is the save's to release. The copies are
        waited for first: a buffer back in the pool must not still be the target of a copy in flight."""
        if self.claimed:
            return
        self.snapshot.mark()
        for copies in self.copies:
            for copy in copies:
                if copy.buffer is None:
                    continue
                self.snapshot.copied_bytes -= copy.nbytes
                copy.discard()
        self.copies.clear()
        self.claimed = True  # nothing left to hand over


_LAST = LRU(8)  # id(model) -> (weak reference to the model, its last async direct plan's anchors)


def remember_direct_plan(model: Any, anchors: _Anchors) -> None:
    """Note the plan an async direct save of ``model`` just used: the next one copies its pieces early."""
    if isinstance(model, torch.nn.Module):
        _LAST.put(id(model), (weakref.ref(model), anchors))


def take_early(model: Any, snapshot: Snapshotter) -> EarlySnapshot | None:
    """Copy the pieces ``model``'s last async direct save wrote, from its remembered tensors (device tensors
    only: a CPU copy blocks the caller, so nothing would overlap); None when there is no such plan."""
    hit = _LAST.get(id(model)) if isinstance(model, torch.nn.Module) else None
    if hit is None or hit[0]() is not model:
        return None
    anchors = hit[1]
    layout, key_meta, direct, rank = anchors
    locals_ = remembered_locals(model, layout)
    if locals_ is None:
        return None
    program = direct_program(layout, key_meta, direct, rank)
    if any(locals_[name].device.type == "cpu" for name, _, _ in program):
        return None
    early = EarlySnapshot(snapshot, anchors, program)
    try:
        for step in program:
            local = locals_[step[0]]
            early.copies.append(take_step(snapshot, local, step, key_meta) if step[2] else ())
            early.sources.append(_source(local))
    except Exception:  # a guess that failed: the save copies as usual (and meets the problem there, if real)
        early.release()
        return None
    return early
