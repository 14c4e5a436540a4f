"""Reference tensors and hand-made cuts for the DCP tests, written without workbench's layout code.

Every reference value comes from a seeded generator keyed by the parameter's name; every rank's expected local
tensor is cut from it by hand, with the builder's cuts in the order they apply (the same recipe as
``tests/dist/test_save_load_hf.py``). DTensor's ``full_tensor()`` is no oracle here: it does not undo an
interleaved shard under FSDP2.
"""

from __future__ import annotations

import zlib

import torch

from workbench.models import Qwen3MoeShape

__all__ = ["SHAPE", "STATE_KINDS", "cut_by_hand", "reference", "reference_step"]

# 4 experts x (gate 4 + up 4) rows = 32 rows of fused_w1w3; EP2 x ETP2 gives each rank 4 runs of 2 rows
SHAPE = Qwen3MoeShape(vocab_size=32, hidden_size=8, moe_intermediate_size=4, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_experts=4)
STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")


def reference(name: str, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The full reference tensor of ``name`` (a parameter or one of its Adam moments)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{kind}:{name}".encode()))
    values = torch.randn(shape, generator=generator)
    if kind == "exp_avg_sq":
        values = values.abs()
    return values.to(dtype)


def reference_step(name: str) -> torch.Tensor:
    """Adam's scalar ``step`` for ``name`` (different per parameter, so a mix-up shows)."""
    return torch.tensor(float(1 + zlib.crc32(name.encode()) % 97))


def cut_by_hand(full: torch.Tensor, name: str, mesh_shape: tuple[int, int, int], rank: int,
                num_experts: int) -> torch.Tensor:
    """The local tensor ``rank`` of a (fsdp, ep, etp) mesh holds of ``full`` under ``build_qwen3_moe``'s layout.

    Cuts, in the order they apply: experts over ep (dim 0); then etp (``fused_w1w3``: an even interleave of its
    ``2 x local experts`` stripes; ``fused_w2``: dim 1); then FSDP2's chunk of dim 0, last. Other parameters:
    FSDP2's chunk of dim 0.
    """
    fsdp, ep, etp = mesh_shape
    coords = {"fsdp": rank // (ep * etp), "ep": rank // etp % ep, "etp": rank % etp}
    sizes = {"fsdp": fsdp, "ep": ep, "etp": etp}
    if name.endswith("fused_w1w3"):
        cuts = [(0, "ep", 1), (0, "etp", 2 * num_experts // ep), (0, "fsdp", 1)]
    elif name.endswith("fused_w2"):
        cuts = [(0, "ep", 1), (1, "etp", 1), (0, "fsdp", 1)]
    else:
        cuts = [(0, "fsdp", 1)]
    want = full
    for dim, mesh_dim, stripes in cuts:
        size, me, n = sizes[mesh_dim], coords[mesh_dim], want.shape[dim]
        if stripes == 1:  # PyTorch's chunk rule
            chunk = -(-n // size)
            start = min(me * chunk, n)
            want = want.narrow(dim, start, max(0, min(chunk, n - start)))
        else:  # rank r holds runs r, r + W, ... of the W x F runs
            run = n // (size * stripes)
            want = torch.cat([want.narrow(dim, (j * size + me) * run, run) for j in range(stripes)], dim=dim)
    return want
