"""Benchmark: load an HF safetensors checkpoint into GPU (or CPU) tensors, beside the read limit and other loaders.

One run, one machine, one checkpoint of ``--files`` files of random bf16 tensors (``--size-gb`` in all), made in
the target directory. Each method runs ``--repeats`` times in round robin, cold (every file's pages evicted with
``posix_fadvise(DONTNEED)`` before the run) and warm (right after a run, the page cache full):

- the read limit: ``dd bs=64M`` of every file to ``/dev/null`` (cold only: warm it measures memcpy);
- ``wb.load_hf`` into one tensor per key (``--ranks 1``), or into DTensors sharded ``Shard(0)`` over the ranks
  (each rank reads its rows), with the disk bytes the ranks' processes read (``/proc/self/io``) over owned;
- safetensors ``load_file(device=...)`` (``--ranks 1``) or ``safe_open(...).get_slice`` of the rank's rows;
- fastsafetensors ``fastsafe_open(files, device=..., nogds=True)`` and InstantTensor ``safe_open(files, ...)``
  when installed (``--ranks 1``: they read whole tensors).

GB/s are the checkpoint's bytes over the slowest rank's seconds; per GPU, divide by ``--ranks``.

    python bench/load.py --size-gb 8 --files 8 --device cuda --ranks 1 --dir /tmp
    python bench/load.py --size-gb 8 --files 8 --device cuda --ranks 2 --dir /tmp
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import workbench as wb

GB = 10**9
ROWS = 4096  # every tensor is ROWS x cols bf16


def make_checkpoint(root: Path, size_gb: float, files: int, device: str) -> list[Path]:
    """``files`` safetensors files of 4 tensors each, ``size_gb`` in all, and their index."""
    from safetensors.torch import save_file

    per_tensor = size_gb * GB / files / 4
    cols = max(1, int(per_tensor / (ROWS * 2)))
    paths, weight_map = [], {}
    gen = torch.Generator(device=device).manual_seed(0)
    for f in range(files):
        name = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        tensors = {f"model.layers.{f}.w{i}.weight": torch.randn(ROWS, cols, generator=gen, device=device,
                                                               dtype=torch.bfloat16).cpu() for i in range(4)}
        save_file(tensors, str(root / name))
        weight_map |= dict.fromkeys(tensors, name)
        paths.append(root / name)
    total = sum(4 * ROWS * cols * 2 for _ in range(files))
    import json

    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return paths


def evict(paths: list[Path]) -> None:
    """Write back, then drop these files' pages from the page cache."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def os_read_bytes() -> int:
    """Bytes this process made the kernel read from storage (``/proc/self/io``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _keys(root: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    from workbench.io.index import read_checkpoint

    return {k: (info.file, info.shape) for k, info in read_checkpoint(root).keys.items()}


def _rank_main(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    root, paths = Path(cfg["root"]), [Path(p) for p in cfg["paths"]]
    cuda = cfg["device"] == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    keys = _keys(root)
    out: dict[str, Any] = {"times": {}, "os_read": {}, "owned": 0}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        if world > 1:
            dist.barrier()

    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
        target = {k: DTensor.from_local(torch.empty(shape[0] // world, *shape[1:], dtype=torch.bfloat16,
                                                    device=device), mesh, [Shard(0)]) for k, (_, shape) in keys.items()}
    else:
        target = {k: torch.empty(shape, dtype=torch.bfloat16, device=device) for k, (_, shape) in keys.items()}
    out["owned"] = sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in target.values())

    def wb_load() -> None:
        wb.load_hf(target, root, timeout=600, read_threads=cfg["threads"])

    def st_load() -> None:
        from safetensors import safe_open
        from safetensors.torch import load_file

        if world == 1:
            for p in paths:
                for t in load_file(str(p), device=str(device)).values():
                    if not cuda:
                        t.clone()  # on CPU load_file maps the file: touch every byte, as a copy into a model does
            return
        for p in paths:
            with safe_open(str(p), "pt", device=str(device)) as f:
                for k in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    rows = keys[k][1][0] // world
                    f.get_slice(k)[rank * rows:(rank + 1) * rows].clone()  # on CPU a slice is a lazy map

    def fst_load() -> None:
        from fastsafetensors import fastsafe_open

        with fastsafe_open([str(p) for p in paths], device=str(device), nogds=True) as f:
            for k in f.keys():  # noqa: SIM118
                f.get_tensor(k)

    def it_load() -> None:
        from instanttensor import safe_open

        with safe_open([str(p) for p in paths], framework="pt", device=device.index if cuda else "cpu") as f:
            for _ in f.tensors():
                pass

    methods = [("wb.load_hf", wb_load), ("safetensors", st_load)]
    if world == 1 and importlib.util.find_spec("fastsafetensors") and cuda:
        methods.append(("fastsafetensors", fst_load))
    if world == 1 and importlib.util.find_spec("instanttensor") and cuda:
        methods.append(("instanttensor", it_load))
    for _ in range(cfg["repeats"]):
        for name, run in methods:
            for temp in ("cold", "warm"):
                if temp == "cold" and rank == 0:
                    evict(paths)
                sync()
                before = os_read_bytes()
                t0 = time.perf_counter()
                try:
                    run()
                    sync()
                except Exception as exc:  # a peer loader that cannot run here is reported, not fatal
                    out.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:300]
                    break
                out["times"].setdefault(f"{name} {temp}", []).append(time.perf_counter() - t0)
                out["os_read"].setdefault(f"{name} {temp}", []).append(os_read_bytes() - before)
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, out)
        return {"ranks": gathered}
    return {"ranks": [out]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--threads", type=int, default=16, help="load_hf's read_threads")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="wb-load-", dir=args.dir))
    try:
        paths = make_checkpoint(root, args.size_gb, args.files, "cuda" if args.device == "cuda" else "cpu")
        nbytes = sum(p.stat().st_size for p in paths)
        dd: list[float] = []
        for _ in range(args.repeats):
            evict(paths)
            t0 = time.perf_counter()
            for p in paths:
                subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=64M"], check=True, capture_output=True)
            dd.append(time.perf_counter() - t0)
        cfg = {"root": str(root), "paths": [str(p) for p in paths], "device": args.device, "repeats": args.repeats,
               "threads": args.threads}
        if args.ranks == 1:
            if args.device == "cuda":
                torch.cuda.set_device(0)
            result = _rank_main(cfg)
        else:
            result = wb.launch(_rank_main, nprocs=args.ranks, backend="nccl" if args.device == "cuda" else "gloo",
                               args=(cfg,), timeout=3600)[0]
        ranks = result["ranks"]
        gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        print(f"checkpoint  {nbytes / GB:.2f} GB in {len(paths)} files on {root}; {args.ranks} rank(s), {gpu}; "
              f"torch {torch.__version__}")
        limit = nbytes / min(dd)
        print("\n| method | cold GB/s (best) | cold / read limit | warm GB/s (best) | warm GB/s per GPU | "
              "disk read / owned (cold) | runs cold (s) | runs warm (s) |")
        print("|---|---|---|---|---|---|---|---|")
        print(f"| `dd bs=64M` of every file, cold (the read limit) | {limit / GB:.2f} | 1.00 | — | — | — | "
              f"{', '.join(f'{t:.2f}' for t in dd)} | — |")
        owned = sum(r["owned"] for r in ranks)
        names = list(dict.fromkeys(k.rsplit(" ", 1)[0] for k in ranks[0]["times"]))
        for name in names:
            cold = _slowest(ranks, f"{name} cold")
            warm = _slowest(ranks, f"{name} warm")
            disk = min(sum(r["os_read"][f"{name} cold"][i] for r in ranks) for i in range(len(cold)))
            size = owned if name != "safetensors" or args.ranks > 1 else nbytes
            wbest = f"{size / min(warm) / GB:.2f} | {size / min(warm) / GB / args.ranks:.2f}" if warm else "— | —"
            runs = " | ".join(", ".join(f"{t:.2f}" for t in ts) for ts in (cold, warm))
            print(f"| {name} | {size / min(cold) / GB:.2f} | {size / min(cold) / limit:.2f} | {wbest} | "
                  f"{disk / size:.3f} | {runs} |")
        for name, err in ranks[0].get("errors", {}).items():
            print(f"error       {name}: {err}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _slowest(ranks: list[dict[str, Any]], key: str) -> list[float]:
    """Each run's seconds on its slowest rank."""
    runs = min(len(r["times"].get(key, [])) for r in ranks)
    return [max(r["times"][key][i] for r in ranks) for i in range(runs)]


if __name__ == "__main__":
    main()
