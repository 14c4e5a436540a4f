"""Benchmark: render time and smallest text of every figure kind for the largest parameter of each sample layout,
HTML repr times, and the explorer's update time after a rank change.

Baseline, in the same run: an empty figure of the same size rendered to the same PNG (the fixed cost any figure
pays); each figure's time is also given as a ratio to it. A figure is timed from the call to a finished notebook
PNG (``_style.png_bytes``: 2x pixels, what ``_repr_png_`` shows); an HTML repr from the call to its string. The
smallest text is the smallest font size of the texts matplotlib actually draws (target >= 8 pt).

Explorer (Python side): a rank change is timed from setting the slider to the last view updated
(``Explorer.update_seconds``: offsets overview and zoom, mesh, info; a schedule not yet drawn is planned and
drawn in a background thread and not waited for). Three kinds: first visits right after ``explore()`` returns
(its background thread is still drawing the default policy's schedule classes), first visits once it is done,
and repeat visits of those ranks; target <= 100 ms including the browser (``tests/browser``).

    .venv/bin/python bench/viz.py [sample_meshes/*.toml ...] [--repeat 3] [--samples 20]
"""

from __future__ import annotations

import argparse
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
    """The figure rendered to the PNG a notebook shows."""
    return _style.png_bytes(fig)


def smallest_text(fig: Any) -> tuple[float, int]:
    """The smallest font size (points) of the texts drawn when ``fig`` renders, and how many were drawn."""
    from unittest import mock

    from matplotlib.text import Text

    sizes: list[float] = []
    original = Text.draw

    def spy(self: Any, renderer: Any) -> None:
        original(self, renderer)
        if self.get_visible() and self.get_text().strip():
            sizes.append(self.get_fontsize())

    with mock.patch.object(Text, "draw", spy):
        fig.canvas.draw()
    return min(sizes, default=float("nan")), len(sizes)


def bench_layout(path: Path, repeat: int) -> list[str]:
    layout = load_layout(path)
    spec = max(layout.specs.values(), key=lambda s: math.prod(s.global_shape))
    rank = layout.mesh.size - 1
    mesh_dim = layout.mesh.dim_names[-1]
    plan_time, plan_set = best(lambda: plan_save(layout, ranks=[rank], budget_bytes=1 << 30), 1)
    schedule = plan_set.schedules[rank]
    base, _ = best(lambda: png(_style.new_figure((7.5, 5.0))), repeat)
    rows = [f"| {layout.name} | {layout.mesh.size} | `{spec.name}` {spec.global_shape} | "
            f"empty figure (baseline) | {base * 1e3:.0f} ms | 1.0x | |"]
    middle = layout.mesh.size // 2 + 1
    figures = {
        f"plot_shard_offsets, rank {middle}": lambda: plot_shard_offsets(spec, rank=middle),
        "plot_shard_offsets, no rank": lambda: plot_shard_offsets(spec),
        "plot_mesh, group outlined": lambda: plot_mesh(layout.mesh, spec, highlight=(rank, mesh_dim)),
        "plot_mesh, plain": lambda: plot_mesh(layout.mesh),
        f"plot_schedule ({schedule.num_calls} calls)": lambda: plot_schedule(schedule),
    }
    for name, make in figures.items():
        seconds, data = best(lambda make=make: (lambda f: (png(f), f))(make()), repeat)
        size, count = smallest_text(data[1])
        rows.append(f"| | | | {name} | {seconds * 1e3:.0f} ms | {seconds / base:.1f}x | {size:g} pt ({count} texts, "
                    f"PNG {len(data[0]) / 1024:.0f} KiB) |")
    objects = {
        "MeshSpec": layout.mesh, "LoadSpec": spec, "Layout": layout, "HFLoadPlan": plan_hf_load(spec, rank),
        "HFSavePlan": plan_hf_save(spec, rank), "UnshardSchedule": schedule,
    }
    for name, obj in objects.items():
        seconds, text = best(lambda obj=obj: render_html(obj), repeat)
        rows.append(f"| | | | repr {name} ({len(text) / 1024:.0f} KiB) | {seconds * 1e3:.1f} ms | | |")
    rows.append(f"| | | | (planning the rank's save, not part of the figure) | {plan_time * 1e3:.0f} ms | | |")
    return rows


def bench_explorer(path: Path, samples: int) -> str:
    layout = load_layout(path)
    start = time.perf_counter()
    ex = explore(layout).explorer
    build = time.perf_counter() - start
    rng = random.Random(0)
    size = layout.mesh.size

    def visit(ranks: list[int]) -> list[float]:
        out = []
        for rank in ranks:
            ex.rank.value = rank if rank != ex.rank.value else (rank + 1) % size
            out.append(ex.update_seconds)
        return out

    early = visit([rng.randrange(size) for _ in range(max(2, samples // 4))])
    start = time.perf_counter()
    ex.settle()
    drawn = time.perf_counter() - start
    ranks = rng.sample(range(size), min(samples, size))
    first = visit(ranks)
    again = visit(ranks)
    start = time.perf_counter()
    ex.policy.value = "minimal"
    policy = time.perf_counter() - start

    def fmt(values: list[float]) -> str:
        if not values:
            return "-"
        return f"median {statistics.median(values) * 1e3:.0f} ms, max {max(values) * 1e3:.0f} ms (n={len(values)})"

    return (f"| {layout.name} | {size} | {build:.2f} s (+{drawn:.2f} s background) | {fmt(early)} | {fmt(first)} | "
            f"{fmt(again)} | {policy * 1e3:.0f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layouts", nargs="*", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--samples", type=int, default=20, help="rank changes timed in the explorer")
    args = parser.parse_args()
    paths = args.layouts or sorted((ROOT / "sample_meshes").glob("*.toml"))
    print(f"machine: {machine()}\n")
    print("| layout | ranks | largest parameter | what | time | vs empty figure | smallest text |")
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        for row in bench_layout(path, args.repeat):
            print(row, flush=True)
    print("\n| layout | ranks | explore() build | rank change, first visits while the background draws | "
          "first visits | repeat visits | policy -> minimal |")
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        print(bench_explorer(path, args.samples), flush=True)


if __name__ == "__main__":
    main()
