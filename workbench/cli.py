"""The ``workbench`` command line: summaries of layouts and planned saves, simulated round trips, a demo.

Every subcommand is registered by a ``register(subparsers) -> None`` function that adds its parser and sets
``func`` (``args.func(args) -> int`` runs it). Subcommands of other packages are listed in ``_EXTENSIONS`` by
module name (one line each); their module must define ``register``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["build_parser", "main", "rank_list", "register_demo", "register_layout", "register_plan",
           "register_simulate"]

# Modules whose ``register(subparsers)`` adds more subcommands, e.g. "workbench.debug.cli".
_EXTENSIONS: tuple[str, ...] = (
    "workbench.debug.cli",  # inspect, diff, diagnose
    "workbench.kernel.cli",  # kernel install / list / remove
)

_FORMATTER = argparse.RawDescriptionHelpFormatter


def rank_list(text: str) -> tuple[int, ...]:
    """argparse type of ``--rank``: ``5``, ``0,5``, ``0-7`` or a mix (``0,8-11``)."""
    from workbench.report.units import parse_ranks

    try:
        return parse_ranks(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _byte_count(text: str) -> int:
    from workbench.report.units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _writer_count(text: str) -> int:
    """argparse type of ``--max-writers``: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of writer ranks") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1 rank must write")
    return value


def _check_ranks(ranks: Sequence[int], layout: Any) -> None:
    """Ranks outside the layout's mesh are an error, before any work."""
    from workbench.report.units import format_ranks

    bad = [r for r in ranks if not 0 <= r < layout.mesh.size]
    if bad:
        raise ValueError(f"rank(s) {format_ranks(bad)} outside {layout.name!r}'s {layout.mesh.size} ranks "
                         f"(0-{layout.mesh.size - 1})")


def _check_policy_dims(policy: Any, layout: Any) -> None:
    """A policy naming a mesh dim the layout does not have (a typo) is an error, not a silent full save."""
    unknown = [d for d in getattr(policy, "mesh_dims", ()) if d not in layout.mesh.dim_names]
    if unknown:
        raise ValueError(f"policy {policy} names mesh dim(s) {unknown} that {layout.name!r} does not have; its mesh "
                         f"dims: {list(layout.mesh.dim_names)}")


def _policy(text: str) -> Any:
    from workbench.plan.policy import SavePolicy

    mode, _, dims = text.partition(":")
    names = [d for d in dims.split(",") if d]
    if mode in ("full", "minimal") and not names:
        return SavePolicy.full() if mode == "full" else SavePolicy.minimal()
    if mode == "preserve" and names:
        return SavePolicy.preserve(*names)
    if mode == "gather_only" and names:
        return SavePolicy.gather_only(*names)
    raise argparse.ArgumentTypeError(
        f"policy {text!r}: use minimal (save_hf's default), full, preserve:DIM[,DIM] or gather_only:DIM[,DIM]"
    )


def _round_trip_policy(text: str) -> Any:
    """argparse type of ``simulate --policy``: a policy whose saves are HF-keyed, so a round trip can compare them."""
    from workbench.run.round_trip import check_round_trip_policy

    try:
        policy = _policy(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"policy {text!r}: use minimal (save_hf's default), full or "
                                         "preserve:DIM[,DIM]") from None
    try:
        return check_round_trip_policy(policy)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be simulated: {exc}") from None


def _add_rank(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--rank", type=rank_list, default=None, metavar="RANKS",
                        help=f"ranks to show: '5', '0,5', '0-7' or a mix like '0,8-11' (default: {default})")


def _add_output(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--full", action="store_true", help=f"list {what} instead of the summary")
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON (exact byte counts; with --full, every line's data too)")


def _subparser(subparsers: Any, name: str, *, help: str, description: str, examples: Sequence[str]
               ) -> argparse.ArgumentParser:
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    return subparsers.add_parser(name, help=help, description=description, epilog=epilog, formatter_class=_FORMATTER)


# -- layout ------------------------------------------------------------------------------------------------
def register_layout(subparsers: Any) -> None:
    """``workbench layout``: what ranks hold, summarized by layer pattern."""
    p = _subparser(
        subparsers, "layout",
        help="summarize what ranks hold of every HF key, with totals, outlier ranks and coverage",
        description="Load a layout file (TOML, see sample_meshes/README.md) and summarize it: problems first "
        "(coverage holes or overlaps, empty ranks, uneven shards), the coverage count, the ranks holding the "
        "most and least bytes, then per rank its parameters grouped by layer pattern with local shapes and "
        "human-unit sizes. --full lists every key region and every coverage verdict.",
        examples=[
            "workbench layout sample_meshes/deepseek_v3_671b.toml --rank 0",
            "workbench layout sample_meshes/toy_expert_tp.toml --rank 4-5 --param '*experts*' --full",
            "workbench layout sample_meshes/qwen3_30b_a3b.toml --json",
        ],
    )
    p.add_argument("path", help="layout file, e.g. sample_meshes/toy_expert_tp.toml")
    _add_rank(p, "every rank of a mesh of <= 16 ranks, else 0")
    p.add_argument("--param", default=None, help="glob on parameter names, e.g. '*experts*'")
    p.add_argument("--max-keys", type=int, default=12, help="with --full: key regions shown per rank and parameter")
    _add_output(p, "every key region of every parameter")
    p.set_defaults(func=_run_layout)


def _run_layout(args: argparse.Namespace) -> int:
    from workbench.layout.layout_file import load_layout
    from workbench.report.layout_report import summarize_layout

    layout = load_layout(args.path)
    report = summarize_layout(layout, ranks=args.rank, params=args.param, max_keys=args.max_keys,
                              hint="--full lists every key region")
    if args.json:
        print(json.dumps(report.to_dict(full=args.full), indent=1))
    else:
        print(report.full() if args.full else report)
    return 0 if report.ok else 1


# -- plan --------------------------------------------------------------------------------------------------
def register_plan(subparsers: Any) -> None:
    """``workbench plan``: a rank's save, its unshard schedule and what it writes."""
    p = _subparser(
        subparsers, "plan",
        help="summarize a save: per rank the all-gathers, predicted peak against the budget, bytes written",
        description="Plan the save of a layout as save_hf would (policy minimal unless told) and summarize it "
        "for the chosen ranks: problems first (a predicted peak over the budget, with the tensors too large "
        "for it and their sizes; writers carrying far more bytes than the mean), then the writers, then per "
        "rank what it receives, its predicted peak, what it writes and its calls grouped by mesh dim. "
        "--full lists every call; --param lists the save plans of matching parameters.",
        examples=[
            "workbench plan sample_meshes/toy_expert_tp.toml --rank 5 --budget 200B",
            "workbench plan sample_meshes/deepseek_v3_671b.toml --rank 0 --budget 4GiB --policy full",
            "workbench plan sample_meshes/qwen3_30b_a3b.toml --rank 0,8 --policy preserve:ep --json",
        ],
    )
    p.add_argument("path", help="layout file")
    _add_rank(p, "0")
    p.add_argument("--budget", type=_byte_count, default=None,
                   help="memory budget of the unshard schedule, e.g. 256MiB, 4GiB (default: none)")
    p.add_argument("--policy", type=_policy, default=None,
                   help="minimal (default, as save_hf), full, preserve:ep, gather_only:fsdp")
    p.add_argument("--param", default=None, help="glob on parameter names whose save plans to list")
    p.add_argument("--max-writers", type=_writer_count, default=None, help="cap the number of writer ranks")
    p.add_argument("--write-mode", choices=("direct", "gather"), default="direct",
                   help="direct (default, as save_hf on one host or a shared filesystem): tensors whose pieces make "
                   "long byte segments are written in place by their holders and only the rest is scheduled; "
                   "gather: every key goes through the schedule to a writer")
    p.add_argument("--min-segment", type=_byte_count, default=None,
                   help="direct mode: average segment length below which a tensor is gathered (default: what "
                   "save_hf uses, 0 on one host, where short segments go through a memory map and nothing is "
                   "gathered; 64KiB with --across-hosts)")
    p.add_argument("--across-hosts", action="store_true",
                   help="plan as save_hf does when the ranks span several hosts (direct mode gathers tensors "
                   "whose segments are shorter than 64KiB)")
    _add_output(p, "every gather call")
    p.set_defaults(func=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from workbench.layout.layout_file import load_layout
    from workbench.plan.policy import SavePolicy
    from workbench.plan.save_set import key_sizes, plan_save_within_writers
    from workbench.report.save_report import summarize_save

    layout = load_layout(args.path)
    ranks = args.rank or (0,)
    _check_ranks(ranks, layout)
    policy = args.policy or SavePolicy.minimal()
    _check_policy_dims(policy, layout)
    direct: tuple[str, ...] = ()
    capped = args.max_writers is not None and args.max_writers < layout.mesh.size  # save_hf writes nothing in place
    if args.write_mode == "direct" and policy.mode in ("full", "minimal") and not capped:
        from workbench.io.files.direct import DEFAULT_MIN_SEGMENT_BYTES, direct_names
        from workbench.layout.model_layout import Layout
        from workbench.plan.save_set import key_meta

        meta = key_meta(layout, {n: layout.dtype(n) for n in layout}, None, None)
        default = DEFAULT_MIN_SEGMENT_BYTES if args.across_hosts else 0  # what save_hf picks
        minimum = default if args.min_segment is None else args.min_segment
        direct = direct_names(layout, meta, minimum)
        skip = set(direct)
        layout = Layout(layout.mesh, {n: sp for n, sp in layout.specs.items() if n not in skip},
                        {n: d for n, d in layout.dtypes.items() if n not in skip}, name=layout.name) \
            if skip else layout
    if direct and not layout.specs:
        if args.json:
            print(json.dumps({"write_mode": "direct", "direct_tensors": list(direct), "ranks": {}}, indent=1))
        else:
            print(f"write mode direct: all {len(direct)} tensors written in place by their holders; nothing to "
                  "gather, no schedule (--write-mode gather shows the gather path)")
        return 0
    plan_set = plan_save_within_writers(layout, ranks=ranks, policy=policy, budget_bytes=args.budget,  # as save_hf
                                        max_writers=args.max_writers)
    sizes = key_sizes(layout, {n: layout.dtype(n) for n in layout}, None, None)
    report = summarize_save(layout, plan_set, ranks=ranks, params=args.param, key_bytes=sizes,
                            hint="--full lists every call")
    if args.json:
        data = report.to_dict(full=args.full)
        data["write_mode"] = args.write_mode
        data["direct_tensors"] = list(direct)
        print(json.dumps(data, indent=1))
        return 0
    if args.write_mode == "direct":
        what = (f"{len(direct)} tensor(s) written in place by their holders (no gather); the schedule below "
                f"covers the {len(layout.specs)} gathered (pieces shorter than the minimum segment)"
                if direct else "no tensor written in place (every one's pieces are short, or the policy keeps cuts)")
        print(f"write mode direct: {what}")
    print(report.full() if args.full else report)
    return 0


# -- simulate ----------------------------------------------------------------------------------------------
def register_simulate(subparsers: Any) -> None:
    """``workbench simulate``: a bit-exact round trip through every rank, in memory."""
    p = _subparser(
        subparsers, "simulate",
        help="load random tensors into every rank of a layout, save them back in memory, compare bit for bit",
        description="Run the real load plans, unshard schedule and executor for every rank of a (small) layout "
        "in one process: random HF tensors are loaded into each rank, saved back, and compared with the "
        "originals bit for bit. Exit status 0 when exact. --rank also summarizes those ranks' save.",
        examples=[
            "workbench simulate sample_meshes/toy_expert_tp.toml",
            "workbench simulate sample_meshes/toy_expert_tp.toml --policy full --budget 200B --rank 0-1",
        ],
    )
    p.add_argument("path", help="layout file (small: it holds every rank's tensors in memory)")
    _add_rank(p, "none")
    p.add_argument("--budget", type=_byte_count, default=None, help="memory budget of the save schedule")
    p.add_argument("--policy", type=_round_trip_policy, default=None,
                   help="minimal (default, as save_hf), full or preserve:DIM[,DIM] such as preserve:ep (gather_only "
                   "saves no HF checkpoint: use plan for it)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    import math

    from workbench.layout.layout_file import load_layout
    from workbench.plan.policy import SavePolicy
    from workbench.report.save_report import summarize_save
    from workbench.report.units import format_bytes, format_count
    from workbench.run.round_trip import simulate_round_trip
    from workbench.run.simulated import plan_save

    layout = load_layout(args.path)
    _check_ranks(args.rank or (), layout)
    total = sum(math.prod(spec.visible_shape) * layout.dtype(name).itemsize for name, spec in layout.specs.items())
    if total * 3 > 2 << 30:
        print(f"workbench: error: {layout.name} holds {format_bytes(total)}; simulating every rank in memory needs "
              "about 3x that. Use a small layout (sample_meshes/toy_expert_tp.toml).", file=sys.stderr)
        return 2
    policy = args.policy or SavePolicy.minimal()
    _check_policy_dims(policy, layout)
    result = simulate_round_trip(layout, budget_bytes=args.budget, policy=policy)
    if args.json:
        print(json.dumps({"kind": "round_trip", "layout": result.layout, "policy": str(policy), "ranks": result.ranks,
                          "hf_keys": result.keys, "bytes": result.bytes, "exact": result.exact,
                          "mismatched": list(result.mismatched), "writers": result.writers, "calls": result.calls,
                          "peak_bytes": result.peak_bytes}, indent=1))
        return 0 if result.exact else 1
    bad = list(result.mismatched[:5])
    verdict = "bit-exact" if result.exact else f"MISMATCH in {len(result.mismatched)} keys: {bad}"
    print(f"round trip {result.layout} [{policy}]: {format_count(result.keys)} HF keys ({format_bytes(result.bytes)}) "
          f"loaded into {result.ranks} ranks, saved back by {result.writers} writer ranks in {result.calls} gather "
          f"calls (predicted peak {format_bytes(result.peak_bytes)} per rank): {verdict}")
    if args.rank:
        plan_set = plan_save(layout, ranks=args.rank, policy=policy, budget_bytes=args.budget)
        print()
        print(summarize_save(layout, plan_set, ranks=args.rank))
    return 0 if result.exact else 1


# -- demo --------------------------------------------------------------------------------------------------
def register_demo(subparsers: Any) -> None:
    """``workbench demo``: a real save and reload on 4 local gloo ranks."""
    p = _subparser(
        subparsers, "demo",
        help="save a sharded model from 4 local gloo ranks, reload it into another topology, check bit for bit",
        description="Write a small Qwen3-MoE checkpoint, launch 4 gloo ranks that load it laid out EP2 x ETP2 "
        "(interleaved expert TP) under FSDP2 and save it with save_hf, reload the result into FSDP2 x EP2, and "
        "check every key bit for bit. The temporary folder is removed afterwards unless --dir is given.",
        examples=["workbench demo", "workbench demo --dir /tmp/wb-demo   # keep the checkpoints"],
    )
    p.add_argument("--dir", default=None, help="where to write the checkpoints, kept afterwards "
                   "(default: a temporary folder, removed at the end)")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from workbench.demo import run_demo

    return 0 if run_demo(4, args.dir) else 1


# -- entry point -------------------------------------------------------------------------------------------
_BUILTIN: tuple[Callable[[Any], None], ...] = (register_layout, register_plan, register_simulate, register_demo)


def build_parser() -> argparse.ArgumentParser:
    """The ``workbench`` parser with every subcommand: the built-in ones, then each of ``_EXTENSIONS``."""
    parser = argparse.ArgumentParser(
        prog="workbench",
        description="Derive, plan, show and debug sharded HuggingFace checkpoints of DTensor training runs.",
        epilog="examples:\n  workbench layout sample_meshes/toy_expert_tp.toml\n"
        "  workbench plan sample_meshes/deepseek_v3_671b.toml --rank 0 --budget 4GiB\n"
        "run 'workbench COMMAND --help' for a command's options",
        formatter_class=_FORMATTER,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in _BUILTIN:
        register(sub)
    for module in _EXTENSIONS:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``workbench`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    try:
        return int(func(args))
    except BrokenPipeError:  # `workbench layout ... | head`: the reader left; say nothing more
        sys.stderr.close()
        return 0
    except (OSError, ValueError) as exc:  # WorkbenchError, unreadable files, bad ranks/globs: a message, no traceback
        message = str(exc)
        path = getattr(args, "path", None)
        if isinstance(path, str) and path not in message:  # e.g. a decoding error: say which file it was
            message = f"{path}: {message}"
        print(f"workbench: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
