"""The ``workbench`` command line: inspect layouts now; plans, saves and checkpoint diagnosis grow here."""

from __future__ import annotations

import argparse
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
    return parser


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
    except WorkbenchError as exc:
        print(f"workbench: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
