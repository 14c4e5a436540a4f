"""What the live view of running cells costs: no-op cell latency, and a 3 s cell's time with the view on and off.

    .venv/bin/python bench/kernel_live.py [--nprocs 2] [--backend gloo|nccl] [--cells 60] [--repeats 5]

One kernel, the view switched with ``%live on|off`` between runs, on and off interleaved so that load from other
jobs falls on both alike. Three cells:

* a no-op cell (``pass``): round trip, execute_request sent -> reply and iopub idle (the view never shows there);
* ``time.sleep(3)``: the rank's main thread holds no GIL, so the view's questions cost it nothing; its extra time
  is the kernel's own (drawing and sending the view);
* a 3 s pure-Python loop: the rank's I/O thread must take the GIL from the main thread to answer where it is
  (twice a second with the view on, every 2 s with it off); the extra time is measured on the ranks
  (``time.perf_counter`` around the loop, slowest rank) and end to end.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kernel.support import execute
from workbench.kernel.spec import install_kernel

LOOP = "def spin(n):\n    x = 0\n    for i in range(n):\n        x += i\n    return x\n"


def _timed(client, code: str) -> tuple[float, str]:
    start = time.perf_counter()
    out = execute(client, code, timeout=300)
    assert out.reply["status"] == "ok", out.error_text
    return time.perf_counter() - start, out.streams["stdout"]


def _slowest_rank(stdout: str) -> float:
    return max(float(x) for x in re.findall(r"^(?:\[\d+\] )?took (\S+)$", stdout, re.M))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--cells", type=int, default=60, help="no-op cells per setting")
    parser.add_argument("--repeats", type=int, default=5, help="3 s cells per setting and kind")
    args = parser.parse_args()
    from jupyter_client.manager import start_new_kernel

    prefix = tempfile.mkdtemp(prefix="workbench-bench-live-")
    install_kernel(nprocs=args.nprocs, backend=args.backend, name="workbench-bench-live", prefix=prefix)
    os.environ["JUPYTER_PATH"] = str(Path(prefix) / "share" / "jupyter")
    manager, client = start_new_kernel(kernel_name="workbench-bench-live", startup_timeout=300)
    try:
        execute(client, "pass", timeout=300)
        execute(client, "%rank_output all")
        execute(client, LOOP + "import time\nt = time.perf_counter(); spin(10**6); per = time.perf_counter() - t")
        # the loop's length on this machine: 3 s on rank 0, the same count everywhere
        _, text = _timed(client, "n = int(3 * 10**6 / per)\nprint('n', n)")
        n = int(re.findall(r"n (\d+)", text)[0])
        execute(client, f"n = {n}")
        noop: dict[str, list[float]] = {"on": [], "off": []}
        sleep: dict[str, list[float]] = {"on": [], "off": []}
        spin_trip: dict[str, list[float]] = {"on": [], "off": []}
        spin_rank: dict[str, list[float]] = {"on": [], "off": []}
        for setting in ("on", "off"):
            execute(client, f"%live {setting}")
            for _ in range(5):
                _timed(client, "pass")  # warm-up
        for i in range(args.cells):
            for setting in ("on", "off") if i % 2 == 0 else ("off", "on"):
                execute(client, f"%live {setting}")
                noop[setting].append(_timed(client, "pass")[0])
        for i in range(args.repeats):
            for setting in ("on", "off") if i % 2 == 0 else ("off", "on"):
                execute(client, f"%live {setting}")
                sleep[setting].append(_timed(client, "time.sleep(3)")[0])
                trip, text = _timed(client, "t = time.perf_counter(); spin(n); print('took', time.perf_counter() - t)")
                spin_trip[setting].append(trip)
                spin_rank[setting].append(_slowest_rank(text))
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)

    def med(values: list[float], scale: float = 1.0) -> str:
        return f"{statistics.median(values) * scale:.3f}"

    print(f"{args.nprocs} {args.backend} ranks; medians of {args.cells} no-op cells and {args.repeats} 3 s cells "
          "per setting, interleaved")
    print(f"{'median (min)':<44} {'view on':>17} {'view off':>17} {'on - off':>9}")
    rows = [("no-op cell, round trip (ms)", noop, 1e3), ("time.sleep(3), round trip (s)", sleep, 1.0),
            ("3 s Python loop, round trip (s)", spin_trip, 1.0), ("3 s Python loop, slowest rank's time (s)",
                                                                  spin_rank, 1.0)]
    for label, values, scale in rows:
        diff = (statistics.median(values["on"]) - statistics.median(values["off"])) * scale
        on, off = (f"{med(values[k], scale)} ({min(values[k]) * scale:.3f})" for k in ("on", "off"))
        print(f"{label:<44} {on:>17} {off:>17} {diff:>+9.3f}")


if __name__ == "__main__":
    main()
