"""Parameters that share memory (tied weights) in a load: each is filled from its own key, and they must agree.

A module with ``head.weight = embed.weight`` has two parameters, two checkpoint keys and one tensor. Filling both
into that tensor left the key read last in both, silently. So a load reads every tied parameter after the first
into a tensor of its own (``untie``), and once the reads are done checks that it holds what the first holds
(``tie_problem``): equal keys (what a save of a tied model writes) load as before; different ones are an error
naming both parameters. Tensors that overlap without being the same view are refused before anything is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from workbench.errors import CheckpointError

__all__ = ["tie_problem", "untie"]


Ties = tuple[tuple[str, str], ...]  # (a tied parameter, the first parameter it shares its tensor with)


def untie(targets: Mapping[str, torch.Tensor], rank: int) -> tuple[dict[str, torch.Tensor], Ties]:
    """``targets`` with every tied parameter after the first given a tensor of its own, and the ``(parameter, the one
    it is tied to)`` pairs; a copy of ``targets`` as it was when nothing shares memory.

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
    for names in by_storage.values():
        firsts: list[str] = []
        for name in names:
            t = targets[name]
            same = next((f for f in firsts if _same_view(targets[f], t)), None)
            if same is not None:
                out[name] = torch.empty_like(t)
                ties.append((name, same))
                continue
            other = next((f for f in firsts if _overlap(targets[f], t)), None)
            if other is not None:
                raise CheckpointError(
                    f"rank {rank}: parameters {other!r} {tuple(targets[other].shape)} and {name!r} {tuple(t.shape)} "
                    "overlap in memory without being the same tensor: a load would fill the shared elements from "
                    "whichever key came last; give them separate tensors")
            firsts.append(name)
    return out, tuple(ties)


def tie_problem(ties: Ties, targets: Mapping[str, torch.Tensor], layout: Any, rank: int) -> CheckpointError | None:
    """None when every tied parameter's own tensor (``untie``) holds what its first holds, else an error naming
    the first pair that differs, with their keys."""
    for name, first in ties:
        if not torch.equal(targets[name], targets[first]):
            keys = " and ".join(", ".join(layout.specs[n].hf_keys) for n in (first, name))
            return CheckpointError(
                f"rank {rank}: parameters {first!r} and {name!r} share one tensor (tied weights), but the checkpoint's "
                f"{keys} hold different values: one tensor cannot hold both; untie the parameters, or load a "
                "checkpoint whose tied keys are equal")
    return None


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of the storage that ``t`` touches (two views interleaved in one buffer have overlapping
    ranges: they are refused, though no element is shared)."""
    size = t.element_size()
    start = t.storage_offset() * size
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1
    return start, start + extent * size


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.storage_offset(), a.shape, a.stride(), a.dtype) == (b.storage_offset(), b.shape, b.stride(), b.dtype)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1
