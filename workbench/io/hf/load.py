"""``load_hf``: fill a (sharded) model from a HuggingFace checkpoint, each rank reading only what it owns."""

from __future__ import annotations

import hashlib
import math
import os
import socket
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from workbench.display import html_of
from workbench.errors import CheckpointError, LayoutError
from workbench.faults import fault_point
from workbench.io.files.box_reads import BoxReader
from workbench.io.files.direct import replicating_dims
from workbench.io.files.index import CheckpointIndex, torch_dtype
from workbench.io.files.read import CheckpointReader
from workbench.io.files.staging import SLOT_BYTES, StagingRing
from workbench.io.files.transfers import PIECE_BYTES, Transfer, copy_transfers, landing_views, plan_transfers
from workbench.io.gc_paused import gc_paused
from workbench.io.hf.load_timings import LoadClock, LoadTimings
from workbench.io.hf.tied import tie_problem, untie
from workbench.layout.fp8 import SCALE_SUFFIX
from workbench.layout.key_map import KeyMap
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout, held_whole_by_every_rank, layout_and_locals
from workbench.memo import LRU
from workbench.mesh import MeshDimRef, MeshSpec, format_mesh_dim
from workbench.plan.casts import changes_kind, narrows_range
from workbench.plan.load_plan import Adapter, HFLoadPlan, expected_key_shape, plan_hf_load
from workbench.run.guard import LoadFailed, RankProblem, agree, problem_from
from workbench.run.load_ops import execute_load, prepare_target
from workbench.run.torch_comm import DEFAULT_TIMEOUT, ControlChannel

__all__ = ["LoadReport", "load_hf"]

_WHOLE = 1 << 62  # piece_bytes of a transfer not cut into pieces
# tests only: an unpinned staging ring through which a load into CPU tensors takes the path of a GPU load (boxes
# landing in the model's tensors from the reading threads, others read through the ring), its copies run at once
_CPU_LANDING_RING: StagingRing | None = None
# what one more read costs a load, in bytes copied: about 100 us of the loading thread a piece, at 20 GB/s
READ_COST_BYTES = 2 << 20
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadReport:
    """What one rank loaded: keys, bytes read versus bytes it owns, and what did not match.

    ``bytes_read`` is what the rank's positional reads asked the files for (a box of short runs close together is
    read as its one span, so it may exceed the box); the disk's own count, readahead included, is
    ``/proc/self/io``'s ``read_bytes`` (``bench/save_load.py`` reports it). ``bytes_direct`` is the part of it read
    with ``O_DIRECT``, around the page cache (``read_direct``). ``timings``: the seconds of each stage
    (``LoadTimings``: check, plan, read, drain, share, agree).
    """

    path: Path
    rank: int
    parameters: int
    bytes_read: int
    bytes_owned: int
    seconds: float
    bytes_received: int = 0
    bytes_direct: int = 0
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[str, ...] = ()
    timings: LoadTimings = field(default_factory=LoadTimings)
    unexpected_allowed: bool = False

    @property
    def read_ratio(self) -> float:
        """Bytes read / bytes this rank had to read (1.0: not a byte more than needed). Replicated parameters read
        by another replica and received from it (``bytes_received``) do not count."""
        assigned = self.bytes_owned - self.bytes_received
        return self.bytes_read / assigned if assigned else 1.0

    @property
    def ok(self) -> bool:
        """True when every expected key was found with its expected shape, and no other key was there (other keys
        are fine where the load allowed them: ``allow_unexpected``, a pipeline stage's)."""
        return not (self.missing or self.mismatched or (self.unexpected and not self.unexpected_allowed))

    def __str__(self) -> str:
        lines = [
            f"loaded {self.parameters} parameters from {self.path} on rank {self.rank}: read {self.bytes_read} "
            f"bytes for {self.bytes_owned} owned ({self.read_ratio:.3f}x"
            + (f"; {self.bytes_received} received from replicas" if self.bytes_received else "")
            + f") in {self.seconds:.2f} s"
        ]
        unexpected = "unexpected (allowed)" if self.unexpected_allowed else "unexpected"
        for what, keys in (("missing", self.missing), (unexpected, self.unexpected), ("mis-shaped", self.mismatched)):
            if keys:
                lines.append(f"  {len(keys)} {what}: {list(keys[:5])}{' ...' if len(keys) > 5 else ''}")
        return "\n".join(lines)

    def _repr_html_(self) -> str | None:
        """HTML for notebooks, from the renderer ``workbench.viz`` registers (``workbench.display``)."""
        return html_of(self)


@gc_paused()
def load_hf(
    model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    layout: Layout | None = None,
    key_map: KeyMap | None = None,
    strict: bool = True,
    allow_unexpected: bool = False,
    adapters: Mapping[str, Adapter] | None = None,
    cast: bool = False,
    read_replicas_once: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    rank: int | None = None,
    read_threads: int = 16,
    budget_bytes: int = 1 << 30,
    read_direct: bool | Literal["auto"] | None = None,
) -> LoadReport:
    """Load a HuggingFace checkpoint into a model whose parameters are DTensors (or plain tensors), in place.

    Each rank reads exactly the slices of each key its local tensors own, with positional reads (``pread``) from
    ``read_threads`` threads ahead of the copies, neighbouring slices of a file in one read (``BoxReader``). A
    parameter's slices that repeat with one step in a file and in the local tensor (the experts of a fused MoE
    tensor) are one strided box (``transfers.plan_transfers``), read in pieces of 8 MiB and copied by one op each;
    into a CPU tensor of the checkpoint's dtype the bytes land in place, with no copy. Per-key canonical
    ``adapters`` (whole keys) run first where given; tail (FP8) padding is zeroed. The ranks agree twice over the
    load's own gloo group (within ``timeout``): after checking the checkpoint against the layout and planning the
    reads (comparing what each parsed, ``ParsedCheckpoint``), and at the end, so a failure on one rank is an error
    on every rank. The reads that land on a GPU start into the staging ring before the first agreement (they
    overlap it); nothing is copied into the model before it.

    Args:
        strict: every missing, unexpected, mis-shaped or differently typed key is an error (else those
            parameters are skipped and listed in the report).
        allow_unexpected: keys of the checkpoint that the layout does not name are no error under ``strict`` (they
            are listed in the report, which stays ``ok``): a pipeline stage's load, whose checkpoint holds the other
            stages' keys too, and which still must find every key of its own.
        cast: convert a key whose checkpoint dtype differs from the model's (else that is a mismatch), but not a
            floating key into an integer or bool parameter, nor a complex one into a real one (a mismatch); a float8
            key that has a scale key (``_scale_inv``, ``_scale``) into a parameter that is not float8 is refused
            (its raw values mean nothing without their scales).
        read_replicas_once: a parameter replicated over mesh dims (HSDP's replicas, a replicated norm) is read by
            one replica of each group (replicas take turns over the parameters) and broadcast to the others,
            instead of being read by every replica. Only where the layout's mesh is the whole world: a pipeline
            stage loaded with its own layout (``layout=pipeline.stages[stage]``, ``rank=`` its place in the stage)
            reads each replica on its own rank, as ``read_replicas_once=False`` does (a group of the stage's ranks
            alone would have to be made by every rank of the world at once; reading is safe, and costs each replica
            only its replicated parameters' bytes).
        timeout: seconds to wait for a peer at an agreement before failing.
        rank: the rank to load for (default: this process's rank).
        read_threads: threads reading the files.
        budget_bytes: memory for slices read ahead of their copies; the load holds at most this much plus the
            largest single read. Into a GPU model this is device memory: reads go through the process's pinned
            staging ring (512 MiB, pinned once per process, ``io/files/staging.py``), so a first load pins no more
            than that, and adapters receive the key on the device.
        read_direct: ``"auto"`` reads a request of 1 MiB or more with ``O_DIRECT`` (4 KiB-aligned, around the page
            cache) when almost none of its pages are cached, ``True`` always, ``False`` never (a filesystem that
            refuses ``O_DIRECT`` is read through the page cache). None: ``WORKBENCH_READ_DIRECT`` (``auto|1|0``),
            else ``"auto"``.

    Raises:
        CheckpointError: on the rank whose checkpoint check failed (one error listing every missing, unexpected,
            mis-shaped and differently typed key); LoadFailed on its peers, naming it. A failure while planning
            the reads (a shard that cannot be opened, say) is raised likewise, on its rank as itself and on its
            peers as a LoadFailed; no tensor was changed. Ranks that parsed different checkpoints at one path
            (another save published there during the load) raise LoadFailed, naming two of them, before any
            tensor changes. A failure while reading (any exception, on any rank)
            is a LoadFailed on every rank: the model's values must not be used. An
            interrupt (``KeyboardInterrupt``) while reading, sharing replicated parameters or reporting the status
            is raised again on its rank once every rank has agreed (chained to the LoadFailed its peers raise).

    Automatic garbage collection is paused while it runs (``io/gc_paused.py``): a full collection of the process
    meeting a load made it 0.2 s longer on one rank.

    .. note:: SPMD under torch.distributed: every rank calls it.
    """
    start = time.perf_counter()
    clock = LoadClock()
    channel = ControlChannel(timeout, what=f"load_hf of {os.path.abspath(path)}")
    rank = channel.rank if rank is None else rank
    who, place = _problem_rank(channel, rank)  # whom a failure names: a stage's place is every stage's too
    what = f"load of {path}"
    reader: CheckpointReader | None = None
    mine: BaseException | None = None
    interrupt: BaseException | None = None  # not an Exception: raised again once every rank has agreed
    replicas: dict[str, ReplicaRead] = {}
    batches: dict[str, ReplicaBatch] = {}
    shares_replicas = False  # replicas read once and broadcast (only over a mesh that is the whole world)
    stage = _CHECKING
    started: _StartedReads | None = None
    try:
        given = layout
        layout, targets = layout_and_locals(model_or_state_dict, key_map, layout=layout)
        if given is None:  # plain tensors on every rank of a world of several (DDP): replicated over the world
            layout = held_whole_by_every_rank(layout, dist.get_world_size() if dist.is_initialized() else 1)
        if rank >= layout.mesh.size:  # before the checks: say what a pipeline stage's load needs
            raise LayoutError(
                f"rank {rank} is not in the layout's mesh {layout.mesh!r} ({layout.mesh.size} ranks): a pipeline "
                "stage's layout takes rank=, this rank's place in its stage (pipeline.stage_of_rank(rank)[1]), and "
                "allow_unexpected=True (the other stages' keys)"
            )
        if given is not None:
            _refuse_other_shapes(layout, targets, rank)
        fault_point("load.plan", rank)
        reader = CheckpointReader(path)
        shares_replicas = read_replicas_once and rank == channel.rank and _live_over(layout)
        checked = _checked(reader.index, layout, targets, adapters, cast, rank, shares_replicas)
        missing, unexpected, mismatched = checked.missing, checked.unexpected, checked.mismatched
        if strict and (missing or mismatched or (unexpected and not allow_unexpected)):
            raise CheckpointError(_problem(path, missing, () if allow_unexpected else unexpected, mismatched))
        wanted, replicas, batches = checked.wanted, checked.replicas, checked.batches
        # tied parameters the load fills: each read into a tensor of its own, compared below (one it skips would
        # compare a tensor nothing was read into; one it fills alone fills the shared tensor)
        untied, ties = untie({n: targets[n] for n in wanted}, rank)
        targets = {**targets, **untied}
        clock.lap("check")
        # planned, and the boxes landing on the GPU start reading into the staging ring, before the agreement: the
        # reads overlap it, and nothing is copied into the model until every rank has checked the checkpoint
        stage = _PLANNING
        started = _start_reads(reader, wanted, replicas, targets, adapters, rank, read_threads=read_threads,
                               budget_bytes=budget_bytes, read_direct=read_direct)
        fault_point("load.planned", rank)
        clock.lap("plan")
    except BaseException as exc:  # KeyboardInterrupt too: the peers wait for this rank's word at the agreement
        mine = exc
        interrupt = None if isinstance(exc, Exception) else exc
        clock.lap("plan" if stage == _PLANNING else "check")
    try:
        parsed = parsed_checkpoint(reader.index) if reader is not None else None
        shared = _agree(channel, mine, who, stage + place, what,
                        share=(parsed, replica_digests(batches), shares_replicas))
        _check_same_checkpoint([p for p, _, _ in shared], what)
        _check_same_replica_reads([once for _, _, once in shared], what)
        _check_replica_groups([d for _, d, _ in shared], layout.mesh, what)
        assert reader is not None and started is not None
        plans, landed, transfers, on_gpu, boxes = (started.plans, started.landed, started.transfers, started.on_gpu,
                                                   started.boxes)
        clock.lap("agree")
        problem = None
        loaded = owned = received = 0
        try:
            for name, plan in plans.items():
                nbytes = _owned_bytes(wanted[name], plan, reader, adapters, rank)
                owned += nbytes
                loaded += 1
                if name in replicas and not replicas[name].reads:
                    received += nbytes
                    continue
                fault_point("load.read", rank)
                if name in landed:  # read and copied by the reader's threads: nothing to ask for, finish() waits
                    prepare_target(plan, targets[name])
                elif name in transfers:
                    _copy_planned(plan, transfers[name], boxes.read, targets[name], non_blocking=on_gpu)
                else:
                    execute_load(plan, boxes.read, targets[name], adapters, cast=cast, non_blocking=on_gpu)
            clock.lap("read")
            boxes.finish()  # the boxes landing on the GPU from the reading threads: queued, or the first failure
            if on_gpu:  # the copies were queued: they land before anyone reads the model
                torch.cuda.synchronize()
            boxes.check_unchanged()  # no file was rewritten under the reads
            clock.lap("drain")
            clock.add("read_wait", boxes.wait_seconds)
        except BaseException as exc:  # an interrupt is this rank's problem first, raised after the agreement
            problem = problem_from(exc, who, "reading its slices" + place)
            interrupt = interrupt or (None if isinstance(exc, Exception) else exc)
        if batches:
            problem, stopped = _share_replicas(layout, batches, targets, rank, timeout, problem)
            interrupt = interrupt or stopped
            clock.lap("share")
        tied = tie_problem(ties, targets, layout, rank) if ties and problem is None else None
        if tied is not None:
            problem = problem_from(tied, who, "checking its tied parameters" + place)
        try:
            fault_point("load.status", rank)
        except BaseException as exc:  # an interrupt too: the peers wait for this rank's status
            problem = problem or problem_from(exc, who, "reporting its status" + place)
            interrupt = interrupt or (None if isinstance(exc, Exception) else exc)
        try:
            agree(channel, problem, what=what, error=LoadFailed, outcome="the model's values must not be used")
        except LoadFailed as failed:
            if interrupt is not None:
                raise interrupt from failed
            raise
        clock.lap("agree")
        return LoadReport(
            path=Path(path),
            rank=rank,
            parameters=loaded,
            bytes_read=boxes.bytes_fetched,
            bytes_direct=boxes.bytes_direct,
            bytes_owned=owned,
            bytes_received=received,
            seconds=time.perf_counter() - start,
            missing=missing,
            unexpected=unexpected,
            mismatched=mismatched,
            timings=clock.timings(),
            unexpected_allowed=allow_unexpected,
        )
    finally:
        if started is not None:
            started.boxes.close()
        if reader is not None:
            reader.close()


_CHECKING = "checking the checkpoint against the layout"
_PLANNING = "planning its reads"


@dataclass(frozen=True, slots=True)
class _StartedReads:
    """A rank's reads, planned and started: each wanted parameter's plan, those whose boxes land in their tensors
    from the reading threads (``_landed``), the coalesced transfers, whether copies are queued on a GPU, and the
    reader, already reading the landing pieces into the staging ring."""

    plans: dict[str, HFLoadPlan]
    landed: set[str]
    transfers: dict[str, tuple[Transfer, ...]]
    on_gpu: bool
    boxes: BoxReader


def _start_reads(
    reader: CheckpointReader,
    wanted: Mapping[str, LoadSpec],
    replicas: Mapping[str, ReplicaRead],
    targets: Mapping[str, torch.Tensor],
    adapters: Mapping[str, Adapter] | None,
    rank: int,
    *,
    read_threads: int,
    budget_bytes: int,
    read_direct: bool | Literal["auto"] | None,
) -> _StartedReads:
    """Plan what this rank reads (a replicated parameter only where it is this rank's turn) and start the reader.
    Into a GPU (or through the CPU seam) the reader starts reading the landing pieces at once; it copies nothing
    into the model until the loading thread drains it (``BoxReader.finish``). A parameter whose cast may narrow
    (``narrows_range``) is not landed there: its pieces are copied by the loading thread, each checked first."""
    plans = {name: spec.memo(("load_plan", rank), lambda spec=spec: plan_hf_load(spec, rank))
             for name, spec in wanted.items()}
    to_read = [n for n in plans if not (n in replicas and not replicas[n].reads)]
    device = next((targets[n].device for n in to_read if targets[n].device.type == "cuda"), None)
    ring = None
    if device is None and _CPU_LANDING_RING is not None:  # the CPU seam: the GPU's path, copies at once
        device, ring = torch.device("cpu"), _CPU_LANDING_RING
    on_gpu = device is not None and device.type == "cuda"
    narrowing = {n for n in to_read if any(narrows_range(reader.dtype(r.hf_key), targets[n].dtype)
                                           for r in plans[n].reads)}
    landed = _landed(plans, [n for n in to_read if n not in narrowing], targets, adapters, device)
    transfers = _transfers(reader, wanted, plans, to_read, targets, adapters, rank, landed)
    boxes = BoxReader(reader.index, _reads_in_order(plans, to_read, adapters, transfers, targets, landed),
                      threads=read_threads, budget_bytes=budget_bytes, pin_memory=on_gpu, direct=read_direct,
                      device=device, ring=ring)
    return _StartedReads(plans, landed, transfers, on_gpu, boxes)


def _transfers(
    reader: CheckpointReader,
    specs: Mapping[str, LoadSpec],
    plans: Mapping[str, HFLoadPlan],
    names: list[str],
    targets: Mapping[str, torch.Tensor],
    adapters: Mapping[str, Adapter] | None,
    rank: int,
    landed: Collection[str] = (),
) -> dict[str, tuple[Transfer, ...]]:
    """The coalesced transfers of every parameter read here whose keys have no adapter (those are read whole, key
    by key, and canonicalized by ``execute_load``). Those that land on the GPU (``landed``) are not cut into
    pieces here: ``BoxReader`` cuts them into pieces of its staging slots (pieces of exactly a slot's data would
    leave a few KiB of each over). Kept with the parameter's spec for the checkpoint's index (``_for_index``): a
    repeat load of the same checkpoint (whose parsed index ``cached_checkpoint`` reuses) plans nothing again."""
    out = {}
    for name in names:
        plan = plans[name]
        if _adapted(plan, adapters):
            continue
        piece_bytes = _WHOLE if name in landed else PIECE_BYTES
        strides = targets[name].stride()
        out[name] = _for_index(
            specs[name], ("transfers", rank, strides, piece_bytes), reader.index,
            lambda plan=plan, strides=strides, piece_bytes=piece_bytes: plan_transfers(
                reader.index, plan.reads, strides, piece_bytes=piece_bytes),
        )
    return out


def _adapted(plan: HFLoadPlan, adapters: Mapping[str, Adapter] | None) -> bool:
    """Whether an adapter reads one of the parameter's keys (whole: the parameter has no transfers)."""
    return bool(adapters) and any(r.hf_key in adapters for r in plan.reads)


def _landed(
    plans: Mapping[str, HFLoadPlan],
    names: list[str],
    targets: Mapping[str, torch.Tensor],
    adapters: Mapping[str, Adapter] | None,
    device: torch.device | None,
) -> set[str]:
    """The parameters read here whose every box lands in their local tensor on ``device`` (no adapter, no padding
    to zero first; ``_reads_in_order``): the reader's threads read and copy them, so the loop asks it for none of
    their boxes."""
    if device is None:
        return set()
    return {n for n in names
            if targets[n].device == device and not plans[n].zero_fill and not _adapted(plans[n], adapters)}


def _owned_bytes(
    spec: LoadSpec, plan: HFLoadPlan, reader: CheckpointReader, adapters: Mapping[str, Adapter] | None, rank: int
) -> int:
    """Bytes of the checkpoint's keys this rank's slices of the parameter hold (keys with an adapter left out)."""
    def count() -> int:
        return sum(r.numel * reader.dtype(r.hf_key).itemsize for r in plan.reads
                   if not (adapters and r.hf_key in adapters))

    if adapters:
        return count()
    return _for_index(spec, ("owned_bytes", rank), reader.index, count)


def _for_index(spec: LoadSpec, what: tuple, index: CheckpointIndex, compute: Callable[[], _T]) -> _T:
    """``compute()`` for ``spec`` and the checkpoint ``index``, kept with the spec (``LoadSpec.memo``) for the last
    index it was asked for: the index object itself is the key (``cached_checkpoint`` hands out the same object
    while the checkpoint's files are unchanged, and a new one when any changed), so a stale plan is never reused."""
    kept: list[tuple[CheckpointIndex, Any] | None] = spec.memo(("for_index", *what), lambda: [None])
    entry = kept[0]  # one (index, value) pair, replaced whole: a thread never sees one index with another's value
    if entry is None or entry[0] is not index:
        entry = kept[0] = (index, compute())
    return entry[1]


def _copy_planned(
    plan: HFLoadPlan, transfers: tuple[Transfer, ...], read: Any, out: torch.Tensor, *, non_blocking: bool
) -> None:
    """``execute_load`` for a parameter without adapters, one copy per coalesced transfer."""
    prepare_target(plan, out)
    copy_transfers(transfers, read, out, non_blocking=non_blocking,
                   into=f"the model's {plan.name!r} on rank {plan.rank}")


def _bytes_land_in_place(t: torch.Tensor) -> bool:
    """Whether a file's bytes read into ``t``'s memory give ``t`` the file's values: not through a conjugate or
    negative view (which a copy would honour), and not into an expanded dim (whose elements share memory)."""
    return not (t.is_conj() or t.is_neg() or any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride())))


def _reads_in_order(
    plans: Mapping[str, HFLoadPlan],
    names: list[str],
    adapters: Mapping[str, Adapter] | None,
    transfers: Mapping[str, tuple[Transfer, ...]],
    targets: Mapping[str, torch.Tensor],
    landed: Collection[str] = (),
) -> list[tuple[str, tuple[slice, ...] | None] | Any]:
    """Every read the consumer will ask for, in its order: a parameter's coalesced transfers (``FileBox``-es; with
    the place in the local tensor where the bytes can land there: a tensor on the GPU the load reads into
    (``landed``, ``_landed``; a copy there casts) or a CPU tensor of the checkpoint's dtype with no padding to zero
    first), or, for one with adapters, the owned box of each key, or the whole key (once per parameter) where an
    adapter canonicalizes it."""
    reads: list[Any] = []
    for name in names:
        if name in transfers:
            out = targets[name]
            same_dtype = all(t.source.dtype == out.dtype for t in transfers[name])
            if name in landed or (not plans[name].zero_fill and out.device.type == "cpu" and same_dtype
                                  and _bytes_land_in_place(out)):
                reads.extend(zip((t.source for t in transfers[name]), landing_views(transfers[name], out)))
            else:
                reads.extend(t.source for t in transfers[name])
            continue
        whole: set[str] = set()
        for r in plans[name].reads:
            if adapters and r.hf_key in adapters:
                if r.hf_key not in whole:
                    whole.add(r.hf_key)
                    reads.append((r.hf_key, None))
            else:
                reads.append((r.hf_key, r.key_slices()))
    return reads


@dataclass(frozen=True, slots=True)
class ReplicaRead:
    """How one replicated parameter is loaded on this rank: the replicating mesh dims (one flattened group), the
    group rank that reads it, and whether that is this rank."""

    mesh_dim: MeshDimRef
    reader: int
    reads: bool


def _problem_rank(channel: ControlChannel, rank: int) -> tuple[int, str]:
    """The rank a failure of this load names, and what it adds to the stage the rank was in: in a world of several
    processes, this process's own rank, with ``rank`` (its place in the layout's mesh) where that differs. A
    pipeline stage loads with ``rank=`` its place in the stage, which a rank of every other stage shares: that place
    alone named a healthy rank of another stage. A process loading as any rank, in a world of one, names ``rank``."""
    import torch.distributed as dist

    if rank == channel.rank or not (dist.is_initialized() and dist.get_world_size() > 1):
        return rank, ""
    return channel.rank, f" as rank {rank} of its layout's mesh"


def _live_over(layout: Layout) -> bool:
    """Whether the replicas of ``layout`` can share their reads: a live world of several ranks that is the layout's
    mesh (a pipeline stage loaded with its own layout has a smaller mesh: each of its replicas reads for itself)."""
    import torch.distributed as dist

    return (dist.is_initialized() and dist.get_world_size() > 1 and str(dist.get_backend()) != "fake"
            and dist.get_world_size() == layout.mesh.size)


def replica_readers(
    layout: Layout, specs: Mapping[str, LoadSpec], rank: int, targets: Mapping[str, torch.Tensor]
) -> dict[str, ReplicaRead]:
    """For every parameter replicated over some mesh dims, who reads it in this rank's replica group: in model
    order, the member with the least work so far (lowest index on a tie). A parameter's work is the bytes of the
    tensor it fills, in its dtype (``targets``: this rank's local tensors), plus ``READ_COST_BYTES`` for each of
    its reads (a read a key, or a read a staging slot of bytes where the keys are smaller: a fused tensor's experts
    are packed): a read costs the loading thread about as much as copying that many bytes, so a member that reads
    one large embedding and one that reads a hundred small norms of the same bytes are not even. The members of a
    replica group hold the same shards in the same dtypes, so each computes the same answer (``replica_digests``
    proves it)."""
    out = {}
    loads: dict[MeshDimRef, list[int]] = {}
    for name, spec in specs.items():
        dims = tuple(layout.mesh.dim_names[i] for i in replicating_dims(spec))
        if not dims:
            continue
        ref: MeshDimRef = dims[0] if len(dims) == 1 else dims
        size = layout.mesh.group_size(ref)
        if size == 1:
            continue
        load = loads.setdefault(ref, [0] * size)
        reader = min(range(size), key=load.__getitem__)
        nbytes = math.prod(spec.local_shape(rank)) * targets[name].element_size()
        reads = min(len(spec.hf_keys), -(-nbytes // SLOT_BYTES) or 1)  # small keys read alone; fused ones packed
        load[reader] += nbytes + READ_COST_BYTES * reads
        out[name] = ReplicaRead(ref, reader, layout.mesh.group_rank(rank, ref) == reader)
    return out


@dataclass(frozen=True, slots=True)
class ReplicaBatch:
    """One broadcast of replicated parameters: the replicating mesh dims, the group rank that reads them, and
    their names and element counts."""

    mesh_dim: MeshDimRef
    reader: int
    names: tuple[str, ...]
    numels: tuple[int, ...]


def replica_batches(
    replicas: Mapping[str, ReplicaRead], targets: Mapping[str, torch.Tensor]
) -> dict[str, ReplicaBatch]:
    """This rank's broadcasts of replicated parameters, one per (mesh dims, reader, dtype, device), in the order
    they run: sorted by that key, so every rank runs the batches of one mesh dim before the next one's, and groups
    that overlap cannot wait on each other in a cycle. Every member of a replica group must have the very same
    batches (``replica_digests``), or a broadcast would pair one rank's parameter with another's."""
    found: dict[str, tuple[ReplicaRead, list[str]]] = {}
    for name, r in replicas.items():
        t = targets[name]
        found.setdefault(f"{format_mesh_dim(r.mesh_dim)}|{r.reader:08d}|{t.dtype}|{t.device.type}", (r, []))[1].append(
            name)
    return {
        key: ReplicaBatch(r.mesh_dim, r.reader, tuple(names), tuple(targets[n].numel() for n in names))
        for key, (r, names) in sorted(found.items())
    }


def replica_digests(batches: Mapping[str, ReplicaBatch]) -> dict[str, tuple[MeshDimRef, str, str, int]]:
    """What a rank's replica groups compare, per replicating mesh dims: (the dims, a hash of every batch in order,
    the first parameter, the parameter count). A few short entries per rank, whatever the world's size."""
    by_dims: dict[str, list] = {}
    for key, batch in batches.items():
        by_dims.setdefault(format_mesh_dim(batch.mesh_dim), []).append((key, batch))
    out = {}
    for dims, entries in by_dims.items():
        text = repr([(key, b.reader, b.names, b.numels) for key, b in entries])
        names = [n for _, b in entries for n in b.names]
        out[dims] = (entries[0][1].mesh_dim, hashlib.sha1(text.encode()).hexdigest(), names[0], len(names))
    return out


def _share_replicas(
    layout: Layout,
    batches: Mapping[str, ReplicaBatch],
    targets: Mapping[str, torch.Tensor],
    rank: int,
    timeout: float,
    problem: RankProblem | None,
) -> tuple[RankProblem | None, BaseException | None]:
    """Broadcast every replicated parameter from its reader to its replica group, batch by batch
    (``replica_batches``). Before each batch the group exchanges a "failed" flag, with this rank's failure to read
    or to make the batch's buffer in it, so no rank leaves its replicas waiting. Returns this rank's problem (a
    peer's failure is a secondary one) and the first interrupt caught here (an exception that is not an
    ``Exception``, e.g. ``KeyboardInterrupt``): like any failure it only raises this rank's flags on the batches
    left, and the caller raises it again once the ranks have agreed."""
    from workbench.run.torch_comm import TorchCommunicator

    stage = "sharing replicated parameters"
    interrupt: BaseException | None = None

    def caught(exc: BaseException, where: int, *, broken: bool = False) -> RankProblem:
        nonlocal interrupt
        if interrupt is None and not isinstance(exc, Exception):
            interrupt = exc
        return problem_from(exc, where, stage, broken=broken)

    try:
        comm = TorchCommunicator(layout.mesh, {b.mesh_dim for b in batches.values()}, timeout=timeout)
    except BaseException as exc:  # making groups is a collective of the world: it may be out of step now
        failed = caught(exc, rank, broken=True)
        return problem or failed, interrupt
    for index, batch in enumerate(batches.values()):
        mesh_dim, reader, names = batch.mesh_dim, batch.reader, batch.names
        reads = layout.mesh.group_rank(rank, mesh_dim) == reader
        tensors = [targets[n] for n in names]
        flat = None
        if problem is None:
            try:  # one buffer per batch, made before the flag: a rank that cannot make it says so there
                fault_point("load.share", rank, index)
                flat = torch.cat([t.reshape(-1) for t in tensors]) if reads else torch.empty(
                    sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device
                )
            except BaseException as exc:  # KeyboardInterrupt too: the group still needs this rank's flag
                problem = caught(exc, comm.rank)
        try:
            stop = comm.any_flag(mesh_dim, problem is not None)
        except BaseException as exc:  # the group may be out of step: no more calls on it
            failed = caught(exc, comm.rank, broken=True)
            return problem or failed, interrupt
        if stop:
            problem = problem or RankProblem(
                comm.rank, stage, f"a peer in its {format_mesh_dim(mesh_dim)} replica group failed", secondary=True,
            )
            continue
        assert flat is not None
        try:
            comm.broadcast(flat, mesh_dim, reader)
        except BaseException as exc:
            failed = caught(exc, comm.rank, broken=True)
            return problem or failed, interrupt
        if not reads:
            try:
                _copy_out(flat, tensors)
            except BaseException as exc:  # the group is fine: the next batch's flag tells the peers
                problem = caught(exc, comm.rank)
        del flat
    return problem, interrupt


def _copy_out(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """``flat``'s consecutive pieces into ``tensors`` (of its dtype and device), in order: one
    ``split_with_sizes_copy`` where every tensor is contiguous (a copy per tensor cost the loading thread a launch
    each: hundreds for a model's replicated norms and projections), else one copy each."""
    if all(t.is_contiguous() for t in tensors):
        torch.split_with_sizes_copy(flat, [t.numel() for t in tensors], out=[t.view(-1) for t in tensors])
        return
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()


def _check_same_replica_reads(once: list[bool], what: str) -> None:
    """Raise LoadFailed on every rank when some ranks share their replicas' reads and others do not (they passed
    different ``read_replicas_once``: a rank that reads its replicas itself would leave its group's broadcasts
    unanswered), naming the ranks of each value."""
    if len(set(once)) < 2:
        return
    by_value = " and ".join(f"{value} on rank(s) {', '.join(str(r) for r, o in enumerate(once) if o == value)}"
                            for value in (True, False))
    cause = f"the ranks passed different read_replicas_once ({by_value}): every rank must pass the same"
    raise LoadFailed(f"{what} failed; no tensor was changed.\n  {cause}",
                     [RankProblem(r, "planning the replica reads", cause) for r, o in enumerate(once) if not o])


def _check_replica_groups(shared: list[Any], mesh: MeshSpec, what: str) -> None:
    """Every member of each replica group must broadcast the same batches (the same parameters, sizes and readers,
    in the same order): each rank's digests are compared with its group leader's (the group's first rank), and each
    leader checks that its members have digests too, so the work is one pass over the ranks. Else raise LoadFailed
    on every rank (each sees every digest, so each decides alike), naming the ranks and a parameter. A model whose
    ranks hold different parameters (pipeline stages) is loaded stage by stage, each with its own layout."""
    group_of: dict[str, dict[int, tuple[int, ...]]] = {}  # per mesh dims: each rank's group
    for rank, digests in enumerate(shared):
        for dims, mine in (digests or {}).items():
            if dims not in group_of:
                group_of[dims] = {r: g for g in mesh.groups(mine[0]) for r in g}
            group = group_of[dims][rank]
            peers = [group[0]] if rank != group[0] else group[1:]  # a member: its leader; the leader: its members
            for peer in peers:
                theirs = (shared[peer] or {}).get(dims)
                if theirs == mine:
                    continue
                differs = (f"rank {rank} shares {mine[3]} starting with {mine[2]!r}, rank {peer} {theirs[3]} starting "
                           f"with {theirs[2]!r}" if theirs else f"rank {peer} shares nothing over them")
                problem = RankProblem(
                    rank, "planning the replica reads",
                    f"ranks {rank} and {peer} are replicas over {dims!r} but hold different replicated parameters "
                    f"({differs}); every rank must hold the same model. A pipeline stage loads with its own layout: "
                    "stage, local = pipeline.stage_of_rank(rank); load_hf(model, path, layout=pipeline.stages[stage], "
                    "rank=local, allow_unexpected=True), where pipeline = "
                    "workbench.layout.pipeline.read_checkpoint_pipeline_layout(path) (or the PipelineLayout it was "
                    "saved with)",
                )
                raise LoadFailed(f"{what} failed; no tensor was changed.\n  {problem.cause}", [problem])


@dataclass(frozen=True, slots=True)
class ParsedCheckpoint:
    """What one rank parsed of a checkpoint, for the ranks to compare at their first agreement
    (``_check_same_checkpoint``): ranks that parsed one path while another save published there would each read
    their own checkpoint, every file still the one its rank parsed, and load a model mixed of the two.

    ``directory``: the checkpoint's folder (ranks that load other folders, pipeline stages each from its own, are
    not compared). ``files`` hashes what the headers say (the weight map, every key's dtype, shape and byte range,
    every file's ``__metadata__`` and size): alike on every host of a shared file system and in a copy on each
    host's own disk, however it was copied. ``inodes`` hashes every data file's inode and modification time (ns),
    compared only between ranks of one ``host`` (its name and the files' devices), where one file is one inode: an
    NFS mount's device number differs between hosts, and a copy on each host's own disk has inodes and times of its
    own. Between hosts, a checkpoint replaced by one of the same keys, shapes and metadata is not told apart.
    """

    directory: str
    host: str
    files: str
    inodes: str


_PARSED = LRU(4)  # id(index) -> (index, ParsedCheckpoint): the index kept, so its id holds


def parsed_checkpoint(index: CheckpointIndex) -> ParsedCheckpoint:
    """The ``ParsedCheckpoint`` of ``index``, kept for the very index object (a repeat load of an unchanged
    checkpoint hashes its weight map once)."""
    hit = _PARSED.get(id(index))
    if hit is not None and hit[0] is index:
        return hit[1]
    ids = [index.file_ids.get(f, (0, 0, 0, 0)) for f in index.files]  # file_id: (device, inode, size, mtime_ns)
    headers = (index.weight_map, [(k.hf_key, k.file, k.dtype, k.shape, k.data_offsets) for k in index.keys.values()],
               sorted(index.file_metadata.items()), [(f, size) for f, (_, _, size, _) in zip(index.files, ids)])
    parsed = ParsedCheckpoint(
        directory=str(_loaded_from(index)),
        host=f"{socket.gethostname()} {sorted({device for device, *_ in ids})}",
        files=_sha1(headers),
        inodes=_sha1([(inode, mtime) for _, inode, _, mtime in ids]),
    )
    _PARSED.put(id(index), (index, parsed))
    return parsed


def _loaded_from(index: CheckpointIndex) -> Path:
    """What a rank loads, for comparing it with its peers: the index file, else the lone weights file (ranks that
    each load a file of their own in one folder, pipeline stages say, load different checkpoints on purpose)."""
    if index.index_file is not None or len(index.files) != 1:
        return index.index_file or index.directory
    return index.directory / index.files[0]


def _sha1(value: object) -> str:
    return hashlib.sha1(repr(value).encode()).hexdigest()


def _check_same_checkpoint(shared: list[ParsedCheckpoint], what: str) -> None:
    """Raise LoadFailed on every rank (each sees every rank's ``ParsedCheckpoint`` and decides alike) where two
    ranks parsed different checkpoints in one directory: each rank is compared with the first rank that named its
    directory, and for the inodes with the first of those on its host."""
    first_in: dict[str, int] = {}
    first_on: dict[tuple[str, str], int] = {}
    for rank, mine in enumerate(shared):
        peer = first_in.setdefault(mine.directory, rank)
        if mine.files == shared[peer].files:
            peer = first_on.setdefault((mine.directory, mine.host), rank)
            if mine.inodes == shared[peer].inodes:
                continue
        copies = "" if shared[peer].host == mine.host else (
            ", or each host holds a checkpoint of its own there and theirs differ")
        problem = RankProblem(
            rank, "comparing the checkpoint it parsed with its peers'",
            f"ranks {peer} and {rank} read different checkpoints at {mine.directory}: it was replaced during the "
            f"load{copies}; load again once it is complete and the same for every rank",
        )
        raise LoadFailed(f"{what} failed; no tensor was changed.\n  {problem.cause}", [problem])


@dataclass(frozen=True, slots=True)
class _Checked:
    """What a load learns from the checkpoint's index and the layout before reading: the keys that do not match,
    the parameters to read, and who reads and broadcasts each replicated one."""

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[str, ...]
    wanted: dict[str, LoadSpec]
    replicas: dict[str, ReplicaRead]
    batches: dict[str, ReplicaBatch]


_CHECKED = LRU(4)  # (ids of the layout and index, ...) -> (layout, index, _Checked): the objects kept, so ids hold


def _refuse_other_shapes(layout: Layout, targets: Mapping[str, torch.Tensor], rank: int) -> None:
    """A given layout must cut each parameter as the model does on this rank: its local shape (and a DTensor's global
    shape) are compared before anything is read (a layout of another mesh used to fail deep in a copy)."""
    for name, spec in layout.specs.items():
        tensor = targets[name]
        want = spec.local_shape(rank)
        if tuple(tensor.shape) != tuple(want):
            raise LayoutError(
                f"parameter {name!r}: rank {rank} holds a local tensor of shape {tuple(tensor.shape)}, but the layout "
                f"given ({spec.describe_shards() or 'replicated'} of {spec.global_shape} over {layout.mesh!r}) gives "
                f"this rank {tuple(want)}: the layout is not the model's (another mesh or other placements)"
            )


def _checked(
    index: CheckpointIndex,
    layout: Layout,
    targets: Mapping[str, torch.Tensor],
    adapters: Mapping[str, Adapter] | None,
    cast: bool,
    rank: int,
    share_replicas: bool,
) -> _Checked:
    """``_check`` and the replica plan, kept for the very layout and index objects (a repeat load of an unchanged
    checkpoint, whose parsed index ``cached_checkpoint`` reuses, into the same model checks nothing again) with
    the same dtypes, devices and shapes of the local tensors; not kept with ``adapters`` (a mapping may change)."""
    key = None
    if not adapters:
        meta = tuple((t.dtype, t.device, t.shape) for t in targets.values())
        key = (id(layout), id(index), tuple(targets), meta, cast, rank, share_replicas)
        hit = _CHECKED.get(key)
        if hit is not None and hit[0] is layout and hit[1] is index:
            return hit[2]
    missing, unexpected, mismatched = _check(index, layout, targets, adapters, cast)
    bad = set(missing) | {m.split(":", 1)[0] for m in mismatched}
    wanted = {n: s for n, s in layout.specs.items() if not bad.intersection(s.hf_keys)}
    replicas = replica_readers(layout, wanted, rank, targets) if share_replicas else {}
    checked = _Checked(missing, unexpected, mismatched, wanted, replicas, replica_batches(replicas, targets))
    if key is not None:
        _CHECKED.put(key, (layout, index, checked))
    return checked


def _check(
    index: CheckpointIndex,
    layout: Layout,
    targets: Mapping[str, torch.Tensor],
    adapters: Mapping[str, Adapter] | None,
    cast: bool,
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Missing, unexpected, and mis-shaped or differently typed keys (each ``"key: what differs"``)."""
    present = index.keys
    expected = layout.hf_keys
    missing = tuple(k for k in expected if k not in present)
    unexpected = tuple(sorted(k for k in present if k not in expected))
    mismatched = []
    for name, spec in layout.specs.items():
        want = expected_key_shape(spec)
        for key in spec.hf_keys:
            if key not in present or (adapters and key in adapters):
                continue
            info = present[key]
            if cast:
                _refuse_unscaled_fp8_cast(key, info.dtype, targets[name].dtype, name, present)
            if info.shape != want:
                mismatched.append(f"{key}: checkpoint {info.shape}, layout of {name!r} expects {want}")
            elif (stored := torch_dtype(info.dtype)) != targets[name].dtype and (
                    not cast or changes_kind(stored, targets[name].dtype)):
                how = ("cast=True does not convert floating values into integers or bools, nor complex into real ones"
                       if cast else "pass cast=True to convert")
                mismatched.append(
                    f"{key}: checkpoint dtype {str(stored).removeprefix('torch.')}, the model's {name!r} is "
                    f"{str(targets[name].dtype).removeprefix('torch.')} ({how})"
                )
    return missing, unexpected, tuple(mismatched)


# the keys that scale a float8 key's raw values: DeepSeek's block scales (``workbench.layout.fp8``), and the
# per-tensor or per-channel ``weight_scale`` of compressed-tensors checkpoints
_FP8_SCALE_SUFFIXES = (SCALE_SUFFIX, "_scale")


def _is_float8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _refuse_unscaled_fp8_cast(
    key: str, stored: str, target: torch.dtype, name: str, present: Mapping[str, Any]
) -> None:
    """Raise where ``cast`` would convert a float8 key (safetensors dtype ``stored``) that has a scale key into a
    parameter that is not float8: its raw values mean nothing without their scales (they were cast silently, the
    scales left unread)."""
    if not stored.startswith("F8_") or _is_float8(target):
        return
    scale = next((key + s for s in _FP8_SCALE_SUFFIXES if key + s in present), None)
    if scale is None:
        return
    dtype = str(torch_dtype(stored)).removeprefix("torch.")
    raise CheckpointError(
        f"{key}: checkpoint dtype {dtype} scaled by {scale!r}; cast=True into the "
        f"model's {name!r} ({str(target).removeprefix('torch.')}) would load its raw float8 values without their "
        "scales. Load it into a float8 parameter with its scale (a layout from workbench.layout.fp8.with_fp8_scales) "
        "and dequantize that (workbench.io.hf.fp8.dequantize_blocks), or dequantize the checkpoint first "
        "(workbench.io.hf.fp8.dequantized_state, then save_hf)"
    )


def _agree(
    channel: ControlChannel, mine: BaseException | None, rank: int, stage: str, what: str, *, share: Any = None
) -> list[Any]:
    """Every rank learns whether any rank failed ``stage``; the failing rank raises its own error. Returns every
    rank's ``share``, in rank order."""
    problem = problem_from(mine, rank, stage) if mine is not None else None
    try:
        return agree(channel, problem, what=what, error=LoadFailed, outcome="no tensor was changed", share=share)
    except LoadFailed:
        if mine is not None:
            raise mine from None
        raise


def _problem(path: str | Path, missing: tuple[str, ...], unexpected: tuple[str, ...], mismatched: tuple[str, ...]
             ) -> str:
    lines = [f"checkpoint {path} does not match the model's layout:"]
    for what, keys, hint in (
        ("missing from the checkpoint", missing, "check the key map, or load with strict=False"),
        ("in the checkpoint but not in the layout", unexpected, "map them to parameters, or load with strict=False "
         "(allow_unexpected=True where they belong to other pipeline stages)"),
        ("with another shape or dtype", mismatched, "saved from another config, with padding, or in fp32?"),
    ):
        if keys:
            shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
            lines.append(f"  {len(keys)} key(s) {what} ({hint}): {shown}")
    return "\n".join(lines)
