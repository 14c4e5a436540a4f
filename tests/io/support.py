"""Helpers for the io tests: build real checkpoints in a temporary directory."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from workbench.io.files.file_plan import FilePlan, plan_files
from workbench.io.files.index import INDEX_NAME, write_index
from workbench.io.files.staging import StagingRing
from workbench.io.files.write import write_safetensors


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaNs and infs included for floats), or 0/1 for bool."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bit-exact comparison (NaN == NaN)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def save_checkpoint(
    directory: Path,
    tensors: Mapping[str, torch.Tensor],
    writers: Mapping[str, int] | None = None,
    *,
    max_shard_bytes: int = 10**9,
    metadata: Mapping[str, str] | None = None,
) -> FilePlan:
    """Write ``tensors`` as an indexed checkpoint into ``directory`` (created); return the plan."""
    directory.mkdir(parents=True, exist_ok=True)
    writers = dict(writers) if writers is not None else dict.fromkeys(tensors, 0)
    plan = plan_files(
        writers, {k: nbytes(t) for k, t in tensors.items()}, list(tensors), max_shard_bytes=max_shard_bytes
    )
    for spec in plan.files:
        write_safetensors(directory / spec.name, {k: tensors[k] for k in spec.keys}, metadata)
    write_index(directory, plan)
    return plan


def edit_index(directory: Path, edit) -> None:
    """Rewrite the index json through ``edit(body) -> None``."""
    path = directory / INDEX_NAME
    body = json.loads(path.read_text())
    edit(body)
    path.write_text(json.dumps(body, indent=2))


def small_model() -> dict[str, torch.Tensor]:
    """A few keys of mixed dtypes and shapes."""
    return {
        "model.embed_tokens.weight": random_tensor((8, 4), torch.bfloat16, 1),
        "model.layers.0.mlp.gate_up_proj.weight": random_tensor((6, 4), torch.float32, 2),
        "model.layers.0.input_layernorm.weight": random_tensor((4,), torch.float16, 3),
        "model.layers.0.step": random_tensor((), torch.int64, 4),
        "model.layers.0.mask": random_tensor((3, 5), torch.bool, 5),
        "lm_head.weight": random_tensor((8, 4), torch.bfloat16, 6),
    }


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every key of a checkpoint directory, read back whole."""
    from workbench.io.files.read import CheckpointReader

    with CheckpointReader(path) as reader:
        keys = reader.keys()
        return {k: reader.read(k) for k in keys}


def all_slots_free(ring: StagingRing) -> bool:
    """Whether every slot of ``ring`` is free now (taken with try_take, then given back)."""
    taken = []
    while (slot := ring.try_take()) is not None:
        taken.append(slot)
    for slot in taken:
        ring.give(slot)
    return len(taken) == ring.slots and len({id(s) for s in taken}) == ring.slots
