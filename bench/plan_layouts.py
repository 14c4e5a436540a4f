"""Benchmark: derive every LoadSpec and all runs of a sample layout, for one rank and for every rank.

Baseline, in the same run: torch's own ``_compute_local_shape_and_global_offset`` over the same
(parameter, rank) pairs. It is given each parameter's cuts in workbench's forward order (one mesh dim per
cut), so both answer the same question; torch answers with one box per rank, workbench with every run.

    .venv/bin/python bench/plan_layouts.py [sample_meshes/deepseek_v3_671b.toml] [--ranks N]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch
from torch.distributed.tensor import Shard

from workbench import _compat, load_layout
from workbench.layout.load_spec import LoadSpec
from workbench.layout.runs import cached_dim_segments, runs_from_segments

ROOT = Path(__file__).resolve().parents[1]


def torch_equivalent(spec: LoadSpec, rank: int) -> tuple[tuple[int, ...], tuple[int, ...], list, list[int]]:
    """(global_shape, mesh_shape, placements, coordinate) that make torch compute the same shard."""
    mesh_shape, placements, coordinate = [], [], []
    for d in spec.shards:
        mesh_shape.append(spec.mesh.group_size(d.mesh_dim))
        coordinate.append(spec.mesh.group_rank(rank, d.mesh_dim))
        placements.append(_compat.make_strided_shard(d.dim, d.interleave_factor) if d.is_interleaved else Shard(d.dim))
    return spec.global_shape, tuple(mesh_shape) or (1,), placements or [torch.distributed.tensor.Replicate()], (
        coordinate or [0]
    )


def machine() -> str:
    """CPU model and core count, for RESULTS.md."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def clear_caches() -> None:
    cached_dim_segments.cache_clear()
    runs_from_segments.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=str(ROOT / "sample_meshes" / "deepseek_v3_671b.toml"))
    parser.add_argument("--ranks", type=int, default=None, help="limit 'all ranks' to the first N")
    args = parser.parse_args()

    clear_caches()
    t0 = time.perf_counter()
    layout = load_layout(args.path)
    t_derive = time.perf_counter() - t0
    specs = list(layout.specs.values())
    ranks = list(layout.mesh.all_ranks())[: args.ranks]
    probe = ranks[len(ranks) // 2]

    clear_caches()
    t0 = time.perf_counter()
    one = sum(len(s.runs(probe)) for s in specs)
    t_one = time.perf_counter() - t0

    t0 = time.perf_counter()
    for s in specs:
        shape, mesh_shape, placements, coord = torch_equivalent(s, probe)
        _compat.torch_local_shape_and_offset(shape, mesh_shape, coord, placements)
    t_torch_one = time.perf_counter() - t0

    clear_caches()
    t0 = time.perf_counter()
    total_runs = 0
    for r in ranks:
        for s in specs:
            total_runs += len(s.runs(r))
    t_all = time.perf_counter() - t0

    stride = max(1, len(ranks) // 64)  # torch's helper is timed on a sample of ranks and scaled
    sample = ranks[::stride]
    t0 = time.perf_counter()
    for r in sample:
        for s in specs:
            shape, mesh_shape, placements, coord = torch_equivalent(s, r)
            _compat.torch_local_shape_and_offset(shape, mesh_shape, coord, placements)
    t_torch_all = (time.perf_counter() - t0) * len(ranks) / len(sample)

    pairs = len(specs) * len(ranks)
    print(f"layout      {layout.name}: {layout.mesh!r}, {len(specs)} params, {len(layout.hf_keys)} HF keys")
    print(f"machine     {machine()}, torch {torch.__version__}")
    print(f"derive      every LoadSpec from the file: {t_derive * 1e3:8.1f} ms")
    print(f"one rank    all runs of rank {probe}: {t_one * 1e3:8.1f} ms ({one} runs); torch helper "
          f"{t_torch_one * 1e3:.1f} ms; ratio ours/torch {t_one / t_torch_one:.2f}")
    print(f"all ranks   {len(ranks)} ranks x {len(specs)} params = {pairs} pairs: {t_all:6.2f} s ({total_runs} runs); "
          f"torch helper {t_torch_all:.2f} s (scaled from {len(sample)} ranks); "
          f"ratio ours/torch {t_all / t_torch_all:.2f}")
    print(f"targets     one rank < 50 ms: {'met' if t_one < 0.05 else 'MISSED'}; "
          f"all ranks < 10 s: {'met' if t_all < 10 else 'MISSED'}")


if __name__ == "__main__":
    main()
