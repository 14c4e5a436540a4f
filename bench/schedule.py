"""Benchmark: plan a save and its unshard schedule under memory budgets, for one rank and the whole world.

For each sample layout and budget it reports the calls, the predicted peak memory, and the bytes a rank
receives, next to the baseline of the same run without a budget (one call per (group, dtype) per round
over the whole model: XTuner's behaviour), and checks the targets:

* predicted peak <= budget + largest tensor;
* calls within 2x of the fewest the budget allows (per (mesh dim, dtype): total gathered bytes / budget), with
  look-ahead batching (the default) next to the same budget without it (``lookahead=False``), in the same run;
* one rank's whole save plan (plans, schedule, writer map) under ``minimal``, what every rank of ``save_hf``
  runs, well under a second; with ``--slow-baseline`` next to the path it replaced (every rank x every
  parameter planned to find each key's holders), timed in the same run, and checked to give the same writers;
* a repeated plan of the same save (the plan cache) under 1 ms per rank;
* planning the whole world (every rank's plans and schedule, checked against each other) in seconds.

    .venv/bin/python bench/schedule.py [--layouts qwen3_30b_a3b deepseek_v3_671b] [--world-ranks N] [--slow-baseline]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch

from workbench import load_layout
from workbench.layout.model_layout import Layout
from workbench.plan.policy import SavePolicy
from workbench.plan.save_plan import plan_hf_save
from workbench.plan.save_set import SavePlanSet, clear_plan_cache, key_sizes, plan_save
from workbench.plan.schedule import UnshardSchedule, schedule_unshard
from workbench.plan.writers import assign_writers, key_holders

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
BUDGETS = (256 * MiB, 1024 * MiB, 4096 * MiB)


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def min_calls(schedule: UnshardSchedule, budget: int) -> int:
    """Fewest calls a per-call byte budget allows: per (mesh dim, dtype), total gathered bytes / budget;
    a step whose tensor alone exceeds the budget (an oversized call) counts as one call of its own."""
    totals: dict[tuple, int] = {}
    alone = 0
    for call in schedule.calls:
        if call.oversized:
            alone += 1
            continue
        key = (call.mesh_dim, call.dtype)
        totals[key] = totals.get(key, 0) + sum(i.bound_numel for i in call.items) * call.dtype.itemsize
    return alone + sum(max(1, math.ceil(t / budget)) for t in totals.values())


def largest_tensor(plan_set: SavePlanSet, rank: int) -> int:
    return max(p.output_bytes for p in plan_set.plans[rank])


def slow_writers(layout: Layout, policy: SavePolicy) -> dict[str, int]:
    """The writer map the way plan_save found holders before geometry sharing: every rank's plan of every
    parameter (the baseline of the planning-speed fix)."""
    runtime = {n: layout.dtype(n) for n in layout}
    plans = {
        r: tuple(plan_hf_save(s, r, policy, runtime_dtype=runtime[n]) for n, s in layout.specs.items())
        for r in layout.mesh.all_ranks()
    }
    return assign_writers(key_holders(plans), key_sizes(layout, runtime, None, None), world=layout.mesh.all_ranks())


def planning_rows(layout: Layout, rank: int, slow_baseline: bool) -> list[str]:
    rows = ["| policy | one rank, cold | repeat (cached), median of 200 | every-rank baseline | same writers |",
            "|---|---|---|---|---|"]
    for policy in (SavePolicy.minimal(), SavePolicy.full()):
        clear_plan_cache()
        t0 = time.perf_counter()
        cold = plan_save(layout, ranks=[rank], policy=policy, budget_bytes=4096 * MiB)
        cold.plans[rank]  # plans are built lazily: count them
        t_cold = time.perf_counter() - t0
        repeats = []
        for _ in range(200):
            t0 = time.perf_counter()
            again = plan_save(layout, ranks=[rank], policy=policy, budget_bytes=4096 * MiB)
            repeats.append(time.perf_counter() - t0)
        assert again is cold
        t_repeat = statistics.median(repeats)
        baseline = same = "—"
        if slow_baseline and policy.mode == "minimal":
            t0 = time.perf_counter()
            want = slow_writers(layout, policy)
            baseline = f"{time.perf_counter() - t0:.2f} s"
            same = "yes" if list(want.items()) == list(cold.writers.items()) else "NO"
        rows.append(f"| {policy} | {t_cold * 1e3:.0f} ms | {t_repeat * 1e6:.0f} µs "
                    f"({'met' if t_repeat < 1e-3 else 'MISSED'} < 1 ms) | {baseline} | {same} |")
    return rows


def bench_layout(path: Path, world_ranks: int | None, slow_baseline: bool) -> list[str]:
    layout = load_layout(path)
    rank = 0
    rows = [f"### {layout.name}: {layout.mesh!r}, {len(layout)} tensors, {len(layout.hf_keys)} HF keys", ""]
    rows.append("| budget | waves | calls | min calls | calls / min | without look-ahead: calls (/ min) | "
                "predicted peak | budget + largest | peak target | receives / rank |")
    rows.append("|---|---|---|---|---|---|---|---|---|---|")
    for budget in (None, *BUDGETS):
        t0 = time.perf_counter()
        plan_set = plan_save(layout, ranks=[rank], budget_bytes=budget, cache=False)
        t_one = time.perf_counter() - t0
        s = plan_set.schedules[rank]
        big = largest_tensor(plan_set, rank)
        if budget is None:
            rows.append(f"| none (baseline) | {len(s.waves)} | {s.num_calls} | — | — | — | {gib(s.peak_bytes)} | — | "
                        f"— | {gib(s.bytes_moved)} |")
            continue
        runtime = {n: layout.dtype(n) for n in layout}
        plain = schedule_unshard(plan_set.plans[rank], runtime, budget, lookahead=False)  # the same run, no look-ahead
        assert plain.bytes_moved == s.bytes_moved
        low = min_calls(s, budget)
        ok = s.peak_bytes <= budget + big
        rows.append(
            f"| {budget // MiB} MiB | {len(s.waves)} | {s.num_calls} | {low} | {s.num_calls / low:.2f} | "
            f"{plain.num_calls} ({plain.num_calls / min_calls(plain, budget):.2f}) | "
            f"{gib(s.peak_bytes)} | {gib(budget + big)} | {'met' if ok else 'MISSED'} | {gib(s.bytes_moved)} |"
        )
    rows.append("")
    rows.append(f"Planning one rank (plans + schedule, full policy, 4 GiB budget): {t_one * 1e3:.0f} ms (last row).")
    rows.append("")
    rows += planning_rows(layout, rank, slow_baseline)
    rows.append("")
    ranks = list(layout.mesh.all_ranks())[:world_ranks]
    t0 = time.perf_counter()
    plan_save(layout, ranks=ranks, budget_bytes=1024 * MiB, cache=False)
    t_all = time.perf_counter() - t0
    rows.append(f"Planning {len(ranks)} ranks (every rank's plans and schedule, each checked against rank 0's): "
                f"{t_all:.2f} s.")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="*", default=["qwen3_30b_a3b", "deepseek_v3_671b"])
    parser.add_argument("--world-ranks", type=int, default=None, help="plan only the first N ranks as 'all'")
    parser.add_argument("--slow-baseline", action="store_true",
                        help="also time the every-rank holder search plan_save used before (DeepSeek: ~30 s)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}")
    for name in args.layouts:
        print("\n".join(bench_layout(ROOT / "sample_meshes" / f"{name}.toml", args.world_ranks, args.slow_baseline)))
        print()


if __name__ == "__main__":
    main()
