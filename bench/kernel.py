"""Launcher kernel: start-up with N ranks and a no-op cell's round trip, against a plain ipykernel (same run).

    .venv/bin/python bench/kernel.py [--nprocs 4] [--cells 100] [--backend gloo|nccl] [--compare SRC]

``--compare SRC`` also measures the SPMD kernel of another source tree (e.g. ``git archive`` of an older commit
unpacked into SRC), in the same run, for before/after numbers on one machine.

Round trip = execute_request sent -> execute_reply received and the cell's iopub idle seen (what a notebook
waits for). Start-up = kernel process start -> first cell answered (for the SPMD kernel: every rank started by
torch's elastic agent, process group initialized, joined over ZMQ).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kernel.support import execute
from workbench.run.kernel.spec import install_kernel


def _measure(kernel_name: str, cells: int, source: str | None = None) -> tuple[float, list[float]]:
    from jupyter_client.manager import start_new_kernel

    env, where = dict(os.environ), {}
    if source is not None:  # the kernel and its ranks import workbench from there (-m puts the cwd first)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
        where = {"cwd": source}
    start = time.perf_counter()
    manager, client = start_new_kernel(kernel_name=kernel_name, startup_timeout=300, env=env, **where)
    try:
        first = execute(client, "pass", timeout=300)
        assert first.reply["status"] == "ok", first.reply
        startup = time.perf_counter() - start
        for _ in range(5):  # warm-up
            execute(client, "pass")
        times = []
        for _ in range(cells):
            t = time.perf_counter()
            execute(client, "pass")
            times.append(time.perf_counter() - t)
        return startup, times
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--cells", type=int, default=100)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--compare", metavar="SRC", default=None,
                        help="also measure the SPMD kernel of the workbench source tree SRC (same run)")
    args = parser.parse_args()
    prefix = tempfile.mkdtemp(prefix="workbench-bench-kernel-")
    name = f"workbench-bench-{args.nprocs}"
    install_kernel(nprocs=args.nprocs, backend=args.backend, name=name, prefix=prefix)
    os.environ["JUPYTER_PATH"] = str(Path(prefix) / "share" / "jupyter")
    rows = [("ipykernel (python3)", *_measure("python3", args.cells))]
    if args.compare:
        rows.append((f"SPMD {args.nprocs} {args.backend}, {Path(args.compare).name}",
                     *_measure(name, args.cells, args.compare)))
    rows.append((f"workbench SPMD, {args.nprocs} {args.backend} ranks", *_measure(name, args.cells)))
    print(f"{'kernel':<34} {'start-up s':>10} {'no-op cell ms: median':>22} {'p90':>7}")
    for label, start, times in rows:
        p90 = statistics.quantiles(times, n=10)[-1]
        print(f"{label:<34} {start:>10.2f} {statistics.median(times) * 1e3:>22.1f} {p90 * 1e3:>7.1f}")
    (_, base_start, base), (_, spmd_start, spmd) = rows[0], rows[-1]
    print(f"ratio (SPMD / ipykernel): start-up {spmd_start / base_start:.1f}x, "
          f"no-op cell {statistics.median(spmd) / statistics.median(base):.2f}x")


if __name__ == "__main__":
    main()
