"""The torch.distributed.checkpoint names the DCP planners build on, each behind one shim with a fallback.

DCP's planner interface (``SavePlanner``, ``LoadPlanner``, ``WriteItem``, ``ReadItem``, ``ChunkStorageMetadata``,
``TensorProperties``) is public and stable from torch 2.3 on. The resharding helper that turns saved chunks and
wanted chunks into read items, ``planner_helpers.create_read_items_for_chunk_list``, is public by name but lives
in a module torch reorganizes; it is imported here with a fallback that computes the same overlaps. Kept apart
from ``workbench/_compat.py`` (shared) so the DCP layer can move with torch on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["chunk_overlaps", "read_items_for_chunks", "set_up_default_load"]


def read_items_for_chunks(fqn: str, storage_md: Any, chunks: Sequence[Any]) -> list[Any]:
    """``ReadItem``s that fill ``chunks`` (global boxes this rank wants) from the saved chunks of ``storage_md``.

    Each read item's ``dest_index`` is ``MetadataIndex(fqn, chunk.offsets, i)`` for the ``i``-th wanted chunk and
    its ``dest_offsets`` are relative to that chunk, as torch's default planner makes them.
    """
    try:
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list as helper
    except ImportError:  # pragma: no cover - depends on the torch release
        helper = None
    if helper is not None:
        return list(helper(fqn, storage_md, list(chunks)))
    return _read_items_fallback(fqn, storage_md, chunks)


def _read_items_fallback(fqn: str, storage_md: Any, chunks: Sequence[Any]) -> list[Any]:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    items = []
    for want_index, want in enumerate(chunks):
        for saved_index, saved in enumerate(storage_md.chunks):
            overlap = chunk_overlaps(saved.offsets, saved.sizes, want.offsets, want.sizes)
            if overlap is None:
                continue
            storage_offsets, dest_offsets, lengths = overlap
            items.append(ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(fqn, want.offsets, want_index),
                dest_offsets=torch.Size(dest_offsets),
                storage_index=MetadataIndex(fqn, saved.offsets, saved_index),
                storage_offsets=torch.Size(storage_offsets),
                lengths=torch.Size(lengths),
            ))
    return items


def chunk_overlaps(
    saved_offsets: Sequence[int], saved_sizes: Sequence[int], want_offsets: Sequence[int], want_sizes: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """The overlap of two global boxes as (offsets in the saved box, offsets in the wanted box, lengths), or None."""
    storage, dest, lengths = [], [], []
    for so, ss, wo, ws in zip(saved_offsets, saved_sizes, want_offsets, want_sizes):
        lo, hi = max(so, wo), min(so + ss, wo + ws)
        if hi <= lo:
            return None
        storage.append(lo - so)
        dest.append(lo - wo)
        lengths.append(hi - lo)
    return tuple(storage), tuple(dest), tuple(lengths)


def set_up_default_load(state_dict: dict[str, Any], metadata: Any, strict: bool) -> list[Any]:
    """Read items of torch's default planner for entries that need no layout work (plain tensors, bytes)."""
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

    return list(create_default_local_load_plan(state_dict, metadata, strict).items)
