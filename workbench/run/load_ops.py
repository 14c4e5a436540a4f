"""Executing an HFLoadPlan: copy the owned slices of HF tensors into a local tensor."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from workbench.errors import PlanError
from workbench.plan.casts import check_fits
from workbench.plan.load_plan import Adapter, HFLoadPlan

__all__ = ["SliceReader", "execute_load", "prepare_target", "reader_from_tensors"]

# (hf_key, slices or None for the whole key) -> tensor
SliceReader = Callable[[str, tuple[slice, ...] | None], torch.Tensor]


def reader_from_tensors(hf_tensors: Mapping[str, torch.Tensor]) -> SliceReader:
    """A reader over in-memory HF tensors (the simulated world; tests)."""

    def read(key: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        if key not in hf_tensors:
            raise PlanError(f"HF key {key!r} is not in the checkpoint")
        tensor = hf_tensors[key]
        return tensor if index is None else tensor[index]

    return read


def prepare_target(plan: HFLoadPlan, out: torch.Tensor) -> None:
    """Check that ``out`` is the local tensor ``plan`` fills (its shape), and zero it where the plan pads it."""
    if tuple(out.shape) != plan.target_shape:
        raise PlanError(
            f"parameter {plan.name!r}, rank {plan.rank}: local tensor has shape {tuple(out.shape)}, the plan "
            f"expects {plan.target_shape}"
        )
    if plan.zero_fill:
        out.zero_()


def execute_load(
    plan: HFLoadPlan,
    read: SliceReader,
    out: torch.Tensor,
    adapters: Mapping[str, Adapter] | None = None,
    *,
    cast: bool = True,
    non_blocking: bool = False,
) -> torch.Tensor:
    """Fill ``out`` (the rank's local tensor) from the checkpoint as ``plan`` says; returns ``out``.

    Keys with an adapter are read whole and canonicalized before slicing; all others are read by slice.
    Tail padding is zeroed. ``cast=True`` converts values ``out``'s dtype holds, and raises ``CheckpointError`` on
    one it does not (``plan.casts.check_fits``: it would wrap, saturate or become inf). ``cast=False``: an
    adapter's output of another dtype than ``out`` is an error (the checkpoint check cannot see it), not a silent
    conversion. ``non_blocking``: copies from pinned host memory
    into a GPU tensor are queued on the current stream (the caller synchronizes before using ``out``).
    """
    prepare_target(plan, out)
    canonical: dict[str, torch.Tensor] = {}
    for r in plan.reads:
        adapter = (adapters or {}).get(r.hf_key)
        if adapter is None:
            piece = read(r.hf_key, r.key_slices())
        else:
            if r.hf_key not in canonical:
                whole = adapter(r.hf_key, read(r.hf_key, None))
                if tuple(whole.shape) != plan.key_shape:
                    raise PlanError(
                        f"parameter {plan.name!r}: adapter for {r.hf_key!r} returned shape {tuple(whole.shape)}, "
                        f"the layout's canonical key shape is {plan.key_shape}"
                    )
                if not cast and whole.dtype != out.dtype:
                    raise PlanError(
                        f"parameter {plan.name!r}, rank {plan.rank}: adapter for {r.hf_key!r} returned {whole.dtype}, "
                        f"the model's tensor is {out.dtype} (pass cast=True to convert)"
                    )
                canonical[r.hf_key] = whole
            piece = canonical[r.hf_key][r.key_slices()]
        if tuple(piece.shape) != r.sizes:
            raise PlanError(
                f"parameter {plan.name!r}: HF key {r.hf_key!r} gave a slice of shape {tuple(piece.shape)} for "
                f"{r.key_slices()}, expected {r.sizes}; is the key smaller than the layout says?"
            )
        if cast:
            check_fits(piece, out.dtype, f"{r.hf_key}, read into the model's {plan.name!r} on rank {plan.rank}")
        out[r.local_slices()].copy_(piece, non_blocking=non_blocking)
    return out
