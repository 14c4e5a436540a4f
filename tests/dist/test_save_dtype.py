"""Issue 20's scenario on 2 gloo ranks: a bf16 model, a Layout built from LoadSpecs (no dtypes given), ``save_hf``,
then a strict ``load_hf`` back into the same model: bf16 on disk, every value bit for bit, in both write modes. And
a Layout dtype that disagrees with a rank's tensor fails every rank before any data moves."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

import workbench as wb

EXPERT_KEYS = [f"model.layers.0.mlp.experts.{e}.weight" for e in range(4)]


def global_values() -> dict[str, torch.Tensor]:
    """Every parameter's global tensor, bf16 from random bits (NaN payloads too), by parameter name."""
    gen = torch.Generator().manual_seed(20)
    shapes = {"embed": (9, 6), "experts": (8, 4), "proj": (6, 10), "norm": (6,)}
    return {n: torch.randint(-(1 << 15), 1 << 15, s, generator=gen, dtype=torch.int16).view(torch.bfloat16)
            for n, s in shapes.items()}


def local_of(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's piece by torch.chunk (rows for embed / experts, columns for proj, all of norm)."""
    if name == "norm":
        return full.clone()
    return torch.chunk(full, 2, dim=1 if name == "proj" else 0)[rank].clone()


def _layout():
    from torch.distributed.tensor import Replicate, Shard

    mesh = wb.MeshSpec((2,), ("fsdp",))
    specs = {
        "embed": wb.LoadSpec.from_placements("embed", "model.embed_tokens.weight", (9, 6), mesh, [Shard(0)]),
        "experts": wb.LoadSpec.from_placements("experts", EXPERT_KEYS, (8, 4), mesh, [Shard(0)], fused_dim=0),
        "proj": wb.LoadSpec.from_placements("proj", "model.layers.0.proj.weight", (6, 10), mesh, [Shard(1)]),
        "norm": wb.LoadSpec.from_placements("norm", "model.norm.weight", (6,), mesh, [Replicate()]),
    }
    return wb.Layout(mesh, specs)  # no dtypes: what a user builds from LoadSpecs


def _save_and_load_back(root: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    layout = _layout()
    model = {n: local_of(n, t, rank) for n, t in global_values().items()}
    out = {}
    for mode in ("direct", "gather"):
        path = Path(root) / mode
        wb.save_hf(model, path, layout=layout, write_mode=mode)
        back = {n: torch.zeros_like(t) for n, t in model.items()}
        wb.load_hf(back, path, layout=layout)  # strict: a dtype change would be refused
        out[mode] = {n: torch.equal(back[n].view(torch.int16), model[n].view(torch.int16)) for n in model}
    return out


def test_bf16_model_with_a_layout_from_loadspecs_round_trips_bit_exact(tmp_path: Path) -> None:
    from tests.io.support import read_checkpoint

    results = wb.launch(_save_and_load_back, nprocs=2, args=(str(tmp_path),), timeout=180)
    for rank, per_mode in results.items():
        for mode, same in per_mode.items():
            assert all(same.values()), (rank, mode, same)
    values = global_values()
    want = {"model.embed_tokens.weight": values["embed"], "model.layers.0.proj.weight": values["proj"],
            "model.norm.weight": values["norm"]}
    want.update(zip(EXPERT_KEYS, torch.chunk(values["experts"], 4)))
    for mode in ("direct", "gather"):
        saved = read_checkpoint(tmp_path / mode)
        assert saved.keys() == want.keys()
        for key, tensor in want.items():
            assert saved[key].dtype == torch.bfloat16, (mode, key, saved[key].dtype)
            assert torch.equal(saved[key].view(torch.int16), tensor.view(torch.int16)), (mode, key)
        data = 0
        for file in (tmp_path / mode).glob("*.safetensors"):
            raw = file.read_bytes()
            (length,) = struct.unpack("<Q", raw[:8])
            header = json.loads(raw[8 : 8 + length])
            header.pop("__metadata__", None)
            assert {e["dtype"] for e in header.values()} == {"BF16"}, (mode, file.name, header)
            data += len(raw) - 8 - length
        assert data == sum(t.numel() * 2 for t in values.values())  # 2 bytes an element: not doubled


def _save_with_a_disagreeing_dtype(root: str) -> dict:
    import dataclasses

    import torch.distributed as dist

    rank = dist.get_rank()
    layout = _layout()
    layout = dataclasses.replace(layout, dtypes={"embed": "bfloat16"})  # given, and right on rank 0
    model = {n: local_of(n, t, rank) for n, t in global_values().items()}
    if rank == 1:
        model["embed"] = model["embed"].float()  # rank 1's tensor is not what the layout says
    try:
        wb.save_hf(model, Path(root) / "ckpt", layout=layout, timeout=30)
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


def test_a_disagreeing_layout_dtype_fails_every_rank_before_any_data_moves(tmp_path: Path) -> None:
    results = wb.launch(_save_with_a_disagreeing_dtype, nprocs=2, args=(str(tmp_path),), timeout=120)
    assert results[1]["type"] == "LayoutError"
    assert results[0]["type"] == "SaveFailed"
    for outcome in results.values():  # both name the parameter and both dtypes
        assert "'embed'" in outcome["message"], outcome
        assert "bfloat16" in outcome["message"] and "float32" in outcome["message"], outcome
    assert "rank 1" in results[0]["message"]
    assert list(tmp_path.iterdir()) == []  # nothing was created
