"""``save_hf``: write a sharded model as a HuggingFace checkpoint, from every rank at once, atomically.

Every rank runs the same plan: its save plans and unshard schedule (the all-gathers, batched under a memory
budget), the writer of each key (byte-balanced over the ranks holding it) and the file each key goes to. A
writer writes its own files (``model-0000k-of-0000N.safetensors``) in background threads while the next
gathers run. Files land in a hidden sibling ``.NAME.incomplete``; once every rank reports success, rank 0
writes the index and config files and publishes the directory with one atomic rename. A checkpoint already at
``path`` survives any failure.
"""

from __future__ import annotations

import concurrent.futures as futures
import math
import shutil
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench.errors import CheckpointError, WorkbenchError
from workbench.io.file_plan import DEFAULT_MAX_SHARD_BYTES, FilePlan, plan_files
from workbench.io.index import write_index
from workbench.io.publish import AtomicRenamePublisher
from workbench.io.stream_write import StreamWriter
from workbench.layout.key_map import KeyMap
from workbench.layout.model_layout import Layout, local_tensors
from workbench.plan.policy import SavePolicy
from workbench.run.communicator import Communicator, drive
from workbench.run.executor import WaveOutput, unshard
from workbench.run.simulated import SavePlanSet, key_meta, plan_save
from workbench.run.unshard_ops import split_keys

__all__ = ["AsyncSave", "SaveResult", "local_communicator", "save_hf"]

_DEFAULT_BUDGET = 2 << 30
_IN_FLIGHT: set[Path] = set()  # targets of this process's saves that are not published or failed yet


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What one rank did for a save: the published path, its files and bytes, and the time it took."""

    path: Path
    rank: int
    files: tuple[str, ...]
    bytes_written: int
    seconds: float
    calls: int
    predicted_peak_bytes: int

    def __str__(self) -> str:
        return (
            f"saved {self.path} (rank {self.rank}: {len(self.files)} file(s), {self.bytes_written} bytes, "
            f"{self.calls} gather calls, {self.seconds:.2f} s)"
        )


@dataclass
class AsyncSave:
    """A save whose gathers are done and whose files are being written; ``wait()`` publishes it.

    .. note:: SPMD: every rank must call ``wait()`` (it exchanges every rank's status before publishing).
    """

    _session: _SaveSession
    _result: SaveResult | None = field(default=None, init=False)

    def done(self) -> bool:
        """True when this rank's files are written (publishing still needs ``wait()``)."""
        return all(f.done() for f, _ in self._session.pending)

    def wait(self) -> SaveResult:
        """Finish writing, check every rank, publish atomically; returns this rank's result."""
        if self._result is None:
            try:
                self._result = self._session.finish()
            finally:
                self._session.close()
        return self._result


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
    comm: Communicator | None = None,
) -> SaveResult | AsyncSave:
    """Save a (sharded) model as a HuggingFace checkpoint at ``path``.

    Args:
        model_or_state_dict: a module whose parameters are DTensors (FSDP2, EP, ETP...) or plain tensors, or
            a state dict of them.
        path: the checkpoint directory to create or replace.
        layout: the model's Layout (default: ``Layout.from_model(model, key_map)``).
        key_map: runtime name -> HF key(s) (callable or regex table); None keeps the names.
        policy: ``SavePolicy.minimal()`` (default: the full checkpoint, gathering only what whole keys need),
            ``full()`` (gather everything everywhere) or ``preserve(...)`` (each EP rank writes its experts).
        budget_bytes: memory budget of the all-gather schedule (None: no bound).
        max_shard_bytes: the largest file a writer makes (a bigger key gets a file alone).
        fp32_keys_pattern: regexes of HF keys saved in float32.
        dtype: save dtype of the other floating keys (default: their runtime dtype).
        config_files: files copied next to the weights (config.json, tokenizer files...).
        max_writers: cap on the number of writer ranks (default: every rank may write).
        write_threads: file writers per rank (tensors are written to their files as soon as they are whole; at
            most ``budget_bytes`` of them wait for a writer).
        async_save: return after the gathers, with files still being written; ``.wait()`` publishes.
        comm: the communicator (default: torch.distributed's default world, or one process).

    Returns:
        This rank's SaveResult, or an AsyncSave.

    Raises:
        CheckpointError / PlanError / LayoutError: on every rank, naming the rank and what failed; nothing is
            published at ``path`` and a checkpoint already there is left intact.

    .. note:: SPMD: every rank of the model's mesh calls it with the same arguments.
    """
    start = time.perf_counter()
    mine: WorkbenchError | None = None
    tensors: dict[str, torch.Tensor] = {}
    try:  # local checks first, agreed on over the whole world before any group is built: no rank may hang
        layout = layout or Layout.from_model(model_or_state_dict, key_map)
        tensors = local_tensors(model_or_state_dict, layout)
    except WorkbenchError as exc:
        mine = exc
    _agree_on_world(mine, path)
    comm = comm or default_communicator(layout)
    target = Path(path).resolve()
    if target in _IN_FLIGHT:
        raise CheckpointError(
            f"a save to {target} is still in progress in this process (async_save pending); call its wait() "
            "before saving to the same path again"
        )
    in_flight = budget_bytes if budget_bytes is not None else _DEFAULT_BUDGET  # host bytes queued for writing
    session = _SaveSession(layout, Path(path), comm, start, write_threads, max_shard_bytes, config_files, in_flight)
    try:
        problem = None
        try:
            session.plan(policy, budget_bytes, dtype, fp32_keys_pattern, max_writers, tensors)
        except WorkbenchError as exc:
            problem = f"rank {comm.rank}: {exc}"
        session.agree(problem, "planning the save")  # before any gather: a bad rank must not leave others hanging
        session.gather(tensors)
        handle = AsyncSave(session)
        return handle if async_save else handle.wait()
    except BaseException:
        session.close()
        raise


def _world_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _agree_on_world(mine: WorkbenchError | None, path: str | Path) -> None:
    """Every rank of the default world shares its problem (or None); all raise if any rank has one: the rank
    with the problem its own error, the others a CheckpointError naming it."""
    import torch.distributed as dist

    problem = f"rank {_world_rank()}: {mine}" if mine is not None else None
    problems = [problem]
    if dist.is_initialized():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    if mine is not None:
        raise mine
    found = [p for p in problems if p]
    if found:
        raise CheckpointError(f"save to {path} refused; nothing was written:\n" + "\n".join(found))


class _SaveSession:
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
    ) -> None:
        self.layout, self.path, self.comm, self.start = layout, path, comm, start
        self.rank = comm.rank
        self.max_shard_bytes = max_shard_bytes
        self.config_files = [Path(c) for c in config_files]
        self.pool = futures.ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="workbench-write")
        self.pending: list[tuple[futures.Future[int], int]] = []
        self.queued_bytes = 0
        self.in_flight_bytes = in_flight_bytes
        self.files: dict[str, StreamWriter] = {}
        self.key_meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.publisher = AtomicRenamePublisher(path)
        self.plan_set: SavePlanSet | None = None
        self.file_plan: FilePlan | None = None
        self.metadata = {"format": "pt", "workbench_version": _version(), "layout": layout.fingerprint()}
        self.error: str | None = None
        self.target = path.resolve()
        _IN_FLIGHT.add(self.target)

    def plan(
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
        self.plan_set = plan_save(
            self.layout,
            ranks=[self.rank],
            policy=policy,
            budget_bytes=budget,
            dtype=dtype,
            fp32_keys_pattern=fp32_keys_pattern,
            max_writers=max_writers,
        )
        for plan in self.plan_set.plans[self.rank]:
            local = tensors[plan.name]
            if tuple(local.shape) != plan.local_shape:
                raise CheckpointError(
                    f"parameter {plan.name!r}: local tensor has shape {tuple(local.shape)}, the layout says "
                    f"{plan.local_shape}"
                )
        runtime = {name: self.layout.dtype(name) for name in self.layout}
        self.key_meta = key_meta(self.layout, runtime, dtype, fp32_keys_pattern)
        sizes = {k: math.prod(shape) * d.itemsize for k, (d, shape) in self.key_meta.items()}
        self.file_plan = plan_files(
            self.plan_set.writers, sizes, list(self.layout.hf_keys), max_shard_bytes=self.max_shard_bytes
        )
        if self.rank == 0:
            self.publisher.prepare()

    def close(self) -> None:
        """Forget this save (a later save to the same path may start) and stop its writer threads. Called on every
        way out: by ``save_hf`` when it raises, by ``AsyncSave.wait`` when it returns or raises."""
        _IN_FLIGHT.discard(self.target)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def agree(self, problem: str | None, stage: str) -> None:
        """Exchange every rank's problem (or None); raise the same error everywhere if any rank has one."""
        problems = [p for p in self.comm.all_gather_object(problem) if p]
        if problems:
            if self.rank == 0:
                self.publisher.abort()
            raise CheckpointError(
                f"save to {self.path} failed while {stage}; nothing was published:\n" + "\n".join(problems)
            )

    def gather(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Run the unshard schedule; each key this rank writes goes to its file the moment its wave ends."""
        assert self.plan_set is not None and self.file_plan is not None
        plans = {p.name: p for p in self.plan_set.plans[self.rank]}
        writers = self.plan_set.writers
        try:
            for spec in self.file_plan.files_of(self.rank):
                entries = [(k, *self.key_meta[k]) for k in spec.keys]
                self.files[spec.name] = StreamWriter(self.publisher.temporary / spec.name, entries, self.metadata)
            file_of = {k: f.name for f in self.file_plan.files_of(self.rank) for k in f.keys}

            def on_wave(wave: WaveOutput) -> None:
                for name, tensor in wave.tensors.items():
                    for key, value in split_keys(tensor, plans[name]).items():
                        if writers.get(key) == self.rank:
                            self._submit(self.files[file_of[key]], key, _HostCopy.of(value.detach()))

            program = unshard(self.plan_set.schedules[self.rank], self.plan_set.plans[self.rank], tensors)
            drive(program, self.comm, on_wave)
        except Exception as exc:  # a local failure after collectives started: report it at the status exchange
            self.error = f"rank {self.rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"

    def _submit(self, writer: StreamWriter, key: str, copy: _HostCopy) -> None:
        """Queue one tensor's write; past ``in_flight_bytes`` queued, wait for the oldest writes first."""
        nbytes = copy.host.numel() * copy.host.element_size()
        while self.pending and self.queued_bytes + nbytes > self.in_flight_bytes:
            future, size = self.pending.pop(0)
            future.result()
            self.queued_bytes -= size
        self.queued_bytes += nbytes
        self.pending.append((self.pool.submit(lambda: writer.write(key, copy.wait())), nbytes))

    def finish(self) -> SaveResult:
        for future, _ in self.pending:
            try:
                future.result()
            except Exception as exc:
                self.error = self.error or f"rank {self.rank}: writing failed: {type(exc).__name__}: {exc}"
        self.pending.clear()
        self.pool.shutdown(wait=True)
        written = 0
        for writer in self.files.values():
            try:
                written += writer.close()
            except Exception as exc:
                self.error = self.error or f"rank {self.rank}: {type(exc).__name__}: {exc}"
        self.agree(self.error, "gathering and writing")
        assert self.file_plan is not None and self.plan_set is not None
        problem = None
        if self.rank == 0:
            try:
                write_index(
                    self.publisher.temporary,
                    self.file_plan,
                    {"workbench_version": self.metadata["workbench_version"], "layout": self.metadata["layout"]},
                )
                for config in self.config_files:
                    shutil.copy2(config, self.publisher.temporary / config.name)
                self.publisher.finalize(verify=True)
            except Exception as exc:
                problem = f"rank 0: publishing failed: {type(exc).__name__}: {exc}"
                self.publisher.abort()
        problems = [p for p in self.comm.all_gather_object(problem) if p]
        if problems:
            raise CheckpointError(f"save to {self.path} failed; nothing was published:\n" + "\n".join(problems))
        schedule = self.plan_set.schedules[self.rank]
        return SaveResult(
            self.path,
            self.rank,
            tuple(f.name for f in self.file_plan.files_of(self.rank)),
            written,
            time.perf_counter() - self.start,
            schedule.num_calls,
            schedule.peak_bytes,
        )


class _OneProcess:
    """The communicator of a job of one process with no process group."""

    rank = 0

    def all_gather(self, send: torch.Tensor, mesh_dim: Any) -> torch.Tensor:
        return send

    def barrier(self) -> None:
        return None

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


def local_communicator() -> Communicator:
    """A communicator for a single process (a model on one device, no torch.distributed)."""
    return _OneProcess()


@dataclass
class _HostCopy:
    """A tensor on its way to host memory: on GPU, a non-blocking copy into pinned memory that overlaps the next
    gathers; the writer thread waits for it. The device tensor is held until then."""

    host: torch.Tensor
    source: torch.Tensor | None = None
    event: Any = None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _HostCopy:
        if tensor.device.type == "cpu":
            return cls(tensor)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, tensor, event)

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.source = self.event = None
        return self.host


def default_communicator(layout: Layout) -> Communicator:
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
    return TorchCommunicator(layout.mesh, refs)


def _version() -> str:
    from workbench import __version__

    return __version__
