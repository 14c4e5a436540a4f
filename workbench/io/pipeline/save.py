"""Save a pipeline-parallel model as one HF checkpoint: every stage saves as its own world, then one merge.

``save_hf`` assumes one mesh whose ranks all hold the same parameter names. A pipeline stage is exactly that on
its own (``PipelineLayout.stages``, stage-local ranks), so each stage runs an ordinary ``save_hf`` through a
``StageCommunicator`` that makes the stage look like a world: stage-local ranks, process groups over the stage's
own ranks, agreement among the stage only. Global rank 0 first prepares the save's own unpublished directory
(``.NAME.incomplete``, with its owner marker and heartbeat), and the stages write side by side into it
(``.NAME.incomplete/stageK``): no stage's files are ever a checkpoint of their own beside the target, which
``latest_checkpoint`` could take for the newest or which a crash would leave behind as one (a dead save's directory
is stale, and ``clean_incomplete`` removes it with its stages). After every rank's stage succeeded, global rank 0
renumbers the files
(``model-0000k-of-0000N.safetensors`` over all stages), writes one index with ``metadata.total_size``, the layout of
the whole pipeline (``workbench_layout.toml``: every stage's layout as its save wrote it, with a ``[pipeline]``
table naming each stage's parameters, so ``diagnose`` can tell which global ranks held a region), copies the config
files and publishes the whole directory with one atomic rename. A failure anywhere publishes nothing.

Failure containment: every exchange across stages runs on the save's own gloo control group of the whole world
(``ControlChannel``, with a timeout), never on the default group: before any stage group is built (argument
checks), after the stages' saves (each rank's status, whatever it raised, ``KeyboardInterrupt`` included) and after
the merge. If any rank failed, every rank raises the same ``SaveFailed`` naming each failing rank (global rank),
its pipeline stage, what it was doing and the cause; nothing is published and a checkpoint already at the path is
left as it was. Within a stage, ``save_hf``'s own flag protocol and status exchange keep the stage's ranks in step.

.. note:: This is the part of pipeline support that needs no change to the planner. What the planner itself
   should grow is in the module's report (per-stage parameter sets in the writer assignment and the schedule's
   SPMD contract per stage group, so a single ``save_hf`` call covers every stage and no merge step is needed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workbench.errors import CheckpointError, LayoutError
from workbench.io.files.file_plan import FilePlan, FileSpec, file_name
from workbench.io.files.index import INDEX_NAME, read_index, write_index
from workbench.io.files.publish import AtomicRenamePublisher
from workbench.io.files.publish_types import temporary_path
from workbench.io.hf.save_planning import RESERVED_NAMES
from workbench.layout.layout_file import LAYOUT_FILE_NAME, read_checkpoint_layout
from workbench.layout.model_layout import Layout, replicated_on
from workbench.layout.pipeline import PipelineLayout
from workbench.mesh import MeshDimRef, MeshSpec, format_mesh_dim
from workbench.run.guard import (
    RankProblem,
    RanksFailed,
    SaveFailed,
    agree,
    describe_problems,
    forget_groups_if_broken,
    problem_from,
)
from workbench.run.torch_comm import ControlChannel, TorchCommunicator, _subgroup, ranks_listed

__all__ = ["StageCommunicator", "pipeline_layout_from_model", "save_hf_pipeline"]

_DEFAULT_TIMEOUT = 300.0
# the exchanges across stages wait this many timeouts: a stage learns that one of its ranks left mid-save (an
# exception its save_hf did not contain) only when its own collectives time out, at worst twice (the gather or flag
# call it was in, then its status exchange); its ranks then still reach the exchange across stages in time
ACROSS_STAGES = 3


def _partition(groups: Sequence[Sequence[int]], backend: str | None, timeout: float) -> Any:
    """This rank's group of a partition of the world, made once per (partition, backend, timeout) and reused by
    later saves (``torch_comm``'s cache: groups are never freed, so one per save would leak)."""
    return _subgroup(tuple(tuple(g) for g in groups), backend, timeout)


class StageCommunicator(TorchCommunicator):
    """This rank's pipeline stage as a world of its own (a ``Communicator`` for ``save_hf(..., comm=...)``).

    A ``TorchCommunicator`` whose groups are built over the stage mesh: ``rank`` is the stage-local rank,
    ``all_gather`` over a mesh dim of the stage mesh runs on the stage's own ranks, ``all_gather_object`` and
    ``barrier`` stay within the stage. Only the group construction differs; every collective is inherited.

    .. note:: SPMD: every rank of the *whole* world constructs one, with the same ``pipeline`` and ``timeout``
       (process groups of every stage are created by every rank, in one order).
    """

    # its status exchanges span one stage: a decision drawn from them (dropping the cached groups) would be taken by
    # that stage's ranks only; the exchange across stages takes it for the whole world
    agrees_over_world = False

    def __init__(self, pipeline: PipelineLayout, *, timeout: float = _DEFAULT_TIMEOUT) -> None:
        if not dist.is_initialized() or dist.get_world_size() != pipeline.mesh.size:
            raise CheckpointError(f"StageCommunicator needs a world of {pipeline.mesh.size} ranks for {pipeline!r}")
        self.pipeline = pipeline
        self.stage, self.rank = pipeline.stage_of_rank(dist.get_rank())
        self.size = len(pipeline.stage_ranks(self.stage))
        self.mesh = pipeline.stage_mesh
        self.timeout = float(timeout)
        self.device = None
        count = len(pipeline.stages)
        self._control = _partition([pipeline.stage_ranks(s) for s in range(count)], "gloo", timeout)
        refs = {d.mesh_dim for layout in pipeline.stages for spec in layout.specs.values() for d in spec.shards}
        backend = str(dist.get_backend())
        gloo = backend == "gloo"
        gloo_scratch = "gloo" in backend and "nccl" not in backend  # as TorchCommunicator: gloo's scratch
        reordered = False  # a group whose global ranks are not in torch's (sorted) order: its gathers are copied back
        self._groups: dict[MeshDimRef, Any] = {}
        self._flags: dict[MeshDimRef, Any] = {}
        self._sizes: dict[MeshDimRef, int] = {}
        self._members: dict[MeshDimRef, tuple[int, ...]] = {}
        self._reorder: dict[MeshDimRef, torch.Tensor] = {}
        mine = pipeline.stage_ranks(self.stage)
        for ref in sorted(refs, key=format_mesh_dim):
            local = self.mesh.groups(ref)
            self._sizes[ref] = len(local[0])
            if len(local[0]) == 1:
                continue
            self._bind_order(ref, [mine[r] for r in self.mesh.group_ranks(self.rank, ref)])
            partition = [[pipeline.stage_ranks(s)[r] for r in g] for s in range(count) for g in local]
            reordered = reordered or any(g != sorted(g) for g in partition)
            self._groups[ref] = _partition(partition, None, timeout)
            self._flags[ref] = self._groups[ref] if gloo else _partition(partition, "gloo", timeout)
        # as TorchCommunicator: a second buffer of a gather's size, gloo's scratch or the reorder copy, decided from
        # every stage's groups so that every rank plans the same schedule
        self.gather_scratch = gloo_scratch or reordered

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Small objects from every rank of the stage, in stage-local rank order."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._control)
        return out

    def __repr__(self) -> str:
        return f"StageCommunicator(stage={self.stage}, rank={self.rank}, size={self.size})"


def pipeline_layout_from_model(
    model: torch.nn.Module | Mapping[str, torch.Tensor], pp_dim: str = "pp", key_map: Any = None, *,
    timeout: float = _DEFAULT_TIMEOUT,
) -> PipelineLayout:
    """The pipeline layout of a live model whose ranks each hold their stage only (every rank calls it).

    Each rank reads its stage's layout (``Layout.from_model``: the root mesh, ``pp_dim`` included; a model of plain
    tensors on every rank of a world of several is pure pipeline parallelism, rank ``r`` holding stage ``r``); the ranks
    exchange them (small metadata, over the control group: a rank that fails or does not answer within ``timeout``
    seconds is named on every rank) and every rank gets the same ``PipelineLayout``.

    Raises:
        LayoutError: this rank's own model could not be read, a parameter name held by two stages, stages that
            disagree on the mesh, or ranks of plain tensors beside ranks of DTensors (a rank holding no tensor is
            a stage with no parameter). RanksFailed: another rank could not read its model (named with the cause).
    """
    if not isinstance(pp_dim, str):  # a key map passed by position lands here
        raise LayoutError(f"pipeline_layout_from_model: pp_dim must be the pipeline's mesh dim name, got {pp_dim!r} "
                          "(pass a key map by keyword: key_map=...)")
    channel = ControlChannel(timeout, what="pipeline_layout_from_model")
    own: Any = None
    problem = None
    try:
        own = Layout.from_model(model, key_map)
        if own.mesh.size > 1 or pp_dim in own.mesh.dim_names:
            own.mesh.mesh_dim_index(pp_dim)  # a mesh without the pipeline dim: named here, by the rank that has it
    except Exception as exc:
        problem = problem_from(exc, channel.rank, "reading its stage's layout")
        failure = exc
    try:
        everyone = agree(channel, problem, what="reading the pipeline layout", error=RanksFailed,
                         outcome="no layout was made", share=own)
    except RanksFailed:
        if problem is not None:
            raise failure from None
        raise
    layouts = _on_one_mesh(everyone, pp_dim)
    mesh = layouts[0].mesh
    pp = mesh.mesh_dim_index(pp_dim)
    specs, dtypes, owner = {}, {}, {}
    for s, layout in sorted(((mesh.coordinate(r)[pp], layout) for r, layout in enumerate(layouts)),
                            key=lambda item: item[0]):
        for name, spec in layout.specs.items():
            if owner.setdefault(name, s) != s:
                raise LayoutError(f"parameter {name!r} is held by stage {owner[name]} and stage {s}")
            specs[name] = spec
            if name in layout.dtypes:  # none is assumed: the save takes the tensor's own
                dtypes[name] = layout.dtypes[name]
    merged = Layout(mesh, specs, dtypes, name=layouts[0].name)
    return PipelineLayout.from_layout(merged, pp_dim, owner.__getitem__)


def _on_one_mesh(everyone: Sequence[Layout], pp_dim: str) -> list[Layout]:
    """Every rank's layout on the pipeline mesh: a rank of plain tensors or none in a world where other ranks hold
    DTensors on a mesh with ``pp_dim`` holds no parameter (a stage with none) or is refused (named); with no
    DTensor anywhere, every rank is a stage of its own (``_pure_pipeline``).

    Raises:
        LayoutError: ranks on different meshes, or ranks of plain tensors beside ranks of DTensors (ranks named).
    """
    meshes: dict[MeshSpec, list[int]] = {}
    for rank, layout in enumerate(everyone):
        if pp_dim in layout.mesh.dim_names:
            meshes.setdefault(layout.mesh, []).append(rank)
    if not meshes:
        return [_pure_pipeline(layout, pp_dim, len(everyone)) for layout in everyone]
    if len(meshes) > 1:
        listed = "; ".join(f"rank(s) {ranks_listed(ranks)} on {mesh!r}" for mesh, ranks in meshes.items())
        raise LayoutError(f"stages disagree on the mesh: {listed}")
    ((mesh, ranks),) = meshes.items()
    plain = [r for r, layout in enumerate(everyone) if r not in ranks and layout.specs]
    if plain:
        raise LayoutError(f"rank(s) {ranks_listed(plain)} hold plain tensors (no DTensor), rank(s) "
                          f"{ranks_listed(ranks)} DTensors on {mesh!r}: hold every stage's parameters as DTensors "
                          "on that mesh (Replicate() where a stage does not cut one)")
    return [layout if r in ranks else Layout(mesh, {}, {}, name=everyone[ranks[0]].name)
            for r, layout in enumerate(everyone)]


def _pure_pipeline(layout: Layout, pp_dim: str, world: int) -> Layout:
    """A model of plain tensors (a layout of one rank, no DTensor) in a world of several ranks: each rank is a stage
    and holds its parameters whole, on a mesh of ``pp_dim`` alone. Any other layout as it is."""
    if world == 1 or layout.mesh.size != 1 or pp_dim in layout.mesh.dim_names:
        return layout
    return replicated_on(layout, MeshSpec((world,), (pp_dim,)))


def save_hf_pipeline(
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    path: str | Path,
    pipeline: PipelineLayout,
    *,
    config_files: Sequence[str | Path] = (),
    timeout: float = _DEFAULT_TIMEOUT,
    **save_kwargs: Any,
) -> Path:
    """Save this rank's stage of a pipeline-parallel model; together the ranks publish one HF checkpoint at ``path``.

    ``model`` holds this rank's stage only (its parameter names are those of ``pipeline.layout_of_rank(rank)``).
    ``save_kwargs`` go to each stage's ``save_hf`` (``fp32_keys_pattern``, ``dtype``, ``budget_bytes``,
    ``max_shard_bytes``, ``write_mode``...); the save is synchronous (no ``async_save``).

    ``timeout``: seconds a collective of a stage's save waits for a peer of its stage (as ``save_hf``'s); the
    exchanges across stages wait up to ``ACROSS_STAGES`` (3) times as long, since a stage may need two timeouts to
    learn that one of its ranks left its save mid-way. No collective runs on the default group.

    Raises:
        SaveFailed: a rank failed (an error or any other exception, ``KeyboardInterrupt`` included, in its stage's
            save, in the merge, or a rank that did not answer): every rank raises it, naming each failing global
            rank, its pipeline stage, what it was doing and the cause; nothing is published at ``path`` and a
            checkpoint already there is left intact.

    .. note:: SPMD: every rank of the whole pipeline mesh calls it, with the same arguments.
    """
    from workbench.io.hf.save import call_options, other_arguments_problem, save_hf

    path = Path(path)
    if not dist.is_initialized():
        raise CheckpointError("save_hf_pipeline needs an initialized default process group (wb.launch or torchrun)")
    what = f"pipeline save to {path}"
    world = ControlChannel(ACROSS_STAGES * timeout, what=f"save_hf_pipeline to {os.path.abspath(path)}")
    rank = world.rank
    # the stages save into the directory rank 0 prepares for the whole save: never a checkpoint beside the target
    stages = [temporary_path(path) / f"stage{s}" for s in range(len(pipeline.stages))]
    publisher: AtomicRenamePublisher | None = None
    # arguments first, agreed on by the whole world before any stage group is built (a collective of every rank)
    problem: RankProblem | None = None
    failure: BaseException | None = None
    digest = ""
    try:
        _check_arguments(pipeline, config_files if rank == 0 else (), save_kwargs)
        digest = hashlib.sha256(pipeline.to_toml().encode()).hexdigest()
        if rank == 0:
            preparing = AtomicRenamePublisher(path)
            preparing.prepare()  # refuses a live save at the path, or a directory that is not a checkpoint
            publisher = preparing
    except Exception as exc:
        problem, failure = problem_from(exc, rank, "checking the arguments"), exc

    def abort() -> None:  # rank 0's directory, with every stage in it: once every stage's save has ended
        if publisher is not None:
            publisher.abort()

    # every stage saves with the same arguments: stages that differ would publish one checkpoint of mixed dtypes;
    # and the same pipeline: every rank builds every stage's groups from it, and ranks that differ would wait in
    # group constructions or collectives that others never make (a timeout naming no cause)
    shared = _across_stages(world, problem, what, outcome="nothing was written", on_failure=abort, cause=failure,
                            share=(call_options(save_kwargs), digest))
    differ = other_arguments_problem([options for options, _ in shared]) or _pipelines_differ(
        [d for _, d in shared])
    if differ is not None:
        abort()
        raise SaveFailed(f"{what} refused before anything was written: {differ}",
                         [RankProblem(r, "checking the arguments", differ) for r in range(len(shared))])
    comm = StageCommunicator(pipeline, timeout=timeout)
    mine: RankProblem | None = None
    try:
        save_hf(model, stages[comm.stage], layout=pipeline.stages[comm.stage], comm=comm, timeout=timeout,
                **save_kwargs)
    except BaseException as exc:  # KeyboardInterrupt too: the other stages must hear of it, not wait for it
        failure = exc
        mine = _stage_problem(exc, pipeline, rank)

    # an interrupt (not an Exception) save_hf raised again after its stage agreed may still have come from inside
    # a collective, leaving this rank's stage groups out of step: every rank drops them
    _across_stages(world, mine, what, on_failure=abort, cause=failure,
                   suspect=failure is not None and not isinstance(failure, Exception))
    merged: RankProblem | None = None
    if publisher is not None:
        try:
            _merge(stages, publisher, config_files, pipeline)
        except BaseException as exc:
            failure = exc
            merged = problem_from(exc, 0, "merging the stages and publishing (index, config files, rename)")
            _quietly(abort)
    _across_stages(world, merged, what, cause=failure,
                   lost="rank 0 may or may not have published: check with wb.latest_checkpoint")
    return path


def _check_arguments(pipeline: PipelineLayout, config_files: Sequence[str | Path], save_kwargs: Mapping) -> None:
    """What ``save_hf_pipeline`` can refuse before any data moves (``config_files``: rank 0 copies them)."""
    if dist.get_world_size() != pipeline.mesh.size:
        raise CheckpointError(f"the world has {dist.get_world_size()} ranks, the pipeline's mesh {pipeline.mesh!r} "
                              f"has {pipeline.mesh.size}")
    for name in ("async_save", "layout", "comm"):
        if name in save_kwargs and (name != "async_save" or save_kwargs[name]):
            why = "the save is synchronous" if name == "async_save" else "save_hf_pipeline sets it for each stage"
            raise CheckpointError(f"save_hf_pipeline does not take {name}= ({why})")
    missing = [str(c) for c in config_files if not Path(c).is_file()]
    if missing:
        raise CheckpointError(f"config file(s) to copy do not exist: {missing}")
    clash = [str(c) for c in config_files if Path(c).name in RESERVED_NAMES or Path(c).name.endswith(".safetensors")]
    if clash:
        raise CheckpointError(f"config file(s) {clash} would overwrite the index, layout, owner marker or weight files "
                              "of the checkpoint; rename them or leave them out of config_files")


def _pipelines_differ(digests: Sequence[str]) -> str | None:
    """Which ranks passed which pipeline (every rank's digest of its ``pipeline.to_toml()``); None when alike."""
    by_digest: dict[str, list[int]] = {}
    for rank, digest in enumerate(digests):
        by_digest.setdefault(digest, []).append(rank)
    if len(by_digest) == 1:
        return None
    listed = ", ".join(f"{'another' if i else 'one'} on rank(s) {ranks_listed(ranks)}"
                       for i, ranks in enumerate(by_digest.values()))
    return (f"the ranks passed different pipeline layouts ({listed}); every rank must pass the same PipelineLayout "
            "(pipeline_layout_from_model gives every rank the same one)")


def _stage_problem(exc: BaseException, pipeline: PipelineLayout, rank: int) -> RankProblem:
    """This rank's problem from what its stage's ``save_hf`` raised, by global rank and with its pipeline stage.

    A ``SaveFailed`` carries the problems of the stage's ranks by stage-local rank: this rank's own is kept (every
    rank of the stage reports its own); a rank that only learnt of a peer's failure is marked as such."""
    stage, local = pipeline.stage_of_rank(rank)
    where = f"pipeline stage {stage}"
    if isinstance(exc, RanksFailed):
        own = sorted((p for p in exc.problems if p.rank == local), key=lambda p: p.broken)
        if not own:
            return RankProblem(rank, f"saving {where}", "a peer of its stage failed", secondary=True)
        return dataclasses.replace(own[0], rank=rank, stage=f"{own[0].stage} ({where})")
    return problem_from(exc, rank, f"saving {where}")


def _across_stages(
    world: ControlChannel,
    mine: RankProblem | None,
    what: str,
    *,
    outcome: str = "nothing was published",
    lost: str = "",
    on_failure: Callable[[], None] | None = None,
    cause: BaseException | None = None,
    suspect: bool = False,
    share: Any = None,
) -> list[Any]:
    """Every rank's problem (or None) over the world's control group; if any rank has one, every rank raises the
    same ``SaveFailed`` (chained to this rank's own exception, ``cause``). Returns every rank's ``share``.

    Root causes come first: a rank whose own failure is a collective that broke (it timed out, or lost a peer)
    stopped because of another rank when some rank reports a failure of its own. A rank that does not answer
    within the channel's timeout is reported as such (with this rank's own problem).

    Process groups a collective left out of step (one that timed out, or that a rank left mid-call: ``suspect``)
    would pair the next save's calls with the wrong ones, so then every rank drops the cached groups (the same
    decision everywhere, from the same exchanged flags) and the next save makes fresh ones."""
    try:
        everyone = world.all_gather_object((mine, suspect, share))
    except Exception as exc:
        gone = problem_from(exc, world.rank, "exchanging status with the other stages", broken=True)
        found = [p for p in (mine, gone) if p is not None]
        forget_groups_if_broken(found)  # this rank cannot tell which of its groups are still in step
        _quietly(on_failure)
        note = ("a rank did not answer the exchange across stages: it died, hangs, or is still in its stage's save "
                "past the timeout")
        raise SaveFailed(describe_problems(what, found, lost or outcome, note), found) from cause or exc
    found = [p for p, _, _ in everyone if p is not None]
    forget_groups_if_broken(found, suspect=any(s for _, s, _ in everyone))
    if not found:
        return [shared for _, _, shared in everyone]
    if any(not p.broken and not p.secondary for p in found):
        found = [dataclasses.replace(p, secondary=True) if p.broken else p for p in found]
    _quietly(on_failure)
    raise SaveFailed(describe_problems(what, found, outcome), found) from cause


def _quietly(fn: Callable[[], None] | None) -> None:
    if fn is None:
        return
    try:
        fn()
    except Exception:  # cleanup after a failure must not hide the failure
        pass


def _merge(stage_dirs: Sequence[Path], publisher: AtomicRenamePublisher, config_files: Sequence[str | Path],
           pipeline: PipelineLayout) -> None:
    """Move every stage's files up into the publisher's prepared directory (which holds the stages) with global
    numbering, remove the stages, write one index and the pipeline's layout file, and publish it."""
    files: list[tuple[Path, dict[str, str]]] = []  # (file, {key: ...}) in stage order
    empty: set[int] = set()  # stages that wrote no key
    for stage, stage_dir in enumerate(stage_dirs):
        weight_map, _, problems = read_index(stage_dir / INDEX_NAME)  # bounded, checked parsing
        strays = sorted({n for n in weight_map.values() if Path(n).name != n or n in ("", ".", "..")})
        if strays:
            problems.append(f"{stage_dir / INDEX_NAME}: file name(s) {strays[:3]} are not in its directory")
        if problems:
            raise CheckpointError(f"pipeline stage {stage}'s index cannot be merged: {'; '.join(problems)}")
        if not weight_map:
            empty.add(stage)
        by_file: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            by_file.setdefault(name, []).append(key)
        files.extend((stage_dir / name, dict.fromkeys(keys, name)) for name, keys in sorted(by_file.items()))
    saved = _saved_pipeline(pipeline, stage_dirs, empty)
    total = len(files)
    temporary = publisher.temporary
    specs = []
    for number, (source, keys) in enumerate(files, start=1):
        name = file_name("model", number, total)
        nbytes = _data_bytes(source)
        os.replace(source, temporary / name)  # the same directory tree: a rename
        specs.append(FileSpec(name=name, writer=0, keys=tuple(keys), nbytes=nbytes))
    for stage_dir in stage_dirs:
        shutil.rmtree(stage_dir)
    weight_map = {key: spec.name for spec in specs for key in spec.keys}
    write_index(temporary, FilePlan(files=tuple(specs), weight_map=weight_map, total_size=sum(s.nbytes for s in specs)))
    (temporary / LAYOUT_FILE_NAME).write_text(saved.to_toml(), encoding="utf-8")  # fsynced by finalize
    for config in config_files:
        shutil.copy2(config, temporary / Path(config).name)
    publisher.finalize()


def _saved_pipeline(pipeline: PipelineLayout, stage_dirs: Sequence[Path], empty: set[int]) -> PipelineLayout:
    """The pipeline as its stages were saved: each stage's own layout file (``save_hf`` writes it with the dtypes
    of the tensors it wrote, which ``pipeline`` may leave out) on ``pipeline``'s mesh."""
    stages = []
    for stage, stage_dir in enumerate(stage_dirs):
        if stage in empty:  # a stage that saved no key (no parameter): its layout file lists none, and is no layout
            stages.append(Layout(pipeline.stage_mesh, {}, {}, name=f"{pipeline.name}[{pipeline.pp_dim}={stage}]"))
            continue
        layout = read_checkpoint_layout(stage_dir)
        if layout is None:
            raise CheckpointError(f"pipeline stage {stage}'s save left no {LAYOUT_FILE_NAME} in {stage_dir}")
        stages.append(layout)
    return PipelineLayout(pipeline.mesh, pipeline.pp_dim, tuple(stages), name=pipeline.name)


def _data_bytes(path: Path) -> int:
    """Tensor bytes of a safetensors file (its size minus the header)."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header
