"""``python -m workbench.kernel install|list|remove``: the ``workbench kernel`` command on its own."""

from __future__ import annotations

import argparse
import sys

from workbench.kernel.cli import register


def _main() -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.kernel")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["kernel", *sys.argv[1:]])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(_main())
