"""Writer assignment: which rank writes which HF key, balanced by bytes."""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence

from workbench.plan.save_plan import HFSavePlan

__all__ = ["assign_writers", "key_holders", "key_nbytes", "writer_pool"]


def writer_pool(ranks: Sequence[int], max_writers: int | None) -> tuple[int, ...]:
    """Up to ``max_writers`` ranks spread evenly over ``ranks`` (so writers land on different hosts)."""
    ranks = tuple(sorted(ranks))
    if max_writers is None or max_writers >= len(ranks):
        return ranks
    n = max(1, max_writers)
    return tuple(ranks[i * len(ranks) // n] for i in range(n))


def assign_writers(
    key_holders: Mapping[str, Sequence[int]],
    key_bytes: Mapping[str, int],
    *,
    max_writers: int | None = None,
    world: Sequence[int] | None = None,
) -> dict[str, int]:
    """``{hf_key: writer rank}``, balancing written bytes over the ranks that hold each key.

    A key can be written by any rank whose save output covers it (every rank under a full save; the
    ranks holding that key's experts under ``preserve``). Keys are placed largest first on the candidate
    with the fewest bytes so far (ties: lowest rank), restricted to a pool of at most ``max_writers``
    ranks spread over ``world`` (default: every holder). The result depends only on the layout and policy,
    so every rank computes the same assignment.
    """
    every = sorted(set(world) if world is not None else {r for h in key_holders.values() for r in h})
    pool = set(writer_pool(every, max_writers))
    load: dict[int, int] = {}
    out: dict[str, int] = {}
    order = sorted(key_holders, key=lambda k: (-key_bytes.get(k, 0), k))
    heaps: dict[int, tuple[list[tuple[int, int]], tuple[int, ...]]] = {}
    for key in order:
        holders = key_holders[key]
        entry = heaps.get(id(holders))
        if entry is None:
            candidates = tuple(r for r in holders if r in pool) or tuple(holders)
            heap = [(load.get(r, 0), r) for r in candidates]
            heapq.heapify(heap)
            entry = heaps[id(holders)] = (heap, tuple(holders))
        heap = entry[0]
        while True:  # lazy heap: skip entries whose load changed through another candidate set
            bytes_so_far, rank = heapq.heappop(heap)
            if bytes_so_far == load.get(rank, 0):
                break
            heapq.heappush(heap, (load.get(rank, 0), rank))
        out[key] = rank
        load[rank] = bytes_so_far + key_bytes.get(key, 0)
        heapq.heappush(heap, (load[rank], rank))
    return {k: out[k] for k in key_holders}


def key_holders(plans_by_rank: Mapping[int, Sequence[HFSavePlan]]) -> dict[str, tuple[int, ...]]:
    """``{hf_key: ranks whose save output covers it}``; keys with the same holders share one tuple."""
    holders: dict[str, list[int]] = {}
    for rank in sorted(plans_by_rank):
        for plan in plans_by_rank[rank]:
            for key in plan.hf_keys:
                holders.setdefault(key, []).append(rank)
    interned: dict[tuple[int, ...], tuple[int, ...]] = {}
    return {k: interned.setdefault(tuple(v), tuple(v)) for k, v in holders.items()}


def key_nbytes(plan: HFSavePlan) -> dict[str, int]:
    """Bytes each key of a save plan's output occupies on disk."""
    shape = list(plan.output_shape)
    if plan.fused_dim is not None and plan.hf_keys:
        shape[plan.fused_dim] //= len(plan.hf_keys)
    numel = math.prod(shape)
    return {k: numel * d.itemsize for k, d in zip(plan.hf_keys, plan.key_dtypes)}
