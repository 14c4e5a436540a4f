"""TorchCommunicator: the Communicator of a real torch.distributed job (gloo on CPU, NCCL on GPU).

Three kinds of process groups serve a save or a load, all created once per (mesh, timeout) and reused by every
later save of the same mesh (``new_group`` is a collective of the whole world, and groups are never freed by
torch until the job ends, so making them per save would leak):

* **data groups**, one set per mesh dim (or flattened dims) the layout gathers over, on the world's backend;
* **flag groups**, the same rank sets on gloo (the data groups themselves when the world is gloo): before each
  data call the ranks of its group exchange one "has anyone failed" flag, so a failing rank never leaves a
  peer waiting in a data call (``run/guard.py``);
* one **control group**, the whole world on gloo, for the status exchange and agreement, with the caller's
  timeout (a rank that died or hangs is reported after ``timeout`` seconds, not the backend's 10-30 minutes).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import hashlib
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from workbench import _compat
from workbench.errors import CheckpointError, PeersAbsent, PlanError
from workbench.mesh import MeshDimRef, MeshSpec, format_mesh_dim
from workbench.run.communicator import FinishFailed

__all__ = [
    "DEFAULT_TIMEOUT", "ControlChannel", "TorchCommunicator", "control_group", "forget_groups", "join_the_world",
    "ranks_listed",
]

DEFAULT_TIMEOUT = 600.0  # seconds a save's collective may wait for a peer that died or hangs
_GROUPS: dict[tuple, Any] = {}  # (backend, timeout, rank sets) -> this rank's group


def _timedelta(timeout: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(timeout))


def _subgroup(groups: tuple[tuple[int, ...], ...], backend: str | None, timeout: float) -> Any:
    """This rank's group among ``groups`` (a partition of the world), created once and cached."""
    key = (backend, float(timeout), groups)
    if key not in _GROUPS:
        mine, _ = dist.new_subgroups_by_enumeration(
            [list(g) for g in groups], timeout=_timedelta(timeout), backend=backend
        )
        _GROUPS[key] = mine
    return _GROUPS[key]


# dtypes every backend's collectives carry; any other (float8, int16, unsigned, bool, complex) goes as its bytes
_WIRE_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                          torch.int8, torch.uint8})


def _on_the_wire(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous) as a collective may carry it: itself, or a flat view of its bytes for a dtype gloo
    lacks (a gather or broadcast moves bytes whole, so nothing changes but the type: "Invalid scalar type" named
    neither the parameter nor the dtype)."""
    return tensor if tensor.dtype in _WIRE_DTYPES else tensor.view(-1).view(torch.uint8)  # a view: in place


def control_group(timeout: float = DEFAULT_TIMEOUT) -> Any:
    """The whole world on gloo with ``timeout``: the save's and load's own group for status and agreement.

    .. note:: SPMD: the first call for a timeout is a collective of the whole world.
    """
    if str(dist.get_backend()) == "fake":  # a fake world (planning, tests): its own group answers everything
        return None
    key = ("control", float(timeout))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend="gloo", timeout=_timedelta(timeout))
    return _GROUPS[key]


@dataclass(frozen=True, slots=True)
class _Prepared:
    """An all-gather made ready on this rank (``TorchCommunicator.prepare_gather``): the caller's dtype, the flat
    send and the receive buffer."""

    dtype: torch.dtype
    send: torch.Tensor
    out: torch.Tensor


class ControlChannel:
    """The control group alone (rank, ``all_gather_object``): status exchange for code with no data groups.

    Without an initialized world it is a world of one. With a fake world it uses the fake default group.
    """

    agrees_over_world = True  # every rank takes part in its exchanges: ``guard.agree`` may drop the cached groups

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, *, what: str = "this call") -> None:
        self._live = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._live else 0
        self._world = dist.get_world_size() if self._live else 1
        self._timeout, self._what = float(timeout), what
        self._group = None
        self._may_remake = False  # the first exchange through a group made by an earlier call
        if self._live and self._world > 1 and str(dist.get_backend()) != "fake":
            if ("control", self._timeout) not in _GROUPS:  # making it is a collective: join the world first
                join_the_world(self.rank, self._world, timeout, what)
            else:
                self._may_remake = True
            self._group = control_group(timeout)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Small Python objects from every rank, in rank order.

        The first exchange through a group an earlier call made, failing before its timeout, found it closed by a
        peer's earlier failure (a call that peer made alone, then timed out): the cached groups are dropped, the ranks
        meet at ``join_the_world`` and make the group again, and the exchange runs once more. Closing spreads from
        peer to peer round gloo's ring, each destroying its group in turn, which on a busy host takes seconds: only
        a failure after 0.9 of the timeout is taken for the timeout itself.
        """
        if self._world == 1:
            return [obj]
        out: list[Any] = [None] * self._world
        start = time.monotonic()
        try:
            dist.all_gather_object(out, obj, group=self._group)
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)  # their locals hold the group, which must go (_discard_group)
            self._discard_group()
            if not isinstance(exc, Exception) or not self._may_remake or time.monotonic() - start > 0.9 * self._timeout:
                raise
        else:
            self._may_remake = False
            return out
        self._may_remake = False  # out of the except clause: the failed exchange's frames are gone
        forget_groups()
        join_the_world(self.rank, self._world, self._timeout, self._what)
        self._group = control_group(self._timeout)
        out = [None] * self._world
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _discard_group(self) -> None:
        """Destroy the control group after an exchange on it failed here: it is out of step for this rank (a lone
        call's exchange left its peers' connections waiting), and destroying it closes its connections, so a peer
        whose next exchange needs one of them fails at once and meets this rank at ``join_the_world`` (with more
        than two ranks, one peer's exchange waited out its timeout instead, and that call failed on every rank)."""
        broken, self._group = self._group, None
        if broken is None:  # the default group (a fake world): never destroyed here
            return
        if _GROUPS.get(("control", self._timeout)) is broken:
            del _GROUPS[("control", self._timeout)]
        with contextlib.suppress(Exception):
            dist.destroy_process_group(broken)
        del broken
        gc.collect()  # what still holds it may be garbage of a finished call (a save's session, in a cycle)


_JOINED: dict[str, Any] = {"store": None, "calls": {}}  # the default store, and the joins made per call


def join_the_world(rank: int, world: int, timeout: float, what: str) -> None:
    """Wait until every rank of the world has called this for the same call ``what`` (e.g. ``"save_hf to /abs/path"``,
    a collective save or load about to make the job's control group), through the default store alone: no process
    group is made or used, so a rank that calls it alone (a save inside ``if rank == 0:``) withdraws after
    ``timeout`` and raises ``PeersAbsent``, leaving every group and torch's group counter as they were (a lone
    ``new_group`` would have put them out of step); the same call made on every rank then joins. Without a reachable
    store it returns at once. Used only where torch would use the store anyway (making a group): a save through
    groups already made never touches the store (a rank whose file store broke, e.g. under a file-size limit, still
    saves and reports).

    Calls are told apart by ``what`` and numbered per ``what`` on each rank (a path saved to again is the next
    number), so a rank's lone call never pairs with its peers' next call of another kind or path. A counter key
    counts the ranks arrived and the last sets a "go" key; a rank that times out takes its count back with
    compare-and-set, unless the last rank arrived meanwhile (then it goes on); the last rank to leave deletes the keys.
    """
    store = _compat.default_store()
    if store is None:
        return
    if _JOINED["store"] is not store:  # a new world: its store starts empty
        _JOINED.update(store=store, calls={})
    tag = hashlib.sha1(what.encode()).hexdigest()[:16]
    number = _JOINED["calls"].get(tag, 0) + 1
    keys = (f"workbench/join/{tag}/{number}/{k}" for k in ("count", "go", "left", "who"))
    count_key, go_key, left_key, who_key = keys
    try:
        store.append(who_key, f"{rank}@{float(timeout)!r},")
        arrived = store.add(count_key, 1)
    except Exception as exc:  # the store itself failed on this rank (a full disk under a FileStore): say so
        raise PeersAbsent(f"{what}: rank {rank} could not join its peers through the default store "
                          f"({type(exc).__name__}: {exc}); they report it absent after their timeout") from exc
    if arrived >= world:
        store.set(go_key, "1")
    else:
        _wait_for_go(store, go_key, count_key, who_key, rank, world, timeout, what)
    _JOINED["calls"][tag] = number
    timeouts = _arrivals(store, who_key)  # read before the last rank to leave deletes it
    if store.add(left_key, 1) >= world:  # every rank is past this join: its keys are done with
        for key in (count_key, go_key, left_key, who_key):
            try:
                store.delete_key(key)
            except Exception:  # a store without deletion keeps four small keys per call
                pass
    if len(set(timeouts.values())) > 1:  # one control group per timeout: ranks that differ would pair other groups
        by_value: dict[float, list[int]] = {}
        for r, t in sorted(timeouts.items()):
            by_value.setdefault(t, []).append(r)
        values = "; ".join(f"{t:g} s on {_ranks_text(rs)}" for t, rs in by_value.items())
        raise CheckpointError(f"{what}: the ranks passed different timeouts ({values}); every rank must pass the "
                              "same. Nothing was written or read.")


def _arrivals(store: Any, who_key: str) -> dict[int, float]:
    """``{rank: timeout}`` of every rank that appended itself to ``who_key``."""
    entries = (e.split("@") for e in store.get(who_key).decode().split(",") if e)
    return {int(r): float(t) for r, t in entries}


def _wait_for_go(store: Any, go_key: str, count_key: str, who_key: str, rank: int, world: int, timeout: float,
                 what: str) -> None:
    """Wait for the last rank in slices of half a second (a KeyboardInterrupt, the notebook's stop button, lands
    between them); on the deadline or an interrupt take this rank's count back (``_withdraw``) and raise."""
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no word from every rank within {timeout:g} s")
            started = time.monotonic()
            try:
                store.wait([go_key], _timedelta(min(0.5, left)))
                return
            except Exception:  # this slice timed out (or the store answered at once with an error: pace it)
                if time.monotonic() - started < 0.25:
                    time.sleep(0.25)
    except BaseException as exc:  # the deadline, or an interrupt: withdraw, unless the last rank came meanwhile
        withdrawn = _withdraw(store, count_key, world)
        if not isinstance(exc, TimeoutError):
            raise
        if withdrawn:
            absent = [r for r in range(world) if r not in _arrivals(store, who_key)]
            raise PeersAbsent(
                f"{what}: rank {rank} waited {timeout:g} s for the world's other {world - 1} rank(s) to join, and "
                f"{_ranks_text(absent) if absent else 'not all'} did not. Saves and loads are collective: every "
                "rank of the world calls them with its own shards (a call inside `if rank == 0:` leaves rank 0 "
                "waiting here); a peer that died or hangs looks the same. Nothing was written or read, and nothing "
                "is left out of step: the same call made on every rank joins."
            ) from exc


def _withdraw(store: Any, count_key: str, world: int) -> bool:
    """Take this rank's count back (compare-and-set); False when the last rank arrived meanwhile (the join goes on:
    the "go" key is set or about to be)."""
    while (arrived := int(store.add(count_key, 0))) < world:
        if store.compare_set(count_key, str(arrived), str(arrived - 1)) == str(arrived - 1).encode():
            return True
    return False


def ranks_listed(ranks: Sequence[int]) -> str:
    """Ranks for a message: the first eight, then how many in all."""
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f", ... ({len(ranks)} in all)" if len(ranks) > 8 else "")


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks_listed(ranks)}" if len(ranks) == 1 else f"ranks {ranks_listed(ranks)}"


def forget_groups() -> None:
    """Drop the cached groups: after ``destroy_process_group`` (before a new world is initialized), or on every rank
    after a collective broke (``guard.forget_groups_if_broken``); the next save or load makes fresh ones."""
    _GROUPS.clear()


class TorchCommunicator:
    """Binds the layout's mesh dims (and flattened groups) to process groups of the default world.

    Groups are made for every mesh dim ref the caller will gather over, in one sorted order, and cached (see the
    module docstring). A group of one rank needs no process group: its gather is the identity.

    .. note:: SPMD: call the constructor on every rank of the world, with the same ``mesh``, ``mesh_dims`` and
       ``timeout``.
    """

    # its status exchanges span the whole world, so every rank takes a decision drawn from them alike: ``guard.agree``
    # drops the cached groups after a broken collective (a subclass over part of the world says False)
    agrees_over_world = True

    def __init__(
        self,
        mesh: MeshSpec,
        mesh_dims: Iterable[MeshDimRef],
        *,
        device: torch.device | str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ):
        if not dist.is_initialized():
            raise PlanError("TorchCommunicator needs an initialized default process group (use wb.launch or torchrun)")
        if dist.get_world_size() != mesh.size:
            raise PlanError(
                f"the world has {dist.get_world_size()} ranks but the layout's mesh {mesh!r} has {mesh.size}"
            )
        self.mesh = mesh
        self.rank = dist.get_rank()
        self.timeout = float(timeout)
        self.device = torch.device(device) if device is not None else None
        backend = str(dist.get_backend())
        # gloo gathers into a flat scratch buffer of the output's size, then copies it out (measured: a 200 MB
        # gather raises the peak RSS by 200 MB beyond its output); NCCL writes the output in place
        gloo_scratch = "gloo" in backend and "nccl" not in backend
        self._control = control_group(timeout)
        self._groups: dict[MeshDimRef, Any] = {}
        self._flags: dict[MeshDimRef, Any] = {}
        self._sizes: dict[MeshDimRef, int] = {}
        self._members: dict[MeshDimRef, tuple[int, ...]] = {}  # this rank's group, in mesh (group-rank) order
        self._reorder: dict[MeshDimRef, torch.Tensor] = {}  # where torch's order differs: mesh position -> torch's
        for ref in sorted({mesh.resolve(r) for r in mesh_dims}, key=format_mesh_dim):
            groups = mesh.groups(ref)
            self._sizes[ref] = len(groups[0])
            if len(groups[0]) == 1:
                continue
            self._bind_order(ref, mesh.group_ranks(self.rank, ref))
            self._groups[ref] = _subgroup(groups, None, self.timeout)
            self._flags[ref] = self._groups[ref] if backend == "gloo" else _subgroup(groups, "gloo", self.timeout)
        # every gather needs a second buffer of its output's size while the output lives: gloo's scratch, or the copy
        # that puts a group listed out of torch's order back in the mesh's order (``all_gather``; it follows gloo's
        # scratch, freed by then, so gloo needs no more). Any group of the mesh, not only this rank's: the schedule
        # the flag sizes must be the same on every rank
        self.gather_scratch = gloo_scratch or any(
            list(g) != sorted(g) for ref in self._groups for g in mesh.groups(ref)
        )

    def _bind_order(self, ref: MeshDimRef, members: Sequence[int]) -> None:
        """Remember this rank's group along ``ref`` as global ranks in mesh order. torch numbers a group's ranks in
        sorted order; a mesh may list them otherwise (a custom rank array, a flattened dim): collectives are mapped
        back to the mesh's order, or pieces would land permuted."""
        members = self._members[ref] = tuple(members)
        torch_order = sorted(members)
        if list(members) != torch_order:
            self._reorder[ref] = torch.tensor([torch_order.index(r) for r in members])

    def __repr__(self) -> str:
        refs = ", ".join(f"{format_mesh_dim(r)}={n}" for r, n in self._sizes.items())
        return (
            f"TorchCommunicator(rank={self.rank}, backend={dist.get_backend()}, groups=[{refs}], "
            f"timeout={self.timeout:g}s)"
        )

    def _check(self, mesh_dim: MeshDimRef) -> tuple[MeshDimRef, int]:
        ref = self.mesh.resolve(mesh_dim)
        if ref not in self._sizes:
            raise PlanError(f"rank {self.rank}: no process group was made for mesh dim {format_mesh_dim(ref)!r}")
        return ref, self._sizes[ref]

    def prepare_gather(self, send: torch.Tensor, mesh_dim: MeshDimRef) -> _Prepared:
        """All of an all-gather that can fail on this rank alone, done before the ranks agree to make the call: the
        flat send (its bytes, for a float8: gloo has none) and the receive buffer, the largest allocation of a
        save. An out-of-memory error here is this rank's failure, which its flag tells its peers."""
        _, world = self._check(mesh_dim)
        flat = _on_the_wire(send.contiguous())
        return _Prepared(send.dtype, flat, flat.new_empty(world * flat.numel()) if world > 1 else flat)

    def all_gather(
        self, send: torch.Tensor, mesh_dim: MeshDimRef, *, prepared: _Prepared | None = None
    ) -> torch.Tensor:
        """``W x send`` in group-rank order, through one flat all-gather over the group (into ``prepared``'s buffer
        when given). A failure after the collective, which every rank of the group completed, is ``FinishFailed``."""
        ref, world = self._check(mesh_dim)
        if world == 1:
            return send
        if prepared is None:
            prepared = self.prepare_gather(send, mesh_dim)
        out = prepared.out
        _compat.all_gather_flat(out, prepared.send, self._groups[ref])
        try:
            reorder = self._reorder.get(ref)
            if reorder is not None:  # torch's order (sorted ranks) to the mesh's
                out = out.view(world, -1)[reorder.to(out.device)].reshape(-1)
            return out.view(prepared.dtype) if out.dtype != prepared.dtype else out
        except Exception as exc:  # every peer left the collective too: this rank's own failure
            raise FinishFailed(f"after the all-gather over {format_mesh_dim(ref)}: {exc}") from exc

    def broadcast(self, tensor: torch.Tensor, mesh_dim: MeshDimRef, src: int) -> torch.Tensor:
        """``tensor`` of group rank ``src`` on every rank of this rank's group along ``mesh_dim`` (in place)."""
        ref, world = self._check(mesh_dim)
        if world == 1:
            return tensor
        # src: a global rank; the bytes of a dtype gloo lacks, broadcast in place
        dist.broadcast(_on_the_wire(tensor), src=self._members[ref][src], group=self._groups[ref])
        return tensor

    def any_flag(self, mesh_dim: MeshDimRef, flag: bool) -> bool:
        """True on every rank of this rank's group along ``mesh_dim`` when any of them passes True (gloo, CPU)."""
        ref, world = self._check(mesh_dim)
        if world == 1:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._flags[ref])
        return bool(value.item())

    def barrier(self) -> None:
        """Wait for every rank of the world (on the control group, within the timeout)."""
        dist.barrier(group=self._control)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Small Python objects from every rank, in rank order (on the control group, within the timeout)."""
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=self._control)
        return out
