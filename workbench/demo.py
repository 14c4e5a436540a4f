"""``workbench demo``: a real distributed save and reload on local gloo ranks, checked bit for bit.

1. Write a source checkpoint of a small Qwen3-MoE (random bf16 weights, fp32 norms) from one process.
2. Launch 4 gloo ranks. Each builds the model laid out EP2 x ETP2 (experts split over EP, every expert's gate
   and up split over expert TP by an InterleavedShard) under FSDP2, loads the source with ``wb.load_hf``, and
   saves it with ``wb.save_hf`` (writers balanced by bytes, atomic publish).
3. The same 4 ranks rebuild the model as FSDP2 x EP2 (no expert TP) and load the saved checkpoint back.
4. Check: every saved key equals the source bit for bit, and every rank's reloaded shard equals what its load
   plan selects from the source. Print the figures.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from workbench.models import Qwen3MoeShape, qwen3_moe_hf_shapes

__all__ = ["DEMO_SHAPE", "run_demo"]

DEMO_SHAPE = Qwen3MoeShape(vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8)
_NORMS = r"norm\.weight$"


def _ranks(source: str, saved: str, shape: Qwen3MoeShape) -> dict[str, Any]:
    """What every rank runs (module level, so the spawned ranks import it)."""
    from torch.distributed.device_mesh import init_device_mesh

    from workbench import _compat
    from workbench.io.hf.load import load_hf
    from workbench.io.hf.save import save_hf
    from workbench.models import build_qwen3_moe, qwen3_moe_key_map

    key_map = qwen3_moe_key_map(shape.num_experts)
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("fsdp", "ep", "etp"))
    model = build_qwen3_moe(shape, mesh)
    loaded = load_hf(model, source, key_map=key_map, cast=True)  # bf16 norms into fp32 ones
    result = save_hf(model, saved, key_map=key_map, fp32_keys_pattern=_NORMS, budget_bytes=256 << 10,
                     max_shard_bytes=256 << 10)
    mesh2 = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("fsdp", "ep", "etp"))
    model2 = build_qwen3_moe(shape, mesh2)
    reloaded = load_hf(model2, saved, key_map=key_map, cast=True)  # fp32 norms back into bf16
    expected = build_qwen3_moe(shape, mesh2)
    load_hf(expected, source, key_map=key_map, cast=True)
    mine, want = model2.state_dict(keep_vars=True), expected.state_dict(keep_vars=True)
    mismatched = [n for n in mine if not torch.equal(_compat.dtensor_local(mine[n]), _compat.dtensor_local(want[n]))]
    return {"loaded": loaded, "saved": result, "reloaded": reloaded, "mismatched": mismatched}


def run_demo(nprocs: int = 4, directory: str | Path | None = None) -> bool:
    """Run the demo and print what happened; True when everything matched bit for bit.

    Without ``directory`` the checkpoints go to a temporary folder that is removed at the end, whatever
    happens; a given ``directory`` is kept.
    """
    if nprocs != 4:
        raise ValueError("the demo's meshes (1x2x2 and 2x2x1) need exactly 4 ranks")
    if directory is not None:
        return _run_demo(nprocs, Path(directory))
    with tempfile.TemporaryDirectory(prefix="workbench-demo-") as root:
        return _run_demo(nprocs, Path(root))


def _run_demo(nprocs: int, root: Path) -> bool:
    from safetensors.torch import load_file

    from workbench.io.files.index import read_checkpoint
    from workbench.io.hf.save import save_hf
    from workbench.run.launcher import launch

    source, saved = root / "source", root / "saved"
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for key, key_shape in qwen3_moe_hf_shapes(DEMO_SHAPE).items():
        value = torch.randn(key_shape, generator=generator).to(torch.bfloat16)
        tensors[key] = value.float() if key.endswith("norm.weight") else value
    save_hf(tensors, source, max_shard_bytes=1 << 20)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"source checkpoint: {len(tensors)} HF keys, {nbytes / 2**20:.2f} MiB at {source}")
    start = time.perf_counter()
    results = launch(_ranks, nprocs=nprocs, args=(str(source), str(saved), DEMO_SHAPE), timeout=300)
    wall = time.perf_counter() - start
    checkpoint = read_checkpoint(saved)
    written = {}
    for file in checkpoint.files:
        written.update(load_file(saved / file))
    same_keys = written.keys() == tensors.keys()
    exact = same_keys and all(torch.equal(written[k], tensors[k]) and written[k].dtype == tensors[k].dtype
                              for k in tensors)
    reshard_ok = all(not r["mismatched"] for r in results.values())
    print(f"launched {nprocs} gloo ranks ({wall:.1f} s including start-up):")
    print("  EP2 x ETP2 (interleaved expert TP) under FSDP2: load_hf, then save_hf")
    for rank, r in results.items():
        s = r["saved"]
        loaded = r["loaded"]
        print(f"  rank {rank}: holds {loaded.bytes_owned} B: read {loaded.bytes_read} B ({loaded.read_ratio:.3f}x what "
              f"it had to read), received {loaded.bytes_received} B of replicated parameters from a replica; "
              f"{s.write_mode} save: {s.direct_tensors} tensors written in place, {s.calls} gather calls (predicted "
              f"peak {s.predicted_peak_bytes} B); wrote {s.bytes_written} B into {len(s.files)} file(s) in "
              f"{s.seconds:.2f} s")
    print(f"saved checkpoint: {len(checkpoint.files)} files, {len(checkpoint.keys)} keys, total_size "
          f"{checkpoint.total_size} B; norms kept in float32: "
          f"{all(i.dtype == 'F32' for k, i in checkpoint.keys.items() if k.endswith('norm.weight'))}")
    print(f"saved == source, bit for bit: {exact}")
    print(f"reloaded into FSDP2 x EP2 (no expert TP): every rank's shards equal the source's: {reshard_ok}")
    print("demo: OK" if exact and reshard_ok else "demo: MISMATCH")
    return exact and reshard_ok
