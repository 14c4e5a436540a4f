"""Benchmark: the explorer's rank change on DeepSeek-V3 (or another sample layout), in Python and in Chromium.

Python side (``Explorer.update_seconds``, from the slider's new value to the last view updated), three kinds:
a jump to a rank far from any shown (drawn on the change: the SVG marks over the overview, the zoom panel and
the mesh), a step to the next rank once the background thread had its quiet moment (drawn ahead),
and a repeat visit. Also what a change sends (its one HTML value: the rank's text and every picture's inline
SVG marks) and what a parameter change sends once (the static PNGs).

Browser (``--browser``): the explorer in JupyterLab in headless Chromium (``tests/browser`` harness), from the
key press to the change painted, for steps right to new ranks, steps back and typed jumps, with the kernel's own
time and the machine's load (2-core machines shared with other jobs: read the load); and the floor, the same key
press on a bare slider whose kernel-side observer writes its value into an HTML widget, in the same page.

    .venv/bin/python bench/figures_explorer.py [sample_meshes/deepseek_v3_671b.toml] [--samples 12] [--browser]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from workbench import load_layout
from workbench.viz.widgets import Explorer

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    return f"{platform.machine()}, {os.cpu_count()} CPU(s), Python {platform.python_version()}, load average {load}"


def fmt(values: list[float]) -> str:
    return f"median {statistics.median(values):.0f} ms, max {max(values):.0f} ms (n={len(values)})"


def far_ranks(size: int, near: set[int], count: int, seed: int = 0) -> list[int]:
    """``count`` ranks, none of them in ``near`` nor next to an earlier pick (so each is drawn on the change)."""
    rng = random.Random(seed)
    picked: list[int] = []
    for rank in rng.sample(range(size), size):
        if rank not in near:
            picked.append(rank)
            near |= {rank + d for d in range(-70, 71)}
        if len(picked) == count:
            break
    return picked


def python_side(path: Path, samples: int) -> list[str]:
    layout = load_layout(path)
    param = max(layout.specs, key=lambda n: math.prod(layout.specs[n].global_shape))
    start = time.perf_counter()
    ex = Explorer(layout, param=param, rank=layout.mesh.size // 2)
    build = time.perf_counter() - start
    start = time.perf_counter()
    ex.settle()
    background = time.perf_counter() - start
    spec = layout.specs[param]
    shown = {ex.rank.value}
    jumps, steps, repeats, sent = [], [], [], []
    for rank in far_ranks(layout.mesh.size, set(shown), samples):
        ex.rank.value = rank
        jumps.append(ex.update_seconds * 1e3)
        sent.append(len(ex.rank_view.value.encode()))
        ex.settle()  # the ranks next to it are drawn ahead
        ex.rank.value = rank + 1 if rank + 1 < layout.mesh.size else rank - 1
        steps.append(ex.update_seconds * 1e3)
        ex.settle()
        ex.rank.value = rank
        repeats.append(ex.update_seconds * 1e3)
        ex.settle()
    base = sum(len(i.value) for i in (ex.offsets, ex.zoom_image, ex.mesh_image))
    return [
        f"| {layout.name} | {layout.mesh.size} | `{param}` {spec.global_shape} | {build:.2f} s "
        f"(+{background:.2f} s background) | {fmt(jumps)} | {fmt(steps)} | {fmt(repeats)} | "
        f"{statistics.median(sent) / 1024:.0f} KiB per change, {base / 1024:.0f} KiB once |"
    ]


def browser(path: Path) -> list[str]:
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    sys.path.insert(0, str(ROOT))  # the tests/browser harness
    from tests.browser.explorer_timing import FLOOR_CELL, JUMPS, time_floor, time_rank_changes
    from tests.browser.harness import JupyterLab, chromium_page, missing_reason
    from tests.browser.test_explorer_in_jupyterlab import _open_explorer

    reason = missing_reason()
    if reason:
        return [f"(browser skipped: {reason})"]
    root = Path(tempfile.mkdtemp(prefix="wb-bench-explorer-"))
    layout = load_layout(path)
    if layout.mesh.shape != (16, 64):
        raise SystemExit(f"--browser times DeepSeek-V3's 16 x 64 mesh (its ranks are fixed), not {layout.mesh!r}")
    param = max(layout.specs, key=lambda n: math.prod(layout.specs[n].global_shape))
    source = ("import workbench as wb\nimport workbench.viz\n"
              f"app = wb.viz.explore(wb.load_layout({str(path)!r}), param={param!r}, rank=512)\napp")
    notebook = new_notebook(cells=[new_code_cell(source), new_code_cell(FLOOR_CELL)])
    notebook.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nbformat.write(notebook, root / "explore.ipynb")
    load_before = os.getloadavg()[0]
    with JupyterLab(root) as lab, chromium_page() as page:
        app = _open_explorer(page, lab, "explore.ipynb")
        app.locator(".widget-html-content", has_text="drawn ahead").filter(has_text="all").wait_for(timeout=180_000)
        steps = [("step right, new rank", r, "right") for r in range(513, 521)]
        steps += [("step back, shown before", r, "left") for r in range(519, 511, -1)]
        steps += [("typed jump, far from any shown", r, "type") for r in JUMPS]
        timed = time_rank_changes(page, app, steps)
        floor = time_floor(page, 9)
    load_after = os.getloadavg()[0]
    rows = []
    for kind, got in timed.items():
        rows.append(f"| {layout.name} | {kind} | {fmt(got['browser_ms'])} | {fmt(got['kernel_ms'])} | "
                    f"{load_before:.1f} -> {load_after:.1f} |")
    rows.append(f"| {layout.name} | floor: a bare slider writing an HTML widget | {fmt(floor)} | - | "
                f"{load_before:.1f} -> {load_after:.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layouts", nargs="*", type=Path)
    parser.add_argument("--samples", type=int, default=12, help="jumps timed on the Python side")
    parser.add_argument("--browser", action="store_true", help="also time rank changes in JupyterLab + Chromium")
    args = parser.parse_args()
    paths = args.layouts or [ROOT / "sample_meshes" / "deepseek_v3_671b.toml"]
    print(f"machine: {machine()}\n")
    print("| layout | ranks | parameter | explore() build | jump (drawn on the change) | step (drawn ahead) | "
          "repeat | sent |")
    print("|---|---|---|---|---|---|---|---|")
    for path in paths:
        for row in python_side(path, args.samples):
            print(row, flush=True)
    if args.browser:
        print("\n| layout | change | key press to change painted (Chromium) | kernel's own time | load average |")
        print("|---|---|---|---|---|")
        for row in browser(paths[0]):
            print(row, flush=True)
    print(f"\nmachine at the end: {machine()}")


if __name__ == "__main__":
    main()
