"""The fault tally: >= 50 injected crashes in saves and loads on real gloo ranks; 0 hangs, 0 partial publishes.

Runs, from ``tests/faults/harness.py``:

* every save point (plan, snapshot, gather wave, write, fsync, status, index, rename, cleanup), sync and async,
  with a rotating action (OSError, EFBIG, ENOSPC, MemoryError, a bug) on a random rank, plus a real EFBIG through
  RLIMIT_FSIZE and every load point, on 2 ranks and on 4 (EP x FSDP, where failures must cross groups);
* SIGKILL of one rank, at a random armed point or after a random delay, in separate launches.

Usage: ``python bench/faults.py [--seeds 2] [--kills 12] [--json out.json]``. Prints a Markdown table for
``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workbench as wb
from tests.faults.harness import (
    Scenario,
    check_published,
    run_killed,
    run_scenarios,
    standard_scenarios,
    verdict,
    write_old_checkpoint,
)
from workbench.faults import SAVE_POINTS

DEADLINE = 30.0


def injected(world: int, seed: int, work: Path) -> list:
    scenarios = standard_scenarios(world, seed=seed)
    root, records = work / f"w{world}-s{seed}", work / f"w{world}-s{seed}-records"
    root.mkdir()
    records.mkdir()
    for scenario in scenarios:
        write_old_checkpoint(root / scenario.name)
    try:
        wb.launch(run_scenarios, nprocs=world, args=(str(root), str(records), scenarios, world), timeout=600)
    except wb.LaunchError as exc:
        print(f"launch failed: {exc}", file=sys.stderr)
    outcomes = {}
    for rank in range(world):
        record = records / f"rank{rank}.json"
        outcomes[rank] = json.loads(record.read_text()) if record.is_file() else {}
    return [verdict(root, s, outcomes, world, DEADLINE) for s in scenarios]


def killed(count: int, seed: int, work: Path) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        timed = i % 2 == 1
        point = rng.choice([p for p in SAVE_POINTS if p not in ("index", "rename", "cleanup")])
        scenario = Scenario(point, rng.randrange(2), "kill", async_save=rng.random() < 0.5,
                            policy=rng.choice(("minimal", "full")))
        root = work / f"kill{i}"
        root.mkdir()
        write_old_checkpoint(root / scenario.name)
        delay = rng.uniform(0.0, 1.5) if timed else None
        start = time.perf_counter()
        died = False
        try:
            wb.launch(run_killed, nprocs=2, args=(str(root), scenario, delay, 2), timeout=120)
        except wb.LaunchError as exc:
            died = True
            hung = any(f.timed_out for f in exc.failures)
        else:
            hung = False
        partial, problems = check_published(root, scenario, expect="either")
        out.append({"scenario": scenario.name + (f"-after-{delay:.2f}s" if timed else ""), "died": died,
                    "hangs": int(hung), "partial_publishes": partial, "problems": problems,
                    "seconds": time.perf_counter() - start})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=1, help="rounds of the standard scenarios per world size")
    parser.add_argument("--kills", type=int, default=12, help="SIGKILL launches")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="workbench-faults-"))
    start = time.perf_counter()
    verdicts = []
    for seed in range(args.seeds):
        for world in (2, 4):
            verdicts += injected(world, seed, work)
    kills = killed(args.kills, 100, work)
    elapsed = time.perf_counter() - start
    bad = [v for v in verdicts if not v.ok]
    bad += [k for k in kills if k["hangs"] or k["partial_publishes"] or k["problems"]]
    runs = len(verdicts) + len(kills)
    points = sorted({v.scenario.split("-")[0] for v in verdicts})
    print(f"machine: {platform.node()} ({platform.machine()}, {platform.processor() or 'cpu'}), "
          f"python {platform.python_version()}, torch {__import__('torch').__version__}")
    print("| runs | injected (raise) | SIGKILL | points | hangs | partial publishes | other problems | slowest raise | "
          "wall |")
    print("|---|---|---|---|---|---|---|---|---|")
    hangs = sum(v.hangs for v in verdicts) + sum(k["hangs"] for k in kills)
    partial = sum(v.partial_publishes for v in verdicts) + sum(k["partial_publishes"] for k in kills)
    other = sum(len(v.problems) for v in verdicts if not v.hangs) + sum(len(k["problems"]) for k in kills)
    slowest = max((v.seconds for v in verdicts), default=0.0)
    print(f"| {runs} | {len(verdicts)} | {len(kills)} | {len(points)} ({', '.join(points)}) | {hangs} | {partial} | "
          f"{other} | {slowest:.2f} s | {elapsed:.0f} s |")
    for item in bad:
        print("FAILED:", item if isinstance(item, dict) else f"{item.scenario}: {item.problems}")
    if args.json:
        args.json.write_text(json.dumps({"verdicts": [v.__dict__ if hasattr(v, "__dict__") else v for v in verdicts],
                                         "kills": kills}, default=str, indent=1))


if __name__ == "__main__":
    main()
