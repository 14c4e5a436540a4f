"""``load_hf``: fill a (sharded) model from a HuggingFace checkpoint, each rank reading only what it owns."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.errors import CheckpointError
from workbench.io.read import CheckpointReader
from workbench.layout.key_map import KeyMap
from workbench.layout.model_layout import Layout, local_tensors
from workbench.plan.load_plan import Adapter, expected_key_shape, plan_hf_load
from workbench.run.load_ops import execute_load

__all__ = ["LoadReport", "load_hf"]


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What one rank loaded: keys, bytes read versus bytes it owns, and what did not match."""

    path: Path
    rank: int
    parameters: int
    bytes_read: int
    bytes_owned: int
    seconds: float
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[str, ...] = ()

    @property
    def read_ratio(self) -> float:
        """Bytes read / bytes owned (1.0: not a byte more than needed)."""
        return self.bytes_read / self.bytes_owned if self.bytes_owned else 1.0

    @property
    def ok(self) -> bool:
        """True when every expected key was found with its expected shape, and no other key was there."""
        return not (self.missing or self.unexpected or self.mismatched)

    def __str__(self) -> str:
        lines = [
            f"loaded {self.parameters} parameters from {self.path} on rank {self.rank}: read {self.bytes_read} "
            f"bytes for {self.bytes_owned} owned ({self.read_ratio:.3f}x) in {self.seconds:.2f} s"
        ]
        for what, keys in (("missing", self.missing), ("unexpected", self.unexpected), ("mis-shaped", self.mismatched)):
            if keys:
                lines.append(f"  {len(keys)} {what}: {list(keys[:5])}{' ...' if len(keys) > 5 else ''}")
        return "\n".join(lines)


def load_hf(
    model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    layout: Layout | None = None,
    key_map: KeyMap | None = None,
    strict: bool = True,
    adapters: Mapping[str, Adapter] | None = None,
    rank: int | None = None,
) -> LoadReport:
    """Load a HuggingFace checkpoint into a model whose parameters are DTensors (or plain tensors), in place.

    Each rank reads, with ``safe_open(...).get_slice``, exactly the slices of each key its local tensors own,
    runs the per-key canonical ``adapters`` (whole keys) first where given, copies into its local shards and
    zeroes tail (FP8) padding. No collective is needed.

    Raises:
        CheckpointError: with ``strict`` (default), one error listing every missing, unexpected and mis-shaped
            key; without it, those parameters are skipped and listed in the report.
    """
    start = time.perf_counter()
    layout = layout or Layout.from_model(model_or_state_dict, key_map)
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
    targets = local_tensors(model_or_state_dict, layout)
    with CheckpointReader(path) as reader:
        present = set(reader.keys())
        expected = layout.hf_keys
        missing = tuple(k for k in expected if k not in present)
        unexpected = tuple(sorted(k for k in present if k not in expected))
        mismatched = []
        for name, spec in layout.specs.items():
            want = expected_key_shape(spec)
            for key in spec.hf_keys:
                if key in present and not (adapters and key in adapters) and reader.shape(key) != want:
                    mismatched.append(f"{key}: checkpoint {reader.shape(key)}, layout of {name!r} expects {want}")
        if strict and (missing or unexpected or mismatched):
            raise CheckpointError(_problem(path, missing, unexpected, mismatched))
        bad = set(missing) | {m.split(":", 1)[0] for m in mismatched}
        loaded = owned = 0
        for name, spec in layout.specs.items():
            if bad.intersection(spec.hf_keys):
                continue
            plan = plan_hf_load(spec, rank)
            execute_load(plan, reader.read, targets[name], adapters)
            owned += sum(
                r.numel * reader.dtype(r.hf_key).itemsize for r in plan.reads if not (adapters and r.hf_key in adapters)
            )
            loaded += 1
        read = reader.bytes_read
    return LoadReport(
        Path(path), rank, loaded, read, owned, time.perf_counter() - start, missing, unexpected, tuple(mismatched)
    )


def _problem(path: str | Path, missing: tuple[str, ...], unexpected: tuple[str, ...], mismatched: list[str]) -> str:
    lines = [f"checkpoint {path} does not match the model's layout:"]
    for what, keys, hint in (
        ("missing from the checkpoint", missing, "check the key map, or load with strict=False"),
        ("in the checkpoint but not in the layout", unexpected, "map them to parameters, or load with strict=False"),
        ("with another shape", tuple(mismatched), "was it saved from another config or with padding?"),
    ):
        if keys:
            shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
            lines.append(f"  {len(keys)} key(s) {what} ({hint}): {shown}")
    return "\n".join(lines)
