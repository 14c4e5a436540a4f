"""Save a pipeline-parallel model as one HF checkpoint: every stage saves as its own world, then one merge.

``save_hf`` assumes one mesh whose ranks all hold the same parameter names. A pipeline stage is exactly that on
its own (``PipelineLayout.stages``, stage-local ranks), so each stage runs an ordinary ``save_hf`` through a
``StageCommunicator`` that makes the stage look like a world: stage-local ranks, process groups over the stage's
own ranks, agreement among the stage only. Stages write side by side into hidden per-stage directories next to the
target; after every rank's stage succeeded, global rank 0 renumbers the files
(``model-0000k-of-0000N.safetensors`` over all stages), writes one index with ``metadata.total_size``, copies the
config files and publishes the whole directory with one atomic rename. A failure anywhere publishes nothing.

.. note:: This is the part of pipeline support that needs no change to the planner. What the planner itself
   should grow is in the module's report (per-stage parameter sets in the writer assignment and the schedule's
   SPMD contract per stage group, so a single ``save_hf`` call covers every stage and no merge step is needed).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workbench.errors import CheckpointError
from workbench.io.file_plan import FilePlan, FileSpec, file_name
from workbench.io.index import INDEX_NAME, write_index
from workbench.io.publish import AtomicRenamePublisher
from workbench.layout.pipeline import PipelineLayout
from workbench.mesh import MeshDimRef, format_mesh_dim
from workbench.run.torch_comm import TorchCommunicator

__all__ = ["StageCommunicator", "pipeline_layout_from_model", "save_hf_pipeline"]

_DEFAULT_TIMEOUT = 300.0


def _partition(groups: Sequence[Sequence[int]], backend: str | None, timeout: float) -> Any:
    import datetime

    mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups], backend=backend,
                                                timeout=datetime.timedelta(seconds=timeout))
    return mine


class StageCommunicator(TorchCommunicator):
    """This rank's pipeline stage as a world of its own (a ``Communicator`` for ``save_hf(..., comm=...)``).

    A ``TorchCommunicator`` whose groups are built over the stage mesh: ``rank`` is the stage-local rank,
    ``all_gather`` over a mesh dim of the stage mesh runs on the stage's own ranks, ``all_gather_object`` and
    ``barrier`` stay within the stage. Only the group construction differs; every collective is inherited.

    .. note:: SPMD: every rank of the *whole* world constructs one, with the same ``pipeline`` and ``timeout``
       (process groups of every stage are created by every rank, in one order).
    """

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
        gloo = str(dist.get_backend()) == "gloo"
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
            self._groups[ref] = _partition(partition, None, timeout)
            self._flags[ref] = self._groups[ref] if gloo else _partition(partition, "gloo", timeout)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Small objects from every rank of the stage, in stage-local rank order."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._control)
        return out

    def __repr__(self) -> str:
        return f"StageCommunicator(stage={self.stage}, rank={self.rank}, size={self.size})"


def pipeline_layout_from_model(
    model: torch.nn.Module | Mapping[str, torch.Tensor], pp_dim: str = "pp", key_map: Any = None
) -> PipelineLayout:
    """The pipeline layout of a live model whose ranks each hold their stage only (every rank calls it).

    Each rank reads its stage's layout (``Layout.from_model``: the root mesh, ``pp_dim`` included); the ranks
    exchange them (small metadata, ``all_gather_object``) and every rank gets the same ``PipelineLayout``.

    Raises:
        LayoutError: a parameter name held by two stages, or stages that disagree on the mesh.
    """
    from workbench.errors import LayoutError
    from workbench.layout.model_layout import Layout

    mine = Layout.from_model(model, key_map)
    pp = mine.mesh.mesh_dim_index(pp_dim)
    stage = mine.mesh.coordinate(dist.get_rank())[pp]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (stage, mine))
    specs, dtypes, owner = {}, {}, {}
    for s, layout in sorted(everyone, key=lambda item: item[0]):
        if layout.mesh != mine.mesh:
            raise LayoutError(f"stages disagree on the mesh: {layout.mesh!r} and {mine.mesh!r}")
        for name, spec in layout.specs.items():
            if owner.setdefault(name, s) != s:
                raise LayoutError(f"parameter {name!r} is held by stage {owner[name]} and stage {s}")
            specs[name], dtypes[name] = spec, layout.dtypes.get(name, "float32")
    merged = Layout(mine.mesh, specs, dtypes, name=mine.name)
    return PipelineLayout.from_layout(merged, pp_dim, owner.__getitem__)


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
    ``max_shard_bytes``, ``write_mode``...).

    Raises:
        CheckpointError: a stage failed (every rank raises; nothing is published at ``path``).

    .. note:: SPMD: every rank of the whole pipeline mesh calls it.
    """
    from workbench.io.hf_save import save_hf

    path = Path(path)
    comm = StageCommunicator(pipeline, timeout=timeout)
    stage_dir = path.with_name(f".{path.name}.stage{comm.stage}")
    failure: BaseException | None = None
    try:
        save_hf(model, stage_dir, layout=pipeline.stages[comm.stage], comm=comm, timeout=timeout, **save_kwargs)
    except Exception as exc:
        failure = exc
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, None if failure is None else f"{type(failure).__name__}: {failure}")
    failed = {r: msg for r, msg in enumerate(everyone) if msg is not None}
    stages = [path.with_name(f".{path.name}.stage{s}") for s in range(len(pipeline.stages))]
    merged: str | None = None
    if not failed and dist.get_rank() == 0:
        try:
            _merge(stages, path, config_files)
        except Exception as exc:
            merged = f"{type(exc).__name__}: {exc}"
    result = [merged]
    dist.broadcast_object_list(result, src=0)
    if dist.get_rank() == 0:
        for d in stages:
            shutil.rmtree(d, ignore_errors=True)
    dist.barrier()
    if failed or result[0]:
        lines = [f"rank {r}: {m.splitlines()[0]}" for r, m in sorted(failed.items())] or [f"merge: {result[0]}"]
        raise CheckpointError(f"pipeline save to {path} failed; nothing was published:\n  " + "\n  ".join(lines)) \
            from failure
    return path


def _merge(stage_dirs: Sequence[Path], path: Path, config_files: Sequence[str | Path]) -> None:
    """Move every stage's files into one directory with global numbering, one index, and publish it."""
    files: list[tuple[Path, dict[str, str]]] = []  # (file, {key: ...}) in stage order
    for stage_dir in stage_dirs:
        index = json.loads((stage_dir / INDEX_NAME).read_text())
        by_file: dict[str, list[str]] = {}
        for key, name in index["weight_map"].items():
            by_file.setdefault(name, []).append(key)
        files.extend((stage_dir / name, dict.fromkeys(keys, name)) for name, keys in sorted(by_file.items()))
    total = len(files)
    publisher = AtomicRenamePublisher(path)
    temporary = publisher.prepare()
    try:
        specs = []
        for number, (source, keys) in enumerate(files, start=1):
            name = file_name("model", number, total)
            nbytes = _data_bytes(source)
            shutil.move(str(source), temporary / name)
            specs.append(FileSpec(name=name, writer=0, keys=tuple(keys), nbytes=nbytes))
        weight_map = {key: spec.name for spec in specs for key in spec.keys}
        write_index(temporary, FilePlan(files=tuple(specs), weight_map=weight_map,
                                        total_size=sum(s.nbytes for s in specs)))
        for config in config_files:
            shutil.copy2(config, temporary / Path(config).name)
        publisher.finalize()
    except BaseException:
        publisher.abort()
        raise


def _data_bytes(path: Path) -> int:
    """Tensor bytes of a safetensors file (its size minus the header)."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header
