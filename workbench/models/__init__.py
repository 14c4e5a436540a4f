"""Model families: HF key maps, canonical adapters, and small sharded models for tests and demos."""

from workbench.models.qwen3_moe import Qwen3MoeShape, build_qwen3_moe, qwen3_moe_hf_shapes, qwen3_moe_key_map

__all__ = ["Qwen3MoeShape", "build_qwen3_moe", "qwen3_moe_hf_shapes", "qwen3_moe_key_map"]
