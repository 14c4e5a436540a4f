"""Benchmark: load an HF safetensors checkpoint into GPU (or CPU) tensors, beside the read limit and other loaders.

One run, one machine, one checkpoint of ``--files`` files of random bf16 tensors (``--size-gb`` in all), made in
the target directory. ``--repeats`` rounds; in each, every method runs cold (every file's pages evicted with
``posix_fadvise(DONTNEED)`` first), then, in the first ``--warm-repeats`` rounds, warm (every file read through the
page cache first, again before a method whenever a sample of pages shows the cache no longer full). Medians of the
rounds are reported beside the best. Methods (``--methods``, default all that can run):

- ``dd``: ``dd bs=64M`` of every file to ``/dev/null``, one file after another (cold only: warm it measures
  memcpy); ``dd-direct`` the same with ``iflag=direct``. The read limit is the faster of the two (medians);
- ``wb-auto``, ``wb-page-cache``, ``wb-direct``: ``wb.load_hf`` with ``WORKBENCH_READ_DIRECT`` ``auto`` (the default:
  O_DIRECT for cold requests of 1 MiB or more), ``0`` and ``1``, into one tensor per key (``--ranks 1``) or into
  DTensors sharded ``Shard(0)`` over the ranks (each rank reads its rows);
- ``safetensors``: ``load_file(device=...)`` (``--ranks 1``) or ``safe_open(...).get_slice`` of the rank's rows;
- ``fastsafetensors`` (``fastsafe_open(files, device=..., nogds=True)``) and ``instanttensor`` (``safe_open(files,
  ...)``), when installed, on a GPU, ``--ranks 1`` (they read whole tensors).

Per method: the disk bytes the ranks' processes read in a cold run (``/proc/self/io``) over owned, and the share of
the files left in the page cache after a cold run (O_DIRECT leaves none). GB/s are the owned bytes over the slowest
rank's seconds; per GPU, divide by ``--ranks``. ``--json`` writes every run's numbers.

    python bench/load.py --size-gb 8 --files 8 --device cuda --ranks 1 --dir /tmp
    python bench/load.py --size-gb 8 --files 8 --device cuda --ranks 2 --methods dd,dd-direct,wb-auto,safetensors
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import cloudpickle
import page_cache
import torch
from page_cache import cached, evict, fill, os_read_bytes

import workbench as wb

cloudpickle.register_pickle_by_value(page_cache)  # the ranks get these helpers by value, not by import

GB = 10**9
ROWS = 4096  # every tensor is ROWS x cols bf16
METHODS = ("dd", "dd-direct", "wb-auto", "wb-page-cache", "wb-direct", "safetensors", "fastsafetensors",
           "instanttensor")
DIRECT = {"wb-auto": "auto", "wb-page-cache": "0", "wb-direct": "1"}  # WORKBENCH_READ_DIRECT per wb method


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
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return paths


def _keys(root: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    from workbench.io.files.index import read_checkpoint

    return {k: (info.file, info.shape) for k, info in read_checkpoint(root).keys.items()}


def _rank_main(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    root, paths = Path(cfg["root"]), [Path(p) for p in cfg["paths"]]
    cuda = cfg["device"] == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    keys = _keys(root)
    keys_files = {f for f, _ in keys.values()}
    out: dict[str, Any] = {"times": {}, "os_read": {}, "cached": {}, "owned": 0}

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

    def dd(direct: bool, paths: list[Path] = paths) -> None:
        if rank == 0:
            for p in paths:
                cmd = ["dd", f"if={p}", "of=/dev/null", "bs=64M"] + (["iflag=direct"] if direct else [])
                subprocess.run(cmd, check=True, capture_output=True)

    def wb_load(mode: str, paths: list[Path] = paths) -> None:
        names = {p.name for p in paths}
        os.environ["WORKBENCH_READ_DIRECT"] = mode  # BoxReader's default, read when load_hf makes one
        try:
            wb.load_hf({k: t for k, t in target.items() if keys[k][0] in names}, root, timeout=600,
                       read_threads=cfg["threads"], strict=len(names) == len(keys_files))
        finally:
            os.environ.pop("WORKBENCH_READ_DIRECT", None)

    def st_load(paths: list[Path] = paths) -> None:
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

    def fst_load(paths: list[Path] = paths) -> None:
        from fastsafetensors import fastsafe_open

        with fastsafe_open([str(p) for p in paths], device=str(device), nogds=True) as f:
            for k in f.keys():  # noqa: SIM118
                f.get_tensor(k)

    def it_load(paths: list[Path] = paths) -> None:
        from instanttensor import safe_open

        with safe_open([str(p) for p in paths], framework="pt", device=device.index if cuda else "cpu") as f:
            for _ in f.tensors():
                pass

    runs = {"dd": lambda ps=paths: dd(False, ps), "dd-direct": lambda ps=paths: dd(True, ps), "safetensors": st_load,
            "fastsafetensors": fst_load, "instanttensor": it_load}
    runs |= {name: (lambda ps=paths, mode=mode: wb_load(mode, ps)) for name, mode in DIRECT.items()}
    methods = [(name, runs[name]) for name in cfg["methods"]]
    for name, run in methods:  # untimed, on the first file: imports, the CUDA context, pinned memory
        try:
            run(paths[:1])
        except Exception as exc:
            out.setdefault("errors", {})[name] = f"warm-up: {type(exc).__name__}: {exc}"[:300]
        sync()

    def timed(name: str, temp: str, run: Any) -> None:
        if name in out.get("errors", {}):
            return
        sync()
        before = os_read_bytes()
        t0 = time.perf_counter()
        try:
            run()
            sync()
        except Exception as exc:  # a peer loader that cannot run here is reported, not fatal
            out.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:300]
            return
        key = f"{name} {temp}"
        out["times"].setdefault(key, []).append(time.perf_counter() - t0)
        out["os_read"].setdefault(key, []).append(os_read_bytes() - before)
        if rank == 0 and temp == "cold":
            out["cached"].setdefault(name, []).append(cached(paths))

    for rep in range(cfg["repeats"]):  # round robin, so that a slow spell of the disk hits every method
        for name, run in methods:
            if rank == 0:
                evict(paths)
            timed(name, "cold", run)
        if rep >= cfg["warm_repeats"]:
            continue
        for name, run in methods:
            if name.startswith("dd"):
                continue
            if rank == 0 and cached(paths) < 1.0:  # a loader that reads past the cache may also evict it
                fill(paths)
            timed(name, "warm", run)
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, out)
        return {"ranks": gathered}
    return {"ranks": [out]}


def _slowest(ranks: list[dict[str, Any]], key: str) -> list[float]:
    """Each run's seconds on its slowest rank."""
    runs = min(len(r["times"].get(key, [])) for r in ranks)
    return [max(r["times"][key][i] for r in ranks) for i in range(runs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of cold runs (medians reported)")
    parser.add_argument("--warm-repeats", type=int, default=None, help="rounds with warm runs too (default: all)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--threads", type=int, default=16, help="load_hf's read_threads")
    parser.add_argument("--json", default=None, help="write every run's numbers here")
    args = parser.parse_args()
    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(wanted) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; known: {', '.join(METHODS)}")
    skipped = {}
    for name, module in (("fastsafetensors", "fastsafetensors"), ("instanttensor", "instanttensor")):
        if name in wanted and (args.ranks > 1 or args.device != "cuda" or not importlib.util.find_spec(module)):
            skipped[name] = "needs --ranks 1, --device cuda and the package installed"
    methods = [m for m in wanted if m not in skipped]

    root = Path(tempfile.mkdtemp(prefix="wb-load-", dir=args.dir))
    try:
        paths = make_checkpoint(root, args.size_gb, args.files, "cuda" if args.device == "cuda" else "cpu")
        nbytes = sum(p.stat().st_size for p in paths)
        cfg = {"root": str(root), "paths": [str(p) for p in paths], "device": args.device, "repeats": args.repeats,
               "warm_repeats": args.repeats if args.warm_repeats is None else args.warm_repeats,
               "threads": args.threads, "methods": methods}
        if args.ranks == 1:
            if args.device == "cuda":
                torch.cuda.set_device(0)
            result = _rank_main(cfg)
        else:
            result = wb.launch(_rank_main, nprocs=args.ranks, backend="nccl" if args.device == "cuda" else "gloo",
                               args=(cfg,), timeout=3600)[0]
        report(result["ranks"], args, nbytes, root, skipped)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(ranks: list[dict[str, Any]], args: argparse.Namespace, nbytes: int, root: Path,
           skipped: dict[str, str]) -> None:
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    when = datetime.date.today().isoformat()
    print(f"checkpoint  {nbytes / GB:.2f} GB in {len(list(root.glob('*.safetensors')))} files on {root}; "
          f"{args.ranks} rank(s), {gpu}; torch {torch.__version__}, Python {platform.python_version()}; {when}")
    owned = sum(r["owned"] for r in ranks)
    times = {k: _slowest(ranks, k) for k in ranks[0]["times"]}
    med = {k: statistics.median(v) for k, v in times.items() if v}
    dd = [f"{m} cold" for m in ("dd", "dd-direct") if f"{m} cold" in med]
    limit_key = min(dd, key=med.__getitem__) if dd else None
    limit = nbytes / med[limit_key] if limit_key else float("nan")
    print(f"read limit  {limit / GB:.2f} GB/s: median of `{limit_key}`" if limit_key else "read limit  not measured")
    print(f"\n| method | cold GB/s (median of {args.repeats}) | cold / read limit | cold GB/s (best) | "
          "warm GB/s (median) | warm GB/s per GPU | disk read / owned (cold) | cached after cold | runs cold (s) | "
          "runs warm (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    names = list(dict.fromkeys(k.rsplit(" ", 1)[0] for k in ranks[0]["times"]))
    rows = {}
    for name in names:
        size = nbytes if name.startswith("dd") else owned
        cold, warm = times.get(f"{name} cold", []), times.get(f"{name} warm", [])
        if not cold:
            continue
        c = size / statistics.median(cold)
        w = size / statistics.median(warm) if warm else None
        disk = statistics.median(sum(r["os_read"][f"{name} cold"][i] for r in ranks) for i in range(len(cold)))
        left = ranks[0]["cached"].get(name, [])
        rows[name] = {"cold_gbps": c / GB, "cold_vs_limit": c / limit, "warm_gbps": w / GB if w else None,
                      "disk_over_owned": disk / size, "cold_s": cold, "warm_s": warm, "cached_after_cold": left}
        wtext = f"{w / GB:.2f} | {w / GB / args.ranks:.2f}" if w else "— | —"
        ltext = f"{statistics.median(left):.0%}" if left else "—"
        print(f"| {name} | {c / GB:.2f} | {c / limit:.2f} | {size / min(cold) / GB:.2f} | {wtext} | "
              f"{disk / size:.3f} | {ltext} | {', '.join(f'{t:.2f}' for t in cold)} | "
              f"{', '.join(f'{t:.2f}' for t in warm) or '—'} |")
    for name, why in skipped.items():
        print(f"skipped     {name}: {why}")
    for name, err in ranks[0].get("errors", {}).items():
        print(f"error       {name}: {err}")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": gpu, "date": when, "ranks": args.ranks, "bytes": nbytes,
                                               "owned": owned, "limit_gbps": limit / GB, "limit": limit_key,
                                               "methods": rows, "errors": ranks[0].get("errors", {})}, indent=1))


if __name__ == "__main__":
    main()
