"""One rank's part of a ``save_hf``, stage by stage (see ``io/hf/save.py`` for the call that drives it).

::

    prepare   save.py: the write mode, host names and a probe file, agreed before any group is built
    plan      plan_rank_save (io/hf/save_planning.py); rank 0 makes .NAME.incomplete/ and, in direct mode, every file
    agree     every rank's planning outcome, with schedule digests: a failure anywhere fails every rank
    snapshot  direct pieces cast and copied into host memory the save owns; gathers yield their keys (gather)
    write     writer threads (io/hf/save_writers.py) take the copies as they land, behind a gate for async saves
    finish    drain the writers, fsync, and agree on every rank's status and the byte ranges it wrote
    publish   rank 0 proves the ranges tile every file, writes index, layout and configs, renames atomically

``SaveSession`` holds what one save owns on one rank: its plan, its files (streamed in gather mode, written in
place in direct mode), the writer queue, the owner-marker heartbeat, and the problem it will report at the status
exchange. Every way out goes through ``close()``.

An exception that is not an ``Exception`` (``KeyboardInterrupt`` in the main thread or a writer thread,
``SystemExit``) is this rank's problem like any other: the rank keeps answering its peers, takes part in the status
exchange (every peer raises ``SaveFailed`` naming it), and then raises it again.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from workbench.errors import CheckpointError
from workbench.faults import fault_point
from workbench.io.files.direct import DEFAULT_MIN_SEGMENT_BYTES, CheckpointFiles
from workbench.io.files.index import write_index
from workbench.io.files.ownership import MARKER_NAME, Heartbeat
from workbench.io.files.publish import AtomicRenamePublisher
from workbench.io.files.snapshot import HostCopy, Snapshotter
from workbench.io.files.stream_write import StreamWriter
from workbench.io.files.writeback import WritebackWindow
from workbench.io.hf.direct_queue import queue_direct_pieces, write_piece
from workbench.io.hf.early_snapshot import EarlySnapshot
from workbench.io.hf.save_planning import (
    RankSavePlan,
    dtype_problem,
    dtype_summary,
    files_digest,
    files_problem,
    files_summary,
    layout_problem,
    layout_rows,
    plan_rank_save,
    same_model_problem,
)
from workbench.io.hf.save_result import SaveResult
from workbench.io.hf.save_timings import SaveClock
from workbench.io.hf.save_writers import WriterQueue
from workbench.layout.layout_file import write_checkpoint_layout
from workbench.layout.load_spec import KeyRegion
from workbench.layout.model_layout import Layout
from workbench.plan.policy import SavePolicy
from workbench.plan.save_set import layout_fingerprint, saved_layout
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
from workbench.run.unshard_ops import iter_keys
from workbench.version import __version__

__all__ = ["SaveResult", "SaveSession"]

_IN_FLIGHT: set[Path] = set()  # targets of this process's saves that are not published or failed yet


class SaveSession:
    """One rank's part of a save: plan, agree, snapshot and write, finish, publish."""

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
        # absolute now, read by rank 0 at planning (``ConfigCopy``): an async save publishes after the call returns
        # not os.path.abspath: it folds ``link/..`` as text, naming another file than the one the OS opens
        self.config_files = [Path(c) if Path(c).is_absolute() else Path.cwd() / c for c in config_files]
        self.config_copies: list[ConfigCopy] = []
        self.in_flight_bytes = in_flight_bytes
        self.snapshot = snapshot
        self.clock = SaveClock()
        # writes start once the snapshot is taken (an async save: the copies then have the machine to themselves,
        # so the caller is blocked for less), or at once for a sync save, or when the queue must drain
        self.writers = WriterQueue(self.rank, threads, in_flight_bytes, self.clock, self._caught,
                                   gated=snapshot.own_everything)
        self.files: dict[str, StreamWriter] = {}
        self.publisher = AtomicRenamePublisher(path)
        self.heartbeat: Heartbeat | None = None
        self.planned: RankSavePlan | None = None
        # the ranks agree on the model they save (its layout in memory); the files name the layout as saved (the
        # dtypes written: fp32_keys_pattern and dtype= change them), which is what the layout file records
        self.model_fingerprint = layout_fingerprint(layout)
        self.saved = layout
        self.metadata = {"format": "pt", "workbench_version": __version__, "layout": self.model_fingerprint}
        self.problem: RankProblem | None = None
        self.interrupt: BaseException | None = None  # not an Exception: raised again once the ranks have agreed
        self.write_mode = "gather"
        self.min_segment_bytes = DEFAULT_MIN_SEGMENT_BYTES
        self.map_short_runs = False  # every writer shares one page cache: short runs go through a memory map
        self.checkpoint_files: CheckpointFiles | None = None
        self.direct_queued = False  # the direct pieces are snapshotted and queued (before the plan agreement)
        self.early: EarlySnapshot | None = None  # copies taken at the call's start, for the plan of the last save
        self.writeback = WritebackWindow()  # one per save: its writer threads share the bound
        self.blocked_seconds = 0.0
        self.target = path.resolve()
        self.closed = False
        self.prepared = False  # rank 0 made the temporary directory (only then may it remove it)
        self.published = False  # rank 0 renamed it into place (from then on it is never removed)
        snapshot.on_full = self._make_room
        _IN_FLIGHT.add(self.target)

    @property
    def key_meta(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Every key's (save dtype, shape), once planned."""
        return self.planned.key_meta if self.planned is not None else {}

    @property
    def direct(self) -> tuple[str, ...]:
        """The tensors this save writes in place, once planned."""
        return self.planned.direct if self.planned is not None else ()

    # -- plan and agree ----------------------------------------------------------------------------------------

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
            self.planned = plan_rank_save(
                self.layout, self.rank, tensors, policy=policy, budget=budget, dtype=dtype,
                fp32_keys_pattern=fp32_keys_pattern, max_writers=max_writers, write_mode=self.write_mode,
                min_segment_bytes=self.min_segment_bytes,
                # on CPU, tensors waiting for a writer are host memory the save holds (on GPU: pinned copies)
                queued_bytes=self.in_flight_bytes if all(t.device.type == "cpu" for t in tensors.values()) else 0,
                gather_scratch=getattr(self.comm, "gather_scratch", False), max_shard_bytes=self.max_shard_bytes,
                config_files=self.config_files,
            )
            self.saved = saved_layout(self.layout, self.planned.key_meta)
            self.metadata["layout"] = layout_fingerprint(self.saved)
            if self.rank == 0:  # the one rank that publishes them
                self.config_copies = [ConfigCopy.read(c) for c in self.config_files]
            self._prepare()
            fault_point("plan", self.rank)
        except BaseException as exc:  # KeyboardInterrupt too: the peers wait for this rank's word at the agreement
            problem = self._caught(exc, "planning the save")
        if problem is None and snapshot_early and self.checkpoint_files is not None:
            assert not self.writers.gate.is_set(), "an early snapshot needs gated writers"
            self.direct_queued = True
            started = time.perf_counter()
            try:
                self._write_direct(tensors)
            except BaseException as exc:
                problem = self._caught(exc, "writing its own pieces")
            spent = time.perf_counter() - started  # the snapshot's time, inside the caller's "plan" stage
            self.clock.add("snapshot", spent)
            self.clock.add("plan", -spent)
        self._agree_on_plan(problem)

    def _prepare(self) -> None:
        """The files of the save: in direct mode every rank opens them; rank 0 makes the temporary directory with
        its owner marker (and, in direct mode, every file at full size with its header)."""
        assert self.planned is not None
        if self.write_mode == "direct":
            self.checkpoint_files = CheckpointFiles(
                self.publisher.temporary, self.planned.file_plan, self.planned.key_meta, self.metadata,
                self.writeback, map_short_runs=self.map_short_runs,
            )
        if self.rank == 0:
            self.publisher.prepare()
            self.prepared = True
            self.heartbeat = Heartbeat(self.publisher.temporary / MARKER_NAME)
            if self.checkpoint_files is not None:
                self.checkpoint_files.create_all()

    def _agree_on_plan(self, problem: RankProblem | None) -> None:
        """Every rank's outcome, the digests of its schedule, writers and files, and its model's fingerprint in one
        exchange; then every rank checks that all save one model, into the same files, and that their gathers
        match."""
        digests = files = None
        if problem is None:
            assert self.planned is not None
            plan_set = self.planned.plan_set
            digests = plan_digests(plan_set.schedules[self.rank], plan_set.writers, self.layout.mesh, self.rank)
            files = files_digest(self.planned)
        if self.early is not None and not self.direct_queued:
            self.early.release()  # taken for a direct plan this save does not follow
        model = (self.model_fingerprint, len(self.layout.specs), next(iter(self.layout.specs), None))
        everyone = self._agree(problem, what=f"save to {self.path}", on_failure=self._abort,
                               share=(digests, model, files))
        cause = same_model_problem([m for _, m, _ in everyone])
        if cause is not None:  # every rank knows it: a second exchange, of each parameter's dtype and of one rank's
            # layout per fingerprint, names a dtype apart or the first parameter that differs
            fingerprints = [m[0] for _, m, _ in everyone]
            rows = None
            if fingerprints.index(self.model_fingerprint) == self.rank:
                with contextlib.suppress(Exception):  # words for the error only: never keep the peers waiting
                    rows = layout_rows(self.layout)
            shared = self._agree(None, what=f"save to {self.path}", on_failure=self._abort,
                                 share=(dtype_summary(self.layout), rows))
            cause = (dtype_problem(list(self.layout.specs), [s for s, _ in shared])
                     or same_model_problem([m for _, m, _ in everyone],
                                           layout_problem(fingerprints, [r for _, r in shared])))
            self._abort()
            raise SaveFailed(f"save to {self.path} refused before any data moved: {cause}",
                             [RankProblem(self.rank, "checking that the ranks save the same model", cause)])
        assert self.planned is not None
        if len({f for _, _, f in everyone}) > 1:  # one model, other files or save dtypes: name the argument if known
            summaries = self._agree(None, what=f"save to {self.path}", on_failure=self._abort,
                                    share=files_summary(self.planned))
            cause = files_problem(summaries, same_writers=len({d[1] for d, _, _ in everyone}) == 1)
            if cause is not None:
                self._abort()
                stage = "checking that the ranks agree on the plan"
                raise SaveFailed(f"save to {self.path} refused before any data moved: the ranks' plans differ: "
                                 f"{cause}", [RankProblem(self.rank, stage, cause)])
        try:
            check_agreement(  # the digests came with the planning outcome: no exchange of their own
                self.comm, self.planned.plan_set.schedules[self.rank], self.planned.plan_set.writers,
                self.layout.mesh, what=f"save to {self.path}", digests=[d for d, _, _ in everyone],
            )
        except BaseException:  # refused on every rank alike: nothing of it stays on disk, as for the refusal above
            self._abort()
            raise

    # -- snapshot and write ------------------------------------------------------------------------------------

    def gather(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Run the unshard schedule under the flag protocol; each key this rank writes is snapshotted and queued
        for its file the moment its wave ends. A failure is kept for the status exchange, never raised here."""
        assert self.planned is not None
        plan_set, file_plan = self.planned.plan_set, self.planned.file_plan
        plans = {p.name: p for p in plan_set.plans[self.rank]}
        writers = plan_set.writers
        schedule = plan_set.schedules[self.rank]
        failed = None
        try:
            if self.checkpoint_files is None:
                for spec in file_plan.files_of(self.rank):
                    entries = [(k, *self.key_meta[k]) for k in spec.keys]
                    self.files[spec.name] = StreamWriter(
                        self.publisher.temporary / spec.name, entries, self.metadata, self.writeback
                    )
            elif not self.direct_queued:
                self._write_direct(tensors)
        except BaseException as exc:
            failed = self._caught(exc, "writing its own pieces" if self.direct else "creating its files")
        file_of = {k: f.name for f in file_plan.files_of(self.rank) for k in f.keys}
        mine = {k for k, r in writers.items() if r == self.rank}
        own = {_storage_id(t) for t in tensors.values()}  # the rank's tensors (alive anyway): charged their bytes

        def on_wave(wave: WaveOutput) -> None:
            for name, tensor in wave.tensors.items():
                for key, value in iter_keys(tensor, plans[name], mine):  # one key (a copy, maybe) at a time
                    fault_point("snapshot", self.rank)
                    copy = self.snapshot.take(value)
                    if self.checkpoint_files is None:
                        writer = self.files[file_of[key]]
                        job: Any = partial(_write_key, writer, key, copy)
                    else:
                        shape = tuple(value.shape)
                        whole = KeyRegion(key, (0,) * len(shape), shape, (0,) * len(shape))
                        job = partial(write_piece, self.checkpoint_files, whole, copy)
                    storage = None
                    pinned = _storage_id(copy.host)
                    if copy.buffer is None and pinned not in own:  # a view of the save's output: it keeps it all
                        storage = (pinned, copy.host.untyped_storage().nbytes())
                    self.writers.queue(copy.nbytes, job, copy, key, storage=storage)

        program = unshard(schedule, plan_set.plans[self.rank], tensors)
        self.problem = drive_guarded(schedule, program, self.comm, on_wave, poll=self._poll, failed=failed,
                                     on_interrupt=self._keep_interrupt)

    def _write_direct(self, tensors: Mapping[str, torch.Tensor]) -> None:
        assert self.checkpoint_files is not None
        queue_direct_pieces(self.layout, self.rank, self.key_meta, self.direct, tensors, self.checkpoint_files,
                            self.snapshot, self.writers, self.early)

    def _make_room(self) -> bool:
        """The host pool is full while this rank snapshots: hand what it took to the writers and let them run
        (an async save's writers then start before its snapshot is complete). True while a queued write is yet
        to give its buffers back; False when none is (the pool then serves the copy beyond its capacity)."""
        self.writers.flush("the pieces taken so far", mark=self.snapshot.mark)
        self.writers.gate.set()
        return self.writers.busy()

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
            self.writers.stopped = True
        self.writers.gate.set()
        self.blocked_seconds = time.perf_counter() - self.start

    # -- finish and publish ------------------------------------------------------------------------------------

    def finish(self) -> SaveResult:
        """Wait for this rank's writes, fsync its files, agree, then rank 0 publishes; every rank learns the end."""
        if not self.blocked_seconds:
            self.blocked_seconds = time.perf_counter() - self.start
        problem = self.problem
        self.writers.stopped = problem is not None
        with self.clock.measure("drain"):
            drained = self.writers.drain()  # always: every queued write ends (or is skipped) before the files close
        problem = problem or drained
        fsync_started = time.perf_counter()
        problem, written = self._close_files(problem)
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
        publish_problem = None
        if self.rank == 0:
            try:
                self._publish(everyone)
            except BaseException as exc:
                publish_problem = self._caught(exc, "publishing (index, config files, rename)")
                self._abort()
        self._agree(
            publish_problem, what=f"save to {self.path}",
            lost="rank 0 may or may not have published: check with wb.latest_checkpoint",
        )
        self.clock.add("publish", time.perf_counter() - publish_started)
        return self._result(written)

    def _close_files(self, problem: RankProblem | None) -> tuple[RankProblem | None, int]:
        """fsync and close this rank's files (abandon them when the save failed); the first problem, and the bytes
        written. A close is tried even after a failure: a network filesystem may report a deferred error only
        there, and every descriptor is given back."""
        written = 0
        if self.checkpoint_files is not None:
            try:
                if problem is None:
                    fault_point("fsync", self.rank)
                    self.checkpoint_files.fsync()
                    written = sum(self.checkpoint_files.written.values()) + self.checkpoint_files.header_bytes
            except BaseException as exc:
                problem = problem or self._caught(exc, "fsyncing its files")
            try:
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
        return problem, written

    def _publish(self, everyone: Sequence[Any]) -> None:
        """Rank 0, every rank done: prove the direct writes tile every file exactly once, write the index, the
        layout file and the config files, then publish with one verified atomic rename."""
        assert self.planned is not None
        if self.checkpoint_files is not None:
            gaps = self.checkpoint_files.coverage_problems(everyone)
            if gaps:
                raise CheckpointError("the direct writes do not cover every file's data exactly once: "
                                      + "; ".join(gaps))
        fault_point("index", 0)
        temporary = self.publisher.temporary
        write_index(temporary, self.planned.file_plan,
                    {"workbench_version": self.metadata["workbench_version"], "layout": self.metadata["layout"]})
        write_checkpoint_layout(self.saved, temporary)  # so diagnose can name the ranks that wrote a region
        for config in self.config_copies:
            config.write_into(temporary)
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.publisher.finalize(verify=True)
        self.published = True

    def _result(self, written: int) -> SaveResult:
        assert self.planned is not None
        # the writers' job time includes their waits for the writeback window: counted apart
        waited = self.writeback.waited_seconds
        self.clock.add("write", -waited)
        self.clock.add("writeback_wait", waited)
        schedule = self.planned.plan_set.schedules[self.rank]
        files = self.checkpoint_files
        names = (tuple(sorted(set(files.written) | (set(files.headers) if self.rank == 0 else set())))
                 if files is not None else tuple(f.name for f in self.planned.file_plan.files_of(self.rank)))
        return SaveResult(
            path=self.path, rank=self.rank, files=names, bytes_written=written,
            seconds=time.perf_counter() - self.start, calls=schedule.num_calls,
            predicted_peak_bytes=schedule.peak_bytes, blocked_seconds=self.blocked_seconds,
            snapshot_bytes=self.snapshot.copied_bytes, write_mode=self.write_mode, direct_tensors=len(self.direct),
            timings=self.clock.timings(),
        )

    # -- failures ----------------------------------------------------------------------------------------------

    def _poll(self) -> RankProblem | None:
        return self.writers.write_problem

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

    def _abort(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.rank == 0 and self.prepared and not self.published:
            self.prepared = False  # removed once
            self.publisher.abort()

    def close(self, *, abandon: bool = False) -> None:
        """Release what the save holds on every way out: writer threads, file descriptors, the heartbeat, the
        path (a later save to it may start). Idempotent."""
        if self.closed:
            return
        self.closed = True
        _IN_FLIGHT.discard(self.target)
        self.snapshot.forget_model_tensors()  # a handle kept after wait() held every tensor of the model alive
        if abandon:
            self.writers.write_problem = self.writers.write_problem or RankProblem(self.rank, "exiting", "abandoned")
        self.writers.close()
        if self.early is not None:
            self.early.release()  # copies never claimed (a claimed copy went to a writer job, which released it)
        for writer in self.files.values():
            writer.abandon()
        if self.checkpoint_files is not None:
            with contextlib.suppress(OSError):  # a failed save: what a close reports changes nothing
                self.checkpoint_files.close()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        # not published, whatever left the save (a Ctrl-C in a status exchange, exit): the temporary directory goes
        # with its claim and heartbeat, which held it live, so that no later save to the path was possible
        with contextlib.suppress(Exception):
            self._abort()


@dataclass(frozen=True, slots=True)
class ConfigCopy:
    """A config file as it was when ``save_hf`` was called: its name, bytes, permission bits and times. An async
    save publishes after the call returns, when the file may have changed, or the working directory a relative
    name meant; what it publishes is what the call saw."""

    name: str
    data: bytes
    mode: int
    times_ns: tuple[int, int]

    @classmethod
    def read(cls, path: Path) -> ConfigCopy:
        """Read ``path`` now; CheckpointError naming it when it cannot be read."""
        try:
            with open(path, "rb") as file:
                found = os.fstat(file.fileno())
                data = file.read()
        except OSError as exc:
            raise CheckpointError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
        return cls(path.name, data, stat.S_IMODE(found.st_mode), (found.st_atime_ns, found.st_mtime_ns))

    def write_into(self, directory: Path) -> None:
        """Write the file into ``directory`` as it was read (``shutil.copy2`` of the file at the call)."""
        target = directory / self.name
        target.write_bytes(self.data)
        os.chmod(target, self.mode)
        os.utime(target, ns=self.times_ns)


def _write_key(writer: StreamWriter, key: str, copy: HostCopy) -> int:
    return writer.write(key, copy.wait())


def _storage_id(tensor: torch.Tensor) -> int:
    """The address of the storage behind ``tensor`` (views of one tensor share it)."""
    return tensor.untyped_storage().data_ptr()
