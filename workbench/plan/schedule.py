"""The unshard scheduler: batch a save's all-gathers into few calls under a memory budget.

A save undoes each tensor's pending shard steps (inner first). The scheduler

1. packs tensors, in plan order, into *waves* whose modeled peak memory stays within ``budget_bytes``
   (a tensor whose own peak exceeds the budget forms a wave alone and is flagged ``oversized``);
2. inside a wave, runs *rounds*: round k takes every tensor's k-th pending step (so an outer gather
   always sees the output of the inner one), and batches the steps of one (mesh dim, dtype) into one
   foreach all-gather *call*;
3. looks ahead: a wave's round-0 call also takes the first (inner, e.g. FSDP) step of tensors of later
   waves on the same (mesh dim, dtype), in plan order, while every wave from this one to theirs stays
   within the budget. Their intermediate outputs (1/W of the tensor, for an outer cut of W ranks) are kept
   until their own wave, whose round 0 then has fewer items or no call at all. Waves are packed leaving
   0 to 50% of the budget for this, and the packing with the fewest calls is kept.

Every byte count that decides the batching is rank-independent (the largest chunk any rank of the group
sends, the largest local tensor and trimmed copy any rank holds, the widest gather dtype any rank may have:
``HFSavePlan.gather_dtype_bounds``), so every rank, planning alone, computes the same waves and look-ahead: the
SPMD contract that keeps collectives from hanging. Calls are batched per (mesh dim, widest gather dtype), the same
on every rank; a rank whose kept keys gather in another dtype (an EP rank's experts, one key saved float32) splits
such a call by its own dtypes, as every member of its groups does (they hold the same keys). ``check_schedules``
verifies it across ranks.

Memory model, per rank: every allocation the executor (``run.executor``) makes, in its order, under the
drivers (``drive``, ``drive_guarded``), which keep the last gathered buffer until the executor's next
request. A wave casts its tensors to the gather dtype (a look-ahead tensor: at its call). A call packs the
flat send buffer (inputs and the previous reply still alive), drops its inputs, receives ``W x`` send, drops
the send buffer, merges each tensor into one new buffer (a single contiguous dim-0 gather merges in place: a
view of the receive buffer), then the receive buffer goes with the next request. A wave's outputs (trimmed
of FP8 tails: a copy unless the trim is a contiguous view; where a kept cut leaves ranks different pieces, one
rank may copy while another keeps its untrimmed output, so both are counted) are handed out at its end and freed
when the executor resumes, except what the writer queue keeps: at most the outputs handed out so far, and at most
``queued_bytes`` or the largest of those outputs, which the queue takes alone (it charges the whole storage a
queued key keeps alive: a key of a fused output keeps the output). Byte counts use each step's largest chunk on
any rank, and each tensor's largest local tensor and trimmed copy on any rank (``HFSavePlan.bound_local_shape``,
``trim_bound_numel``), so the model is exact on the rank holding the largest pieces and an upper bound elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from workbench.display import html_of
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
        from workbench.name_patterns import group_by_pattern
        from workbench.units import format_bytes

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
        peak_bytes: predicted peak of the memory the save allocates on this rank (the writer queue included): an
            upper bound, sized by the largest pieces of any rank.
        bytes_moved: bytes this rank receives from other ranks.
        early: ``{name: wave}`` of the tensors whose first step is gathered ahead, by an earlier wave's call
            (look-ahead); their intermediate output is kept until their own wave.
        queued_bytes: the writer-queue bound the peak counts (see ``schedule_unshard``).
        wave_peaks: modeled peak of the gathers of each wave (without the writer queue).
        gather_scratch: the peaks count a receive scratch buffer per call (the backend needs one: gloo).
    """

    rank: int
    calls: tuple[GatherCall, ...]
    waves: tuple[tuple[str, ...], ...]
    budget_bytes: int | None
    peak_bytes: int
    bytes_moved: int
    early: Mapping[str, int] = field(default_factory=dict, repr=False, compare=False)
    queued_bytes: int = 0
    wave_peaks: tuple[int, ...] = field(default=(), repr=False, compare=False)
    gather_scratch: bool = False
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

    def _repr_html_(self) -> str | None:
        """HTML for notebooks, from the renderer ``workbench.viz`` registers (``workbench.display``)."""
        return html_of(self)

    def __str__(self) -> str:
        from workbench.name_patterns import group_by_pattern
        from workbench.units import format_bytes, head_and_tail

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
        lines += head_and_tail(self.calls, "calls")
        return "\n".join(lines)

    def __repr__(self) -> str:
        from workbench.units import format_bytes

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
    lookahead: bool = True,
    queued_bytes: int = 0,
    gather_scratch: bool = False,
) -> UnshardSchedule:
    """Build the all-gather schedule of one rank's save plans (every rank passes its own, same order).

    Args:
        save_plans: this rank's plans, in the model's order (the same names, in the same order, on every
            rank).
        dtypes: runtime dtype of each tensor, to count the cast to the gather dtype (default: no cast).
        budget_bytes: bound on the modeled peak memory of the gathers (None: one wave, XTuner's behaviour).
        reference: another rank's schedule of the same save. Wave packing and look-ahead only use
            rank-independent bounds, so its waves and look-ahead are reused (planning a whole world packs once);
            the calls are rebuilt from this rank's plans and must match the reference's structure.
        lookahead: batch the first (inner) step of tensors of later waves into an earlier wave's call on the
            same (mesh dim, dtype) while every wave in between stays within the budget (fewer calls).
        queued_bytes: bytes of finished outputs the save may still hold while later waves gather (its writer
            queue: ``save_hf``'s ``host_buffer_bytes`` when outputs stay in the memory the gathers use, i.e.
            on CPU; 0 when they are copied elsewhere, e.g. device outputs snapshotted to host). Counted in
            ``peak_bytes``, not in the budget, which bounds the gathers.
        gather_scratch: the backend receives each call into a scratch buffer of the output's size, then copies
            it out (gloo does; NCCL receives in place): the receive holds the output twice. Counted in the peaks
            and in the budget.

    Returns:
        The schedule; see the module docstring for its memory model.
    """
    if queued_bytes < 0:
        raise PlanError(f"schedule_unshard: queued_bytes must be >= 0, got {queued_bytes}")
    if not save_plans:
        return UnshardSchedule(rank=-1, calls=(), waves=(), budget_bytes=budget_bytes, peak_bytes=0, bytes_moved=0,
                               queued_bytes=queued_bytes, gather_scratch=gather_scratch)
    rank = save_plans[0].rank
    if len({p.name for p in save_plans}) != len(save_plans):
        raise PlanError("schedule_unshard: save plans repeat a parameter name")
    memo: dict[tuple, tuple] = {}
    runtime = dtypes or {}
    tensors = [_Tensor.of(p, runtime.get(p.name, p.gather_dtype), memo) for p in save_plans]
    if reference is None:
        # packed with every tensor at the widest gather dtype any rank may have (a kept cut on the fused dim can
        # leave this rank's keys in another dtype than a peer's): the waves and look-ahead are rank-independent
        if any(p.gather_dtype_bounds not in ((), (p.gather_dtype,)) for p in save_plans):
            bounds = [_Tensor.of(p, runtime.get(p.name), memo, bound=True) for p in save_plans]
            packed, early = _pack(bounds, budget_bytes, lookahead, gather_scratch)
            own = {t.name: t for t in tensors}
            waves = [[own[t.name] for t in wave] for wave in packed]
        else:
            waves, early = _pack(tensors, budget_bytes, lookahead, gather_scratch)
    else:
        waves, early = _reuse_waves(tensors, reference), dict(reference.early)
    state = _State()
    peaks, calls = _run(waves, early, state=state, scratch=gather_scratch)
    oversized_waves = {
        w for w, wave in enumerate(waves) if budget_bytes is not None and len(wave) == 1 and peaks[w] > budget_bytes
    }
    if oversized_waves:
        calls = [_replace_oversized(c) if c.wave in oversized_waves else c for c in calls]
    done = 0  # bytes of outputs handed out before each wave: what the writer queue may still hold
    largest = 0  # the largest output handed out so far: the queue takes one over its bound alone
    peak = 0
    for w, (handed, biggest) in enumerate(state.handed):
        peak = max(peak, peaks[w] + (min(max(queued_bytes, largest), done) if queued_bytes else 0))
        alive, copy, copies = state.ends[w]
        if copy:  # its keys are split one at a time, each queued (or copied off) before the next is made: the
            # queue may hold the earlier ones (a key's copy c, made while the queue holds min(bound, done + copies - c))
            held = min(copy + max(queued_bytes, largest, copy), done + copies) if queued_bytes else copy
            peak = max(peak, alive + held)
        done += handed + copies
        largest = max(largest, biggest, copy)
    moved = sum(c.bytes_out - c.bytes_in for c in calls)
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
        budget_bytes=budget_bytes, peak_bytes=peak, bytes_moved=moved, early=early, queued_bytes=queued_bytes,
        wave_peaks=tuple(peaks), gather_scratch=gather_scratch, signatures=signatures,
    )


# Wave packing leaves this share of the budget free for look-ahead outputs; the fewest calls wins.
_RESERVES = (0.0, 0.125, 0.25, 0.375, 0.5)
_MAX_SPAN = 32  # the farthest wave a look-ahead item may come from


def _pack(
    tensors: list[_Tensor], budget_bytes: int | None, lookahead: bool, scratch: bool = False
) -> tuple[list[list[_Tensor]], dict[str, int]]:
    """Waves and look-ahead (``{name: wave whose call gathers its first step}``) with the fewest calls."""
    if budget_bytes is None or not lookahead:
        return _pack_waves(tensors, budget_bytes, scratch), {}
    best: tuple | None = None
    for reserve in _RESERVES:
        waves = _pack_waves(tensors, int(budget_bytes * (1 - reserve)), scratch)
        early = _look_ahead(waves, budget_bytes, scratch)
        peaks, calls = _run(waves, early, scratch=scratch)
        score = (len(calls), max(peaks, default=0))
        if best is None or score < best[0]:
            best = (score, waves, early)
        if not early:  # no slack to use: a larger reserve only splits more waves
            break
    assert best is not None
    return best[1], best[2]


def _pack_waves(tensors: list[_Tensor], budget_bytes: int | None, scratch: bool = False) -> list[list[_Tensor]]:
    """Greedy, in plan order: a tensor joins the current wave unless the wave's modeled peak would exceed
    the budget."""
    waves: list[list[_Tensor]] = []
    current: list[_Tensor] = []
    for t in tensors:
        if budget_bytes is not None and current and _simulate([*current, t], scratch)[0] > budget_bytes:
            waves.append(current)
            current = []
        current.append(t)
    if current:
        waves.append(current)
    return waves


def _look_ahead(waves: list[list[_Tensor]], budget: int, scratch: bool = False) -> dict[str, int]:
    """Greedy: each wave's round-0 calls take, in plan order, the first steps of later tensors on the same (mesh
    dim, dtype), while the modeled peak of every wave from this one to the item's own stays within ``budget``.
    Per call, the longest prefix of the candidates (within ``_MAX_SPAN`` waves) that fits is found by bisection,
    then cut back to whole source waves (taking part of a wave's call saves no call); every kept choice is
    checked by running the model over the waves it spans."""
    early: dict[str, int] = {}
    by_name = {t.name: t for wave in waves for t in wave}
    wave_of = {t.name: v for v, wave in enumerate(waves) for t in wave}
    state = _State()
    for w, wave in enumerate(waves):
        start = state.copy()
        keys = dict.fromkeys((t.items[0][0], t.dtype) for t in wave if t.items and t.name not in early)
        for key in keys:
            candidates = [
                t.name for v in range(w + 1, min(len(waves), w + 1 + _MAX_SPAN)) for t in waves[v]
                if t.items and t.name not in early and (t.items[0][0], t.dtype) == key
            ]
            context = {"host": w, "start": start, "wave_of": wave_of, "by_name": by_name, "budget": budget,
                       "scratch": scratch}
            low, high = 0, len(candidates)  # fits(low) holds (nothing taken), find the largest such prefix
            while low < high:
                mid = (low + high + 1) // 2
                if _fits(waves, early, candidates[:mid], **context):
                    low = mid
                else:
                    high = mid - 1
            k = low
            if k < len(candidates):  # the wave the prefix ends in keeps its call: take none of it
                last = wave_of[candidates[k - 1]] if k else -1
                if k and wave_of[candidates[k]] == last:
                    k = next(i for i, name in enumerate(candidates) if wave_of[name] == last)
                    if k and not _fits(waves, early, candidates[:k], **context):  # (should not happen: take none)
                        k = 0
            early.update(dict.fromkeys(candidates[:k], w))
        _run(waves, early, state=state, lo=w, hi=w + 1, by_name=by_name, scratch=scratch)
    return early


def _fits(
    waves: list[list[_Tensor]],
    early: Mapping[str, int],
    names: list[str],
    *,
    host: int,
    start: _State,
    wave_of: Mapping[str, int],
    by_name: Mapping[str, _Tensor],
    budget: int,
    scratch: bool,
) -> bool:
    """Whether taking ``names``' first steps into wave ``host``'s calls keeps every wave up to theirs in budget."""
    if not names:
        return True
    trial = {**early, **dict.fromkeys(names, host)}
    hi = wave_of[names[-1]] + 1
    return _run(waves, trial, state=start.copy(), lo=host, hi=hi, by_name=by_name, budget=budget,
                scratch=scratch)[0] != []


def _reuse_waves(tensors: list[_Tensor], reference: UnshardSchedule) -> list[list[_Tensor]]:
    by_name = {t.name: t for t in tensors}
    try:
        waves = [[by_name.pop(name) for name in wave] for wave in reference.waves]
        own_wave = {t.name: w for w, wave in enumerate(waves) for t in wave}
        if any(own_wave[name] <= host for name, host in reference.early.items()):
            raise PlanError(f"reference schedule of rank {reference.rank} gathers a tensor ahead into a later wave")
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
    dtype: torch.dtype  # this rank's gather dtype
    group_dtype: torch.dtype  # the widest gather dtype of any rank (rank-independent): which calls it joins
    local_numel: int  # of the largest local tensor any rank holds (rank-independent)
    output_numel: int
    items: tuple[tuple[MeshDimRef, int, GatherItem], ...]  # (mesh dim, world, item) per pending step
    trim_bytes: int = 0  # bytes of the largest trimmed copy any rank's ``finalize`` makes (FP8 tails), else 0
    # a rank may trim by a view or not at all, keeping its untrimmed output (rank-independent; see ``_may_not_copy``)
    untrimmed_may_stay: bool = False
    cast_bytes: int = 0  # bytes of the largest copy in the gather dtype any rank makes (0: sent as it is)
    split_copies: tuple[int, ...] = ()  # this rank's copies splitting its output into keys (``iter_keys``), per key

    @classmethod
    def of(cls, plan: HFSavePlan, runtime_dtype: torch.dtype | None, memo: dict[tuple, tuple] | None = None, *,
           bound: bool = False) -> _Tensor:
        """The scheduler's view of a plan, sized by its rank-independent bounds; ``memo`` shares step math between
        plans with the same steps. ``runtime_dtype`` None: no cast. ``bound``: at the widest gather dtype any rank
        may have, casting as much as any rank may (what packs waves alike on every rank)."""
        memo = {} if memo is None else memo
        key = (id(plan.steps), plan.bound_local_shape, plan.runtime_output_shape, plan.trim_bound_numel)
        shared = memo.get(key)
        if shared is None or shared[0] is not plan.steps:
            steps = tuple(
                (s.descriptor.mesh_dim, s.world, s.descriptor.dim, s.descriptor.interleave_factor, s.padded_shape,
                 s.shape_before, math.prod(s.gathered_of(s.bound_before or s.shape_before)))
                for s in plan.pending
            )
            shared = memo[key] = (plan.steps, steps, math.prod(plan.bound_local_shape),
                                  math.prod(plan.runtime_output_shape), plan.trim_bound_numel)
        _, steps, local_numel, output_numel, trim_numel = shared
        items = tuple(
            (ref, world, GatherItem(name=plan.name, step=k, dim=dim, interleave_factor=factor, padded_shape=padded,
                                    merged_shape=before, bound_numel=bound))
            for k, (ref, world, dim, factor, padded, before, bound) in enumerate(steps)
        )
        group = plan.widest_gather_dtype
        if bound:
            dtype = group
            cast = max((d.itemsize for d in plan.gather_dtype_bounds or (plan.gather_dtype,)
                        if runtime_dtype is not None and d != runtime_dtype), default=0)
        else:
            dtype = plan.gather_dtype
            cast = dtype.itemsize if runtime_dtype is not None and dtype != runtime_dtype else 0
        split = () if bound else _split_copies(plan.output_shape, plan.fused_dim, len(plan.hf_keys), plan.key_dtypes,
                                               plan.gather_dtype)
        return cls(name=plan.name, dtype=dtype, group_dtype=group, local_numel=local_numel, output_numel=output_numel,
                   items=items, trim_bytes=trim_numel * dtype.itemsize, cast_bytes=local_numel * cast,
                   split_copies=split, untrimmed_may_stay=trim_numel > 0 and _may_not_copy(plan))

    def signature(self) -> tuple:
        """What the calls depend on: the call dtype (rank-independent) and the (mesh dim, group size) of every
        pending step."""
        return (self.group_dtype, tuple((ref, world) for ref, world, _ in self.items))


def _may_not_copy(plan: HFSavePlan) -> bool:
    """Whether some rank may trim its FP8 tail by a view (or have none to trim), where another copies: only where a
    kept cut over several ranks leaves each rank another piece. Without one every rank's output, and so its trim,
    is the same. Where one is kept, which pieces hold the tail depends on the checkpoint-visible shape, which a plan
    does not carry: any may, so the bound keeps the untrimmed output (an upper bound where every rank copies)."""
    return any(s.preserved and s.world > 1 for s in plan.steps)


@functools.lru_cache(maxsize=4096)
def _split_copies(output_shape: tuple[int, ...], fused_dim: int | None, keys: int, key_dtypes: tuple[torch.dtype, ...],
                  dtype: torch.dtype) -> tuple[int, ...]:
    """Bytes of the copy ``run.unshard_ops.iter_keys`` makes of each key of an output (0: the key is a view): one in
    another dtype than the output's, or a piece that is not contiguous (keys fused on a later dim)."""
    if not keys:
        return ()
    if fused_dim is None or keys == 1:
        pieces = (torch.empty(output_shape, dtype=dtype, device="meta"),)
    else:
        pieces = torch.empty(output_shape, dtype=dtype, device="meta").chunk(keys, dim=fused_dim)
    return tuple(
        piece.numel() * d.itemsize if d != dtype or not piece.is_contiguous() else 0
        for piece, d in zip(pieces, key_dtypes)
    )


class _State:
    """What the save holds between calls: bytes alive, each started tensor's current bytes, the last reply."""

    __slots__ = ("ends", "handed", "held", "live", "reply")

    def __init__(self) -> None:
        self.live = 0
        self.held: dict[str, int] = {}
        self.reply = 0  # the driver keeps the last gathered buffer until the executor asks for the next call
        self.handed: list[tuple[int, int]] = []  # bytes of the outputs each wave hands out (allocated by the save),
        # and of the largest of them
        self.ends: list[tuple[int, int, int]] = []  # per wave: bytes alive when its keys are split (outputs and the
        # driver's reply), its largest split copy, and all of them

    def copy(self) -> _State:
        out = _State()
        out.live, out.held, out.reply = self.live, dict(self.held), self.reply
        return out


def _simulate(wave: list[_Tensor], scratch: bool = False) -> tuple[int, list[GatherCall]]:
    """Peak bytes (rank-independent bound) and the calls of one wave on its own (no look-ahead)."""
    peaks, calls = _run([wave], {}, scratch=scratch)
    return peaks[0], calls


def _run(
    waves: Sequence[Sequence[_Tensor]],
    early: Mapping[str, int],
    *,
    state: _State | None = None,
    lo: int = 0,
    hi: int | None = None,
    by_name: Mapping[str, _Tensor] | None = None,
    budget: int | None = None,
    scratch: bool = False,
) -> tuple[list[int], list[GatherCall]]:
    """Run the memory model over waves ``lo..hi`` (from ``state``, which it updates): each wave's peak and calls.
    With ``budget``, stop at the first wave over it and return no peaks (a feasibility check).

    Order of one wave (what ``run.executor`` does): cast the wave's tensors not started yet; then round by
    round, each call casts its look-ahead tensors, packs the send buffer (the last reply is still held by the
    driver), drops its inputs, receives ``W x`` send, drops the send buffer, merges (in place: no copy), and keeps
    the outputs (with ``scratch``, the output is received into a scratch buffer of its size and copied); a
    look-ahead output stays until its own wave. At the end the outputs are trimmed (FP8 tails)
    and handed out; they are freed when the executor resumes (unless the writer queue keeps them).
    """
    state = _State() if state is None else state
    hi = len(waves) if hi is None else hi
    if by_name is None:
        by_name = {t.name: t for wave in waves for t in wave} if early else {}
    pulled: dict[int, list[_Tensor]] = {}
    for name, host in early.items():
        if lo <= host < hi:
            pulled.setdefault(host, []).append(by_name[name])
    if pulled:
        order = {t.name: i for i, t in enumerate(t for wave in waves for t in wave)}
        for members in pulled.values():
            members.sort(key=lambda t: order[t.name])
    held = state.held
    peaks: list[int] = []
    calls: list[GatherCall] = []
    for w in range(lo, hi):
        wave = waves[w]
        state.reply = 0  # a wave output was handed out: the driver dropped its last reply
        for t in wave:
            if t.name not in held:
                held[t.name] = t.cast_bytes
                state.live += t.cast_bytes
        peak = state.live
        foreign = pulled.get(w, [])
        depth = max((len(t.items) for t in wave), default=0)
        pinned = None  # the tensor the wave's last call merged in place: the driver's last reply is its output
        for rnd in range(depth):
            # one call per (mesh dim, widest dtype) on every rank, split by this rank's dtypes (the members of a
            # group, whose covered keys are the same, split alike)
            slots: dict[tuple[MeshDimRef, torch.dtype], dict[torch.dtype, list[tuple[_Tensor, int, GatherItem]]]] = {}
            members = [t for t in wave if rnd < len(t.items) and not (rnd == 0 and t.name in early)]
            if rnd == 0:
                members += foreign
            for t in members:
                ref, world, item = t.items[rnd]
                slots.setdefault((ref, t.group_dtype), {}).setdefault(t.dtype, []).append((t, world, item))
            batches = [((ref, dtype), batch) for (ref, _), split in slots.items() for dtype, batch in split.items()]
            for (ref, dtype), batch in batches:
                world = batch[0][1]
                items = tuple(item for _, _, item in batch)
                for t, _, _ in batch:  # look-ahead tensors are cast when their call packs them
                    if t.name not in held:
                        held[t.name] = t.cast_bytes
                        state.live += t.cast_bytes
                size = dtype.itemsize
                out = sum(i.bound_numel for i in items) * size
                send = out // world
                freed = sum(held[i.name] for i in items)
                in_place = len(items) == 1 and items[0].dim == 0 and items[0].interleave_factor == 1
                merged = 0 if in_place else out
                live = state.live
                staged = out if scratch else 0
                peak = max(peak, live + state.reply + send, live - freed + send + out + staged,
                           live - freed + out + merged)
                state.live = live - freed + (out if in_place else merged)
                state.reply = 0 if in_place else out
                pinned = items[0].name if in_place else None
                for i in items:
                    held[i.name] = i.bound_numel * size
                calls.append(GatherCall(wave=w, round=rnd, mesh_dim=ref, world=world, dtype=dtype, items=items))
        for t in wave:  # FP8 tails: the trimmed copy is made while the untrimmed output is alive
            if t.trim_bytes:
                peak = max(peak, state.live + state.reply + t.trim_bytes)
                # the copy replaces the untrimmed output; a rank whose trim is a view keeps the untrimmed one
                kept = max(held[t.name], t.trim_bytes) if t.untrimmed_may_stay else t.trim_bytes
                if t.name == pinned and kept != held[t.name]:  # the driver holds the untrimmed buffer as its reply
                    state.reply += held[t.name]  # until the wave is handed out
                state.live += kept - held[t.name]
                held[t.name] = kept
        copies = [c for t in wave for c in t.split_copies]
        state.ends.append((state.live + state.reply, max(copies, default=0), sum(copies)))
        handed = biggest = 0
        for t in wave:
            handed += held[t.name]
            biggest = max(biggest, held[t.name])
            state.live -= held.pop(t.name)
        state.handed.append((handed, biggest))
        if budget is not None and peak > budget:
            return [], calls
        peaks.append(peak)
    return peaks, calls


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
