"""``workbench kernel install|list|remove``: manage the launcher kernel's Jupyter kernelspecs."""

from __future__ import annotations

import argparse
import sys

__all__ = ["register"]

_INSTALL_EXAMPLE = """examples:
  workbench kernel install --nprocs 4                      # 4 local gloo ranks, in this environment
  workbench kernel install --nprocs 8 --backend nccl --name gpu8 --user
  workbench kernel install --nprocs 0 --listen login-node:5555 --backend nccl --name cluster
      # ranks started by your scheduler join with (%ranks_connect prints it; the token stays in a 0600 file):
      #   torchrun ... -m workbench.kernel.worker --connect tcp://login-node:5555 --token-file PATH
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``kernel`` command (with ``install``, ``list``, ``remove``) to the ``workbench`` parser."""
    kernel = subparsers.add_parser(
        "kernel", help="install the SPMD launcher kernel: every notebook cell runs on every rank",
        description="Manage Jupyter kernels whose cells run on every rank of a torch.distributed job.\n"
        "\nexamples:\n  workbench kernel install --nprocs 4 --backend gloo --name workbench-4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kernel.set_defaults(func=lambda args: (kernel.print_help(), 0)[1])
    sub = kernel.add_subparsers(dest="kernel_command", metavar="SUBCOMMAND")
    install = sub.add_parser(
        "install", help="install a kernelspec (N local ranks, or ranks that join from a scheduler)",
        description="Install a Jupyter kernelspec for the workbench SPMD kernel.\n\n" + _INSTALL_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    install.add_argument("--nprocs", type=int, required=True, help="local ranks the kernel starts (0: --listen)")
    install.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="process group backend")
    install.add_argument("--name", default=None, help="kernelspec name (default workbench-BACKEND-N)")
    where = install.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install into your user Jupyter directory")
    where.add_argument("--prefix", default=None, help="install into PREFIX/share/jupyter/kernels (default: "
                       "this Python environment)")
    install.add_argument("--listen", default=None, metavar="HOST:PORT",
                         help="also accept ranks started by a scheduler (torchrun ... --connect); HOST defaults "
                         "to 127.0.0.1, 0.0.0.0 binds every interface (with a warning)")
    install.add_argument("--hang-timeout", type=float, default=None, metavar="SECONDS",
                         help="report every rank's stack when a cell runs longer (default: never)")
    install.add_argument("--hang-action", choices=("report", "interrupt"), default="report",
                         help="after the hang report: keep waiting (report) or interrupt every rank")
    install.add_argument("--join-timeout", type=float, default=None, metavar="SECONDS",
                         help="how long a cell waits for every rank of the job to join (default 300; %%join_timeout)")
    install.add_argument("--dead-after", type=float, default=None, metavar="SECONDS",
                         help="a rank silent this long whose connection is gone is lost: the cell ends naming it "
                         "and the job's other ranks exit (default 30; %%dead_after)")
    install.add_argument("--keep-sockets", action="store_true",
                         help="to free ranks stuck in a gloo collective, only destroy the process groups, without "
                         "closing the ranks' TCP connections (ranks whose groups a device mesh holds then need a "
                         "restart)")
    install.add_argument("--live", choices=("on", "off"), default="on",
                         help="while a cell runs longer than a second, show what each rank is doing, updated in "
                         "place (default on; %%live)")
    install.add_argument("--flight-recorder", choices=("on", "off"), default=None,
                         help="hang reports add every rank's last collectives from torch's flight recorder (on also "
                         "sizes it for local ranks; default: on when TORCH_FR_BUFFER_SIZE or "
                         "TORCH_NCCL_TRACE_BUFFER_SIZE is set; %%flight_recorder)")
    install.add_argument("--display-name", default=None, help="name shown in JupyterLab's launcher")
    install.set_defaults(func=_install)
    listing = sub.add_parser(
        "list", help="list installed workbench kernels",
        description="List the workbench kernels Jupyter can see.\n\nexamples:\n  workbench kernel list",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    listing.add_argument("--prefix", default=None, help="also look under PREFIX/share/jupyter/kernels")
    listing.set_defaults(func=_list)
    remove = sub.add_parser(
        "remove", help="remove an installed workbench kernel",
        description="Remove a workbench kernelspec (other kernels are refused).\n\n"
        "examples:\n  workbench kernel remove workbench-gloo-4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    remove.add_argument("name", help="kernelspec name, as `workbench kernel list` shows it")
    remove.add_argument("--prefix", default=None, help="also look under PREFIX/share/jupyter/kernels")
    remove.set_defaults(func=_remove)


def _install(args: argparse.Namespace) -> int:
    from workbench.kernel.spec import install_kernel

    try:
        path = install_kernel(nprocs=args.nprocs, backend=args.backend, name=args.name, user=args.user,
                              prefix=args.prefix, listen=args.listen, hang_timeout=args.hang_timeout,
                              hang_action=args.hang_action, display_name=args.display_name,
                              close_sockets=not args.keep_sockets, join_timeout=args.join_timeout,
                              dead_after=args.dead_after, live=args.live == "on",
                              flight_recorder=None if args.flight_recorder is None else args.flight_recorder == "on")
    except ValueError as exc:
        print(f"workbench: error: {exc}", file=sys.stderr)
        return 2
    print(f"installed kernel {path.rstrip('/').rsplit('/', 1)[-1]} in {path}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from workbench.kernel.spec import list_kernels

    kernels = list_kernels(args.prefix)
    if not kernels:
        print("no workbench kernels installed (workbench kernel install --nprocs 4)")
    for info in kernels:
        print(info)
    return 0


def _remove(args: argparse.Namespace) -> int:
    from workbench.kernel.spec import remove_kernel

    try:
        path = remove_kernel(args.name, args.prefix)
    except KeyError as exc:
        print(f"workbench: error: {exc.args[0]}", file=sys.stderr)
        return 1
    print(f"removed {path}")
    return 0
