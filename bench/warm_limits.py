"""What bounds a warm load (page cache filled) into GPU memory on this host: one process per GPU, all at once.

Each process owns one GPU and one file of ``--size-gb`` whose pages are in the page cache, and measures, in the
same run and between barriers so every GPU works at once:

* ``h2d``: host-to-device copies from a pinned buffer already filled (the PCIe/DMA limit, no file involved);
* ``pread``: ``pread`` of the warm file into a pinned buffer from ``--threads`` threads (the CPU copy out of the
  page cache: what a reader through the page cache pays before any copy to the GPU);
* ``pread+h2d B x S``: both: blocks of B read into a ring of S pinned buffers by the threads, each copied to the
  GPU as soon as it is read (a staged warm load without the planning), with the seconds pinning the ring costs;
* ``register``: zero copy on the host: ``mmap`` the file read-only, page-lock the mapped page-cache pages with
  ``cudaHostRegister(..., cudaHostRegisterReadOnly)`` in blocks, and DMA from them straight to the GPU; reported
  with the registration's own seconds, which is what this path pays instead of the CPU copy.

Run: ``python bench/warm_limits.py --procs 2 --size-gb 4 --dir /tmp``. GB/s are per process (per GPU); "all" is
the sum over processes (bytes of every process / the slowest process's seconds).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

BLOCK = 64 << 20
HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly


def _make_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    chunk = os.urandom(BLOCK)
    with open(path, "wb") as f:
        for _ in range(size // BLOCK):
            f.write(chunk)


def _fill(path: Path) -> None:
    buf = bytearray(BLOCK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def _pread_all(fd: int, dst, size: int, threads: int) -> None:
    """pread [0, size) of fd into the pinned uint8 tensor ``dst`` (size bytes), in BLOCK pieces, from threads."""
    view = memoryview(dst.numpy())

    def one(off: int) -> None:
        n = min(BLOCK, size - off)
        got = os.preadv(fd, [view[off : off + n]], off)
        if got != n:
            raise OSError(f"short read at {off}: {got} of {n}")

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(0, size, BLOCK)))


def _worker(rank: int, procs: int, path: str, size: int, threads: int, repeats: int, barrier, results,
            rings: tuple[tuple[int, int], ...] = (), only: str = "") -> None:
    import torch

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    stream = torch.cuda.Stream(dev)
    cudart = torch.cuda.cudart()
    gpu = torch.empty(size, dtype=torch.uint8, device=dev)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    out: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:
        for _ in range(repeats):
            torch.cuda.synchronize(dev)
            barrier.wait()
            t0 = time.perf_counter()
            extra = fn()
            torch.cuda.synchronize(dev)
            out.setdefault(name, []).append(time.perf_counter() - t0)
            if extra:
                for k, v in extra.items():
                    out.setdefault(k, []).append(v)

    def h2d() -> None:
        with torch.cuda.stream(stream):
            for off in range(0, size, BLOCK):
                gpu[off : off + BLOCK].copy_(host[off : off + BLOCK], non_blocking=True)
        stream.synchronize()

    def pread() -> None:
        _pread_all(fd, host, size, threads)

    def pread_reuse(block: int):
        """``pread`` of the file in blocks of ``block`` bytes, each thread into its own buffer again and again (no
        GPU): the CPU copy when its destination can stay in the last-level cache, against ``pread``'s 4 GB one."""
        buffers = [torch.empty(block, dtype=torch.uint8, pin_memory=True) for _ in range(threads)]
        free = list(range(threads))

        def one(off: int) -> None:
            mine = free.pop()
            try:
                n = min(block, size - off)
                if os.preadv(fd, [memoryview(buffers[mine].numpy())[:n]], off) != n:
                    raise OSError(f"short read at {off}")
            finally:
                free.append(mine)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(0, size, block)))

    kept_rings = {(b, n): [torch.empty(b, dtype=torch.uint8, pin_memory=True) for _ in range(n)] for b, n in rings}

    def pread_h2d(block: int, slots: int):
        """Blocks of ``block`` bytes read into a ring of ``slots`` pinned buffers, each copied to the GPU when read;
        a slot is read into again once its copy's event has passed. The ring is pinned afresh each run and the
        pinning's own seconds reported (a load in a fresh process pays them), unless ``--rings`` pinned it once
        before the runs (as the loader's staging ring is: made once, kept by the process)."""
        t = time.perf_counter()
        ring = kept_rings.get((block, slots)) or [torch.empty(block, dtype=torch.uint8, pin_memory=True)
                                                  for _ in range(slots)]
        pin = time.perf_counter() - t
        done = [torch.cuda.Event() for _ in ring]
        offsets = list(range(0, size, block))

        def read(i: int) -> int:
            slot = i % slots
            done[slot].synchronize()
            off = offsets[i]
            n = min(block, size - off)
            if os.preadv(fd, [memoryview(ring[slot].numpy())[:n]], off) != n:
                raise OSError(f"short read at {off}")
            return slot

        def copy(i: int, slot: int) -> None:
            off = offsets[i]
            n = min(block, size - off)
            with torch.cuda.stream(stream):
                gpu[off : off + n].copy_(ring[slot][:n], non_blocking=True)
                done[slot].record(stream)

        ahead = max(1, slots - 1)  # reads in flight: a slot's next read waits for its copy
        with ThreadPoolExecutor(threads) as pool:
            futures = {i: pool.submit(read, i) for i in range(min(ahead, len(offsets)))}
            for i in range(len(offsets)):
                copy(i, futures.pop(i).result())
                if i + ahead < len(offsets):
                    futures[i + ahead] = pool.submit(read, i + ahead)
        stream.synchronize()
        return {f"pread+h2d {block >> 20} MiB x {slots}: pinning s": pin}

    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    mapped = np.frombuffer(mm, dtype=np.uint8)  # read-only view: its address is the mapping's
    base = int(mapped.ctypes.data)

    def register(block: int):
        reg = 0.0
        with torch.cuda.stream(stream):
            pending: list[tuple[int, int, torch.cuda.Event]] = []
            for off in range(0, size, block):
                n = min(block, size - off)
                t = time.perf_counter()
                err = cudart.cudaHostRegister(base + off, n, HOST_REGISTER_READ_ONLY)
                reg += time.perf_counter() - t
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister({n} bytes at +{off}) failed: {err}")
                src = _pinned_view(base + off, n)
                gpu[off : off + n].copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                pending.append((off, n, ev))
                while len(pending) > 2:
                    poff, _pn, pev = pending.pop(0)
                    pev.synchronize()
                    t = time.perf_counter()
                    cudart.cudaHostUnregister(base + poff)
                    reg += time.perf_counter() - t
            for poff, _pn, pev in pending:
                pev.synchronize()
                t = time.perf_counter()
                cudart.cudaHostUnregister(base + poff)
                reg += time.perf_counter() - t
        return {f"register {block >> 20} MiB: cudaHost(Un)Register s": reg}

    tests = [("h2d", h2d), ("pread", pread)]
    for block, slots in rings or ((4 << 20, 32), (8 << 20, 16), (8 << 20, 32), (16 << 20, 16), (16 << 20, 32),
                                  (64 << 20, 32)):
        tests.append((f"pread+h2d {block >> 20} MiB x {slots}", lambda b=block, n=slots: pread_h2d(b, n)))
    for block in sorted({b for b, _ in rings}):
        tests.append((f"pread reuse {block >> 20} MiB a thread", lambda b=block: pread_reuse(b)))
    for block in (BLOCK, 256 << 20, 1 << 30):
        tests.append((f"register {block >> 20} MiB", lambda b=block: register(b)))
    tests = [(name, fn) for name, fn in tests if not only or any(word in name for word in only.split(","))]
    for name, fn in tests:
        try:
            timed(name, fn)
        except Exception as exc:  # a path this host refuses: say so, keep measuring the others
            out.setdefault(f"{name}: error", []).append(0.0)
            results.put((rank, f"{name}: {type(exc).__name__}: {exc}"))
    # checksum the last register run against the file so a zero-copy path is shown to carry the right bytes
    check = torch.empty(min(size, BLOCK), dtype=torch.uint8)
    os.preadv(fd, [memoryview(check.numpy())], 0)
    ok = bool(torch.equal(gpu[: check.numel()].cpu(), check))
    results.put((rank, {"times": out, "bit_exact_first_block": ok}))
    del mapped
    mm.close()
    os.close(fd)


def _pinned_view(address: int, nbytes: int):
    """A CPU uint8 tensor over registered host memory at ``address`` (no copy)."""
    import torch

    array = (ctypes.c_uint8 * nbytes).from_address(address)
    return torch.frombuffer(array, dtype=torch.uint8, count=nbytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--rings", default="", help="pread+h2d rings to measure instead of the usual six, each pinned once "
                    "before the runs, as MIBxSLOTS,... (e.g. 16x16,4x16); also adds 'pread reuse' for each block size")
    ap.add_argument("--only", default="", help="run only the tests whose names hold one of these words (comma list)")
    ap.add_argument("--both-only", action="store_true", help="skip the one-process pass")
    args = ap.parse_args()
    rings = tuple((int(b) << 20, int(n)) for b, n in (r.split("x") for r in args.rings.split(",") if r))
    size = int(args.size_gb * (1 << 30)) // BLOCK * BLOCK
    paths = [args.dir / f"warm_limits_{r}.bin" for r in range(args.procs)]
    for p in paths:
        _make_file(p, size)
        _fill(p)
    ctx = mp.get_context("spawn")
    for procs in [args.procs] if args.both_only else sorted({1, args.procs}):
        barrier = ctx.Barrier(procs)
        results = ctx.Queue()
        workers = [
            ctx.Process(
                target=_worker,
                args=(r, procs, str(paths[r]), size, args.threads, args.repeats, barrier, results, rings, args.only),
            )
            for r in range(procs)
        ]
        for w in workers:
            w.start()
        got: dict[int, dict] = {}
        while len(got) < procs:
            rank, item = results.get(timeout=900)
            if isinstance(item, str):
                print(f"  rank {rank}: {item}")
            else:
                got[rank] = item
        for w in workers:
            w.join()
        print(
            f"\n{procs} process(es), one GPU each, {size / 1e9:.2f} GB each, {args.threads} threads, "
            f"{args.repeats} repeats (median)"
        )
        names = list(got[0]["times"])
        for name in names:
            per = [statistics.median(got[r]["times"][name]) for r in range(procs)]
            if name.endswith(" s") or name.endswith("error"):  # seconds: the first run's (later ones reuse memory)
                print(f"  {name:42s} first run " + "  ".join(f"{got[r]['times'][name][0]:.3f}" for r in range(procs)))
                continue
            slowest = max(per)
            print(
                f"  {name:42s} per GPU "
                + "  ".join(f"{size / s / 1e9:6.2f}" for s in per)
                + f"   all {procs * size / slowest / 1e9:6.2f} GB/s"
            )
        print(
            "  bit exact (first block of the last zero-copy run):",
            [got[r]["bit_exact_first_block"] for r in range(procs)],
        )


if __name__ == "__main__":
    main()
