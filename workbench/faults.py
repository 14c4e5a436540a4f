"""Fault injection: named points in the save and load paths where a test makes one rank fail.

Production code calls ``fault_point("write")`` at each point; with no ``WORKBENCH_FAULTS`` in the environment
that is one dictionary look-up. A test (or ``bench/faults.py``) sets the variable in any rank::

    WORKBENCH_FAULTS="write@1"              # rank 1 raises an OSError when it writes a tensor
    WORKBENCH_FAULTS="gather:1@0:kill"      # rank 0 SIGKILLs itself when the 2nd gathering wave starts
    WORKBENCH_FAULTS="fsync@*:efbig"        # every rank fails fsync with EFBIG (file too large)
    WORKBENCH_FAULTS="status@1;index@0"     # several rules, separated by ';'

A rule is ``POINT[:DETAIL][@RANKS][:ACTION]``: ``RANKS`` is ``*`` (default) or a list like ``0,2``; ``ACTION``
is ``raise`` (default: an ``InjectedFault``, an OSError), ``efbig``/``enospc`` (that errno), ``memory`` (a
MemoryError), ``bug`` (a plain RuntimeError) or ``kill`` (SIGKILL of this process, no cleanup at all).
``DETAIL`` narrows a point that repeats: ``gather:1`` fires at the second wave that gathers only (waves whose
tensors are written directly, or need no gather, do not count).

In-process tests that need more than a rule (hold a writer thread at a point, raise a ``KeyboardInterrupt``) wrap
the work in ``with fault_hook(fn):``; ``fn(point, rank, detail)`` then runs at every point first.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = [
    "FAULT_ENV", "LOAD_POINTS", "SAVE_POINTS", "FaultRule", "InjectedFault", "fault_hook", "fault_point",
    "parse_faults",
]

FAULT_ENV = "WORKBENCH_FAULTS"

SAVE_POINTS: tuple[str, ...] = (
    "plan",  # after the save is planned, before the ranks agree on the plan
    "snapshot",  # copying a tensor into host memory the save owns
    "gather",  # the start of each wave that gathers (detail: its ordinal among them, from 0)
    "write",  # writing one tensor into its file (a background writer thread)
    "fsync",  # fsync and close of a finished file
    "status",  # preparing this rank's status for the final exchange
    "index",  # rank 0 writing the index and config files
    "rename",  # rank 0, just before the atomic rename that publishes
    "cleanup",  # rank 0, deleting the replaced checkpoint after publishing (the save has succeeded)
)
LOAD_POINTS: tuple[str, ...] = (
    "load.plan",  # the layout derived, before the checkpoint is checked
    "load.planned",  # the reads planned and those landing on the GPU started, before the ranks agree
    "load.read",  # asking for one parameter's slices, after the agreement
    "load.share",  # each batch of replicated parameters broadcast (detail: its ordinal)
    "load.status",  # preparing this rank's status for the final agreement
)

_ACTIONS = ("raise", "efbig", "enospc", "memory", "bug", "kill")


class InjectedFault(OSError):
    """The error an injected ``raise`` fault throws (an OSError, like the disk errors it stands for)."""


@dataclass(frozen=True, slots=True)
class FaultRule:
    """One injection rule: fire ``action`` at ``point`` (and ``detail``) on ``ranks`` (None: every rank)."""

    point: str
    detail: str | None
    ranks: frozenset[int] | None
    action: str

    def matches(self, point: str, detail: object, rank: int) -> bool:
        """True when this rule fires at ``point``/``detail`` on ``rank``."""
        if self.point != point or (self.ranks is not None and rank not in self.ranks):
            return False
        return self.detail is None or self.detail == str(detail)


def parse_faults(text: str) -> tuple[FaultRule, ...]:
    """Parse a ``WORKBENCH_FAULTS`` value; unknown points or actions are an error (a typo must not pass)."""
    rules = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        action = "raise"
        where, _, rest = part.partition("@")
        ranks_text = rest
        if ":" in rest:
            ranks_text, _, action = rest.partition(":")
        elif not rest and where.count(":") >= 1 and where.rsplit(":", 1)[1] in _ACTIONS:
            where, _, action = where.rpartition(":")
        point, _, detail = where.partition(":")
        if point not in SAVE_POINTS + LOAD_POINTS:
            known = SAVE_POINTS + LOAD_POINTS
            raise ValueError(f"{FAULT_ENV}: unknown fault point {point!r} in {part!r}; known: {known}")
        if action not in _ACTIONS:
            raise ValueError(f"{FAULT_ENV}: unknown action {action!r} in {part!r}; known: {_ACTIONS}")
        ranks = None if ranks_text in ("", "*") else frozenset(int(r) for r in ranks_text.split(","))
        rules.append(FaultRule(point, detail or None, ranks, action))
    return tuple(rules)


_cache: dict[str, tuple[FaultRule, ...]] = {}
FaultHook = Callable[[str, int, object], None]
_hooks: tuple[FaultHook, ...] = ()  # replaced, never mutated: threads at a point read a consistent tuple
_hooks_lock = threading.Lock()


@contextlib.contextmanager
def fault_hook(hook: FaultHook) -> Iterator[None]:
    """While the block runs, call ``hook(point, rank, detail)`` at every fault point of this process (in any
    thread), before the ``WORKBENCH_FAULTS`` rules; what it raises is raised at the point."""
    global _hooks
    with _hooks_lock:
        _hooks = (*_hooks, hook)
    try:
        yield
    finally:
        with _hooks_lock:
            kept = list(_hooks)
            kept.remove(hook)
            _hooks = tuple(kept)


def fault_point(point: str, rank: int, detail: object = None) -> None:
    """Fire the fault a ``WORKBENCH_FAULTS`` rule sets for ``point`` on ``rank`` (after any ``fault_hook``);
    otherwise do nothing."""
    for hook in _hooks:
        hook(point, rank, detail)
    text = os.environ.get(FAULT_ENV)
    if not text:
        return
    rules = _cache.get(text)
    if rules is None:
        rules = _cache[text] = parse_faults(text)
    for rule in rules:
        if rule.matches(point, detail, rank):
            _fire(rule, point, detail, rank)


def _fire(rule: FaultRule, point: str, detail: object, rank: int) -> None:
    where = f"{point}" + (f" {detail}" if detail is not None else "")
    if rule.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if rule.action == "efbig":
        raise OSError(errno.EFBIG, f"injected: {os.strerror(errno.EFBIG)} at {where} on rank {rank}")
    if rule.action == "enospc":
        raise OSError(errno.ENOSPC, f"injected: {os.strerror(errno.ENOSPC)} at {where} on rank {rank}")
    if rule.action == "memory":
        raise MemoryError(f"injected: out of memory at {where} on rank {rank}")
    if rule.action == "bug":
        raise RuntimeError(f"injected: a bug at {where} on rank {rank}")
    raise InjectedFault(errno.EIO, f"injected fault at {where} on rank {rank}")
