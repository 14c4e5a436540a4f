"""``save_hf``: write a sharded model as a HuggingFace checkpoint, from every rank at once, atomically.

Every rank runs the same plan: its save plans and unshard schedule (the all-gathers, batched under a memory
budget), the writer of each key (byte-balanced over the ranks holding it) and the file each key goes to. A
writer writes its own files (``model-0000k-of-0000N.safetensors``) in background threads while the next
gathers run. Files land in a hidden sibling ``.NAME.incomplete`` (with an owner marker); once every rank
reports success, rank 0 writes the index and config files and publishes the directory with one atomic rename.
A checkpoint already at ``path`` survives any failure.

Failure containment (``run/guard.py``): a rank that fails anywhere (bad input, a full disk, a bug, MemoryError,
a KeyboardInterrupt in its main thread or a writer thread) keeps answering its peers' collectives through the flag
protocol, then every rank raises the same ``SaveFailed`` naming the failing rank, the stage and the cause (an
interrupted rank raises its interrupt again instead); nothing is published. Status exchange and agreement run on
the save's own gloo group with ``timeout``, so a rank that died or hangs is reported after ``timeout`` seconds; when
a collective broke (timed out), every rank drops its cached process groups and the next save makes fresh ones.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workbench.errors import CheckpointError, PlanError
from workbench.io.files.direct import DEFAULT_MIN_SEGMENT_BYTES
from workbench.io.files.file_plan import DEFAULT_MAX_SHARD_BYTES
from workbench.io.files.host_pool import DEFAULT_POOL_BYTES, host_pool, trim_host_pools
from workbench.io.files.snapshot import Snapshotter
from workbench.io.hf.early_snapshot import remember_direct_plan, take_early
from workbench.io.hf.save_session import _IN_FLIGHT, SaveResult, SaveSession
from workbench.layout.key_map import KeyMap
from workbench.layout.model_layout import Layout, held_whole_by_every_rank, layout_and_locals
from workbench.plan.casts import check_fits, narrows_range
from workbench.plan.policy import SavePolicy
from workbench.plan.save_plan import save_dtypes
from workbench.plan.save_set import layout_as_held
from workbench.run.communicator import Communicator
from workbench.run.guard import RankProblem, SaveFailed, agree, problem_from
from workbench.run.torch_comm import DEFAULT_TIMEOUT, ranks_listed
from workbench.version import __version__

__all__ = ["AsyncSave", "SaveFailed", "SaveResult", "local_communicator", "release_host_pool", "save_hf",
           "warm_host_pool"]

_DEFAULT_BUDGET = 2 << 30
_UNBOUNDED = 1 << 62
_PENDING: list[AsyncSave] = []  # async saves of this process not waited on yet, oldest first


@dataclass(eq=False)
class AsyncSave:
    """A save whose snapshot is taken and whose files are being written; ``wait()`` publishes it.

    Every byte it writes is already in host memory the save owns, so the caller may change the model at once.
    A failure in the background surfaces at ``wait()`` / ``result()`` and, if neither is called, at the next
    ``save_hf`` (which first finishes every earlier async save of the process, oldest first). At interpreter
    exit, a save never waited on is abandoned (threads, files and its path released, its temporary directory
    removed; nothing published); a forked child leaves its parent's saves alone.

    .. note:: SPMD: every rank must call ``wait()`` (it exchanges every rank's status before publishing).
    """

    _session: SaveSession
    _result: SaveResult | None = field(default=None, init=False)
    _error: BaseException | None = field(default=None, init=False)
    # one finish at a time: a wait() from another thread (or the next save_hf's) waits for the one under way
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def path(self) -> Path:
        """The checkpoint directory this save publishes."""
        return self._session.path

    def done(self) -> bool:
        """True when this rank's files are written (publishing still needs ``wait()``)."""
        return self._session.writers.done()

    def wait(self) -> SaveResult:
        """Finish writing, check every rank, publish atomically; returns this rank's result (or raises SaveFailed
        on every rank). Calling it again, from any thread, returns the same result or raises the same error (a call
        made while another thread's is under way waits for it)."""
        with self._lock:
            if self._result is None and self._error is None:
                try:
                    self._result = self._session.finish()
                except BaseException as exc:
                    self._error = exc
                finally:
                    try:
                        self._session.close()
                    finally:  # pending until finished: a save_hf meanwhile waits for it (its collectives come first)
                        with contextlib.suppress(ValueError):
                            _PENDING.remove(self)
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    result = wait


def save_hf(
    model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    layout: Layout | None = None,
    key_map: KeyMap | None = None,
    policy: SavePolicy | None = None,
    budget_bytes: int | None = _DEFAULT_BUDGET,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    fp32_keys_pattern: Sequence[str] | str | None = None,
    dtype: torch.dtype | None = None,
    config_files: Sequence[str | Path] = (),
    max_writers: int | None = None,
    write_threads: int = 4,
    async_save: bool = False,
    host_buffer_bytes: int | None = None,
    write_mode: str = "auto",
    min_segment_bytes: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    comm: Communicator | None = None,
) -> SaveResult | AsyncSave:
    """Save a (sharded) model as a HuggingFace checkpoint at ``path``.

    Args:
        model_or_state_dict: a module whose parameters are DTensors (FSDP2, EP, ETP...) or plain tensors, or
            a state dict of them.
        path: the checkpoint directory to create or replace. An existing directory is replaced only when it is
            empty or a checkpoint (files only, among them an index or a ``.safetensors`` file); any other is
            refused before anything is written (a SaveFailed on every rank, saying why) and left as it was. A
            replaced checkpoint's weights, index and layout go; its other files (``config.json``, tokenizer files,
            a trainer's optimizer state) are kept in the new directory.
        layout: the model's Layout (default: ``Layout.from_model(model, key_map)``). Each tensor is saved in its
            own dtype: a parameter the layout gives no dtype takes its tensor's, and a given dtype that disagrees
            with the tensor is an error (LayoutError on that rank, SaveFailed on its peers, before any data moves).
        key_map: runtime name -> HF key(s) (callable or regex table); None keeps the names.
        policy: ``SavePolicy.minimal()`` (default: the full checkpoint, gathering only what whole keys need),
            ``full()`` (gather everything everywhere) or ``preserve(...)`` (each EP rank writes its experts).
        budget_bytes: memory budget of the all-gather schedule (None: no bound).
        max_shard_bytes: the largest file a writer makes (a bigger key gets a file alone).
        fp32_keys_pattern: regexes of HF keys saved in float32 (floating keys only; every other key is saved in
            its tensor's own dtype).
        dtype: an explicit cast of the other floating keys (default None: none, each tensor's own dtype): a
            floating dtype of 16 bits or more. A cast (by ``dtype`` or ``fp32_keys_pattern``) that would change a
            float8 tensor is refused: its raw values mean nothing without their block scales (save
            ``workbench.io.hf.fp8.dequantized_state`` instead). So is a cast into a smaller range (float32 or
            bfloat16 into float16) of a tensor holding a value it would make inf, naming the parameter, the count
            and the first value. Refused on every rank; nothing is published.
        config_files: files copied next to the weights (config.json, tokenizer files...); a name that is one of
            the files the save writes (the index, a weight file) is refused. They are read during the call (an
            async save publishes them as they were then, whatever the working directory is at ``wait()``).
        max_writers: cap on the number of ranks that write files (default: every rank may write); the allowed
            ranks are spread over the world (``writer_pool``; rank 0 always among them). Honored in every write
            mode: the other ranks open no file. In direct mode their pieces are gathered to the allowed writers,
            who write whole keys into the shared files; under ``minimal`` a key kept on ranks none of which may
            write makes the save gather as ``full`` does; under ``preserve`` it is an error (every rank, before
            any data moves).
        write_threads: file writers per rank (tensors are written to their files as soon as they are whole).
        async_save: return as soon as every byte this rank writes is copied into host memory the save owns;
            files are written in the background and ``.wait()`` publishes.
        host_buffer_bytes: the most bytes of tensors waiting for a writer, and the capacity of the process's
            reused host pools (pinned for GPU tensors); when full the save waits for writes to drain (an async
            save then returns later). Default: ``budget_bytes`` for a sync save; for an async save no bound but
            the rank's share of the checkpoint (the snapshot of it is held until written, and the pool keeps its
            buffers for the next save).
        write_mode: ``"direct"``: every rank writes the bytes it holds straight into the final files at their
            offsets, with no gather (a tensor whose pieces would be shorter than ``min_segment_bytes`` per
            segment is gathered instead); needs every rank to see the same filesystem (one node, or Lustre /
            GPFS / NFS). ``"gather"``: each key is gathered to one writer rank, which writes it (any
            filesystem). ``"auto"`` (default): direct when all ranks share a host or see a probe file rank 0
            writes next to ``path``; else gather. Policies other than full and minimal always gather.
        min_segment_bytes: in direct mode, the average segment length below which a tensor is gathered. None
            (default): 0 when every rank is on one host, where a tensor of short segments (TP over the last dim)
            is written through a shared memory map of its file, one strided copy per piece; else 64 KiB.
        timeout: seconds any collective of the save may wait for a peer before the save fails naming it.
        comm: the communicator (default: torch.distributed's default world, or one process).

    Returns:
        This rank's SaveResult, or an AsyncSave.

    Raises:
        SaveFailed (a CheckpointError): on every rank, naming each failing rank, its stage and the cause;
            nothing is published at ``path`` and a checkpoint already there is left intact. A rank whose own
            input is bad (layout, key map) raises its own LayoutError / PlanError, its peers SaveFailed.
        KeyboardInterrupt: on a rank interrupted during the save (main thread or writer thread), once every rank
            has learnt of it (its peers raise SaveFailed naming it, with the same outcome).

    .. note:: SPMD: every rank of the model's mesh calls it with the same arguments.
    """
    _finish_pending()
    start = time.perf_counter()
    # absolute from here on: an async save writes, beats and publishes after the call returns, when the working
    # directory may be another one (not resolved: a symbolic link at ``path`` is replaced, not followed)
    path = Path(os.path.abspath(path))
    if write_mode not in ("auto", "direct", "gather"):
        raise CheckpointError(f"write_mode must be 'auto', 'direct' or 'gather', got {write_mode!r}")
    # an async save with room for its whole snapshot: the pool is unbounded, so copies never wait for writers
    unbounded = async_save and not host_buffer_bytes
    pool_bytes = _UNBOUNDED if unbounded else host_buffer_bytes or None
    snapshot = Snapshotter((), own_everything=async_save, pool_bytes=pool_bytes)
    # a repeat async save of a GPU model starts copying its last plan's pieces now, while it walks, agrees, plans
    early = take_early(model_or_state_dict, snapshot) if unbounded and layout is None else None
    early_seconds = time.perf_counter() - start
    mine: BaseException | None = None
    tensors: dict[str, torch.Tensor] = {}
    try:  # local checks first, agreed on over the whole world before any group is built: no rank may hang
        given = layout
        layout, tensors = layout_and_locals(model_or_state_dict, key_map, layout=layout, refuse_unlisted=True)
        if given is not None:  # a checkpoint's own layout records the dtypes it wrote: read back as the tensors' own
            layout = layout_as_held(layout, tensors, dtype, fp32_keys_pattern)
        elif comm is None:  # plain tensors on every rank of a world of several (DDP): replicated over the world
            layout = held_whole_by_every_rank(layout, dist.get_world_size() if dist.is_initialized() else 1)
        # each tensor is written in its own dtype: a layout that says nothing is told it, one that disagrees fails
        layout = layout.with_tensor_dtypes(tensors)
        _refuse_values_outside(layout, tensors, dtype, fp32_keys_pattern, _rank(comm))
    except BaseException as exc:  # KeyboardInterrupt too: the peers wait for this rank's word (raised after it)
        mine = exc
    # the write mode's host names (and rank 0's probe file) travel with the agreement: one exchange for both
    wanted = write_mode == "auto" and mine is None and _rank(comm) == 0 and not _one_host_known(comm)
    probe = _write_probe(Path(path)) if wanted else None
    # the arguments every rank must pass alike travel with it too: ranks that differ are refused before any write
    options = (("path", repr(os.path.abspath(path))), *call_options({
        "async_save": async_save, "write_mode": write_mode, "policy": policy, "budget_bytes": budget_bytes,
        "max_shard_bytes": max_shard_bytes, "dtype": dtype, "fp32_keys_pattern": fp32_keys_pattern,
        "max_writers": max_writers, "min_segment_bytes": min_segment_bytes}))
    try:
        everyone = _agree_before_groups(mine, path, timeout, comm, share=(socket.gethostname(), probe, options))
        _refuse_other_arguments([o for _, _, o in everyone], path)
        seen = [(host, probed) for host, probed, _ in everyone]
        _remember_hosts(comm, seen)
        assert layout is not None
        comm = comm or default_communicator(layout, timeout)
        target = Path(path).resolve()
        if target in _IN_FLIGHT:
            raise CheckpointError(
                f"a save to {target} is still in progress in this process (async_save pending); call its wait() "
                "before saving to the same path again"
            )
        mode = _resolve_write_mode(write_mode, comm, seen)
    except BaseException:
        if early is not None:
            early.release()  # from here on the session owns them (its close() releases what is not claimed)
        raise
    finally:
        if probe is not None:
            Path(probe).unlink(missing_ok=True)
    # an async save snapshots all it writes before returning: by default nothing bounds that but the rank's share
    limit = _UNBOUNDED if unbounded else host_buffer_bytes or budget_bytes or DEFAULT_POOL_BYTES
    snapshot.add_model_tensors(tensors.values())
    session = SaveSession(
        layout, Path(path), comm, start, write_threads, max_shard_bytes, config_files, limit, snapshot
    )
    # on one host every writer shares the page cache: short segments go through a memory map, none is gathered
    one_host = mode == "direct" and _one_host(seen)
    if min_segment_bytes is None:
        min_segment_bytes = 0 if one_host else DEFAULT_MIN_SEGMENT_BYTES
    session.write_mode, session.min_segment_bytes, session.early = mode, min_segment_bytes, early
    session.map_short_runs = one_host
    session.clock.add("prepare", time.perf_counter() - start - early_seconds)
    session.clock.add("snapshot", early_seconds)  # issuing the early copies
    try:
        with session.clock.measure("plan"):
            # an async save with room for its whole snapshot copies its direct pieces during the agreement
            session.plan(policy, budget_bytes, dtype, fp32_keys_pattern, max_writers, tensors,
                         snapshot_early=unbounded)
        if unbounded and session.direct:
            remember_direct_plan(model_or_state_dict, (layout, session.key_meta, session.direct, session.rank))
        with session.clock.measure("snapshot"):
            session.gather(tensors)
            if async_save:
                session.settle_snapshot()
        if async_save:
            handle = AsyncSave(session)
            _PENDING.append(handle)
            return handle
        return AsyncSave(session).wait()
    except BaseException:
        session.close()
        raise


def _refuse_values_outside(
    layout: Layout,
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype | None,
    fp32_keys_pattern: Sequence[str] | str | None,
    rank: int,
) -> None:
    """Raise where a save's cast would change a value of this rank's tensors, not only round it: ``dtype=float16``
    of a float32 or bfloat16 model made values over 65504 inf, silently (``plan.casts.check_fits``). Only the
    casts that narrow the range pass over the values; a fused tensor whose keys take different dtypes is checked
    against the narrowest."""
    for name, tensor in tensors.items():
        keys = layout.specs[name].hf_keys
        try:
            saved = save_dtypes(keys, tensor.dtype, dtype=dtype, fp32_keys_pattern=fp32_keys_pattern)
        except PlanError:  # a dtype no save may write: the plan refuses it on every rank, as it always did
            return
        narrower = [d for d in set(saved) if narrows_range(tensor.dtype, d)]
        if narrower:
            target = min(narrower, key=lambda d: torch.finfo(d).max)
            check_fits(tensor.detach(), target, f"parameter {name!r} (HF key(s) {', '.join(keys)}), rank {rank}",
                       advice="save in a dtype that holds them (dtype=None writes each tensor in its own; "
                              "fp32_keys_pattern keeps the keys it matches in float32)")


def release_host_pool() -> int:
    """Free the host buffers that saves keep for the next one (pinned ones too); returns the bytes freed.

    An async save copies what it writes into host buffers the process keeps for the next save (``warm_host_pool``
    allocates them up front); by default nothing bounds them but the largest save's share. Call this after
    ``wait()`` when no save is coming soon (training done, the model moved): buffers a pending save still holds are
    left to it. The next save allocates again.
    """
    return trim_host_pools()


def warm_host_pool(
    model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    *,
    layout: Layout | None = None,
    key_map: KeyMap | None = None,
    dtype: torch.dtype | None = None,
) -> int:
    """Allocate now the host buffers an async save of this model copies its snapshot into, so that the first
    ``save_hf(..., async_save=True)`` blocks its caller only for the copies, not for pinning memory.

    One buffer per local tensor of this rank (pinned for GPU tensors, pages touched for CPU ones), in the
    process's pools that every save reuses; a direct save snapshots exactly these (a piece of a tensor uses
    a buffer up to 4x its size). Call it once after the model is built, on every rank (no collective).

    Args:
        model_or_state_dict: the model ``save_hf`` will save.
        layout, key_map: as for ``save_hf`` (they pick the parameters saved).
        dtype: the save dtype of floating tensors, when the save casts (``save_hf(dtype=...)``).

    Returns:
        The bytes of host memory allocated now (0 when the pools already hold such buffers).
    """
    layout, tensors = layout_and_locals(model_or_state_dict, key_map, layout=layout)
    sizes: dict[bool, list[int]] = {True: [], False: []}
    for tensor in tensors.values():
        itemsize = dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size()
        sizes[tensor.device.type != "cpu"].append(tensor.numel() * itemsize)
    return sum(host_pool(pinned=pinned).reserve(n) for pinned, n in sizes.items() if n)


# the worlds (communicator or default group, by id) an earlier save found on one host; a stale id can only cost a
# probe file not written, and auto then picks gather across hosts (never a wrong write mode for direct)
_ONE_HOST: set[tuple[int, int]] = set()


def _world_id(comm: Communicator | None) -> tuple[int, int]:
    if comm is not None:
        return (id(comm), 0)
    import torch.distributed as dist

    return (id(dist.group.WORLD), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _one_host_known(comm: Communicator | None) -> bool:
    """True when an earlier save of this world found every rank on one host (a probe file is then not needed:
    ``auto`` picks direct writes from the host names alone)."""
    return _world_id(comm) in _ONE_HOST


def _one_host(seen: Sequence[tuple[str, str | None]]) -> bool:
    """True when every rank's (host name, probe) share names the same host."""
    return len({host for host, _ in seen}) == 1


def _remember_hosts(comm: Communicator | None, seen: Sequence[tuple[str, str | None]]) -> None:
    if _one_host(seen):
        _ONE_HOST.add(_world_id(comm))


def _write_probe(path: Path) -> str | None:
    """Rank 0's probe file next to ``path`` (its name), or None where it cannot be written."""
    candidate = path.parent / f".{path.name}.probe-{uuid.uuid4().hex[:12]}"
    try:
        candidate.write_bytes(b"workbench write-mode probe\n")
    except OSError:
        return None
    return str(candidate)


def _rank(comm: Communicator | None) -> int:
    if comm is not None:
        return comm.rank
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _resolve_write_mode(write_mode: str, comm: Communicator, seen: Sequence[tuple[str, str | None]]) -> str:
    """``auto`` -> ``direct`` when every rank sees the files rank 0 writes, else ``gather``. ``seen`` is every
    rank's (host name, rank 0's probe file or None), already exchanged: on one host nothing more is exchanged;
    across hosts, one more exchange says whether every rank sees the probe."""
    if write_mode != "auto":
        return write_mode
    if _one_host(seen):
        return "direct"
    probe = seen[0][1]
    visible = comm.all_gather_object(probe is not None and Path(probe).exists())
    return "direct" if all(visible) else "gather"


def _finish_pending() -> None:
    """Finish this process's earlier async saves, oldest first; the first failure is raised here. An interrupt
    (``KeyboardInterrupt``, ``SystemExit``) is raised as it is, once every save is finished: the peers finish each of
    them too, so skipping one would leave them waiting."""
    first: BaseException | None = None
    interrupt: BaseException | None = None
    while _PENDING:
        try:
            handle = _PENDING[0]
        except IndexError:  # finished meanwhile by a wait() in another thread
            break
        try:
            handle.wait()  # one another thread is waiting on: waits for it, and has its outcome
        except BaseException as exc:
            first = first or exc
            if interrupt is None and not isinstance(exc, Exception):
                interrupt = exc
    if interrupt is not None:
        raise interrupt
    if first is not None:
        raise SaveFailed(
            f"an earlier async save failed, so this save was not started:\n{first}", getattr(first, "problems", ())
        ) from first


def _abandon_pending() -> None:
    """At interpreter exit: release every async save never waited on (no collective is possible any more)."""
    for handle in list(_PENDING):
        if not handle._lock.acquire(blocking=False):  # a daemon thread is finishing it: left to that thread
            continue
        try:
            warnings.warn(
                f"async save to {handle.path} was never waited on; it was not published (call wait() before exiting)",
                stacklevel=1,
            )
            handle._session.close(abandon=True)
        finally:
            handle._lock.release()
    _PENDING.clear()


atexit.register(_abandon_pending)


def _forget_pending_in_child() -> None:
    """A forked child inherits its parent's pending saves but none of their threads: they are the parent's to finish
    (the child's next save would wait for writes that never run) and to abandon (its exit would remove them)."""
    _PENDING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pending_in_child)


_ALIKE = ("async_save", "write_mode", "policy", "budget_bytes", "max_shard_bytes", "dtype", "fp32_keys_pattern",
          "max_writers", "min_segment_bytes")  # the arguments of save_hf every rank must pass alike


def call_options(arguments: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The arguments of a ``save_hf`` call that every rank must pass alike (``arguments`` by name; one not given
    takes ``save_hf``'s default), and the workbench version, which plans them, as text: ranks that differ in one
    would plan other files or gathers, or (``async_save``) take part in other agreements."""
    defaults = {name: p.default for name, p in inspect.signature(save_hf).parameters.items()}
    values = {name: arguments.get(name, defaults[name]) for name in _ALIKE}
    values["policy"] = values["policy"] or SavePolicy.minimal()
    values["workbench_version"] = __version__

    def text(value: Any) -> str:
        if isinstance(value, list | tuple):
            return repr(tuple(value))
        return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else repr(value)

    return tuple((name, text(value)) for name, value in values.items())


def other_arguments_problem(options: Sequence[tuple[tuple[str, str], ...]]) -> str | None:
    """Each argument the ranks passed differently (every rank's ``call_options``), with the ranks of each value;
    None when they agree."""
    differing = []
    for index, (name, _) in enumerate(options[0]):
        by_value: dict[str, list[int]] = {}
        for rank, mine in enumerate(options):
            by_value.setdefault(mine[index][1], []).append(rank)
        if len(by_value) > 1:
            values = ", ".join(f"{value} on rank(s) {ranks_listed(ranks)}" for value, ranks in by_value.items())
            differing.append(f"{name} ({values})")
    if not differing:
        return None
    return f"the ranks passed different arguments: {'; '.join(differing)}; every rank must pass the same"


def _refuse_other_arguments(options: Sequence[tuple[tuple[str, str], ...]], path: Path) -> None:
    """SaveFailed on every rank (each sees every rank's ``call_options``) naming what differs; nothing is written
    yet."""
    cause = other_arguments_problem(options)
    if cause is not None:
        raise SaveFailed(f"save to {path} refused before anything was written: {cause}",
                         [RankProblem(r, "checking the call's arguments", cause) for r in range(len(options))])


def _agree_before_groups(
    mine: BaseException | None, path: str | Path, timeout: float, comm: Communicator | None, share: Any = None
) -> list[Any]:
    """Every rank shares its problem with the layout or model (or None) over the control group; all raise if any
    rank has one: the rank with the problem its own error, the others a SaveFailed naming it. Returns every
    rank's ``share``."""
    from workbench.run.torch_comm import ControlChannel

    channel = comm or ControlChannel(timeout, what=f"save_hf to {os.path.abspath(path)}")
    problem = problem_from(mine, channel.rank, "reading the model's layout") if mine is not None else None
    try:
        return agree(channel, problem, what=f"save to {path}", outcome="nothing was written", share=share)
    except SaveFailed:
        if mine is not None:
            raise mine from None
        raise


class _OneProcess:
    """The communicator of a job of one process with no process group."""

    rank = 0

    def all_gather(self, send: torch.Tensor, mesh_dim: Any) -> torch.Tensor:
        return send

    def any_flag(self, mesh_dim: Any, flag: bool) -> bool:
        return flag

    def barrier(self) -> None:
        return None

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


def local_communicator() -> Communicator:
    """A communicator for a single process (a model on one device, no torch.distributed)."""
    return _OneProcess()


def default_communicator(layout: Layout, timeout: float = DEFAULT_TIMEOUT) -> Communicator:
    """torch.distributed's default world bound to the layout's mesh dims, or one process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if layout.mesh.size != 1:
            raise CheckpointError(
                f"{layout.mesh!r} has {layout.mesh.size} ranks but torch.distributed is not "
                "initialized; run under wb.launch or torchrun"
            )
        return local_communicator()
    from workbench.run.torch_comm import TorchCommunicator

    refs = {d.mesh_dim for spec in layout.specs.values() for d in spec.shards}
    return TorchCommunicator(layout.mesh, refs, timeout=timeout)


