"""The snapshot step of a direct save: this rank's pieces of the tensors written in place, copied and queued.

``queue_direct_pieces`` walks the rank's ``direct_program`` (io/files/direct.py): each piece is cast to its key's save
dtype and copied into host memory the save owns (the copies taken at the call's start are used instead when they
are this plan's: ``EarlySnapshot.claim``), then added to the writer queue's current batch. A tensor whose every
piece is the rank's is copied once, whole, and written by one job. The copies of a batch share one event,
recorded when the batch is handed to a writer.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch

from workbench.faults import fault_point
from workbench.io.files.direct import CheckpointFiles, direct_program
from workbench.io.files.snapshot import HostCopy, Snapshotter
from workbench.io.hf.early_snapshot import EarlySnapshot, take_step
from workbench.io.hf.save_writers import WriterQueue
from workbench.layout.load_spec import KeyRegion
from workbench.layout.model_layout import Layout

__all__ = ["queue_direct_pieces", "write_piece"]


def queue_direct_pieces(
    layout: Layout,
    rank: int,
    key_meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    direct: tuple[str, ...],
    tensors: Mapping[str, torch.Tensor],
    files: CheckpointFiles,
    snapshot: Snapshotter,
    writers: WriterQueue,
    early: EarlySnapshot | None,
) -> None:
    """Snapshot and queue every piece ``rank`` writes of the ``direct`` tensors (replicated pieces: only the
    replica ``writes_piece`` chose). On a failure, the copies no writer will release are given back (once landed)
    and the exception is raised."""
    program = direct_program(layout, key_meta, direct, rank)
    claimed = early.claim((layout, key_meta, direct, rank), program, tensors) if early is not None else None
    reached = 0  # the early copies of the steps before this one are the batch's or a writer's
    mark = snapshot.mark
    try:
        for index, step in enumerate(program):
            reached = index
            name, whole_dtype, mine = step
            if not mine:
                continue
            fault_point("snapshot", rank)
            copies = claimed[index] if claimed is not None else take_step(snapshot, tensors[name], step, key_meta)
            reached = index + 1
            if whole_dtype is not None:
                # every piece of the tensor is ours: one snapshot of the whole local tensor (one device-to-host
                # copy, not one per stripe) and one job writing its pieces
                def job(pieces: tuple[KeyRegion, ...] = mine, whole: HostCopy = copies[0]) -> int:
                    return files.write_local(pieces, whole.wait())

                writers.add(job, copies[0], name, mark=mark)
            else:
                for region, copy in zip(mine, copies):
                    writers.add(partial(write_piece, files, region, copy), copy, region.hf_key, mark=mark)
        writers.flush("the last pieces", mark=mark)
    except BaseException:
        # no writer will release these: the batch not handed over, and the early copies of the steps not reached
        mark()
        writers.drop_batch()
        for copies in claimed[reached:] if claimed is not None else ():
            for copy in copies:
                copy.discard()
        raise


def write_piece(files: CheckpointFiles, region: KeyRegion, copy: HostCopy) -> int:
    """Write one piece into its place in the checkpoint's files, once its copy has landed."""
    return files.write_piece(region, copy.wait())
