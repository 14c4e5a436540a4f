"""Benchmark: render time of every figure and HTML repr for the largest parameter of each sample layout, and the
explorer's update time after a slider change.

Baseline, in the same run: an empty matplotlib figure of the same size rendered to PNG (the fixed cost any
figure pays); each figure's time is also given as a ratio to it. A figure is timed from the call to a finished
PNG (``savefig``); an HTML repr from the call to its string. Explorer: a rank change is timed from setting the
slider to the last view updated (``Explorer.update_seconds``), over ranks whose schedule was already drawn
(warm) and ranks of a new schedule shape class (cold, the schedule figure drawn); target < 200 ms.

    .venv/bin/python bench/viz.py [sample_meshes/*.toml ...] [--repeat 3]
"""

from __future__ import annotations

import argparse
import io
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from workbench import load_layout
from workbench.plan.load_plan import plan_hf_load
from workbench.plan.save_plan import plan_hf_save
from workbench.plan.save_set import plan_save
from workbench.viz import _style
from workbench.viz.figures import plot_mesh, plot_schedule, plot_shard_offsets
from workbench.viz.html import render_html
from workbench.viz.widgets import explore

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    """One line naming the machine and versions."""
    return (f"{platform.machine()}, {os.cpu_count()} CPU(s), Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Fastest of ``repeat`` runs (seconds) and the last result."""
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def png(fig: Any) -> bytes:
    """The figure rendered to PNG."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def bench_layout(path: Path, repeat: int) -> list[str]:
    layout = load_layout(path)
    spec = max(layout.specs.values(), key=lambda s: math.prod(s.global_shape))
    rank = layout.mesh.size - 1
    mesh_dim = layout.mesh.dim_names[-1]
    plan_time, plan_set = best(lambda: plan_save(layout, ranks=[rank], budget_bytes=1 << 30), 1)
    schedule = plan_set.schedules[rank]
    base, _ = best(lambda: png(_style.new_figure((7.0, 4.8))), repeat)
    rows = [f"| {layout.name} | {layout.mesh.size} | `{spec.name}` {spec.global_shape} | "
            f"empty figure (baseline) | {base * 1e3:.0f} ms | 1.0x |"]
    figures = {
        "plot_shard_offsets": lambda: png(plot_shard_offsets(spec, rank=rank)),
        "plot_mesh": lambda: png(plot_mesh(layout.mesh, spec, highlight=(rank, mesh_dim))),
        f"plot_schedule ({schedule.num_calls} calls)": lambda: png(plot_schedule(schedule)),
    }
    for name, fn in figures.items():
        seconds, _ = best(fn, repeat)
        rows.append(f"| | | | {name} | {seconds * 1e3:.0f} ms | {seconds / base:.1f}x |")
    objects = {
        "MeshSpec": layout.mesh, "LoadSpec": spec, "Layout": layout, "HFLoadPlan": plan_hf_load(spec, rank),
        "HFSavePlan": plan_hf_save(spec, rank), "UnshardSchedule": schedule,
    }
    for name, obj in objects.items():
        seconds, text = best(lambda obj=obj: render_html(obj), repeat)
        rows.append(f"| | | | repr {name} ({len(text) / 1024:.0f} KiB) | {seconds * 1e3:.1f} ms | |")
    rows.append(f"| | | | (planning the rank's save, not part of the figure) | {plan_time * 1e3:.0f} ms | |")
    return rows


def bench_explorer(path: Path, samples: int) -> str:
    layout = load_layout(path)
    start = time.perf_counter()
    ex = explore(layout).explorer
    build = time.perf_counter() - start
    rng = random.Random(0)
    ranks = [rng.randrange(layout.mesh.size) for _ in range(samples)]
    cold, warm = [], []
    for rank in ranks:
        before = len(ex._schedule_png)
        ex.rank.value = rank if rank != ex.rank.value else (rank + 1) % layout.mesh.size
        (cold if len(ex._schedule_png) > before else warm).append(ex.update_seconds)
    start = time.perf_counter()
    ex.policy.value = "minimal"
    policy = time.perf_counter() - start

    def fmt(values: list[float]) -> str:
        if not values:
            return "-"
        return f"median {statistics.median(values) * 1e3:.0f} ms, max {max(values) * 1e3:.0f} ms (n={len(values)})"

    return (f"| {layout.name} | {layout.mesh.size} | {build:.2f} s | {fmt(warm)} | {fmt(cold)} | "
            f"{policy * 1e3:.0f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layouts", nargs="*", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--samples", type=int, default=20, help="rank changes timed in the explorer")
    args = parser.parse_args()
    paths = args.layouts or sorted((ROOT / "sample_meshes").glob("*.toml"))
    print(f"machine: {machine()}\n")
    print("| layout | ranks | largest parameter | what | time | vs empty figure |")
    print("|---|---|---|---|---|---|")
    for path in paths:
        for row in bench_layout(path, args.repeat):
            print(row, flush=True)
    print("\n| layout | ranks | explore() build | rank change, schedule already drawn | rank change, new schedule "
          "class | policy -> minimal |")
    print("|---|---|---|---|---|---|")
    for path in paths:
        print(bench_explorer(path, args.samples), flush=True)


if __name__ == "__main__":
    main()
