"""Parameters that share memory (tied weights) in a load: each is filled from its own key, and they must agree.

A module with ``head.weight = embed.weight`` has two parameters, two checkpoint keys and one tensor. Filling both
into that tensor left the key read last in both, silently. So a load reads every tied parameter after the first
into a tensor of its own (``untie``), and once the reads are done checks that it holds what the first holds, bit
for bit (``tie_problem``): equal keys (what a save of a tied model writes) load as before; different ones are an
error naming both parameters. Only the parameters a load fills are untied: a checkpoint that stores one key of the
tie (HF's ``tie_word_embeddings``, loaded with ``strict=False``) fills the shared tensor from it. Tensors that
overlap without being the same view are refused before anything is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from workbench.errors import CheckpointError
from workbench.io.files.stream_write import byte_view

__all__ = ["tie_problem", "untie"]


Ties = tuple[tuple[str, str], ...]  # (a tied parameter, the first parameter it shares its tensor with)


def untie(targets: Mapping[str, torch.Tensor], rank: int) -> tuple[dict[str, torch.Tensor], Ties]:
    """``targets`` with every tied parameter after the first given a tensor of its own, and the ``(parameter, the one
    it is tied to)`` pairs; a copy of ``targets`` as it was when nothing shares memory. Pass only the parameters the
    load fills: one it skips (a key missing under ``strict=False``) keeps the shared tensor to the one it is tied to.

    Raises:
        CheckpointError: two parameters' tensors overlap in memory without being the same view (naming both).
    """
    by_storage: dict[tuple[torch.device, int], list[str]] = {}
    for name, t in targets.items():
        if t.numel():
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(name)
    if all(len(names) == 1 for names in by_storage.values()):
        return dict(targets), ()
    out, ties = dict(targets), []
    order = {name: i for i, name in enumerate(targets)}
    for names in by_storage.values():
        firsts: dict[tuple, str] = {}  # each distinct view of the storage -> the first parameter that is it
        for name in names:
            t = targets[name]
            first = firsts.setdefault(_view_key(t), name)
            if first != name:
                out[name] = torch.empty_like(t)
                ties.append((name, first))
        _refuse_overlaps(targets, sorted(firsts.values(), key=order.__getitem__), rank)
    return out, tuple(ties)


def _refuse_overlaps(targets: Mapping[str, torch.Tensor], names: list[str], rank: int) -> None:
    """Raise where two of ``names`` (distinct views of one storage, in the targets' order) overlap: sorted by where
    their spans start, one sweep against the furthest end seen so far finds a pair if any exists (a view meets
    some earlier one exactly when it starts before that end), in O(n log n), where comparing every pair took a
    minute for the 8,000 views of one flat buffer (FSDP1's ``use_orig_params``)."""
    spans = sorted((*_span(targets[n]), i) for i, n in enumerate(names))
    furthest, owner = -1, -1
    for start, end, i in spans:
        if start < furthest:
            first, later = sorted((owner, i))
            a, b = names[first], names[later]
            raise CheckpointError(
                f"rank {rank}: parameters {a!r} {tuple(targets[a].shape)} and {b!r} {tuple(targets[b].shape)} "
                "overlap in memory without being the same tensor: a load would fill the shared elements from "
                "whichever key came last; give them separate tensors")
        if end > furthest:
            furthest, owner = end, i


def tie_problem(ties: Ties, targets: Mapping[str, torch.Tensor], layout: Any, rank: int) -> CheckpointError | None:
    """None when every tied parameter's own tensor (``untie``) holds what its first holds, bit for bit (two equal
    keys holding a NaN are equal: what a tied save writes), else an error naming the first pair that differs, with
    their keys."""
    for name, first in ties:
        if not _same_bits(targets[name], targets[first]):
            keys = " and ".join(", ".join(layout.specs[n].hf_keys) for n in (first, name))
            return CheckpointError(
                f"rank {rank}: parameters {first!r} and {name!r} share one tensor (tied weights), but the checkpoint's "
                f"{keys} hold different values: one tensor cannot hold both; untie the parameters, or load a "
                "checkpoint whose tied keys are equal")
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (one shape and dtype) hold the same bytes: ``torch.equal`` calls NaN unequal to
    itself."""
    return torch.equal(byte_view(a), byte_view(b))


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of the storage that ``t`` touches (two views interleaved in one buffer have overlapping
    ranges: they are refused, though no element is shared)."""
    size = t.element_size()
    start = t.storage_offset() * size
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1
    return start, start + extent * size


def _view_key(t: torch.Tensor) -> tuple:
    """What makes two tensors of one storage the same view."""
    return (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
