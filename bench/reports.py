"""Lines and seconds of one rank's summary for every sample layout (``workbench layout/plan --rank 0``).

For each layout in sample_meshes/: the layout summary of rank 0 (``str(summarize_layout(...))``) against the
full listing of the same rank (``.full()``, what ``workbench layout`` printed before), and the save summary of
rank 0 (``summarize_save``) under the ``full`` and ``minimal`` policies with a 4 GiB budget (planning time
included: it is what ``workbench plan`` costs). Each figure is the best of ``--repeat`` runs.

    .venv/bin/python bench/reports.py [--repeat 3] [--skip-minimal]
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from workbench.layout.layout_file import load_layout
from workbench.plan.policy import SavePolicy
from workbench.report import summarize_layout, summarize_save
from workbench.run.simulated import plan_save

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]


def _best(fn: Callable[[], str], repeat: int) -> tuple[float, str]:
    best, out = float("inf"), ""
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    """Print one Markdown table row per sample layout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-minimal", action="store_true", help="skip the minimal-policy save summary")
    args = parser.parse_args()
    print(f"# {platform.machine()}, {platform.python_version()}, torch {torch.__version__}")
    print("| layout | ranks | summary lines | summary s | full lines | full s | plan [full] lines | plan [full] s "
          "| plan [minimal] lines | plan [minimal] s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    budget = 4 << 30
    for path in sorted((ROOT / "sample_meshes").glob("*.toml")):
        layout = load_layout(path)
        t_sum, summary = _best(lambda layout=layout: str(summarize_layout(layout, ranks=[0])), args.repeat)
        t_full, full = _best(lambda layout=layout: summarize_layout(layout, ranks=[0]).full(), args.repeat)

        def plan(policy: SavePolicy, layout=layout) -> str:
            plan_set = plan_save(layout, ranks=[0], policy=policy, budget_bytes=budget)
            return str(summarize_save(layout, plan_set, ranks=[0]))

        t_pf, pf = _best(lambda: plan(SavePolicy.full()), args.repeat)
        if args.skip_minimal:
            t_pm, pm = float("nan"), ""
        else:
            t_pm, pm = _best(lambda: plan(SavePolicy.minimal()), 1)
        print(f"| {layout.name} | {layout.mesh.size} | {len(summary.splitlines())} | {t_sum:.2f} | "
              f"{len(full.splitlines())} | {t_full:.2f} | {len(pf.splitlines())} | {t_pf:.2f} | "
              f"{len(pm.splitlines()) if pm else '-'} | {t_pm:.2f} |", flush=True)


if __name__ == "__main__":
    main()
