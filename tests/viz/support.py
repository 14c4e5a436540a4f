"""Layouts the viz tests draw, and ownership computed independently of the viz code (from ``spec.runs``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch.distributed.tensor import Replicate, Shard

from workbench._compat import make_strided_shard
from workbench.layout import InterleavedShard, LoadSpec
from workbench.mesh import MeshSpec

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "sample_meshes").glob("*.toml"))


def expert_tp_16() -> LoadSpec:
    """DESIGN.md's 16-row example: 2 experts x (gate 4 + up 4) on (fsdp=2, ep=2, tp=2), FSDP2's cut on top."""
    mesh = MeshSpec((2, 2, 2), ("fsdp", "ep", "tp"))
    keys = [f"experts.{e}.{p}_proj.weight" for e in range(2) for p in ("gate", "up")]
    return LoadSpec.from_placements(
        "experts.fused_w1w3", keys, (16, 4), mesh,
        [make_strided_shard(0, 4), Shard(0), InterleavedShard(0, num_local_stripes=2)], fused_dim=0,
    )


def cases() -> dict[str, LoadSpec]:
    """Table of layouts, one edge each."""
    return {
        # interleave + FSDP2's strided cut: rows of one rank are not contiguous
        "expert_tp_16": expert_tp_16(),
        # 10 rows over dp=3 (4,4,2) and 7 cols over tp=2 (4,3): uneven on both dims
        "uneven_dp_tp": LoadSpec.from_placements(
            "w", "w", (10, 7), MeshSpec((3, 2), ("dp", "tp")), [Shard(0), Shard(1)]),
        # 5 rows over 4 ranks: 2,2,1,0 -> an empty rank
        "empty_rank": LoadSpec.from_placements("e", "e", (5, 3), MeshSpec((4,), ("dp",)), [Shard(0)]),
        # HSDP: replicated over the outer dim, sharded over the inner one: two replicas of every element
        "hsdp_replicas": LoadSpec.from_placements(
            "h", "h", (7, 5), MeshSpec((2, 3), ("replicate", "shard")), [Replicate(), Shard(0)]),
        # interleave on dim 1 (column-parallel with stripes along columns)
        "interleave_dim1": LoadSpec.from_placements(
            "i", "i", (4, 16), MeshSpec((2, 2), ("ep", "tp")), [Shard(1), InterleavedShard(1, num_local_stripes=2)]),
        # FP8 tail padding: 12 runtime rows, 10 visible, two keys fused
        "fp8_padding": LoadSpec(
            name="p", hf_keys=("a", "b"), global_shape=(12, 4), origin_shape=(10, 4), fused_dim=0,
            mesh=MeshSpec((4,), ("dp",)), shards=LoadSpec.from_placements(
                "p", "p", (12, 4), MeshSpec((4,), ("dp",)), [Shard(0)]).shards),
        # 1-D tensor
        "vector": LoadSpec.from_placements("v", "v", (9,), MeshSpec((2, 2), ("a", "b")), [Shard(0), Replicate()]),
    }


def owners_from_runs(spec: LoadSpec) -> np.ndarray:
    """The lowest rank holding every element of the global tensor, by writing each rank's runs (-1: none)."""
    owners = np.full(spec.global_shape, -1, dtype=np.int64)
    for rank in sorted(spec.mesh.all_ranks(), reverse=True):
        for run in spec.runs(rank):
            owners[run.global_slices()] = rank
    return owners
