"""Benchmark: a warm load in a fresh process, then the same load again, on 1 or more GPUs (NCCL).

A training job loads its checkpoint once, in a process that has pinned nothing yet; a benchmark that loads many times
in one process reports the later loads. This one spawns ``--ranks`` fresh processes (one GPU each), fills the page
cache with the checkpoint's files, and times ``--loads`` calls of ``wb.load_hf`` into DTensors sharded ``Shard(0)``
over the ranks: the first is what a job pays, the others what a process that loaded before pays. GB/s per GPU =
a rank's owned bytes / the slowest rank's seconds. ``--profile`` prints rank 0's cProfile of the first load.

    python bench/first_load.py --ranks 2 --size-gb 8 --files 8 --dir /tmp
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: load.py's checkpoint maker, page_cache

from load import _keys, make_checkpoint
from page_cache import fill


def _rank(rank: int, world: int, root: Path, loads: int, budget: int, profile: bool, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import workbench as wb

    device = torch.device("cuda", rank)
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("fsdp",))
    target = {
        k: DTensor.from_local(torch.empty(shape[0] // world, *shape[1:], dtype=torch.bfloat16, device=device), mesh,
                              [Shard(0)])
        for k, (_, shape) in _keys(root).items()
    }
    owned = sum(t.to_local().nbytes for t in target.values())
    for i in range(loads):
        profiler = cProfile.Profile() if profile and i == 0 and rank == 0 else None
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        wb.load_hf(target, root, timeout=600, budget_bytes=budget)
        torch.cuda.synchronize()
        if profiler:
            profiler.disable()
        seconds = torch.tensor([time.perf_counter() - t0], device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        if rank == 0:
            s = seconds.item()
            kind = "first (fresh processes)" if i == 0 else f"again ({i + 1})"
            print(f"  load {kind:24s} {s:6.3f} s  {owned / s / 1e9:6.2f} GB/s per GPU", flush=True)
        if profiler:
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(12)
            print(out.getvalue()[-3500:], flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--size-gb", type=float, default=8.0)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--loads", type=int, default=4)
    ap.add_argument("--budget-mib", type=int, default=1024, help="load_hf's budget_bytes, in MiB")
    ap.add_argument("--dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--port", type=int, default=29541)
    args = ap.parse_args()
    root = args.dir / f"first_load_{args.size_gb:g}gb_{args.files}"
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "model.safetensors.index.json").exists():
        make_checkpoint(root, args.size_gb, args.files, "cuda")
    fill(sorted(root.glob("*.safetensors")))
    print(f"{args.ranks} GPU(s) ({torch.cuda.get_device_name(0)}), {args.size_gb:g} GB in {args.files} files, page "
          f"cache full, budget {args.budget_mib} MiB, torch {torch.__version__}")
    mp.spawn(_rank, args=(args.ranks, root, args.loads, args.budget_mib << 20, args.profile, args.port),
             nprocs=args.ranks)


if __name__ == "__main__":
    main()
