"""Qwen3-MoE: the HF key map of a fused-expert runtime, and a sharded parameter-only model built from it.

Runtime layout (what training code holds, XTuner-style): each layer's experts are two fused tensors,

* ``layers.{i}.mlp.experts.fused_w1w3``: ``[E * 2 * I, H]`` = for every expert, gate rows then up rows;
  HF keys ``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` and ``...up_proj.weight`` fused on dim 0;
* ``layers.{i}.mlp.experts.fused_w2``: ``[E * H, I]``, the experts' ``down_proj.weight`` fused on dim 0.

``build_qwen3_moe`` lays a model out on a (fsdp, ep, etp) device mesh the way expert-parallel training does:
experts split over EP, every expert's gate and up split over expert TP with an ``InterleavedShard``
(column parallel), ``down_proj`` split on its input dim (row parallel), and FSDP2's ``fully_shard`` over
``fsdp`` on top. The parameters hold no values yet; ``wb.load_hf`` fills them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workbench.layout.key_map import HFKeys

__all__ = ["Qwen3MoeShape", "build_qwen3_moe", "qwen3_moe_hf_shapes", "qwen3_moe_key_map"]

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


@dataclass(frozen=True, slots=True)
class Qwen3MoeShape:
    """The sizes of a Qwen3-MoE model (the fields of its HF config that shape the weights)."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int

    @classmethod
    def from_config(cls, config: Any) -> Qwen3MoeShape:
        """Read the sizes from a transformers ``Qwen3MoeConfig`` (or any object with these attributes)."""
        return cls(**{f: getattr(config, f) for f in cls.__slots__})


def qwen3_moe_key_map(num_experts: int) -> Callable[[str], HFKeys | str]:
    """Runtime name -> HF key(s) for the fused-expert Qwen3-MoE runtime of ``build_qwen3_moe``."""

    def key_map(name: str) -> HFKeys | str:
        if name == "lm_head.weight":
            return name
        match = _LAYER.fullmatch(name)
        if match and match.group(2) == "mlp.experts.fused_w1w3":
            prefix = f"model.layers.{match.group(1)}.mlp.experts"
            keys = [f"{prefix}.{e}.{proj}_proj.weight" for e in range(num_experts) for proj in ("gate", "up")]
            return HFKeys(tuple(keys), fused_dim=0)
        if match and match.group(2) == "mlp.experts.fused_w2":
            prefix = f"model.layers.{match.group(1)}.mlp.experts"
            return HFKeys(tuple(f"{prefix}.{e}.down_proj.weight" for e in range(num_experts)), fused_dim=0)
        return f"model.{name}"

    return key_map


def qwen3_moe_hf_shapes(shape: Qwen3MoeShape) -> dict[str, tuple[int, ...]]:
    """Every HF key of a Qwen3-MoE checkpoint with its shape (per-expert keys, untied lm_head)."""
    h, i, hd = shape.hidden_size, shape.moe_intermediate_size, shape.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for n in range(shape.num_hidden_layers):
        p = f"model.layers.{n}"
        out.update({
            f"{p}.self_attn.q_proj.weight": (shape.num_attention_heads * hd, h),
            f"{p}.self_attn.k_proj.weight": (shape.num_key_value_heads * hd, h),
            f"{p}.self_attn.v_proj.weight": (shape.num_key_value_heads * hd, h),
            f"{p}.self_attn.o_proj.weight": (h, shape.num_attention_heads * hd),
            f"{p}.self_attn.q_norm.weight": (hd,),
            f"{p}.self_attn.k_norm.weight": (hd,),
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.mlp.gate.weight": (shape.num_experts, h),
        })
        for e in range(shape.num_experts):
            out.update({
                f"{p}.mlp.experts.{e}.gate_proj.weight": (i, h),
                f"{p}.mlp.experts.{e}.up_proj.weight": (i, h),
                f"{p}.mlp.experts.{e}.down_proj.weight": (h, i),
            })
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (shape.vocab_size, h)
    return out


class _Experts(nn.Module):
    def __init__(self, w1w3: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.fused_w1w3 = nn.Parameter(w1w3, requires_grad=False)
        self.fused_w2 = nn.Parameter(w2, requires_grad=False)


def build_qwen3_moe(
    shape: Qwen3MoeShape,
    device_mesh: Any,
    *,
    dtype: torch.dtype = torch.bfloat16,
    norm_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """A parameter-only Qwen3-MoE laid out on ``device_mesh`` with dims ("fsdp", "ep", "etp").

    Expert weights are DTensors on the (ep, etp) sub-mesh, then every module is ``fully_shard``-ed over fsdp
    (norms in their own FSDP groups, kept in ``norm_dtype``). Values are uninitialized.

    .. note:: SPMD: every rank of the mesh calls it, with the same arguments.
    """
    from torch.distributed.tensor import DTensor, Shard

    from workbench import _compat
    from workbench.layout import InterleavedShard, LoadSpec
    from workbench.mesh import MeshSpec

    ep = device_mesh["ep"].size()
    if shape.num_experts % ep:
        raise ValueError(f"{shape.num_experts} experts do not split over ep={ep}")
    sub = device_mesh["ep", "etp"]
    sub_spec = MeshSpec.from_device_mesh(sub)
    me = sub.get_rank()
    local_experts = shape.num_experts // ep
    h, i, e = shape.hidden_size, shape.moe_intermediate_size, shape.num_experts
    w1w3_placements = (Shard(0), InterleavedShard(0, num_local_stripes=2 * local_experts))
    w2_placements = (Shard(0), Shard(1))

    def expert_param(global_shape: tuple[int, int], placements: tuple[Any, ...]) -> torch.Tensor:
        local = LoadSpec.from_placements("expert", "expert", global_shape, sub_spec, placements).local_shape(me)
        return DTensor.from_local(torch.empty(local, dtype=dtype, device=device), sub, placements, run_check=False,
                                  shape=torch.Size(global_shape), stride=_contiguous_stride(global_shape))

    def linear(rows: int, cols: int) -> nn.Linear:
        layer = nn.Linear(cols, rows, bias=False, device="meta")
        layer.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device), requires_grad=False)
        return layer

    def norm(size: int) -> nn.Module:
        module = nn.Module()
        module.weight = nn.Parameter(torch.empty(size, dtype=norm_dtype, device=device), requires_grad=False)
        return module

    model = nn.Module()
    model.embed_tokens = nn.Embedding(shape.vocab_size, h, device="meta")
    model.embed_tokens.weight = nn.Parameter(torch.empty(shape.vocab_size, h, dtype=dtype, device=device),
                                             requires_grad=False)
    model.layers = nn.ModuleList()
    for _ in range(shape.num_hidden_layers):
        layer = nn.Module()
        attn = nn.Module()
        attn.q_proj = linear(shape.num_attention_heads * shape.head_dim, h)
        attn.k_proj = linear(shape.num_key_value_heads * shape.head_dim, h)
        attn.v_proj = linear(shape.num_key_value_heads * shape.head_dim, h)
        attn.o_proj = linear(h, shape.num_attention_heads * shape.head_dim)
        attn.q_norm = norm(shape.head_dim)
        attn.k_norm = norm(shape.head_dim)
        layer.self_attn = attn
        layer.input_layernorm = norm(h)
        layer.post_attention_layernorm = norm(h)
        mlp = nn.Module()
        mlp.gate = linear(e, h)
        mlp.experts = _Experts(expert_param((e * 2 * i, h), w1w3_placements), expert_param((e * h, i), w2_placements))
        layer.mlp = mlp
        model.layers.append(layer)
    model.norm = norm(h)
    model.lm_head = linear(shape.vocab_size, h)
    fsdp = device_mesh["fsdp"]
    norms = [m for name, m in model.named_modules() if name.endswith("norm") or name.endswith("layernorm")]
    for module in norms:
        _compat.fully_shard(module, mesh=fsdp)
    for layer in model.layers:
        _compat.fully_shard(layer, mesh=fsdp)
    _compat.fully_shard(model, mesh=fsdp)
    return model


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= size
    return tuple(reversed(out))
