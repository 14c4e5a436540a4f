"""Launcher kernel: start-up with N ranks and a no-op cell's round trip, against a plain ipykernel (same run).

    .venv/bin/python bench/kernel.py [--nprocs 4] [--cells 100] [--backend gloo|nccl] [--compare SRC]

``--hangs`` measures instead, on the SPMD kernel, how long after the hang timeout a hang is reported, and how long
after the interrupt the cell ends and the next collective has run (a rank in user code while the others wait in a
barrier; rank 0 alone in an all_reduce; a rank holding the GIL in a C call, report only).

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
from workbench.kernel.spec import install_kernel


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


HANGS = {
    "rank 1 in user code, rank 0 in a barrier": "import time\nif rank == 1:\n    time.sleep(600)\ndist.barrier()",
    "rank 0 alone in an all_reduce": "if rank == 0:\n    dist.all_reduce(torch.ones(1))",
    "rank 1 holds the GIL in a C call (report only)": (
        "import ctypes, subprocess\nif rank == 1:\n    child = subprocess.Popen(['sh', '-c', 'sleep 6; echo'], "
        "stdout=subprocess.PIPE)\n    ctypes.PyDLL(None).read(child.stdout.fileno(), ctypes.create_string_buffer(1), 1)"
        "\ndist.barrier()"),
}


def _hangs(kernel_name: str, backend: str, hang_timeout: float = 2.0) -> None:
    from jupyter_client.manager import start_new_kernel

    device = "device" if backend == "nccl" else "'cpu'"
    manager, client = start_new_kernel(kernel_name=kernel_name, startup_timeout=300)
    try:
        execute(client, "pass", timeout=300)
        print(f"{'hang':<48} {'report after timeout s':>22} {'cell ends after interrupt s':>28} "
              f"{'next collective done s':>23}")
        for label, code in HANGS.items():
            interrupt = "report only" not in label
            execute(client, f"%hang_timeout {hang_timeout:g} {'interrupt' if interrupt else 'report'}")
            seen: dict[str, float] = {}

            def watch(msg: dict, seen: dict[str, float] = seen) -> None:
                if msg["msg_type"] == "stream" and "still running after" in msg["content"]["text"]:
                    seen.setdefault("report", time.perf_counter())

            start = time.perf_counter()
            execute(client, code, timeout=120, on_output=watch)
            ended = time.perf_counter()
            execute(client, "%hang_timeout off")
            execute(client, f"t = torch.ones(1, device={device})\ndist.all_reduce(t)\nt.item()", timeout=120)
            usable = time.perf_counter()
            hung = start + hang_timeout
            print(f"{label:<48} {seen.get('report', float('nan')) - hung:>22.2f} "
                  f"{ended - hung if interrupt else float('nan'):>28.2f} {usable - hung:>23.2f}")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--cells", type=int, default=100)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--hangs", action="store_true", help="measure hang reports and interrupts instead")
    parser.add_argument("--compare", metavar="SRC", default=None,
                        help="also measure the SPMD kernel of the workbench source tree SRC (same run)")
    args = parser.parse_args()
    prefix = tempfile.mkdtemp(prefix="workbench-bench-kernel-")
    name = f"workbench-bench-{args.nprocs}"
    install_kernel(nprocs=args.nprocs, backend=args.backend, name=name, prefix=prefix)
    os.environ["JUPYTER_PATH"] = str(Path(prefix) / "share" / "jupyter")
    if args.hangs:
        _hangs(name, args.backend)
        return
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
