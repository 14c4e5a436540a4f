"""Benchmark: which write pattern a disk rewards, for a save's bytes (no model, no torch.distributed).

N processes (the ranks) x T threads write ``--size-gb`` GB of random bytes in 64 MiB pieces, then fsync, under
each pattern, in one run, on the same folder:

* ``own-file``: each process its share into its own file, one thread, fsync at the end (the benchmark's limit);
* ``shared``: the ranks' pieces interleaved in ``--files`` shared files (a direct save with big shards), T threads,
  with and without the writeback window (``workbench.io.files.writeback``), its starts gathered per 8 MiB or one per
  write;
* ``many-files``: the same into N x T files (one per thread: no two writers share an inode);
* ``odirect``: the shared pattern through ``O_DIRECT`` from page-aligned buffers (no page cache at all).

    python bench/write_patterns.py --procs 2 --threads 4 --size-gb 8 [--dir /tmp]
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

PIECE = 64 << 20  # bytes a thread hands to pwrite at once (``--piece-mb``: a save's small tensors write ~1 MiB)


def _writer(args: tuple) -> float:
    pattern, proc, procs, threads, total, nfiles, root, window, piece_bytes, start_bytes = args
    global PIECE
    PIECE = piece_bytes
    from workbench.io.files.writeback import WritebackWindow

    pieces = total // PIECE
    mine = list(range(proc, pieces, procs))  # interleaved over the ranks, like halves of every tensor
    per_file = pieces // nfiles
    flags = os.O_WRONLY | (os.O_DIRECT if pattern == "odirect" else 0)
    files = {}

    def fd_of(name: str) -> int:
        if name not in files:
            files[name] = os.open(Path(root) / name, flags)
        return files[name]

    buf = mmap.mmap(-1, PIECE)  # page-aligned, as O_DIRECT needs
    buf.write((os.urandom(1 << 20) * (PIECE // (1 << 20) + 1))[:PIECE])
    wb = WritebackWindow(window if pattern != "odirect" else 0, start_bytes=start_bytes)
    lock = threading.Lock()
    todo = list(mine)

    def run(thread: int) -> None:
        count = 0  # pieces this thread wrote (its own file's next offset)
        while True:
            with lock:
                if not todo:
                    return
                piece = todo.pop(0)
            if pattern == "many-files":
                name, offset = f"t{proc}-{thread}.bin", count * PIECE
                count += 1
            else:
                name, offset = f"s{piece // per_file}.bin", (piece % per_file) * PIECE
            fd = fd_of(name)
            done = 0
            while done < PIECE:
                done += os.pwrite(fd, memoryview(buf)[done:], offset + done)
            wb.wrote(fd, offset, PIECE)

    t0 = time.perf_counter()
    pool = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    for fd in files.values():
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - t0


def _own_file(args: tuple) -> float:
    proc, procs, total, root = args
    block = 64 << 20
    buf = os.urandom(1 << 20) * (block >> 20)
    share = total // procs
    t0 = time.perf_counter()
    fd = os.open(Path(root) / f"own{proc}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for start in range(0, share, block):
        os.write(fd, memoryview(buf)[: min(block, share - start)])
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def _prepare(root: Path, pattern: str, procs: int, threads: int, total: int, nfiles: int) -> None:
    for p in root.iterdir():
        p.unlink()
    os.sync()
    names = ([f"t{p}-{t}.bin" for p in range(procs) for t in range(threads)] if pattern == "many-files"
             else [f"s{i}.bin" for i in range(nfiles)])
    for name in names:
        with open(root / name, "wb") as f:
            f.truncate(total // len(names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--size-gb", type=float, default=8.0)
    parser.add_argument("--files", type=int, default=2, help="shared files (a save with 5 GB shards: 2 for 8 GB)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--piece-mb", type=float, default=64.0, help="bytes per pwrite, in MiB")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    global PIECE
    PIECE = int(args.piece_mb * (1 << 20)) // 4096 * 4096
    total = int(args.size_gb * 1e9) // (PIECE * args.procs * args.threads * args.files) * (
        PIECE * args.procs * args.threads * args.files)
    root = Path(tempfile.mkdtemp(prefix="wb-write-patterns-", dir=args.dir))
    runs: dict[str, list[float]] = {}
    ctx = mp.get_context("spawn")
    cases = [("own-file", None, 0), ("shared", 256 << 20, 8 << 20), ("shared", 256 << 20, 0), ("shared", 0, 0),
             ("many-files", 256 << 20, 8 << 20), ("odirect", 0, 0)]
    try:
        with ctx.Pool(args.procs) as pool:
            for _ in range(args.repeats):
                for pattern, window, start in cases:
                    label = pattern if window is None else f"{pattern}, window {window >> 20} MiB"
                    label += f", starts every {start >> 20} MiB" if start else ""
                    if pattern == "own-file":
                        for p in root.iterdir():
                            p.unlink()
                        os.sync()
                        work = [(p, args.procs, total, str(root)) for p in range(args.procs)]
                        seconds = max(pool.map(_own_file, work))
                    else:
                        _prepare(root, pattern, args.procs, args.threads, total, args.files)
                        work = [(pattern, p, args.procs, args.threads, total, args.files, str(root), window,
                                 PIECE, start) for p in range(args.procs)]
                        seconds = max(pool.map(_writer, work))
                    runs.setdefault(label, []).append(seconds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    best_limit = min(runs["own-file"])
    print(f"{total / 1e9:.2f} GB, {args.procs} processes x {args.threads} threads, {args.files} shared files, "
          f"{PIECE / (1 << 20):g} MiB per write")
    print("| pattern | seconds (best) | GB/s | vs own-file | runs |\n|---|---|---|---|---|")
    for label, seconds in runs.items():
        best = min(seconds)
        print(f"| {label} | {best:.2f} | {total / best / 1e9:.2f} | {best_limit / best:.2f} | "
              f"{', '.join(f'{s:.2f}' for s in seconds)} |")


if __name__ == "__main__":
    main()
