"""HFLoadPlan: what one rank reads from which HF keys, and where it lands in its local tensor."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from workbench.display import html_of
from workbench.errors import PlanError
from workbench.layout.load_spec import KeyRegion, LoadSpec

__all__ = ["Adapter", "HFLoadPlan", "KeyRead", "plan_hf_load"]

# HF -> canonical, per key: (hf_key, the key's whole HF tensor) -> the key's canonical tensor (shape
# ``expected_key_shape(spec)``); e.g. GPT-OSS's gate_up_proj transpose and gate/up de-interleave. A key with
# an adapter is read whole (slicing must wait until the canonical layout exists).
Adapter = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class KeyRead:
    """Read ``sizes`` elements at ``key_offset`` of ``hf_key`` and copy them to ``local_offset``."""

    hf_key: str
    key_offset: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offset: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements read."""
        return math.prod(self.sizes)

    def key_slices(self) -> tuple[slice, ...]:
        """Index of the read in the key's tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.key_offset, self.sizes))

    def local_slices(self) -> tuple[slice, ...]:
        """Index of the destination in the local tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.local_offset, self.sizes))


@dataclass(frozen=True, slots=True, kw_only=True)
class HFLoadPlan:
    """One rank's program for loading one parameter from HF tensors.

    ``reads`` are exact: together they hold precisely the checkpoint-visible elements the rank owns, so
    bytes read equal bytes owned. Elements of the local tensor no read covers are tail padding
    (``origin_shape < global_shape``) and are zeroed when ``zero_fill``.
    """

    name: str
    rank: int
    target_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    reads: tuple[KeyRead, ...]
    zero_fill: bool

    @property
    def hf_keys(self) -> tuple[str, ...]:
        """Keys this rank reads, in first-use order (may be empty)."""
        return tuple(dict.fromkeys(r.hf_key for r in self.reads))

    @property
    def numel_read(self) -> int:
        """Elements read from the checkpoint."""
        return sum(r.numel for r in self.reads)

    def _repr_html_(self) -> str | None:
        """HTML for notebooks, from the renderer ``workbench.viz`` registers (``workbench.display``)."""
        return html_of(self)

    def __str__(self) -> str:
        from workbench.units import format_count

        padding = ", zero padding" if self.zero_fill else ""
        lines = [
            f"HFLoadPlan {self.name!r} rank {self.rank}: local {self.target_shape}, "
            f"{len(self.reads)} read(s), {format_count(self.numel_read)} elements{padding}"
        ]
        lines += [f"  {KeyRegion(r.hf_key, r.key_offset, r.sizes, r.local_offset)}" for r in self.reads]
        return "\n".join(lines)


def plan_hf_load(spec: LoadSpec, rank: int, key_shapes: Mapping[str, Sequence[int]] | None = None) -> HFLoadPlan:
    """Compile the load plan of ``spec`` for ``rank``.

    Args:
        spec: the parameter's LoadSpec.
        rank: the global rank.
        key_shapes: the checkpoint's shape of each key, to check against the spec (optional).

    Raises:
        PlanError: a key's shape in the checkpoint differs from what the spec expects.
    """
    key_shape = expected_key_shape(spec)
    if key_shapes is not None:
        for key in spec.hf_keys:
            if key in key_shapes and tuple(key_shapes[key]) != key_shape:
                raise PlanError(
                    f"parameter {spec.name!r}: HF key {key!r} has shape {tuple(key_shapes[key])} in the "
                    f"checkpoint, but the layout expects {key_shape} (global_shape {spec.global_shape}"
                    + (f", origin_shape {spec.origin_shape}" if spec.origin_shape else "")
                    + (f", {len(spec.hf_keys)} keys fused on dim {spec.fused_dim})" if spec.is_fused else ")")
                )
    target = spec.local_shape(rank)
    reads = tuple(KeyRead(r.hf_key, r.key_offset, r.sizes, r.local_offset) for r in spec.key_regions(rank))
    copied = sum(r.numel for r in reads)
    return HFLoadPlan(
        name=spec.name, rank=rank, target_shape=target, key_shape=key_shape, reads=reads,
        zero_fill=copied < math.prod(target),
    )


def expected_key_shape(spec: LoadSpec) -> tuple[int, ...]:
    """Shape each HF key of ``spec`` has in the checkpoint (canonical coordinates)."""
    shape = list(spec.visible_shape)
    if spec.fused_dim is not None:
        shape[spec.fused_dim] = spec.key_size or 0
    return tuple(shape)
