"""Failure containment for SPMD saves and loads: no rank ever waits in a collective for a peer that failed.

Three mechanisms, used by ``save_hf`` and ``load_hf``:

* **The flag protocol** (``drive_guarded``). Before every data call of the unshard schedule, the ranks of its
  group exchange one flag, "I have failed" (``Communicator.any_flag``). If any rank raises it, every rank of the
  group skips that call and every later call on that group: the decision is made from the same gathered flags
  on every member, so the members stay in step. A rank that failed (an exception in the executor, in writing a
  wave, or in a background writer) stops computing but walks the rest of its schedule raising its flag on every
  group still open, so each peer learns of the failure at its next call on a shared group, passes it on, and no
  one blocks on a call that will not come. Then every rank goes to the status exchange.
* **The status exchange** (``agree``): every rank sends its problem (or None) over the save's own gloo control
  group; if any rank has one, every rank raises the same ``SaveFailed`` naming each failing rank, the stage and
  the cause, root causes first. A rank that died or hangs is reported after the control group's timeout. When a
  collective broke (it timed out, or lost a peer), every rank drops the cached process groups
  (``forget_groups_if_broken``): a group left out of step would pair the next save's calls with stale ones.
* **Interrupts**: an exception that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``) fails the
  rank like any other (it keeps answering its peers and takes part in the status exchange); the caller raises it
  again once the ranks have agreed.
* **The runtime proof of agreement** (``check_agreement``): before the first data call, ranks exchange digests
  of their schedule per group and of the writer map; a mismatch is an error naming the ranks and the first
  differing call, instead of a hang or a torn file.
"""

from __future__ import annotations

import hashlib
import traceback
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workbench.errors import CheckpointError
from workbench.faults import fault_point
from workbench.mesh import MeshSpec, format_mesh_dim
from workbench.plan.schedule import GatherCall, UnshardSchedule
from workbench.run.communicator import Communicator, FinishFailed, own_prepare_gather
from workbench.run.executor import GatherRequest, WaveOutput

__all__ = [
    "LoadFailed",
    "RankProblem",
    "RanksFailed",
    "SaveFailed",
    "agree",
    "check_agreement",
    "describe_problems",
    "drive_guarded",
    "forget_groups_if_broken",
    "problem_from",
]


@dataclass(frozen=True, slots=True)
class RankProblem:
    """What went wrong on one rank: the stage it was in, the cause, and where (traceback tail).

    ``secondary`` marks a rank that stopped only because a peer failed (not a root cause); ``broken`` marks a
    failure of a collective itself (the rank's groups may be unusable).
    """

    rank: int
    stage: str
    cause: str
    where: str = ""
    secondary: bool = False
    broken: bool = False

    def __str__(self) -> str:
        return f"rank {self.rank} failed while {self.stage}: {self.cause}"


class RanksFailed(CheckpointError):
    """A collective operation failed on at least one rank; raised on every rank with every rank's problem."""

    def __init__(self, message: str, problems: Sequence[RankProblem]) -> None:
        super().__init__(message)
        self.problems = tuple(problems)

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        """The ranks with a root-cause problem (not those that stopped because of a peer)."""
        return tuple(p.rank for p in self.problems if not p.secondary)


class SaveFailed(RanksFailed):
    """A save failed on at least one rank; nothing was published."""


class LoadFailed(RanksFailed):
    """A load failed on at least one rank; the model's values must not be used."""


def problem_from(exc: BaseException, rank: int, stage: str, *, broken: bool = False) -> RankProblem:
    """A RankProblem for an exception caught on ``rank`` during ``stage``."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(frames))
    return RankProblem(rank, stage, f"{type(exc).__name__}: {exc}", where, broken=broken)


def agree(
    comm: Communicator,
    mine: RankProblem | None,
    *,
    what: str,
    on_failure: Callable[[], None] | None = None,
    error: type[RanksFailed] = SaveFailed,
    outcome: str = "nothing was published",
    lost: str = "",
    share: Any = None,
) -> list[Any]:
    """Exchange every rank's problem over the control group; if any rank has one, every rank raises ``error``.

    ``on_failure`` runs (on every rank) before raising, e.g. rank 0 removing the temporary directory. If the
    exchange itself fails (a peer died, or did not answer within the timeout), this rank raises with its own
    problem, the exchange's error and ``lost`` (what is known of the outcome then). ``share`` travels in the
    same exchange; every rank's is returned, in rank order (one exchange where two would do).

    When ``comm`` agrees over the whole world (its ``agrees_over_world``: a ``TorchCommunicator`` or a
    ``ControlChannel``, not one pipeline stage) and a problem is a broken collective, or the exchange itself failed,
    every rank drops the cached process groups before raising (``forget_groups_if_broken``).
    """
    world = bool(getattr(comm, "agrees_over_world", False))
    try:
        everyone = comm.all_gather_object((mine, share))
    except Exception as exc:  # a peer is gone: say so with what this rank knows
        gone = problem_from(exc, comm.rank, "exchanging status with its peers", broken=True)
        found = [p for p in (mine, gone) if p is not None]
        if world:
            forget_groups_if_broken(found)
        if on_failure is not None:
            _quietly(on_failure)
        note = ("a peer did not answer the status exchange: it died, hangs, failed before reaching it, or never called "
                "this (every rank of the world calls a save or load, not rank 0 alone)")
        raise error(describe_problems(what, found, lost or outcome, note), found) from exc
    found = [p for p, _ in everyone if p is not None]
    if found:
        if world:
            forget_groups_if_broken(found)
        if on_failure is not None:
            _quietly(on_failure)
        raise error(describe_problems(what, found, outcome), found)
    return [shared for _, shared in everyone]


def forget_groups_if_broken(problems: Sequence[RankProblem | None], *, suspect: bool = False) -> bool:
    """Drop the cached process groups (``torch_comm.forget_groups``) when one of ``problems`` is a broken collective
    (it timed out, or lost a peer) or ``suspect`` (a rank may have left a collective mid-call): such a group is out
    of step and would pair the next save's or load's calls with stale ones. Returns True when they were dropped.

    .. note:: SPMD: every rank of the world calls it with the same exchanged problems, so all decide alike and the
       next save makes fresh groups on every rank (making a group is a collective of the whole world).
    """
    if not suspect and not any(p is not None and p.broken for p in problems):
        return False
    from workbench.run.torch_comm import forget_groups

    forget_groups()
    return True


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # cleanup after a failure must not hide the failure
        pass


def describe_problems(what: str, problems: Sequence[RankProblem], outcome: str, note: str = "") -> str:
    """The message every rank raises: ``"{what} failed; {outcome}."``, then the root causes (identical ones from
    several ranks folded into one line, with where), then the ranks that stopped for them, then ``note``."""
    roots: dict[tuple[str, str], list[RankProblem]] = {}
    for p in problems:
        if not p.secondary:
            roots.setdefault((p.stage, p.cause), []).append(p)
    others = [p.rank for p in problems if p.secondary]
    lines = [f"{what} failed; {outcome}."]
    for (stage, cause), group in roots.items():
        ranks = ", ".join(str(p.rank) for p in group)
        lines.append(f"  rank {ranks} failed while {stage}: {cause}")
        if group[0].where:
            lines.append(f"      at {group[0].where}")
    if others:
        lines.append(f"  rank(s) {', '.join(map(str, others))} stopped because a peer failed")
    if note:
        lines.append(f"  {note}")
    return "\n".join(lines)


# -- the flag protocol -------------------------------------------------------------------------------------------


def drive_guarded(
    schedule: UnshardSchedule,
    program: Generator[GatherRequest | WaveOutput, torch.Tensor | None, None],
    comm: Communicator,
    on_wave: Callable[[WaveOutput], None],
    *,
    poll: Callable[[], RankProblem | None] = lambda: None,
    failed: RankProblem | None = None,
    on_interrupt: Callable[[BaseException], None] | None = None,
) -> RankProblem | None:
    """Run ``program`` (the executor of ``schedule``) on this rank; never leaves a peer waiting in a collective.

    Returns this rank's problem, or None: a local failure (in the program, in ``on_wave``, or reported by
    ``poll``, e.g. a background writer), a peer's failure learnt through the flags (``secondary``), or a failed
    collective (``broken``). ``failed`` starts the rank already failed (it then only raises its flags).

    An exception that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``) in the program, in ``on_wave``
    or at a fault point fails the rank like any other: it is this rank's problem and the rank walks the rest of its
    schedule raising its flags. Then it goes to ``on_interrupt`` (the caller raises it again after the status
    exchange) or, without one, is raised here, once the flags are all exchanged.
    """
    interrupts: list[BaseException] = []

    def caught(exc: BaseException, stage: str, *, broken: bool = False) -> RankProblem:
        if not isinstance(exc, Exception) and not interrupts:
            interrupts.append(exc)
        return problem_from(exc, comm.rank, stage, broken=broken)

    problem = _drive(schedule, program, comm, on_wave, poll, failed, caught)
    if interrupts:
        if on_interrupt is None:
            raise interrupts[0]
        on_interrupt(interrupts[0])
    return problem


def _drive(
    schedule: UnshardSchedule,
    program: Generator[GatherRequest | WaveOutput, torch.Tensor | None, None],
    comm: Communicator,
    on_wave: Callable[[WaveOutput], None],
    poll: Callable[[], RankProblem | None],
    failed: RankProblem | None,
    caught: Callable[..., RankProblem],
) -> RankProblem | None:
    """``drive_guarded``'s walk; ``caught(exc, stage, broken=...)`` makes the problem of anything raised."""
    rank = comm.rank
    calls = schedule.calls
    # a communicator's own (a wrapper forwarding unknown names to another has an all_gather without ``prepared``)
    prepare = own_prepare_gather(comm)
    closed: set = set()  # mesh dims whose group skipped a call: every member skips the rest on it
    index, wave, gathering = 0, -1, -1  # gathering: the ordinal of the current wave among those that gather
    reply: torch.Tensor | None = None
    while True:
        send: torch.Tensor | None = None
        prepared = None  # the last call's buffers: dropped before the executor runs on, as its send buffer is
        if failed is None:
            try:
                request = program.send(reply)
            except StopIteration:
                return None
            except BaseException as exc:  # KeyboardInterrupt too: the peers still need this rank's flags
                failed = caught(exc, f"gathering (wave {max(wave, 0)})")
            else:
                reply = None
                if isinstance(request, WaveOutput):
                    try:
                        on_wave(request)
                    except BaseException as exc:
                        failed = caught(exc, f"writing wave {request.wave}")
                    continue
                if index >= len(calls) or request.call is not calls[index]:
                    failed = RankProblem(rank, "gathering", f"the executor issued {request.call} out of order")
                else:
                    send = request.send
        if failed is not None:
            program.close()
            if index >= len(calls):
                return failed
        call = calls[index]
        index += 1
        if call.wave != wave:
            wave, gathering = call.wave, gathering + 1
            if failed is None:
                try:
                    fault_point("gather", rank, gathering)
                except BaseException as exc:
                    failed = caught(exc, f"gathering (wave {wave})")
        failed = failed or poll()
        if call.mesh_dim in closed:
            continue
        if failed is None and prepare is not None and call.world > 1:
            try:  # what can fail on this rank alone (the receive buffer) fails before its flag, not in the call
                prepared = prepare(send, call.mesh_dim)
            except BaseException as exc:
                failed = caught(exc, f"gathering (wave {wave})")
        if call.world > 1:
            try:
                stop = comm.any_flag(call.mesh_dim, failed is not None)
            except BaseException as exc:  # the group may be out of step: no more calls on any group
                problem = caught(exc, f"gathering (wave {wave})", broken=True)
                return failed or problem
            if stop:
                closed.add(call.mesh_dim)
                failed = failed or RankProblem(
                    rank, f"gathering (wave {wave})",
                    f"a peer in its {format_mesh_dim(call.mesh_dim)} group failed", secondary=True,
                )
                continue
        if failed is None:
            try:
                reply = (comm.all_gather(send, call.mesh_dim) if prepared is None
                         else comm.all_gather(send, call.mesh_dim, prepared=prepared))
            except FinishFailed as exc:  # the collective itself ended on every rank: walk on, raising flags
                failed = caught(exc.__cause__ or exc, f"gathering (wave {wave})")
            except BaseException as exc:
                return caught(exc, f"gathering (wave {wave})", broken=True)


# -- the runtime proof that the ranks agree ------------------------------------------------------------------------


def _call_signature(call: GatherCall) -> tuple:
    items = tuple((i.name, i.step, i.padded_shape) for i in call.items)
    return (call.wave, call.round, str(call.dtype), items)


def schedule_signatures(schedule: UnshardSchedule, mesh: MeshSpec, rank: int) -> dict[tuple, list[tuple]]:
    """Per group this rank gathers over, ``(mesh dim, group ranks) -> [call signature, ...]`` in order."""
    out: dict[tuple, list[tuple]] = {}
    for call in schedule.calls:
        if call.world == 1:
            continue
        key = (format_mesh_dim(call.mesh_dim), mesh.group_ranks(rank, call.mesh_dim))
        out.setdefault(key, []).append(_call_signature(call))
    return out


def _digest(obj: object) -> str:
    return hashlib.sha1(repr(obj).encode()).hexdigest()[:16]


def plan_digests(schedule: UnshardSchedule, writers: Mapping[str, int], mesh: MeshSpec, rank: int) -> tuple:
    """What ``check_agreement`` compares: a digest of this rank's calls per group, and of the writer map (small:
    it can travel in the exchange that agrees on the planning outcome)."""
    mine = schedule_signatures(schedule, mesh, rank)
    return {key: _digest(sigs) for key, sigs in mine.items()}, _digest(sorted(writers.items()))


def check_agreement(
    comm: Communicator, schedule: UnshardSchedule, writers: Mapping[str, int], mesh: MeshSpec, *, what: str,
    digests: Sequence[tuple] | None = None,
) -> None:
    """Prove, before the first data call, that every group's ranks will issue the same calls and that every rank
    has the same writer map; raise SaveFailed on every rank otherwise, naming the ranks and the first difference.

    ``digests``: every rank's ``plan_digests``, when an earlier exchange carried them (else they are exchanged).
    """
    everyone = digests if digests is not None else comm.all_gather_object(
        plan_digests(schedule, writers, mesh, comm.rank))
    by_group: dict[tuple, dict[int, str]] = {}
    for r, (groups, _) in enumerate(everyone):
        for key, digest in groups.items():
            by_group.setdefault(key, {})[r] = digest
    bad_groups = sorted(
        (key for key, seen in by_group.items() if len(set(seen.values())) > 1 or set(seen) != set(key[1])),
        key=repr,
    )
    writer_sets: dict[str, list[int]] = {}
    for r, (_, digest) in enumerate(everyone):
        writer_sets.setdefault(digest, []).append(r)
    if not bad_groups and len(writer_sets) == 1:
        return
    # second round, only on a mismatch: the full signatures of the groups that differ, and the writer maps
    mine = schedule_signatures(schedule, mesh, comm.rank)
    my_groups = {key: mine.get(key) for key in bad_groups if comm.rank in key[1]}
    detail = comm.all_gather_object((my_groups, dict(writers) if len(writer_sets) > 1 else None))
    lines = []
    for key in bad_groups:
        lines.append(_describe_group(key, {r: d[0].get(key) for r, d in enumerate(detail) if r in key[1]}))
    if len(writer_sets) > 1:
        lines.append(_describe_writers({r: d[1] for r, d in enumerate(detail)}, writer_sets))
    problem = RankProblem(comm.rank, "checking that the ranks agree on the plan", "; ".join(lines))
    raise SaveFailed(
        f"{what} refused before any data moved: the ranks' plans differ (every rank must pass the same call "
        "arguments and the same layout; if they did, this is a planner defect: please report it):\n  "
        + "\n  ".join(lines),
        [problem],
    )


def _describe_group(key: tuple, calls_by_rank: Mapping[int, list[tuple] | None]) -> str:
    dim, ranks = key
    listed = {r: calls_by_rank.get(r) or [] for r in ranks}
    length = max(len(c) for c in listed.values())
    for i in range(length):
        seen = {r: (c[i] if i < len(c) else None) for r, c in listed.items()}
        if len(set(map(repr, seen.values()))) > 1:
            parts = ", ".join(f"rank {r}: {_fmt_signature(s)}" for r, s in seen.items())
            return f"group {dim} {list(ranks)}: call {i} differs ({parts})"
    return f"group {dim} {list(ranks)}: the ranks issue different numbers of calls"


def _fmt_signature(sig: tuple | None) -> str:
    if sig is None:
        return "no call"
    wave, rnd, dtype, items = sig
    names = ", ".join(f"{n}[step {s}] {tuple(shape)}" for n, s, shape in items[:3])
    return f"wave {wave} round {rnd} {dtype.removeprefix('torch.')} [{names}{', ...' if len(items) > 3 else ''}]"


def _describe_writers(maps: Mapping[int, Mapping[str, int] | None], sets: Mapping[str, list[int]]) -> str:
    groups = sorted(sets.values())
    a, b = groups[0][0], groups[1][0]
    ma, mb = maps.get(a) or {}, maps.get(b) or {}
    for key in sorted(set(ma) | set(mb)):
        if ma.get(key) != mb.get(key):
            return (
                f"writer maps differ between ranks {groups[0]} and {groups[1]}: key {key!r} is written by rank "
                f"{ma.get(key)} according to rank {a}, by rank {mb.get(key)} according to rank {b}"
            )
    return f"writer maps differ between ranks {groups[0]} and {groups[1]}"
