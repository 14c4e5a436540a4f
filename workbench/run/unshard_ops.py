"""Tensor operations of an unshard step, shared by every executor (simulated or torch.distributed)."""

from __future__ import annotations

import math
from collections.abc import Container, Iterator, Sequence

import torch

from workbench.errors import PlanError
from workbench.plan.save_plan import HFSavePlan
from workbench.plan.schedule import GatherItem

__all__ = ["finalize", "iter_keys", "merge", "merge_in_place", "pack", "split_keys", "unpack"]


def pack(tensors: Sequence[torch.Tensor], items: Sequence[GatherItem], dtype: torch.dtype) -> torch.Tensor:
    """One flat send buffer: each tensor zero-padded to its item's ``padded_shape``, flattened, concatenated."""
    total = sum(math.prod(i.padded_shape) for i in items)
    device = tensors[0].device if tensors else "cpu"
    flat = torch.empty(total, dtype=dtype, device=device)
    offset = 0
    for tensor, item in zip(tensors, items):
        n = math.prod(item.padded_shape)
        view = flat[offset : offset + n].view(item.padded_shape)
        if tuple(tensor.shape) == item.padded_shape:
            view.copy_(tensor)
        else:
            view.zero_()
            view[tuple(slice(0, s) for s in tensor.shape)].copy_(tensor)
        offset += n
    return flat


def unpack(gathered: torch.Tensor, items: Sequence[GatherItem], world: int) -> list[list[torch.Tensor]]:
    """Views ``chunks[item][rank]`` into a gathered buffer laid out ``[rank][item]``."""
    per_rank = sum(math.prod(i.padded_shape) for i in items)
    if gathered.numel() != per_rank * world:
        raise PlanError(f"gathered buffer has {gathered.numel()} elements, expected {world} x {per_rank}")
    out: list[list[torch.Tensor]] = [[] for _ in items]
    for r in range(world):
        offset = r * per_rank
        for k, item in enumerate(items):
            n = math.prod(item.padded_shape)
            out[k].append(gathered[offset : offset + n].view(item.padded_shape))
            offset += n
    return out


def merge(chunks: Sequence[torch.Tensor], item: GatherItem) -> torch.Tensor:
    """Undo one cut from every rank's (padded) chunk, in group-rank order, into one new tensor (no temporaries).

    Contiguous: rank ``r``'s chunk goes to rows ``r * chunk, ...`` along the dim, cut short at the length before
    the cut (the collective padding is dropped). Interleaved: rank ``r`` holds runs ``r, r + W, ...``, so the
    runs are put back run-major.
    """
    dim, n = item.dim, item.merged_shape[item.dim]
    world = len(chunks)
    first = chunks[0]
    shape = (*first.shape[:dim], n, *first.shape[dim + 1:])
    out = torch.empty(shape, dtype=first.dtype, device=first.device)
    if item.interleave_factor == 1:
        offset = 0
        for chunk in chunks:
            take = min(chunk.shape[dim], n - offset)
            if take <= 0:
                break
            out.narrow(dim, offset, take).copy_(chunk.narrow(dim, 0, take))
            offset += take
        if offset != n:
            raise PlanError(f"gathered chunks of {item.name!r} hold {offset} of {n} rows along dim {dim}")
        return out
    factor = item.interleave_factor
    run = n // (world * factor)
    offset = 0
    for j in range(factor):
        for r in range(world):
            out.narrow(dim, offset, run).copy_(chunks[r].narrow(dim, j * run, run))
            offset += run
    return out


def merge_in_place(gathered: torch.Tensor, item: GatherItem, world: int) -> torch.Tensor | None:
    """The merged tensor as a view of the gathered buffer, when one contiguous dim-0 cut is undone alone."""
    if item.dim != 0 or item.interleave_factor != 1:
        return None
    shape = (world * item.padded_shape[0], *item.padded_shape[1:])
    return gathered.view(shape).narrow(0, 0, item.merged_shape[0])


def finalize(tensor: torch.Tensor, plan: HFSavePlan) -> torch.Tensor:
    """Check the fully unsharded tensor and trim tail (FP8) padding to the checkpoint-visible shape."""
    if tuple(tensor.shape) != plan.runtime_output_shape:
        raise PlanError(
            f"parameter {plan.name!r}, rank {plan.rank}: after unsharding the tensor has shape "
            f"{tuple(tensor.shape)}, expected {plan.runtime_output_shape}"
        )
    if plan.output_shape != plan.runtime_output_shape:
        tensor = tensor[tuple(slice(0, s) for s in plan.output_shape)]
    return tensor.contiguous()


def split_keys(tensor: torch.Tensor, plan: HFSavePlan) -> dict[str, torch.Tensor]:
    """The output tensor as ``{hf_key: tensor}`` (split along the fused dim), each in its save dtype.

    A rank whose output covers no key (it holds only padding under a preserving policy) writes nothing.
    """
    return dict(iter_keys(tensor, plan))


def iter_keys(
    tensor: torch.Tensor, plan: HFSavePlan, keys: Container[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``split_keys`` one key at a time, made when asked for, and only the keys in ``keys`` (default: every key): a
    key whose save dtype is not the output's, or whose piece is not contiguous (a cut on a later dim), is a copy
    (``schedule``'s model counts one at a time)."""
    if not plan.hf_keys:
        return
    if plan.fused_dim is None or len(plan.hf_keys) == 1:
        if keys is None or plan.hf_keys[0] in keys:
            yield plan.hf_keys[0], tensor.to(plan.key_dtypes[0]).contiguous()
        return
    pieces = tensor.chunk(len(plan.hf_keys), dim=plan.fused_dim)
    for key, piece, dtype in zip(plan.hf_keys, pieces, plan.key_dtypes):
        if keys is None or key in keys:
            yield key, piece.to(dtype).contiguous()
