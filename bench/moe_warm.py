"""Benchmark: warm loads of a sharded Qwen3-MoE, by stage, on every rank: what bounds a repeat load?

``--ranks`` processes (NCCL on GPUs, gloo on CPU) build the Qwen3-MoE of ``bench/save_load.py`` on an
(fsdp, ep, etp) ``--mesh``, save it once, read its files into the page cache, then time ``--loads`` calls of
``wb.load_hf`` into the same model. Printed: the median of the loads after the first (the first plans what later
loads keep), GB/s per GPU (the ranks' owned bytes / ranks / the slowest rank's median), and for each rank the
stages of its median load (``LoadReport.timings``), the CPU seconds of its loading thread, how many landing pieces
and parts its reader planned, and the garbage collections its loads met (how many, the longest pause). To compare
two versions of the code, run it twice in one session on one machine, each with its own ``PYTHONPATH``.

    python bench/moe_warm.py --ranks 2 --mesh 1 2 1 --size-gb 4 [--threads 16] [--dir /tmp] [--profile 20]

``--profile N`` runs rank 0's last load under ``cProfile`` (its loading thread only) and prints the N functions it
spent most time in, by own time and by cumulative time. ``--each-replica``: every replica reads its replicated
parameters (``read_replicas_once=False``). ``--layers N --hidden H --moe-intermediate I``: a model of another shape
(many small parameters: what a load costs per parameter). ``--seam``: on CPU, the loads take the GPU's
landing path (``load._CPU_LANDING_RING``), so the loading thread's work per piece can be profiled without a GPU.
``--rings 16x16,16x8`` (staging rings: slots x MiB a slot, each pinned once before the loads), ``--threads 16,8``
(``read_threads``), ``--switch 5,0.5`` (``sys.setswitchinterval`` during a load, ms) and ``--nice 0,10`` (the reading
threads' niceness during a load; raising it back needs the right to): the loads go round robin over every
combination, one line of figures for each. Each line also gives the loading thread's time on the CPU and
waiting on a run queue (``/proc/thread-self/schedstat``: ready to run, no core free) in its median load.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import cloudpickle
import page_cache
import torch

import workbench as wb

sys.path.insert(0, str(Path(__file__).resolve().parent))
cloudpickle.register_pickle_by_value(page_cache)  # the ranks get these helpers by value, not by import


def _rank(cfg: dict) -> dict:
    import torch.distributed as dist
    from save_load import DIMS, _fill, pick_shape
    from torch.distributed.device_mesh import init_device_mesh

    from workbench.io.files import landing, staging
    from workbench.models import build_qwen3_moe, qwen3_moe_key_map

    shape = pick_shape(argparse.Namespace(vocab=32768, hidden=cfg["hidden"], moe_intermediate=cfg["moe_intermediate"],
                                          layers=cfg["layers"], heads=16, kv_heads=4, head_dim=64, experts=32,
                                          size_gb=cfg["size_gb"]))
    rank = dist.get_rank()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, cfg["mesh"], mesh_dim_names=DIMS)
    model = build_qwen3_moe(shape, mesh, device=device)
    _fill(model, 0)
    key_map = qwen3_moe_key_map(shape.num_experts)
    folder = Path(cfg["folder"])
    wb.save_hf(model, folder, key_map=key_map)
    time.sleep(1.5)  # a file changed within a second of its parse is not kept (io/files/index.py): past that
    if rank == 0:
        page_cache.fill(sorted(folder.glob("*.safetensors")))
    dist.barrier()
    planned = {}
    real = landing.plan_landing

    def counted(*args, **kwargs):
        pieces = real(*args, **kwargs)
        planned.update(pieces=len(pieces), parts=sum(len(p.parts) for p in pieces))
        return pieces

    landing.plan_landing = counted
    pauses: list[tuple[int, float]] = []  # (generation, seconds) of each garbage collection during the loads
    began_gc = [0.0]

    def collected(phase: str, info: dict) -> None:
        if phase == "start":
            began_gc[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - began_gc[0]))

    gc.callbacks.append(collected)
    # each ring pinned once, before the loads (a ring is used only by a load into GPU memory)
    rings = {(r, blocking): _ring(spec, blocking, device) if cuda else None
             for r, spec in enumerate(cfg["rings"]) for blocking in cfg["blocking"]}
    if cfg["seam"] and not cuda:  # the GPU's landing path into CPU tensors: the loading thread's work, on a laptop
        from workbench.io.hf import load as load_module

        load_module._CPU_LANDING_RING = staging.StagingRing(pinned=False)
    from workbench.io.files import box_reads

    variants = _variants(cfg)  # (ring index, blocking, switch interval, reading threads, niceness) of each
    runs: dict[int, list] = {i: [] for i in range(len(variants))}
    profile = None
    saved = {n: t.detach().clone() for n, t in _locals(model).items()}  # what the last load must bring back
    default_switch = sys.getswitchinterval()
    last = cfg["loads"] * len(variants) - 1
    for i in range(last + 1):  # round robin over the variants: a slow spell hits each of them
        which = i % len(variants)
        ring_at, blocking, switch, threads, nice = variants[which]
        if i == last:  # the last load starts from zeros: every byte it leaves, it loaded
            for t in _locals(model).values():
                t.zero_()
        if cfg["profile"] and rank == 0 and i == last:
            import cProfile

            profile = cProfile.Profile()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        staging._RING = rings[ring_at, blocking]  # the process's ring for this load
        sys.setswitchinterval(switch or default_switch)
        _renice(box_reads._pool(threads), nice)
        queued = _run_queue_wait()
        began, cpu = time.perf_counter(), time.thread_time()
        if profile is not None:
            profile.enable()
        report = wb.load_hf(model, folder, key_map=key_map, read_threads=threads,
                             read_replicas_once=cfg["replicas_once"])
        if profile is not None:
            profile.disable()
        cpu = time.thread_time() - cpu
        queued = _run_queue_wait() - queued
        sys.setswitchinterval(default_switch)
        if cuda:
            torch.cuda.synchronize()
        runs[which].append((time.perf_counter() - began, str(report.timings), cpu, report.bytes_owned, queued))
    staging._RING = None
    _renice(box_reads._pool(cfg["threads"][0]), 0)
    landing.plan_landing = real
    gc.callbacks.remove(collected)
    profiled = ""
    if profile is not None:
        import io
        import pstats

        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(cfg["profile"])
        stats.sort_stats("cumulative").print_stats(cfg["profile"])
        profiled = text.getvalue()
    exact = all(torch.equal(_bytes(t), _bytes(saved[n])) for n, t in _locals(model).items())
    by_ring = []
    for ring_runs in runs.values():
        later = sorted(ring_runs[1:], key=lambda r: r[0])
        median = later[len(later) // 2]
        by_ring.append({"seconds": [round(r[0], 3) for r in ring_runs],
                        "median": statistics.median(r[0] for r in ring_runs[1:]),
                        "stages": median[1], "cpu": median[2], "owned": median[3], "queued": median[4]})
    return {"exact": exact, "rings": by_ring, "planned": planned,
            "profile": profiled, "gc": (len(pauses), max((t for _, t in pauses), default=0.0),
                                        sum(1 for g, _ in pauses if g == 2))}


def _renice(pool: object, nice: int) -> None:
    """Give the pool's reading threads niceness ``nice`` (Linux: a thread's own)."""
    import os

    for thread in list(getattr(pool, "_threads", ())):
        try:
            os.setpriority(os.PRIO_PROCESS, thread.native_id, nice)
        except (OSError, AttributeError) as exc:
            print(f"niceness {nice} for a reading thread refused: {exc}", file=sys.stderr)


def _run_queue_wait() -> float:
    """Seconds the calling thread has waited on a run queue (ready, no core free) so far; 0.0 where the kernel does
    not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _locals(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's local tensor (a DTensor's shard: a view of the model's bytes), by name."""
    return {name: (t.to_local() if hasattr(t, "to_local") else t).detach()
            for name, t in model.state_dict(keep_vars=True).items()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, flat (NaN equals NaN)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _ring(spec: tuple[int, int] | None, blocking: bool, device: torch.device) -> object:
    """A staging ring of ``spec`` (None: the library's), pinned now; ``blocking``: its slots' copy-out events are
    made with ``blocking=True`` (a reading thread waiting for a slot sleeps in ``cudaEventSynchronize`` instead of
    spinning)."""
    from workbench.io.files import staging

    ring = staging.StagingRing(*spec) if spec else staging.StagingRing()
    if blocking:
        slots = [ring.take() for _ in range(ring.slots)]
        for slot in slots:
            slot._done[device] = torch.cuda.Event(blocking=True)
            ring.give(slot)
    return ring


def _variants(cfg: dict) -> list[tuple]:
    """Every (ring index, blocking events, switch interval or None for the interpreter's, reading threads, their
    niceness) the loads go round."""
    return [(r, b, s, t, n) for r in range(len(cfg["rings"])) for b in cfg["blocking"] for s in cfg["switch"]
            for t in cfg["threads"] for n in cfg["nice"]]


def _named(cfg: dict, variant: tuple) -> str:
    ring = cfg["rings"][variant[0]]
    named = "the default ring" if ring is None else f"ring {ring[0]} x {ring[1] >> 20} MiB"
    blocking = ", blocking slot events" if variant[1] else ""
    switch = "" if variant[2] is None else f", switch interval {variant[2] * 1e3:g} ms"
    nice = f", niceness {variant[4]}" if len(cfg["nice"]) > 1 or variant[4] else ""
    return f"{variant[3]} reading threads, {named}{blocking}{switch}{nice}"


def _rings(text: str | None) -> list[tuple[int, int] | None]:
    """``--rings`` as (slots, slot bytes) pairs; [None] (the library's ring) when not given."""
    if not text:
        return [None]
    rings = []
    for item in text.split(","):
        slots, mib = item.lower().split("x")
        rings.append((int(slots), (int(mib) << 20) + 2 * 4096))  # and the two pages an O_DIRECT cover may add
    return rings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mesh", type=int, nargs=3, default=None, help="fsdp ep etp (default: fsdp=ranks)")
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--loads", type=int, default=7)
    parser.add_argument("--threads", default="16", help="load_hf's read_threads; several (16,8): round robin")
    parser.add_argument("--switch", default=None,
                        help="sys.setswitchinterval during the loads, in ms; several (5,0.5): round robin")
    parser.add_argument("--nice", default="0", help="the reading threads' niceness; several (0,10): round robin")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--profile", type=int, default=0, help="print this many functions of rank 0's last load")
    parser.add_argument("--layers", type=int, default=None, help="this many layers (default: as --size-gb asks)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    parser.add_argument("--rings", default=None,
                        help="staging rings to compare, round robin in the same processes: SLOTSxMIB,... (e.g. "
                             "16x16,32x4; default: the library's ring)")
    parser.add_argument("--each-replica", action="store_true",
                        help="every replica reads its replicated parameters (read_replicas_once=False)")
    parser.add_argument("--blocking-events", action="store_true",
                        help="also load through rings whose slot events are blocking (round robin with the default)")
    parser.add_argument("--seam", action="store_true",
                        help="on CPU: the loads take the GPU's landing path (pieces through an unpinned staging "
                             "ring, copies by the loading thread), to profile that thread's work without a GPU")
    args = parser.parse_args()
    mesh = tuple(args.mesh or (args.ranks, 1, 1))
    folder = Path(tempfile.mkdtemp(prefix="wb-moe-warm-", dir=args.dir))
    cfg = {"mesh": mesh, "size_gb": args.size_gb, "loads": args.loads,
           "profile": args.profile, "threads": [int(t) for t in args.threads.split(",")],
           "switch": [float(v) / 1e3 for v in args.switch.split(",")] if args.switch else [None],
           "replicas_once": not args.each_replica,
           "nice": [int(v) for v in args.nice.split(",")],
           "layers": args.layers, "hidden": args.hidden, "moe_intermediate": args.moe_intermediate,
           "folder": str(folder / "ckpt"), "rings": _rings(args.rings), "seam": args.seam,
           "blocking": [False, True] if args.blocking_events else [False]}
    try:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        results = wb.launch(_rank, nprocs=args.ranks, backend=backend, args=(cfg,), timeout=600)
        out = [results[rank] for rank in sorted(results)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"  the last load (into zeroed tensors) gave back the saved values bit for bit on every rank: "
          f"{all(r['exact'] for r in out)}")
    for which, variant in enumerate(_variants(cfg)):
        rows = [r["rings"][which] for r in out]
        slowest = max(r["median"] for r in rows)
        owned = sum(r["owned"] for r in rows)
        print(f"mesh (fsdp, ep, etp) {mesh}, {args.size_gb} GB, {_named(cfg, variant)}: warm load "
              f"{slowest:.3f} s (median of loads 2-{args.loads}), {owned / len(out) / slowest / 1e9:.2f} GB/s per GPU")
        for rank, r in enumerate(rows):
            print(f"  rank {rank}: {r['stages']}; loading thread on the CPU {r['cpu']:.3f} s, on a run queue "
                  f"{r['queued']:.3f} s; loads {r['seconds']}")
    for rank, r in enumerate(out):
        print(f"  rank {rank}: planned {r['planned']}; garbage collections {r['gc'][0]} (generation 2: {r['gc'][2]}), "
              f"the longest {r['gc'][1] * 1e3:.1f} ms")
    if out[0]["profile"]:
        print(f"rank 0's last load under cProfile (its loading thread):\n{out[0]['profile']}")


if __name__ == "__main__":
    main()
