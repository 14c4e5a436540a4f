"""The unshard scheduler: batch a save's all-gathers into few calls under a memory budget.

A save undoes each tensor's pending shard steps (inner first). The scheduler

1. packs tensors, in plan order, into *waves* whose modeled peak memory stays within ``budget_bytes``
   (a tensor whose own peak exceeds the budget forms a wave alone and is flagged ``oversized``);
2. inside a wave, runs *rounds*: round k takes every tensor's k-th pending step (so an outer gather
   always sees the output of the inner one), and batches the steps of one (mesh dim, dtype) into one
   foreach all-gather *call*.

Every byte count that decides the batching is rank-independent (the largest chunk any rank of the group
sends), so every rank computes the same calls in the same order: the SPMD contract that keeps
collectives from hanging. ``check_schedules`` verifies it across ranks.

Memory model of one call, per rank (the executors free in this order): allocate the flat send buffer,
drop the intermediate inputs, allocate the receive buffer (``W x`` send), drop the send buffer, allocate
the merged outputs, drop the receive buffer. A single contiguous dim-0 gather merges in place (a view of
the receive buffer). A tensor's output stays live until its wave ends (it is then written and freed).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from workbench.errors import PlanError
from workbench.mesh import MeshDimRef, MeshSpec, format_mesh_dim
from workbench.plan.save_plan import HFSavePlan

__all__ = ["GatherCall", "GatherItem", "UnshardSchedule", "check_schedules", "schedule_unshard"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GatherItem:
    """One tensor's step inside a call: this rank sends ``padded_shape`` and gets back ``merged_shape``."""

    name: str
    step: int  # index into the plan's pending steps
    dim: int
    interleave_factor: int
    padded_shape: tuple[int, ...]
    merged_shape: tuple[int, ...]
    bound_numel: int  # largest gathered numel of this step on any rank (rank-independent)


@dataclass(frozen=True, slots=True, kw_only=True)
class GatherCall:
    """One foreach all-gather over one mesh dim (group) and one dtype."""

    wave: int
    round: int
    mesh_dim: MeshDimRef
    world: int
    dtype: torch.dtype
    items: tuple[GatherItem, ...]
    oversized: bool = False

    @property
    def bytes_in(self) -> int:
        """Bytes this rank sends."""
        return sum(math.prod(i.padded_shape) for i in self.items) * self.dtype.itemsize

    @property
    def bytes_out(self) -> int:
        """Bytes this rank receives into the gather buffer (its own chunk included)."""
        return self.bytes_in * self.world

    def structure(self) -> tuple:
        """What must agree on every rank: names, steps, group, dtype (shapes may differ across groups)."""
        return (self.wave, self.round, self.mesh_dim, str(self.dtype), tuple((i.name, i.step) for i in self.items))

    def __str__(self) -> str:
        from workbench.report.patterns import group_by_pattern
        from workbench.report.units import format_bytes

        patterns = [g.pattern for g in group_by_pattern(i.name for i in self.items)]
        names = ", ".join(patterns[:3]) + (f", +{len(patterns) - 3}" if len(patterns) > 3 else "")
        flag = "  OVERSIZED (alone)" if self.oversized else ""
        return (
            f"wave {self.wave} round {self.round}  {format_mesh_dim(self.mesh_dim):<8} W={self.world:<4} "
            f"{str(self.dtype).removeprefix('torch.'):<9} {len(self.items):>4} tensors  "
            f"in {format_bytes(self.bytes_in):>9}  out {format_bytes(self.bytes_out):>9}  [{names}]{flag}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class UnshardSchedule:
    """The all-gather program of a save on one rank, with its predicted cost.

    Attributes:
        rank: the rank the schedule is for.
        calls: every call in execution order.
        waves: tensor names of each wave, in order.
        budget_bytes: the memory budget it was built for (None: unbounded).
        peak_bytes: predicted peak of the memory the save allocates on this rank.
        bytes_moved: bytes this rank receives from other ranks.
    """

    rank: int
    calls: tuple[GatherCall, ...]
    waves: tuple[tuple[str, ...], ...]
    budget_bytes: int | None
    peak_bytes: int
    bytes_moved: int
    signatures: Mapping[str, tuple] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_calls(self) -> int:
        """Number of collective calls."""
        return len(self.calls)

    @property
    def rounds(self) -> tuple[tuple[GatherCall, ...], ...]:
        """Calls grouped by (wave, round), in order."""
        groups: dict[tuple[int, int], list[GatherCall]] = {}
        for call in self.calls:
            groups.setdefault((call.wave, call.round), []).append(call)
        return tuple(tuple(g) for g in groups.values())

    def structure(self) -> tuple:
        """The rank-independent shape of the program (equal on every rank, or collectives hang)."""
        return tuple(c.structure() for c in self.calls)

    def _repr_html_(self) -> str:
        """HTML for notebooks: a table and a small picture (``workbench.viz.html``)."""
        from workbench.viz.html import render_html

        return render_html(self)

    def __str__(self) -> str:
        from workbench.report.patterns import group_by_pattern
        from workbench.report.units import format_bytes

        budget = "unbounded" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        lines = [
            f"UnshardSchedule rank {self.rank}: {len(self.waves)} wave(s), {len(self.rounds)} round(s), "
            f"{self.num_calls} call(s); budget {budget}, predicted peak {format_bytes(self.peak_bytes)}, "
            f"receives {format_bytes(self.bytes_moved)}"
        ]
        if self.budget_bytes is not None and self.peak_bytes > self.budget_bytes:
            oversized = dict.fromkeys(i.name for c in self.calls if c.oversized for i in c.items)
            why = (f": {len(oversized)} tensor(s) larger than the budget are gathered alone: "
                   + ", ".join(g.pattern for g in group_by_pattern(oversized)[:3])) if oversized else ""
            lines.append(f"  ! predicted peak {format_bytes(self.peak_bytes)} is over the budget "
                         f"{format_bytes(self.budget_bytes)}{why}")
        shown = self.calls if len(self.calls) <= 24 else self.calls[:12] + self.calls[-12:]
        for index, call in enumerate(shown):
            if len(self.calls) > 24 and index == 12:
                lines.append(f"  ... {len(self.calls) - 24} more calls")
            lines.append(f"  {call}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        from workbench.report.units import format_bytes

        budget = "None" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        over = ", OVER BUDGET" if self.budget_bytes is not None and self.peak_bytes > self.budget_bytes else ""
        return (
            f"UnshardSchedule(rank={self.rank}, calls={self.num_calls}, waves={len(self.waves)}, budget={budget}, "
            f"peak={format_bytes(self.peak_bytes)}, receives={format_bytes(self.bytes_moved)}{over})"
        )


def schedule_unshard(
    save_plans: Sequence[HFSavePlan],
    dtypes: Mapping[str, torch.dtype] | None = None,
    budget_bytes: int | None = None,
    *,
    reference: UnshardSchedule | None = None,
) -> UnshardSchedule:
    """Build the all-gather schedule of one rank's save plans (every rank passes its own, same order).

    Args:
        save_plans: this rank's plans, in the model's order (the same names, in the same order, on every
            rank).
        dtypes: runtime dtype of each tensor, to count the cast to the gather dtype (default: no cast).
        budget_bytes: bound on the modeled peak memory of a wave (None: one wave, XTuner's behaviour).
        reference: another rank's schedule of the same save. Wave packing only uses rank-independent
            bounds, so its waves are reused (planning a whole world packs once); the calls are rebuilt from
            this rank's plans and must match the reference's structure.

    Returns:
        The schedule; see the module docstring for its memory model.
    """
    if not save_plans:
        return UnshardSchedule(rank=-1, calls=(), waves=(), budget_bytes=budget_bytes, peak_bytes=0, bytes_moved=0)
    rank = save_plans[0].rank
    if len({p.name for p in save_plans}) != len(save_plans):
        raise PlanError("schedule_unshard: save plans repeat a parameter name")
    memo: dict[tuple, tuple] = {}
    tensors = [_Tensor.of(p, (dtypes or {}).get(p.name, p.gather_dtype), memo) for p in save_plans]
    waves = _pack_waves(tensors, budget_bytes) if reference is None else _reuse_waves(tensors, reference)
    calls: list[GatherCall] = []
    peak = 0
    moved = 0
    for w, wave in enumerate(waves):
        wave_peak, wave_calls = _simulate(wave, wave_index=w)
        oversized = budget_bytes is not None and len(wave) == 1 and wave_peak > budget_bytes
        if oversized:
            wave_calls = [_replace_oversized(c) for c in wave_calls]
        calls.extend(wave_calls)
        peak = max(peak, wave_peak)
        moved += sum(c.bytes_out - c.bytes_in for c in wave_calls)
    signatures = {t.name: t.signature() for t in tensors}
    if reference is not None:
        for name, signature in signatures.items():
            if reference.signatures.get(name) != signature:
                raise PlanError(
                    f"rank {rank}'s unshard steps of {name!r} ({signature}) differ from rank {reference.rank}'s "
                    f"({reference.signatures.get(name)}); the two ranks would issue different collectives and hang"
                )
    return UnshardSchedule(
        rank=rank, calls=tuple(calls), waves=tuple(tuple(t.name for t in wave) for wave in waves),
        budget_bytes=budget_bytes, peak_bytes=peak, bytes_moved=moved, signatures=signatures,
    )


def _pack_waves(tensors: list[_Tensor], budget_bytes: int | None) -> list[list[_Tensor]]:
    """Greedy, in plan order: a tensor joins the current wave unless the wave's modeled peak would exceed
    the budget."""
    waves: list[list[_Tensor]] = []
    current: list[_Tensor] = []
    for t in tensors:
        if budget_bytes is not None and current and _simulate([*current, t])[0] > budget_bytes:
            waves.append(current)
            current = []
        current.append(t)
    if current:
        waves.append(current)
    return waves


def _reuse_waves(tensors: list[_Tensor], reference: UnshardSchedule) -> list[list[_Tensor]]:
    by_name = {t.name: t for t in tensors}
    try:
        waves = [[by_name.pop(name) for name in wave] for wave in reference.waves]
    except KeyError as exc:
        raise PlanError(
            f"reference schedule of rank {reference.rank} names {exc}, which this rank does not plan"
        ) from None
    if by_name:
        raise PlanError(f"reference schedule of rank {reference.rank} lacks {sorted(by_name)[:3]}")
    return waves


def check_schedules(schedules: Mapping[int, UnshardSchedule], mesh: MeshSpec) -> None:
    """Check the SPMD contract: the ranks of every group issue the same calls on it, in the same order.

    For each mesh dim a schedule gathers over, and each group of that mesh dim, every member's sequence of
    calls on it (tensors, steps, dtype and send shapes) must be equal. Ranks that share no group may batch
    differently (e.g. one EP rank's keys saved in float32).

    Raises:
        PlanError: naming the group, the ranks and the first call that differs (a real run would hang there).
    """
    sequences: dict[int, dict[MeshDimRef, tuple]] = {}
    by_calls: dict[int, dict[MeshDimRef, tuple]] = {}
    for rank, schedule in schedules.items():
        cached = by_calls.get(id(schedule.calls))
        if cached is None:
            per_dim: dict[MeshDimRef, list[tuple]] = {}
            for call in schedule.calls:
                per_dim.setdefault(call.mesh_dim, []).append(
                    (str(call.dtype), tuple((i.name, i.step, i.padded_shape) for i in call.items))
                )
            cached = by_calls[id(schedule.calls)] = {ref: tuple(seq) for ref, seq in per_dim.items()}
        sequences[rank] = cached
    refs = {ref for per_dim in sequences.values() for ref in per_dim}
    for ref in sorted(refs, key=format_mesh_dim):
        for group in mesh.groups(ref):
            members = [r for r in group if r in sequences]
            if len(members) < 2:
                continue
            first = sequences[members[0]].get(ref, ())
            for other in members[1:]:
                seq = sequences[other].get(ref, ())
                if seq is first or seq == first:
                    continue
                index = next((i for i, (a, b) in enumerate(zip(first, seq)) if a != b), min(len(first), len(seq)))
                raise PlanError(
                    f"ranks {members[0]} and {other} of the {format_mesh_dim(ref)} group {list(group)} disagree at "
                    f"their call {index} on it: {_describe(first, index)} vs {_describe(seq, index)}; the "
                    "all-gather would hang or mix tensors"
                )


# -- internals ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class _Tensor:
    name: str
    dtype: torch.dtype
    runtime_dtype: torch.dtype
    local_numel: int
    output_numel: int
    items: tuple[tuple[MeshDimRef, int, GatherItem], ...]  # (mesh dim, world, item) per pending step

    @classmethod
    def of(cls, plan: HFSavePlan, runtime_dtype: torch.dtype, memo: dict[tuple, tuple] | None = None) -> _Tensor:
        """The scheduler's view of a plan; ``memo`` shares step math between plans with the same steps."""
        memo = {} if memo is None else memo
        key = (id(plan.steps), plan.local_shape, plan.runtime_output_shape)  # () is shared by unsharded plans
        shared = memo.get(key)
        if shared is None or shared[0] is not plan.steps:
            steps = tuple(
                (s.descriptor.mesh_dim, s.world, s.descriptor.dim, s.descriptor.interleave_factor, s.padded_shape,
                 s.shape_before, math.prod(s.gathered_of(s.bound_before or s.shape_before)))
                for s in plan.pending
            )
            shared = memo[key] = (plan.steps, steps, math.prod(plan.local_shape),
                                             math.prod(plan.runtime_output_shape))
        _, steps, local_numel, output_numel = shared
        items = tuple(
            (ref, world, GatherItem(name=plan.name, step=k, dim=dim, interleave_factor=factor, padded_shape=padded,
                                    merged_shape=before, bound_numel=bound))
            for k, (ref, world, dim, factor, padded, before, bound) in enumerate(steps)
        )
        return cls(name=plan.name, dtype=plan.gather_dtype, runtime_dtype=runtime_dtype, local_numel=local_numel,
                   output_numel=output_numel, items=items)

    def signature(self) -> tuple:
        """What the calls depend on: dtype and the (mesh dim, group size) of every pending step."""
        return (self.dtype, tuple((ref, world) for ref, world, _ in self.items))


def _simulate(wave: list[_Tensor], wave_index: int = 0) -> tuple[int, list[GatherCall]]:
    """Peak bytes (rank-independent bound) and the calls of one wave."""
    live = sum(t.local_numel * t.dtype.itemsize for t in wave if t.dtype != t.runtime_dtype)
    peak = live
    held = {t.name: (t.local_numel * t.dtype.itemsize if t.dtype != t.runtime_dtype else 0) for t in wave}
    calls: list[GatherCall] = []
    depth = max((len(t.items) for t in wave), default=0)
    for rnd in range(depth):
        batches: dict[tuple[MeshDimRef, torch.dtype], list[tuple[int, GatherItem]]] = {}
        for t in wave:
            if rnd < len(t.items):
                ref, world, item = t.items[rnd]
                batches.setdefault((ref, t.dtype), []).append((world, item))
        for (ref, dtype), members in batches.items():
            world = members[0][0]
            items = tuple(item for _, item in members)
            size = dtype.itemsize
            out = sum(i.bound_numel for i in items) * size
            send = out // world
            freed = sum(held[i.name] for i in items)
            in_place = len(items) == 1 and items[0].dim == 0 and items[0].interleave_factor == 1
            merged = 0 if in_place else sum(i.bound_numel for i in items) * size
            peak = max(peak, live + send, live - freed + send + out, live - freed + out + merged)
            live = live - freed + (out if in_place else merged)
            for i in items:
                held[i.name] = i.bound_numel * size
            calls.append(GatherCall(wave=wave_index, round=rnd, mesh_dim=ref, world=world, dtype=dtype, items=items))
    return peak, calls


def _replace_oversized(call: GatherCall) -> GatherCall:
    return dataclasses.replace(call, oversized=True)


def _describe(structure: tuple, index: int) -> str:
    return repr(structure[index]) if index < len(structure) else "no call"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
