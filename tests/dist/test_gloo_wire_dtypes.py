"""Sharded tensors of dtypes gloo's collectives lack (int16, uint16, bool, complex64; float8 was handled already)
save through gathers and load with replicas shared, bit for bit: a gather or a broadcast moves their bytes. A
gathered int16 save failed with gloo's "Invalid scalar type", naming neither the parameter nor the dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb

DTYPES = {"i16": torch.int16, "u16": torch.uint16, "flag": torch.bool, "c64": torch.complex64}


def _full(name: str) -> torch.Tensor:
    """The global tensor of ``name``, from random bits (its dtype's every pattern, NaN payloads in complex)."""
    bits = torch.randint(0, 256, (6, 8 * DTYPES[name].itemsize), generator=torch.Generator().manual_seed(len(name)),
                         dtype=torch.uint8)
    return (bits % 2).bool() if DTYPES[name] is torch.bool else bits.view(DTYPES[name])


def _save_and_load(root: str) -> dict[str, bool]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    fulls = {f"model.{n}.weight": (_full(n), [Shard(0)]) for n in DTYPES}
    fulls["model.shared.weight"] = (_full("i16"), [Replicate()])
    state = {k: distribute_tensor(full, mesh, p, src_data_rank=None) for k, (full, p) in fulls.items()}
    wb.save_hf(state, Path(root) / "gathered", write_mode="gather")
    target = {k: distribute_tensor(torch.zeros_like(full), mesh, p, src_data_rank=None)
              for k, (full, p) in fulls.items()}
    wb.load_hf(target, Path(root) / "gathered", read_replicas_once=True)
    dist.barrier()
    return {k: torch.equal(target[k].to_local(), state[k].to_local()) for k in state}


@pytest.mark.slow
def test_dtypes_gloo_lacks_are_gathered_and_shared_as_bytes(tmp_path: Path) -> None:
    results = wb.launch(_save_and_load, nprocs=2, args=(str(tmp_path),), timeout=120)
    assert all(all(r.values()) for r in results.values()), results
    saved = {k: v for f in (tmp_path / "gathered").glob("*.safetensors") for k, v in load_file(f).items()}
    for name, dtype in DTYPES.items():
        got = saved[f"model.{name}.weight"]
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), _full(name).view(torch.uint8)), name
    assert torch.equal(saved["model.shared.weight"], _full("i16"))
