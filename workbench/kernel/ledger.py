"""Which collective a rank is in, readable from outside the rank without its help: a record in shared memory.

A rank whose main thread holds the GIL in native code cannot answer a question, but the collectives it called
through ``torch.distributed`` wrote down, on the way in and out, what they are: ``track`` wraps the collectives of
``torch.distributed`` (each call enters and leaves the ``Ledger``, a small memory-mapped file of the rank), and
``read_ledger`` reads that file from any process on the rank's host, the kernel or a peer rank, with no
cooperation from the rank. A record names the operation, its group (name and ranks), the call's number on that
group since the groups were made, and since when the rank is in it. On NCCL a call returns before the GPU ran it:
the record then keeps ``pending``, a CUDA event recorded after the call (public ``torch.cuda.Event``), which a
thread of the rank can query to say whether the GPU has finished the rank's last collective on each group.

The writer bumps a version number to odd before it writes and to even after, so a reader never takes a half
written record (it retries).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["COLLECTIVES", "Ledger", "member_ranks", "read_ledger", "track"]

SIZE = 4096  # bytes of the file: a version, a length, then the record as JSON
_LISTED_MEMBERS = 64  # an uneven group of more ranks than this is not listed in a call (its record would not fit)
_HEAD = struct.Struct("<QI")

# the collectives of torch.distributed that ranks call and wait in (object collectives call these inside)
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
    "reduce", "all_to_all", "all_to_all_single", "barrier", "gather", "scatter", "all_gather_object",
    "broadcast_object_list", "gather_object", "scatter_object_list", "monitored_barrier", "send", "recv",
    "batch_isend_irecv",
)


class Ledger:
    """The rank's side: the record of the collective it is in (or was in last), in a file of mode 0600."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._version = 0
        self._lock = threading.Lock()
        self._inside: list[tuple[str, dict[str, Any]]] = []  # (group name, call): an object collective nests
        self._seq: dict[str, int] = {}  # group name -> calls so far on it
        self._groups: dict[str, tuple[str, dict[str, Any] | None]] = {}  # group name -> label, members
        self._last: dict[str, dict[str, Any]] = {}  # group name -> the last call on it (NCCL: with its event)
        self._write({"state": "idle"})

    def forget_groups(self) -> None:
        """After the process groups were destroyed and made again: numbers start over, names mean new groups."""
        self._seq.clear()
        self._groups.clear()
        self._last.clear()
        self._write({"state": "idle"})

    def enter(self, op: str, group: Any) -> dict[str, Any]:
        """A collective starts on this rank: write it down (called by ``track``'s wrappers)."""
        name, label, members = self._group(group)
        seq = self._seq.get(name, 0) + 1
        self._seq[name] = seq
        call = {"op": op, "group": label, "seq": seq, "since": time.time()}
        if members is not None:
            call["members"] = members
        if self._inside:
            call["within"] = self._inside[0][1]["op"]
        self._inside.append((name, call))
        self._write({"state": "in", **call})
        return call

    def leave(self, call: dict[str, Any], event: Any = None) -> None:
        """The collective returned (or raised); ``event`` (NCCL) completes when the GPU has run it."""
        name = next((n for n, c in reversed(self._inside) if c is call), None)
        self._inside = [(n, c) for n, c in self._inside if c is not call]
        if name is not None:
            self._last[name] = {**call, "returned": time.time(), "event": event}
        if self._inside:
            self._write({"state": "in", **self._inside[-1][1]})
        else:
            self._write({"state": "out", "last": call})

    def pending(self) -> list[dict[str, Any]]:
        """The last call on each group whose CUDA event has not completed (the GPU still waits in it)."""
        out = []
        for last in list(self._last.values()):
            event = last.get("event")
            if event is None:
                continue
            with contextlib.suppress(Exception):
                import torch

                with torch.cuda.device(event.device):  # this thread may have no current device (or another)
                    done = event.query()
                if not done:
                    out.append({k: v for k, v in last.items() if k != "event"})
        return out

    def _group(self, group: Any) -> tuple[str, str, dict[str, Any] | None]:
        """The group's name, its label for people and its members (``members``' form), looked up once per group."""
        import torch.distributed as dist

        pg = group if group is not None else dist.group.WORLD
        name = "default" if pg is None or pg is dist.group.WORLD else str(getattr(pg, "group_name", id(pg)))
        known = self._groups.get(name)
        if known is None:
            ranks: list[int] = []
            with contextlib.suppress(Exception):
                ranks = list(dist.get_process_group_ranks(pg))
            label = f"{name} (ranks {_span(ranks)})" if ranks else name
            known = self._groups[name] = (label, _members(ranks) if ranks else None)
        return name, *known

    def _write(self, record: dict[str, Any]) -> None:
        body = json.dumps(record, separators=(",", ":"), default=str).encode()[: SIZE - _HEAD.size]
        with self._lock:
            self._version += 1
            _HEAD.pack_into(self._map, 0, self._version, 0)  # odd: being written
            self._map[_HEAD.size:_HEAD.size + len(body)] = body
            self._version += 1
            _HEAD.pack_into(self._map, 0, self._version, len(body))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._map.close()


def read_ledger(path: str, tries: int = 100) -> dict[str, Any] | None:
    """The record a rank's ``Ledger`` holds now, or None (no such file, or never a steady read)."""
    try:
        with open(path, "rb") as f:
            view = mmap.mmap(f.fileno(), SIZE, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    try:
        for _ in range(tries):
            version, length = _HEAD.unpack_from(view, 0)
            body = bytes(view[_HEAD.size:_HEAD.size + length])
            if version % 2 == 0 and _HEAD.unpack_from(view, 0)[0] == version:
                with contextlib.suppress(ValueError):
                    return json.loads(body)
            time.sleep(0.001)
        return None
    finally:
        view.close()


def track(ledger: Ledger, *, cuda_events: bool = False) -> Callable[[], None]:
    """Wrap ``torch.distributed``'s collectives (module and ``distributed_c10d``) so each call writes ``ledger``.

    Arguments and results pass through untouched. ``cuda_events``: after a call that waited (``async_op``
    false) record a CUDA event on the current stream, so ``Ledger.pending`` can tell whether the GPU finished it.
    Returns a function that puts the original functions back.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    undo: list[tuple[Any, str, Any]] = []
    for op in COLLECTIVES:
        original = getattr(c10d, op, None)
        if original is None or getattr(original, "__wrapped_by_workbench__", False):
            continue
        wrapper = _wrap(ledger, op, original, cuda_events)
        for module in (c10d, dist):
            if getattr(module, op, None) is original:
                undo.append((module, op, original))
                setattr(module, op, wrapper)

    def restore() -> None:
        for module, op, original in undo:
            setattr(module, op, original)

    return restore


def _wrap(ledger: Ledger, op: str, original: Callable[..., Any], cuda_events: bool) -> Callable[..., Any]:
    params = list(inspect.signature(original).parameters)
    group_at = params.index("group") if "group" in params else None
    async_at = params.index("async_op") if "async_op" in params else None

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[group_at] if group_at is not None and len(args) > group_at else None)
        try:
            call = ledger.enter(op, group)
        except Exception:  # the ledger must never break a collective
            return original(*args, **kwargs)
        result = None
        try:
            result = original(*args, **kwargs)
        finally:
            event = None
            if cuda_events:
                waited = not kwargs.get("async_op", args[async_at] if async_at is not None and len(args) > async_at
                                        else False)
                event = _cuda_event() if waited else None
            with contextlib.suppress(Exception):
                ledger.leave(call, event)
        return result

    collective.__wrapped_by_workbench__ = True  # type: ignore[attr-defined]
    return collective


def _cuda_event() -> Any:
    import torch

    with contextlib.suppress(Exception):
        event = torch.cuda.Event()
        event.record()
        return event
    return None


def _members(ranks: list[int]) -> dict[str, Any] | None:
    """A group's global ranks as a call records them: ``{"first", "last", "step"}`` when they step evenly (a device
    mesh's groups: any size fits), else ``{"ranks": [...]}`` when short; None when they would not fit the record."""
    ordered = sorted(ranks)
    step = ordered[1] - ordered[0] if len(ordered) > 1 else 1
    if step > 0 and ordered == list(range(ordered[0], ordered[-1] + 1, step)):
        return {"first": ordered[0], "last": ordered[-1], "step": step}
    return {"ranks": ordered} if len(ordered) <= _LISTED_MEMBERS else None


def member_ranks(call: dict[str, Any] | None) -> set[int] | None:
    """The global ranks of a ledger call's group (its ``members``), or None where the ledger does not know them."""
    members = (call or {}).get("members")
    with contextlib.suppress(KeyError, TypeError, ValueError):
        if "ranks" in members:
            return {int(r) for r in members["ranks"]}
        return set(range(int(members["first"]), int(members["last"]) + 1, int(members["step"])))
    return None


def _span(ranks: list[int]) -> str:
    """[0, 1, 2, 3] -> "0-3"; [0, 2] -> "0,2"; long irregular lists are cut."""
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    text = ",".join(map(str, ranks[:8]))
    return text + (f",... ({len(ranks)} ranks)" if len(ranks) > 8 else "")
