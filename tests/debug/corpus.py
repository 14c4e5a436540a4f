"""Generated corpus for the debug tests: healthy checkpoints and broken copies, built in a temp dir."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from tests.io.support import save_checkpoint
from workbench.io.files.index import INDEX_NAME


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small HF-like model: fused gate_up, experts, a norm, a square and a non-square weight."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "model.embed_tokens.weight": r(16, 8),
        "model.layers.0.mlp.gate_up_proj.weight": r(12, 6),
        "model.layers.0.mlp.down_proj.weight": r(6, 10),
        "model.layers.0.self_attn.o_proj.weight": r(8, 8),
        "model.layers.0.mlp.experts.0.gate_proj.weight": r(4, 6),
        "model.layers.0.mlp.experts.0.up_proj.weight": r(4, 6),
        "model.norm.weight": r(8, dtype=torch.float32),
        "lm_head.weight": r(24, 8),
    }


def write(directory: Path, tensors: Mapping[str, torch.Tensor], **kwargs) -> Path:
    save_checkpoint(directory, {k: v.contiguous() for k, v in tensors.items()}, **kwargs)
    return directory


def broken(root: Path, name: str, edit: Callable[[dict[str, torch.Tensor]], None], seed: int = 0) -> Path:
    """A copy of ``model(seed)`` with ``edit`` applied, written to ``root / name``."""
    tensors = {k: v.clone() for k, v in model(seed).items()}
    edit(tensors)
    return write(root / name, tensors)


def edit_index(directory: Path, edit: Callable[[dict], None]) -> None:
    path = directory / INDEX_NAME
    body = json.loads(path.read_text())
    edit(body)
    path.write_text(json.dumps(body))


def first_file(directory: Path) -> Path:
    return sorted(directory.glob("*.safetensors"))[0]
