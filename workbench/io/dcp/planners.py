"""DCP planners that describe any workbench layout exactly: one storage chunk per run, resharded on load.

torch's default planner gives every DTensor shard one box, ``compute_local_shape_and_global_offset``. An
interleaved shard (expert TP) is not one box: rank (ep=0, etp=0) of 16 rows on EP2 x ETP2 with
``InterleavedShard(0, 2)`` holds rows 0-1 and 4-5. torch either raises or writes a wrong box, and its global plan
check then refuses the checkpoint ("overlapping chunks"). These planners ask ``LoadSpec.runs(rank)`` instead:

====  ========  ===============================  =========================================
rank  (ep,etp)  runs (global rows -> local rows)  write items on save
====  ========  ===============================  =========================================
0     (0, 0)    0:2 -> 0:2, 4:6 -> 2:4            two chunks, offsets (0, 0) and (4, 0)
1     (0, 1)    2:4 -> 0:2, 6:8 -> 2:4            two chunks, offsets (2, 0) and (6, 0)
====  ========  ===============================  =========================================

On load the runs of the *target* topology become the wanted chunks, and DCP's resharding reads each from the
saved chunks that overlap it, so a checkpoint written at EP2 x ETP2 loads at EP1 x ETP4, at FSDP x ETP, or into
plain unsharded tensors (with torch's default load planner even: the metadata is standard DCP). Optimizer state
(``exp_avg``, ``exp_avg_sq``) are DTensors with their parameter's placements and get the same treatment; plain
tensors (Adam's scalar ``step``) and other objects go through torch's default path.

Usage, on every rank::

    import torch.distributed.checkpoint as dcp
    state = {"model": model.state_dict(), "optim": optimizer_state}
    dcp.save(state, checkpoint_id=path, planner=wb.DCPSavePlanner(model))
    dcp.load(state, checkpoint_id=path, planner=wb.DCPLoadPlanner(model))

Passing ``model`` lets the planners read which mesh dims FSDP2 shards over, whose cut FSDP2 applies last whatever
split factor torch wrote (torch 2.11 leaves interleaved cuts out of it; 2.13 counts them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from workbench import _compat
from workbench.errors import CheckpointError
from workbench.io.dcp._dcp_compat import read_items_for_chunks, set_up_default_load
from workbench.layout.load_spec import LoadSpec
from workbench.layout.runs import Run
from workbench.plan.casts import check_fits, narrows_range

__all__ = ["DCPLoadPlanner", "DCPSavePlanner", "dtensor_runs"]


def _fsdp_dims(model: torch.nn.Module | None, fsdp_mesh_dims: Collection[str] | None) -> tuple[str, ...]:
    dims = set(fsdp_mesh_dims or ())
    if model is not None:
        dims |= _compat.fsdp_shard_mesh_dims(model)
    return tuple(sorted(dims))


def dtensor_runs(fqn: str, tensor: Any, fsdp_mesh_dims: Collection[str] = ()) -> tuple[Run, ...] | None:
    """The runs this rank holds of a DTensor (None when the rank is not on its mesh).

    A tensor with no elements is one empty box at the origin, so every rank names it and DCP records its shape.

    Raises:
        LayoutError: the DTensor's metadata does not describe its local tensor, or a placement is Partial.
    """
    mesh = tensor.device_mesh
    if mesh.get_coordinate() is None:
        return None
    if tensor.numel() == 0:
        return (Run((0,) * tensor.dim(), tuple(tensor.shape), (0,) * tensor.dim()),)
    spec = LoadSpec.from_tensor(fqn, fqn, tensor, fsdp_mesh_dims=tuple(fsdp_mesh_dims))
    return spec.runs(mesh.get_rank())


def _view(local: torch.Tensor, run: Run) -> torch.Tensor:
    return local[run.local_slices()] if run.sizes else local


class DCPSavePlanner(DefaultSavePlanner):
    """torch DCP save planner that writes every DTensor as one chunk per run (interleaved and strided cuts exact).

    Args:
        model: the module whose state is saved (optional); FSDP2's mesh dims are read from it.
        fsdp_mesh_dims: FSDP2's mesh dims, when there is no module at hand (e.g. optimizer state alone).
        flatten_state_dict: as torch's ``DefaultSavePlanner`` (nested dicts become dotted keys).
        dedup_save_to_lowest_rank: as torch's: replicated chunks are written by the lowest rank holding them.

    Replicated copies (HSDP replicas, plain tensors, bytes) are written once: DCP's global plan drops duplicate
    chunks. ``tests/dcp`` saves an EP2 x ETP2 Qwen3-MoE with Adam state and reloads it elsewhere bit for bit.

    .. note:: SPMD: pass one to ``dcp.save`` on every rank, like any planner.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        *,
        fsdp_mesh_dims: Collection[str] | None = None,
        flatten_state_dict: bool = True,
        dedup_save_to_lowest_rank: bool = False,
    ) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=True,
                         dedup_save_to_lowest_rank=dedup_save_to_lowest_rank)
        self.fsdp_mesh_dims = _fsdp_dims(model, fsdp_mesh_dims)
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self) -> SavePlan:
        """One SHARD write item per run of every DTensor; torch's default items for everything else."""
        items: list[WriteItem] = []
        plain: dict[str, Any] = {}
        self._views = {}
        for fqn, obj in self.state_dict.items():
            if _compat.is_dtensor(obj):
                items.extend(self._dtensor_items(fqn, obj))
            else:
                plain[fqn] = obj
        items.extend(create_default_local_save_plan(plain, self.is_coordinator).items)
        plan = SavePlan(items)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def _dtensor_items(self, fqn: str, tensor: Any) -> list[WriteItem]:
        runs = dtensor_runs(fqn, tensor, self.fsdp_mesh_dims)
        if runs is None:
            return []
        local = _compat.dtensor_local(tensor).detach()
        properties = TensorProperties.create_from_tensor(local)
        items = []
        for run in runs:
            offsets = torch.Size(run.global_offset)
            self._views[(fqn, tuple(offsets))] = _view(local, run)
            items.append(WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(run.sizes)),
                    properties=properties,
                    size=tensor.size(),
                ),
            ))
        return items

    def resolve_data(self, write_item: WriteItem) -> Any:
        """The local view of a run (DCP copies views that do not own their storage), else torch's answer."""
        index = write_item.index
        view = self._views.get((index.fqn, tuple(index.offset or ())))
        if view is not None and write_item.type == WriteItemType.SHARD:
            return view
        return super().resolve_data(write_item)


class DCPLoadPlanner(DefaultLoadPlanner):
    """torch DCP load planner that fills every DTensor run by run, from whatever chunks the checkpoint holds.

    The wanted chunks are this rank's runs in the *current* topology, so any saved layout (ours, torch's default,
    another mesh) loads into any target layout. Plain tensors and bytes load as torch's default planner loads
    them.

    Args:
        model: the module being loaded (optional); FSDP2's mesh dims are read from it.
        fsdp_mesh_dims: FSDP2's mesh dims, when there is no module at hand.
        flatten_state_dict: as torch's ``DefaultLoadPlanner``.
        allow_partial_load: as torch's: keys missing from the checkpoint are skipped instead of an error.

    A key saved in a dtype of a larger range than the target's (float32 into float16) is read into a buffer of its
    own dtype first and copied only when every value fits (torch's copy turned 1e5 into inf, silently).

    Raises (from ``dcp.load``):
        CheckpointError: a key is missing from the checkpoint (unless ``allow_partial_load``), its saved global
            shape differs from the target's (both shapes named), or a saved value does not fit the target dtype.

    .. note:: SPMD: pass one to ``dcp.load`` on every rank.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        *,
        fsdp_mesh_dims: Collection[str] | None = None,
        flatten_state_dict: bool = True,
        allow_partial_load: bool = False,
    ) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=True,
                         allow_partial_load=allow_partial_load)
        self.fsdp_mesh_dims = _fsdp_dims(model, fsdp_mesh_dims)
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._narrowing: dict[ReadItem, torch.Tensor] = {}  # read item -> target, where the read has its own buffer

    def create_local_plan(self) -> LoadPlan:
        """Read items for every run of every DTensor; torch's default items for everything else."""
        if self.metadata is None:
            raise CheckpointError("DCPLoadPlanner: set_up_planner was not given the checkpoint metadata")
        saved = self.metadata.state_dict_metadata
        strict = not self.allow_partial_load
        items: list[ReadItem] = []
        plain: dict[str, Any] = {}
        self._views, self._narrowing = {}, {}
        missing = []
        for fqn, obj in self.state_dict.items():
            if not _compat.is_dtensor(obj):
                plain[fqn] = obj
                continue
            if fqn not in saved:
                missing.append(fqn)
                continue
            items.extend(self._dtensor_reads(fqn, obj, saved[fqn]))
        if missing and strict:
            raise CheckpointError(
                f"Missing key in checkpoint state_dict: {len(missing)} sharded tensor(s) are not in the checkpoint, "
                f"e.g. {missing[:3]}; pass allow_partial_load=True to skip them"
            )
        items.extend(set_up_default_load(plain, self.metadata, strict))
        return LoadPlan(items)

    def _dtensor_reads(self, fqn: str, tensor: Any, storage: Any) -> list[ReadItem]:
        if not isinstance(storage, TensorStorageMetadata):
            raise CheckpointError(f"key {fqn!r}: the checkpoint holds a non-tensor object, the target is a DTensor")
        if tuple(storage.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"key {fqn!r}: saved global shape {tuple(storage.size)} differs from the target's "
                f"{tuple(tensor.shape)}; a reshard changes placements, never the global shape"
            )
        runs = dtensor_runs(fqn, tensor, self.fsdp_mesh_dims)
        if not runs:
            return []
        local = _compat.dtensor_local(tensor).detach()
        chunks = []
        for run in runs:
            offsets = torch.Size(run.global_offset)
            self._views[(fqn, tuple(offsets))] = _view(local, run)
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(run.sizes)))
        return read_items_for_chunks(fqn, storage, chunks)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The part of a run's local view that ``read_item`` fills (a view: DCP copies into it in place); a buffer
        of the saved dtype where the copy could change a value (``commit_tensor`` checks and copies it)."""
        index = read_item.dest_index
        view = self._views.get((index.fqn, tuple(index.offset or ())))
        if view is None:
            view = super().resolve_tensor(read_item)
        else:
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                view = view.narrow(dim, start, length)
        stored = self.metadata.state_dict_metadata.get(index.fqn) if self.metadata is not None else None
        if isinstance(stored, TensorStorageMetadata) and narrows_range(stored.properties.dtype, view.dtype):
            self._narrowing[read_item] = view
            return torch.empty(view.shape, dtype=stored.properties.dtype, device=view.device)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Copy a buffer of the saved dtype into its target once every value is known to fit."""
        target = self._narrowing.pop(read_item, None)
        if target is not None:
            check_fits(tensor, target.dtype, f"key {read_item.dest_index.fqn!r}",
                       advice="load into a tensor of the checkpoint's dtype and convert it yourself")
            target.copy_(tensor)
        super().commit_tensor(read_item, tensor)
