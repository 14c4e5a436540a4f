"""The ``workbench`` command line: inspect layouts now; plans, saves and checkpoint diagnosis grow here."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from workbench.errors import WorkbenchError

__all__ = ["main"]


def _ranks(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        elif part:
            out.append(int(part))
    return out


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workbench",
        description="Derive, plan, show and debug sharded HuggingFace checkpoints of DTensor training runs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    layout = sub.add_parser(
        "layout",
        help="print what every rank holds of every HF key, and the coverage verdict",
        description="Load a layout file (TOML, see sample_meshes/README.md) and print, per rank, the "
        "region of every HF key it holds, then whether the ranks cover every element exactly once.",
    )
    layout.add_argument("path", help="layout file, e.g. sample_meshes/toy_expert_tp.toml")
    layout.add_argument("--rank", type=_ranks, default=None, help="ranks to show: '0', '0,5', '0-7'")
    layout.add_argument("--param", default=None, help="glob on parameter names, e.g. '*experts*'")
    layout.add_argument("--max-keys", type=int, default=12, help="key regions shown per rank and parameter")
    plan = sub.add_parser(
        "plan",
        help="print a rank's save plans and its unshard schedule (all-gather calls under a memory budget)",
    )
    plan.add_argument("path", help="layout file")
    plan.add_argument("--rank", type=int, default=0, help="the rank to show (default 0)")
    plan.add_argument("--budget", type=_bytes, default=None, help="memory budget, e.g. 256MiB, 4GiB (default: none)")
    plan.add_argument("--policy", type=_policy, default=None, help="full (default), preserve:ep, gather_only:fsdp")
    plan.add_argument("--param", default=None, help="glob on parameter names whose plans to print")
    simulate = sub.add_parser(
        "simulate",
        help="load random tensors into every rank of a layout, save them back in memory, compare bit for bit",
    )
    simulate.add_argument("path", help="layout file (small: it holds every rank's tensors in memory)")
    simulate.add_argument("--budget", type=_bytes, default=None, help="memory budget of the save schedule")
    simulate.add_argument("--policy", type=_policy, default=None, help="full (default) or preserve:ep")
    demo = sub.add_parser(
        "demo",
        help="save a sharded model from 4 local gloo ranks, reload it into another topology, check bit for bit",
    )
    demo.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    return parser


def _bytes(text: str) -> int:
    units = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * units[unit])
    return int(lowered)


def _policy(text: str) -> object:
    from workbench.plan.policy import SavePolicy

    mode, _, dims = text.partition(":")
    names = [d for d in dims.split(",") if d]
    if mode == "full" and not names:
        return SavePolicy.full()
    if mode == "preserve" and names:
        return SavePolicy.preserve(*names)
    if mode == "gather_only" and names:
        return SavePolicy.gather_only(*names)
    raise argparse.ArgumentTypeError(f"policy {text!r}: use full, preserve:DIM[,DIM] or gather_only:DIM[,DIM]")


def _run_plan(args: argparse.Namespace) -> int:
    import fnmatch

    from workbench.layout.layout_file import load_layout
    from workbench.run.simulated import plan_save

    layout = load_layout(args.path)
    plan_set = plan_save(layout, ranks=[args.rank], policy=args.policy, budget_bytes=args.budget)
    schedule = plan_set.schedules[args.rank]
    print(f"save of {layout.name} [{plan_set.policy}] on {layout.mesh!r}, rank {args.rank}")
    for plan in plan_set.plans[args.rank]:
        if args.param is not None and fnmatch.fnmatchcase(plan.name, args.param):
            print(plan)
    print(schedule)
    mine = sorted(k for k, r in plan_set.writers.items() if r == args.rank)
    print(f"rank {args.rank} writes {len(mine)} of {len(plan_set.writers)} HF keys "
          f"({len(set(plan_set.writers.values()))} writer ranks)")
    return 0


def _run_simulate(args: argparse.Namespace) -> int:
    from workbench.layout.layout_file import load_layout
    from workbench.run.round_trip import simulate_round_trip

    layout = load_layout(args.path)
    total = sum(
        math.prod(spec.visible_shape) * layout.dtype(name).itemsize for name, spec in layout.specs.items()
    )
    if total * 3 > 2 << 30:
        print(f"workbench: error: {layout.name} holds {total / 2**30:.1f} GiB; simulating every rank in memory "
              "needs about 3x that. Use a small layout (sample_meshes/toy_expert_tp.toml).", file=sys.stderr)
        return 2
    report = simulate_round_trip(layout, budget_bytes=args.budget, policy=args.policy)
    print(report)
    return 0 if report.exact else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``workbench`` console script."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "layout":
            from workbench.layout.layout_file import load_layout
            from workbench.viz.text import layout_report

            layout = load_layout(args.path)
            report = layout_report(layout, ranks=args.rank, params=args.param, max_keys=args.max_keys)
            print(report)
            return 0 if "NOT exact" not in report.splitlines()[-1] else 1
        if args.command == "plan":
            return _run_plan(args)
        if args.command == "simulate":
            return _run_simulate(args)
        if args.command == "demo":
            from workbench.demo import run_demo

            return 0 if run_demo(4, args.dir) else 1
    except WorkbenchError as exc:
        print(f"workbench: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
