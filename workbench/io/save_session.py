"""One rank's part of a ``save_hf``: plan, gather and write, then agree and publish (see ``io/hf_save.py``).

``SaveSession`` holds what one save owns on one rank: its plans, its files (streamed in gather mode, written in
place in direct mode), the writer threads and the queue of host copies waiting for them, the owner-marker
heartbeat, and the problem it will report at the status exchange. Every way out goes through ``close()``.

An exception that is not an ``Exception`` (``KeyboardInterrupt`` in the main thread or a writer thread,
``SystemExit``) is this rank's problem like any other: the rank keeps answering its peers, takes part in the status
exchange (every peer raises ``SaveFailed`` naming it), and then raises it again.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import math
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from workbench.display import html_of
from workbench.errors import CheckpointError
from workbench.faults import fault_point
from workbench.io.direct import DEFAULT_MIN_SEGMENT_BYTES, CheckpointFiles, direct_names, direct_program
from workbench.io.early_snapshot import EarlySnapshot, take_step
from workbench.io.file_plan import FilePlan, plan_files
from workbench.io.index import INDEX_NAME, write_index
from workbench.io.ownership import MARKER_NAME, Heartbeat
from workbench.io.publish import AtomicRenamePublisher
from workbench.io.save_timings import SaveClock, SaveTimings
from workbench.io.snapshot import HostCopy, Snapshotter
from workbench.io.stream_write import StreamWriter
from workbench.io.writeback import WritebackWindow
from workbench.layout.layout_file import LAYOUT_FILE_NAME, write_checkpoint_layout
from workbench.layout.load_spec import KeyRegion
from workbench.layout.model_layout import Layout
from workbench.memo import LRU, remember_by_identity
from workbench.plan.policy import SavePolicy
from workbench.plan.save_set import SavePlanSet, key_meta, layout_fingerprint, plan_save_within_writers
from workbench.plan.writers import writer_pool
from workbench.run.communicator import Communicator
from workbench.run.executor import WaveOutput, unshard
from workbench.run.guard import (
    RankProblem,
    SaveFailed,
    agree,
    check_agreement,
    drive_guarded,
    plan_digests,
    problem_from,
)
from workbench.run.unshard_ops import split_keys
from workbench.version import __version__

__all__ = ["SaveResult", "SaveSession"]

_IN_FLIGHT: set[Path] = set()  # targets of this process's saves that are not published or failed yet
_RESERVED = {INDEX_NAME, MARKER_NAME, LAYOUT_FILE_NAME}


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveResult:
    """What one rank did for a save: the published path, its files and bytes, and the time it took.

    ``blocked_seconds`` is how long ``save_hf`` held the caller (for an async save, until the snapshot was
    taken); ``snapshot_bytes`` the bytes copied into host memory the save owns. ``predicted_peak_bytes`` is the
    schedule's peak, with the backend's receive buffers (gloo's scratch) counted. ``timings`` says where the
    time went (stages and writer threads; see ``SaveTimings``).
    """

    path: Path
    rank: int
    files: tuple[str, ...]
    bytes_written: int
    seconds: float
    calls: int
    predicted_peak_bytes: int
    blocked_seconds: float = 0.0
    snapshot_bytes: int = 0
    write_mode: str = "gather"
    direct_tensors: int = 0
    timings: SaveTimings = field(default_factory=SaveTimings)

    def __str__(self) -> str:
        return (
            f"saved {self.path} (rank {self.rank}: {len(self.files)} file(s), {self.bytes_written} bytes, "
            f"{self.calls} gather calls, {self.seconds:.2f} s)"
        )

    def _repr_html_(self) -> str | None:
        """HTML for notebooks, from the renderer ``workbench.viz`` registers (``workbench.display``)."""
        return html_of(self)


_META_CACHE = LRU(16)


def _key_meta_and_direct(
    layout: Layout, dtype: torch.dtype | None, patterns: Sequence[str] | str | None, min_segment: int | None
) -> tuple[dict, tuple[str, ...]]:
    """Every key's (save dtype, shape) and the tensors written directly (none when ``min_segment`` is None);
    cached per layout and options, like the plans, so a repeat save does not redo them."""
    key = (layout_fingerprint(layout), layout.mesh, dtype, patterns if isinstance(patterns, str | None)
           else tuple(patterns), min_segment)
    hit = _META_CACHE.get(key)
    if hit is None:
        runtime = {name: layout.dtype(name) for name in layout}
        meta = key_meta(layout, runtime, dtype, patterns)
        hit = (meta, direct_names(layout, meta, min_segment) if min_segment is not None else ())
        _META_CACHE.put(key, hit)
    return hit


_FILE_PLANS = LRU(16)


def _file_plan(
    plan_set: SavePlanSet, key_meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], layout: Layout,
    max_shard_bytes: int,
) -> FilePlan:
    """Which keys go to which file: gathered keys with their writers' files, direct keys spread over the ranks'
    files; remembered for the same (cached) plan set and key metadata, which fix the layout too."""

    def plan() -> FilePlan:
        sizes = {k: math.prod(shape) * d.itemsize for k, (d, shape) in key_meta.items()}
        writers = dict(plan_set.writers)
        world = layout.mesh.size
        for index, key in enumerate(layout.hf_keys):  # direct keys: any rank-independent spread of files
            writers.setdefault(key, index % world)
        return plan_files(writers, sizes, list(layout.hf_keys), max_shard_bytes=max_shard_bytes)

    return remember_by_identity(_FILE_PLANS, (plan_set, key_meta), max_shard_bytes, plan)


class SaveSession:
    """One rank's part of a save: plan, gather and write, then agree and publish."""

    def __init__(
        self,
        layout: Layout,
        path: Path,
        comm: Communicator,
        start: float,
        threads: int,
        max_shard_bytes: int,
        config_files: Sequence[str | Path],
        in_flight_bytes: int,
        snapshot: Snapshotter,
    ) -> None:
        self.layout, self.path, self.comm, self.start = layout, path, comm, start
        self.rank = comm.rank
        self.max_shard_bytes = max_shard_bytes
        self.config_files = [Path(c) for c in config_files]
        self.pool = futures.ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="workbench-write")
        self.pending: list[tuple[futures.Future[int], int, HostCopy | _Writes]] = []  # (job, bytes, its copies)
        self.queued_bytes = 0
        self.in_flight_bytes = in_flight_bytes
        self.snapshot = snapshot
        self.files: dict[str, StreamWriter] = {}
        self.key_meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.publisher = AtomicRenamePublisher(path)
        self.heartbeat: Heartbeat | None = None
        self.plan_set: SavePlanSet | None = None
        self.file_plan: FilePlan | None = None
        self.metadata = {"format": "pt", "workbench_version": _version(), "layout": layout_fingerprint(layout)}
        self.problem: RankProblem | None = None
        self.write_problem: RankProblem | None = None
        self.interrupt: BaseException | None = None  # not an Exception: raised again once the ranks have agreed
        self.write_mode = "gather"
        self.min_segment_bytes = DEFAULT_MIN_SEGMENT_BYTES
        self.map_short_runs = False  # every writer shares one page cache: short runs go through a memory map
        self.direct: tuple[str, ...] = ()
        self.checkpoint_files: CheckpointFiles | None = None
        self.direct_queued = False  # the direct pieces are snapshotted and queued (before the plan agreement)
        self.early: EarlySnapshot | None = None  # copies taken at the call's start, for the plan of the last save
        self.writeback = WritebackWindow()  # one per save: its writer threads share the bound
        self.clock = SaveClock()
        self._write_lock = threading.Lock()
        self.blocked_seconds = 0.0
        self.target = path.resolve()
        self.closed = False
        self.prepared = False  # rank 0 made the temporary directory (only then may it remove it)
        self.stopped = False  # the save failed or ended: queued writes are skipped
        # writes start once the snapshot is taken (an async save: the copies then have the machine to themselves,
        # so the caller is blocked for less), or at once for a sync save, or when the queue must drain
        self.gate = threading.Event()
        if not snapshot.own_everything:
            self.gate.set()
        self._batch = _Writes()  # direct writes snapshotted and not yet handed to a writer
        snapshot.on_full = self._make_room
        _IN_FLIGHT.add(self.target)

    # -- stages ------------------------------------------------------------------------------------------------

    def plan(
        self,
        policy: SavePolicy | None,
        budget: int | None,
        dtype: torch.dtype | None,
        fp32_keys_pattern: Sequence[str] | str | None,
        max_writers: int | None,
        tensors: Mapping[str, torch.Tensor],
        *,
        snapshot_early: bool = False,
    ) -> None:
        """Plan on every rank, agree (nothing moves if any rank failed), then prove the plans match.

        ``snapshot_early`` (an async save whose writers stay gated until its snapshot is agreed on): this rank's
        direct pieces are copied before the agreement, so their device-to-host copies run while the ranks
        exchange; a failure there is reported at the agreement like a planning failure."""
        problem = None
        try:
            self._plan(policy, budget, dtype, fp32_keys_pattern, max_writers, tensors)
            fault_point("plan", self.rank)
        except BaseException as exc:  # KeyboardInterrupt too: the peers wait for this rank's word at the agreement
            problem = self._caught(exc, "planning the save")
        if problem is None and snapshot_early and self.checkpoint_files is not None:
            assert not self.gate.is_set(), "an early snapshot needs gated writers"
            self.direct_queued = True
            started = time.perf_counter()
            try:
                self._write_direct(tensors)
            except BaseException as exc:
                problem = self._caught(exc, "writing its own pieces")
            spent = time.perf_counter() - started  # the snapshot's time, inside the caller's "plan" stage
            self.clock.add("snapshot", spent)
            self.clock.add("plan", -spent)
        digests = None
        if problem is None:
            assert self.plan_set is not None
            digests = plan_digests(self.plan_set.schedules[self.rank], self.plan_set.writers, self.layout.mesh,
                                   self.rank)
        if self.early is not None and not self.direct_queued:
            self.early.release()  # taken for a direct plan this save does not follow
        model = (self.metadata["layout"], len(self.layout.specs), next(iter(self.layout.specs), None))
        everyone = self._agree(problem, what=f"save to {self.path}", on_failure=self._abort,
                               share=(digests, model))
        self._check_same_model([m for _, m in everyone])
        assert self.plan_set is not None
        check_agreement(  # the digests came with the planning outcome: no exchange of their own
            self.comm, self.plan_set.schedules[self.rank], self.plan_set.writers, self.layout.mesh,
            what=f"save to {self.path}", digests=[d for d, _ in everyone],
        )

    def _check_same_model(self, models: Sequence[tuple[str, int, str | None]]) -> None:
        """Every rank must save the same layout: ranks that hold different parameters (pipeline stages called as one
        model) would each leave the others' tensors to a writer that does not have them, and publish a checkpoint
        without them. Raises SaveFailed on every rank (each sees every rank's fingerprint), before any data moves."""
        by_layout: dict[str, list[int]] = {}
        for rank, (fingerprint, _, _) in enumerate(models):
            by_layout.setdefault(fingerprint, []).append(rank)
        if len(by_layout) == 1:
            return
        groups = "; ".join(
            f"rank(s) {_ranks(ranks)}: {models[ranks[0]][1]} parameters, the first {models[ranks[0]][2]!r}"
            for ranks in by_layout.values()
        )
        cause = (f"the ranks hold different layouts ({groups}); every rank must save the same model (pipeline "
                 "stages save with save_hf_pipeline)")
        self._abort()
        raise SaveFailed(f"save to {self.path} refused before any data moved: {cause}",
                         [RankProblem(self.rank, "checking that the ranks save the same model", cause)])

    def _plan(
        self,
        policy: SavePolicy | None,
        budget: int | None,
        dtype: torch.dtype | None,
        fp32_keys_pattern: Sequence[str] | str | None,
        max_writers: int | None,
        tensors: Mapping[str, torch.Tensor],
    ) -> None:
        policy = policy or SavePolicy.minimal()
        if policy.mode == "gather_only":
            raise CheckpointError("save_hf writes HF checkpoints; SavePolicy.gather_only keeps runtime layout")
        missing = [c for c in self.config_files if not c.is_file()]
        if missing:
            raise CheckpointError(f"config file(s) to copy do not exist: {[str(m) for m in missing]}")
        # a cap on the writers: the capped ranks write nothing, so their pieces are gathered to allowed writers, who
        # write whole keys into the files rank 0 made (rank 0 is always allowed: writer_pool starts at the lowest)
        mesh = self.layout.mesh
        capped = max_writers is not None and len(writer_pool(mesh.all_ranks(), max_writers)) < mesh.size
        direct = self.write_mode == "direct" and policy.mode in ("full", "minimal") and not capped
        self.key_meta, self.direct = _key_meta_and_direct(
            self.layout, dtype, fp32_keys_pattern, self.min_segment_bytes if direct else None
        )
        for name, spec in self.layout.specs.items():
            local, want = tensors[name], spec.local_shape(self.rank)
            if tuple(local.shape) != tuple(want):
                raise CheckpointError(
                    f"parameter {name!r}: local tensor has shape {tuple(local.shape)}, the layout says {tuple(want)}"
                )
        gathered = self.layout
        if self.direct:
            skip = set(self.direct)
            gathered = Layout(
                self.layout.mesh,
                {n: s for n, s in self.layout.specs.items() if n not in skip},
                {n: d for n, d in self.layout.dtypes.items() if n not in skip},
            )
        self.plan_set = plan_save_within_writers(
            gathered,
            ranks=[self.rank],
            policy=policy,
            budget_bytes=budget,
            dtype=dtype,
            fp32_keys_pattern=fp32_keys_pattern,
            max_writers=max_writers,
            # on CPU, tensors waiting for a writer are host memory the save holds (on GPU: pinned copies)
            queued_bytes=self.in_flight_bytes if all(t.device.type == "cpu" for t in tensors.values()) else 0,
            gather_scratch=getattr(self.comm, "gather_scratch", False),
        )
        self.file_plan = _file_plan(self.plan_set, self.key_meta, self.layout, self.max_shard_bytes)
        ours = _RESERVED | {f.name for f in self.file_plan.files}
        clash = [str(c) for c in self.config_files if c.name in ours or c.name.endswith(".safetensors")]
        if clash:
            raise CheckpointError(
                f"config file(s) {clash} would overwrite the index or weight files this save writes; rename them or "
                "leave them out of config_files"
            )
        if self.write_mode == "direct":
            self.checkpoint_files = CheckpointFiles(
                self.publisher.temporary, self.file_plan, self.key_meta, self.metadata, self.writeback,
                map_short_runs=self.map_short_runs,
            )
        if self.rank == 0:
            self.publisher.prepare()
            self.prepared = True
            self.heartbeat = Heartbeat(self.publisher.temporary / MARKER_NAME)
            if self.checkpoint_files is not None:
                self.checkpoint_files.create_all()

    def gather(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Run the unshard schedule under the flag protocol; each key this rank writes is snapshotted and queued
        for its file the moment its wave ends. A failure is kept for the status exchange, never raised here."""
        assert self.plan_set is not None and self.file_plan is not None
        plans = {p.name: p for p in self.plan_set.plans[self.rank]}
        writers = self.plan_set.writers
        schedule = self.plan_set.schedules[self.rank]
        failed = None
        try:
            if self.checkpoint_files is None:
                for spec in self.file_plan.files_of(self.rank):
                    entries = [(k, *self.key_meta[k]) for k in spec.keys]
                    self.files[spec.name] = StreamWriter(
                        self.publisher.temporary / spec.name, entries, self.metadata, self.writeback
                    )
            elif not self.direct_queued:
                self._write_direct(tensors)
        except BaseException as exc:
            failed = self._caught(exc, "writing its own pieces" if self.direct else "creating its files")
        file_of = {k: f.name for f in self.file_plan.files_of(self.rank) for k in f.keys}

        def on_wave(wave: WaveOutput) -> None:
            for name, tensor in wave.tensors.items():
                for key, value in split_keys(tensor, plans[name]).items():
                    if writers.get(key) == self.rank:
                        fault_point("snapshot", self.rank)
                        if self.checkpoint_files is None:
                            self._submit(self.files[file_of[key]], key, self.snapshot.take(value))
                        else:
                            shape = tuple(value.shape)
                            whole = KeyRegion(key, (0,) * len(shape), shape, (0,) * len(shape))
                            copy = self.snapshot.take(value)
                            self._queue(copy.nbytes, partial(_write_piece, self.checkpoint_files, whole, copy), copy,
                                        key)

        program = unshard(schedule, self.plan_set.plans[self.rank], tensors)
        self.problem = drive_guarded(schedule, program, self.comm, on_wave, poll=self._poll, failed=failed,
                                     on_interrupt=self._keep_interrupt)

    def settle_snapshot(self) -> None:
        """Async: agree that every rank's gathers and snapshot copies were made (so no rank returns a handle while
        a peer raises), while the last device-to-host copies are still landing; then wait for them. A copy that
        fails to land after the agreement is this rank's problem at ``wait()``: its writers write nothing, and
        every rank's ``wait()`` raises, with nothing published."""
        if self.problem is None:
            try:
                self.snapshot.mark()
            except BaseException as exc:
                self.problem = self._caught(exc, "taking the snapshot")
        self._agree(self.problem, what=f"async save to {self.path}", on_failure=self._abort)
        try:
            self.snapshot.settle()
        except BaseException as exc:
            self.problem = self._caught(exc, "taking the snapshot (a copy did not land)")
            self.stopped = True
        self.gate.set()
        self.blocked_seconds = time.perf_counter() - self.start

    def finish(self) -> SaveResult:
        """Wait for this rank's writes, fsync its files, agree, then rank 0 publishes; every rank learns the end."""
        if not self.blocked_seconds:
            self.blocked_seconds = time.perf_counter() - self.start
        problem = self.problem
        self.stopped = problem is not None
        self.gate.set()
        with self.clock.measure("drain"):
            for future, _, _ in self.pending:
                try:
                    future.result()
                except BaseException as exc:  # _run_write records its own; this is a Ctrl-C while waiting here
                    problem = problem or self._caught(exc, "writing its files")
                    self.stopped = True  # the writes still queued are skipped
        problem = problem or self.write_problem
        self.pending.clear()
        self.queued_bytes = 0
        written = 0
        fsync_started = time.perf_counter()
        if self.checkpoint_files is not None:
            try:
                if problem is None:
                    fault_point("fsync", self.rank)
                    self.checkpoint_files.fsync()
                    written = sum(self.checkpoint_files.written.values()) + self.checkpoint_files.header_bytes
            except BaseException as exc:
                problem = problem or self._caught(exc, "fsyncing its files")
            try:  # a network filesystem may report a deferred write error only here: a problem like any other
                self.checkpoint_files.close()
            except BaseException as exc:
                problem = problem or self._caught(exc, "closing its files")
        for writer in self.files.values():
            try:
                if problem is None:
                    fault_point("fsync", self.rank)
                    written += writer.close()
                else:
                    writer.abandon()
            except BaseException as exc:
                problem = problem or self._caught(exc, f"fsyncing {writer.path.name}")
                writer.abandon()
        publish_started = time.perf_counter()
        self.clock.add("fsync", publish_started - fsync_started)
        try:
            fault_point("status", self.rank)
        except BaseException as exc:
            problem = problem or self._caught(exc, "reporting its status")
        # with the status, the byte ranges each rank wrote per file (compacted): rank 0 proves they tile every file
        ranges = None
        if self.checkpoint_files is not None and problem is None:
            try:
                ranges = self.checkpoint_files.written_ranges()
            except BaseException as exc:
                problem = self._caught(exc, "listing the byte ranges it wrote")
        everyone = self._agree(problem, what=f"save to {self.path}", on_failure=self._abort, share=ranges)
        assert self.file_plan is not None and self.plan_set is not None
        publish_problem = None
        if self.rank == 0:
            try:
                if self.checkpoint_files is not None:
                    gaps = self.checkpoint_files.coverage_problems(everyone)
                    if gaps:
                        raise CheckpointError(
                            "the direct writes do not cover every file's data exactly once: " + "; ".join(gaps)
                        )
                fault_point("index", 0)
                write_index(
                    self.publisher.temporary,
                    self.file_plan,
                    {"workbench_version": self.metadata["workbench_version"], "layout": self.metadata["layout"]},
                )
                # the layout it was saved with, so diagnose can name the ranks that wrote a region
                write_checkpoint_layout(self.layout, self.publisher.temporary)
                for config in self.config_files:
                    shutil.copy2(config, self.publisher.temporary / config.name)
                if self.heartbeat is not None:
                    self.heartbeat.stop()
                self.publisher.finalize(verify=True)
            except BaseException as exc:
                publish_problem = self._caught(exc, "publishing (index, config files, rename)")
                self._abort()
        self._agree(
            publish_problem, what=f"save to {self.path}",
            lost="rank 0 may or may not have published: check with wb.latest_checkpoint",
        )
        self.clock.add("publish", time.perf_counter() - publish_started)
        # the writers' job time includes their waits for the writeback window: counted apart
        waited = self.writeback.waited_seconds
        self.clock.add("write", -waited)
        self.clock.add("writeback_wait", waited)
        schedule = self.plan_set.schedules[self.rank]
        files = (
            tuple(sorted(set(self.checkpoint_files.written) | (set(self.checkpoint_files.headers) if self.rank == 0
                                                                 else set())))
            if self.checkpoint_files is not None
            else tuple(f.name for f in self.file_plan.files_of(self.rank))
        )
        return SaveResult(
            path=self.path,
            rank=self.rank,
            files=files,
            bytes_written=written,
            seconds=time.perf_counter() - self.start,
            calls=schedule.num_calls,
            predicted_peak_bytes=schedule.peak_bytes,
            blocked_seconds=self.blocked_seconds,
            snapshot_bytes=self.snapshot.copied_bytes,
            write_mode=self.write_mode,
            direct_tensors=len(self.direct),
            timings=self.clock.timings(),
        )

    # -- writing -----------------------------------------------------------------------------------------------

    def _write_direct(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Queue every piece this rank writes directly: its boxes of the direct tensors, cast to the save dtype
        and snapshotted (replicated pieces: only the replica chosen by ``writes_piece``); the copies taken at the
        call's start are used when they are this plan's (``EarlySnapshot.claim``). The copies of a batch share
        one event, recorded when the batch is handed to a writer."""
        files = self.checkpoint_files
        assert files is not None
        program = direct_program(self.layout, self.key_meta, self.direct, self.rank)
        early = None
        if self.early is not None:
            early = self.early.claim((self.layout, self.key_meta, self.direct, self.rank), program, tensors)
        reached = 0  # the early copies of the steps before this one are the batch's or a writer's
        try:
            for index, step in enumerate(program):
                reached = index
                name, whole_dtype, mine = step
                if not mine:
                    continue
                fault_point("snapshot", self.rank)
                copies = early[index] if early is not None else take_step(self.snapshot, tensors[name], step,
                                                                          self.key_meta)
                reached = index + 1
                if whole_dtype is not None:
                    # every piece of the tensor is ours: one snapshot of the whole local tensor (one device-to-host
                    # copy, not one per stripe) and one job writing its pieces
                    def job(pieces: tuple[KeyRegion, ...] = mine, whole: HostCopy = copies[0]) -> int:
                        return files.write_local(pieces, whole.wait())

                    self._batch.add(job, copies[0], name)
                else:
                    for region, copy in zip(mine, copies):
                        self._batch.add(partial(_write_piece, files, region, copy), copy, region.hf_key)
                if self._batch.nbytes >= _BATCH_BYTES:
                    self._flush_batch(name)
            self._flush_batch("the last pieces")
        except BaseException:
            # no writer will release these: the batch not handed over, and the early copies of the steps not reached
            self.snapshot.mark()
            self._batch.discard()
            self._batch = _Writes()
            for copies in early[reached:] if early is not None else ():
                for copy in copies:
                    copy.discard()
            raise

    def _flush_batch(self, key: str) -> None:
        """Hand the direct writes snapshotted so far to a writer thread (their copies' event recorded first)."""
        self.snapshot.mark()
        if self._batch.items:
            self._queue(self._batch.nbytes, self._batch, self._batch, key)
            self._batch = _Writes()

    def _make_room(self) -> bool:
        """The host pool is full while this rank snapshots: hand what it took to the writers and let them run
        (an async save's writers then start before its snapshot is complete). True while a queued write is yet
        to give its buffers back; False when none is (the pool then serves the copy beyond its capacity)."""
        self._flush_batch("the pieces taken so far")
        self.gate.set()
        return any(not future.done() for future, _, _ in self.pending)

    def _queue(self, nbytes: int, job: Any, copy: HostCopy | _Writes, key: str) -> None:
        """Hand ``job`` to a writer thread; past ``in_flight_bytes`` queued, wait for the oldest writes first."""
        while self.pending and self.queued_bytes + nbytes > self.in_flight_bytes:
            self.gate.set()
            future, size, _ = self.pending.pop(0)
            with self.clock.measure("queue_wait"):
                futures.wait([future])
            self.queued_bytes -= size
        self.queued_bytes += nbytes
        self.pending.append((self.pool.submit(self._run_write, job, copy, key), nbytes, copy))

    def _run_write(self, job: Any, copy: HostCopy | _Writes, key: str) -> int:
        """A writer thread's job. A failure is recorded (the gathers poll it), never raised."""
        try:
            with self.clock.measure("gate_wait"):
                self.gate.wait()
            if self.write_problem is not None or self.stopped:
                return 0  # the save has failed: do not keep writing
            fault_point("write", self.rank)
            with self.clock.measure("copy_wait"):
                copy.wait()
            with self.clock.measure("write"):  # the window's waits inside are moved to writeback_wait at the end
                return job()
        except BaseException as exc:  # KeyboardInterrupt too: kept for the main thread, never raised in this one
            with self._write_lock:
                if self.write_problem is None:
                    what = job.current if isinstance(job, _Writes) else key
                    self.write_problem = self._caught(exc, f"writing {what!r}")
                elif not isinstance(exc, Exception):
                    self._keep_interrupt(exc)
            return 0
        finally:
            copy.discard()  # written: already landed; skipped (a failed save): waited for before it is reused

    def _submit(self, writer: StreamWriter, key: str, copy: HostCopy) -> None:
        """Queue one whole key's write into this rank's own file (gather mode)."""
        self._queue(copy.nbytes, lambda: writer.write(key, copy.wait()), copy, key)

    def _poll(self) -> RankProblem | None:
        return self.write_problem

    # -- failures ----------------------------------------------------------------------------------------------

    def _keep_interrupt(self, exc: BaseException) -> None:
        """Keep the first exception that is not an ``Exception``: raised again after the status exchange."""
        if self.interrupt is None and not isinstance(exc, Exception):
            self.interrupt = exc

    def _caught(self, exc: BaseException, stage: str) -> RankProblem:
        """This rank's problem for ``exc``, raised during ``stage`` (an interrupt is kept to be raised again)."""
        self._keep_interrupt(exc)
        return problem_from(exc, self.rank, stage)

    def _agree(self, problem: RankProblem | None, **options: Any) -> list[Any]:
        """``agree`` on the save's communicator; when the save failed, a rank that was interrupted raises its
        interrupt (the ``SaveFailed`` every rank has, naming it, as its cause) instead of the ``SaveFailed``."""
        try:
            return agree(self.comm, problem, **options)
        except SaveFailed as failed:
            if self.interrupt is not None:
                raise self.interrupt from failed
            raise

    # -- ending ------------------------------------------------------------------------------------------------

    def _abort(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.rank == 0 and self.prepared:
            self.publisher.abort()

    def close(self, *, abandon: bool = False) -> None:
        """Release what the save holds on every way out: writer threads, file descriptors, the heartbeat, the
        path (a later save to it may start). Idempotent."""
        if self.closed:
            return
        self.closed = self.stopped = True
        self.gate.set()
        _IN_FLIGHT.discard(self.target)
        if abandon:
            self.write_problem = self.write_problem or RankProblem(self.rank, "exiting", "abandoned")
        self.pool.shutdown(wait=True, cancel_futures=True)
        for future, _, copy in self.pending:
            if future.cancelled():  # never ran, so never gave its pool buffers back
                copy.discard()
        self._batch.discard()  # snapshotted, never handed to a writer
        if self.early is not None:
            self.early.release()  # copies never claimed (a claimed copy went to a writer job, which released it)
        for writer in self.files.values():
            writer.abandon()
        if self.checkpoint_files is not None:
            with contextlib.suppress(OSError):  # a failed save: what a close reports changes nothing
                self.checkpoint_files.close()
        if self.heartbeat is not None:
            self.heartbeat.stop()


_BATCH_BYTES = 64 << 20  # direct writes handed to a writer thread together: one submit per batch, not per tensor


class _Writes:
    """Consecutive small writes run by one writer thread as one job; each copy is released once written."""

    def __init__(self) -> None:
        self.items: list[tuple[Any, HostCopy, str]] = []
        self.nbytes = 0
        self.current = ""  # the key being written (named when it fails)

    def add(self, job: Any, copy: HostCopy, key: str) -> None:
        """Append one write of ``copy``'s bytes."""
        self.items.append((job, copy, key))
        self.nbytes += copy.nbytes
        self.current = self.current or key

    def wait(self) -> None:
        """Wait until every copy of the batch is in host memory."""
        for _, copy, _ in self.items:
            copy.wait()

    def __call__(self) -> int:
        total = 0
        for job, copy, key in self.items:
            self.current = key
            total += job()
            copy.release()
        return total

    def release(self) -> None:
        """Free every copy (after the job; releasing twice is harmless)."""
        for _, copy, _ in self.items:
            copy.release()

    def discard(self) -> None:
        """Free every copy once no device-to-host copy is landing in it (a failed or abandoned save)."""
        for _, copy, _ in self.items:
            copy.discard()


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f", ... ({len(ranks)} in all)" if len(ranks) > 8 else "")


def _write_piece(files: CheckpointFiles, region: KeyRegion, copy: HostCopy) -> int:
    return files.write_piece(region, copy.wait())


def _version() -> str:
    return __version__
