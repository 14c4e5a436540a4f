"""``workbench inspect | diff | diagnose``: the debug subcommands; exit status 0 healthy, 1 findings, 2 unreadable,
3 internal error.

Unreadable input (a path that does not exist or is not a checkpoint, a layout file that cannot be read) exits 2
with a message naming the path on stderr; with ``--json`` the report still goes to stdout. Any other exception is a
bug of workbench, not a finding: it exits 3 with its last traceback line and a request to report it.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main", "register"]

_EXIT = """exit status: 0 healthy, 1 findings, 2 could not read (a path that does not exist or is not a
checkpoint, an unreadable layout file: the message, naming the path, goes to stderr), 3 internal error (a bug of
workbench: please report it)"""
INTERNAL_ERROR = 3
_INSPECT = """Summarize a checkpoint from its headers only (no tensor data is read): keys grouped by layer
pattern, shapes, dtypes, bytes per file, parameter count, index consistency, unfinished saves beside it
and workbench's layout fingerprint.

examples:
  workbench inspect exp/hf-100
  workbench inspect exp/dcp-100 --allow-pickle --json"""
_DIFF = """Compare checkpoint B with the reference A key by key; for every tensor that differs, name the
transform that reproduces it exactly (interleave gathered as contiguous, rank order, gate/up swap,
transpose, replicated concat, one shard only, untrimmed padding, renamed keys, dtype round trips).

A checkpoint saved by workbench carries the layout it was saved with (workbench_layout.toml): each differing
key then names the ranks whose shards differ, and each missing key the ranks that held it.

examples:
  workbench diff exp/hf-100-good exp/hf-100
  workbench diff exp/good exp/suspect --layout sample_meshes/toy_expert_tp.toml --json
  workbench diff exp/good exp/suspect --layout my_model.toml     # written by wb.save_layout(layout, path)"""
_DIAGNOSE = """Say what is wrong with a checkpoint, judged against a reference checkpoint (values compared)
or a layout file (keys, shapes and dtypes; shape bugs named from the layout's cuts).

examples:
  workbench diagnose exp/hf-100 --expected exp/hf-100-good
  workbench diagnose exp/hf-100 --expected exp/hf-100-good --layout exp/hf-90   # the layout exp/hf-90 was saved with
  workbench diagnose exp/hf-100 --expected sample_meshes/toy_expert_tp.toml --json"""


_LAYOUT_HELP = ("the training layout: a layout file (TOML, e.g. written by wb.save_layout) or a checkpoint folder "
                "that carries one (workbench_layout.toml); its cuts are tried first and its ranks named")

_BLOCK_HELP = "largest read at once: 1 byte or more, e.g. 4096, 64KiB, 32MiB (default 32MiB)"


def _block(text: str) -> int:
    """argparse type of ``--block-size``: a whole number of bytes >= 1, optionally with a unit (``64B``,
    ``512KiB``, ``32MiB``, ``1GiB``)."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
    lowered = text.strip().lower()
    number, size = lowered, 1
    for unit, unit_size in units.items():
        if lowered.endswith(unit):
            number, size = lowered[: -len(unit)], unit_size
            break
    try:
        value = int(number) if size == 1 else int(float(number) * size)
    except (ValueError, OverflowError):  # not a number, nan or inf
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, e.g. 4096, 64KiB or 32MiB)"
                                         ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1 byte (the largest read at "
                                         f"once), got {value}")
    return value


def register(subparsers: Any) -> None:
    """Add ``inspect``, ``diff`` and ``diagnose`` to a parser's subparsers (each sets ``func``)."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser("inspect", help="summarize a checkpoint's headers (no tensor data read)",
                              description=_INSPECT, epilog=_EXIT, formatter_class=fmt)
    p.add_argument("path", help="HF folder, .safetensors file, or DCP folder")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read a DCP folder's .metadata (a pickle: only for checkpoints you trust)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_guarded("inspect", _inspect))

    p = subparsers.add_parser("diff", help="compare checkpoint B with reference A and explain each difference",
                              description=_DIFF, epilog=_EXIT, formatter_class=fmt)
    p.add_argument("a", help="the reference checkpoint")
    p.add_argument("b", help="the checkpoint to judge")
    p.add_argument("--layout", default=None, help=_LAYOUT_HELP)
    p.add_argument("--block-size", type=_block, default=32 << 20, help=_BLOCK_HELP)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_guarded("diff", _diff))

    p = subparsers.add_parser("diagnose", help="what is wrong with a checkpoint, against a reference or layout",
                              description=_DIAGNOSE, epilog=_EXIT, formatter_class=fmt)
    p.add_argument("path", help="the checkpoint to judge")
    p.add_argument("--expected", required=True, help="reference checkpoint, or layout file (.toml)")
    p.add_argument("--layout", default=None, help="with a reference checkpoint: " + _LAYOUT_HELP)
    p.add_argument("--block-size", type=_block, default=32 << 20, help=_BLOCK_HELP)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_guarded("diagnose", _diagnose))


def _guarded(command: str, run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``run`` with an unexpected exception (neither ``OSError`` nor ``ValueError``: those are unreadable input)
    turned into exit status 3 and one line on stderr, so that a crash is never read as status 1 (findings)."""

    @functools.wraps(run)
    def guarded(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except (OSError, ValueError):
            raise
        except Exception as exc:
            return _internal_error(command, exc)

    return guarded


def _internal_error(command: str, exc: Exception) -> int:
    """Exit status 3: the traceback's last line and where it was raised, with a request to report it."""
    last = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" (at {last.filename}:{last.lineno})" if last else ""
    line = traceback.format_exception_only(type(exc), exc)[-1].strip()
    print(f"workbench {command}: internal error, not a finding about the checkpoint: {line}{where}; please report "
          "it with the command line", file=sys.stderr)
    return INTERNAL_ERROR


_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")  # C0 and C1 controls, newline kept


def _printable(text: str) -> str:
    """``text`` with every control character but newline escaped (``\\x1b``): a key read from a checkpoint must not
    drive the terminal (clear it, move the cursor, retitle the window)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def _emit(command: str, result: Any, as_json: bool) -> int:
    """Print a report and return its exit status. An unreadable subject or reference (status 2 with an error) is an
    error: its text, which names the path, goes to stderr; ``--json`` still prints the report to stdout. A report
    read but not checked (status 2, a DCP folder not unpickled) goes to stdout like any other."""
    status = result.exit_status
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    if status == 2 and (getattr(result, "error", "") or not getattr(result, "unchecked", "")):
        print(_printable(f"workbench {command}: {result.to_text()}"), file=sys.stderr)
    elif not as_json:
        print(_printable(result.to_text()))
    return status


def _load_layout(path: str | None, *, pipelines: bool = True) -> Any:
    """The layout a ``--layout`` (or ``--expected``) argument names: a layout file or a checkpoint folder carrying
    one. With ``pipelines``, a pipeline's (a ``[pipeline]`` table) is read as a ``PipelineLayout``, whose stages say
    which global ranks held what; else every layout is read as one mesh (the whole model's keys, shapes, dtypes)."""
    if path is None:
        return None
    from pathlib import Path

    from workbench.errors import LayoutFileError
    from workbench.layout.layout_file import LAYOUT_FILE_NAME, checkpoint_layout_path
    from workbench.layout.pipeline import load_any_layout

    if Path(path).is_dir():
        carried = checkpoint_layout_path(path)
        if carried is None:
            raise LayoutFileError(f"--layout {path}: a folder without {LAYOUT_FILE_NAME}; give a layout file (TOML)")
        path = str(carried)
    return load_any_layout(path, pipelines=pipelines)  # parsed once: a pipeline's is one with a pipeline table


def _inspect(args: argparse.Namespace) -> int:
    from workbench.debug.inspect import inspect_checkpoint

    try:
        inspection = inspect_checkpoint(args.path, allow_pickle=args.allow_pickle)
    except (OSError, ValueError) as exc:  # inspect_checkpoint reports damage as findings; this is anything else
        return _unreadable("inspect", exc, args.path, [args.path])
    return _emit("inspect", inspection, args.json)


def _unreadable(command: str, exc: Exception, subject: str, paths: Sequence[str | None]) -> int:
    """Exit status 2 with one line on stderr. An error that names none of ``paths`` (what the command was given)
    is said of ``subject`` (e.g. ``'B against A'``), so the line always says what could not be read."""
    message = str(exc)
    if not any(p and p in message for p in paths):
        message = f"{subject}: {message}"
    print(f"workbench {command}: {type(exc).__name__}: {message}", file=sys.stderr)
    return 2


def _diff(args: argparse.Namespace) -> int:
    from workbench.debug.diff import diff_checkpoints

    try:
        report = diff_checkpoints(args.a, args.b, layout=_load_layout(args.layout), block_bytes=args.block_size)
    except (OSError, ValueError) as exc:  # an unreadable layout file, a read that failed: could not judge (2)
        return _unreadable("diff", exc, f"{args.b} against {args.a}", [args.a, args.b, args.layout])
    return _emit("diff", report, args.json)


def _diagnose(args: argparse.Namespace) -> int:
    from workbench.debug.diagnose import diagnose

    try:
        # a layout file as the expected side is read here, so that an unreadable one is named like --layout's
        expected = _load_layout(args.expected, pipelines=False) if args.expected.endswith(".toml") else args.expected
        report = diagnose(args.path, expected, layout=_load_layout(args.layout), block_bytes=args.block_size)
    except (OSError, ValueError) as exc:
        return _unreadable("diagnose", exc, f"{args.path} against {args.expected}",
                           [args.path, args.expected, args.layout])
    return _emit("diagnose", report, args.json)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one debug subcommand (``python -m workbench.debug.cli inspect PATH``); return its exit status."""
    parser = argparse.ArgumentParser(prog="workbench", description="Debug sharded HF checkpoints.")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (OSError, ValueError) as exc:  # unreadable input of any kind: status 2, one line
        print(f"workbench {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
