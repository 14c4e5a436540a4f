"""A fused expert tensor whose EP cut ``minimal`` keeps, with one expert's key saved float32 (fp32_keys_pattern):
EP rank 0 gathers its experts in float32, EP rank 1 in bfloat16, while other tensors gather over the EP group. Each
rank plans alone (as save_hf does); the ranks must still batch alike, and the checkpoint hold every key's bytes in
its own dtype."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import Shard

import workbench as wb

R, C = 64, 64
EXPERTS = [f"experts.{e}.w" for e in range(4)]


def _layout() -> wb.Layout:
    mesh = wb.MeshSpec((2, 2), ("ep", "fsdp"))
    return wb.Layout(mesh, {
        "experts.w": wb.LoadSpec.from_placements("experts.w", EXPERTS, (4 * R, C), mesh, [Shard(0), Shard(1)],
                                                 fused_dim=0),
        "embed": wb.LoadSpec.from_placements("embed", "embed", (2 * R, C), mesh, [Shard(0), Shard(0)]),
        "head": wb.LoadSpec.from_placements("head", "head", (2 * R, C), mesh, [Shard(0), Shard(0)]),
    })


def _globals() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(19)
    return {"experts.w": torch.randn(4 * R, C, generator=gen).bfloat16(),
            "embed": torch.randn(2 * R, C, generator=gen).bfloat16(),
            "head": torch.randn(2 * R, C, generator=gen).bfloat16()}


def _save(root: str, budget: int) -> str:
    import torch.distributed as dist

    rank = dist.get_rank()
    ep, fsdp = divmod(rank, 2)
    full = _globals()
    local = {
        "experts.w": torch.chunk(torch.chunk(full["experts.w"], 2, dim=0)[ep], 2, dim=1)[fsdp].clone(),
        "embed": torch.chunk(torch.chunk(full["embed"], 2, dim=0)[ep], 2, dim=0)[fsdp].clone(),
        "head": torch.chunk(torch.chunk(full["head"], 2, dim=0)[ep], 2, dim=0)[fsdp].clone(),
    }
    try:
        wb.save_hf(local, Path(root) / str(budget), layout=_layout(), budget_bytes=budget, write_mode="gather",
                   fp32_keys_pattern=r"experts\.0\.w")
    except Exception as exc:  # returned, so that every rank's outcome is seen
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return "ok"


def test_ranks_whose_experts_gather_in_different_dtypes_save_together(tmp_path: Path) -> None:
    from safetensors import safe_open

    budget = 98304  # the ranks packed different waves at this budget, and the save was refused as a planner defect
    results = wb.launch(_save, nprocs=4, args=(str(tmp_path), budget), timeout=180)
    assert all(v == "ok" for v in results.values()), results
    full = _globals()
    want = dict(zip(EXPERTS, torch.chunk(full["experts.w"], 4)))
    want["experts.0.w"] = want["experts.0.w"].float()
    want.update(embed=full["embed"], head=full["head"])
    saved = {}
    for file in (tmp_path / str(budget)).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            saved.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (not iterable)
    assert saved.keys() == want.keys()
    for key, tensor in want.items():
        assert saved[key].dtype == tensor.dtype, key
        assert torch.equal(saved[key].view(torch.uint8), tensor.contiguous().view(torch.uint8)), key
