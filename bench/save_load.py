"""Benchmark: save a sharded Qwen3-MoE as an HF checkpoint and load it back, against the disk and two baselines.

One run, one model, one machine, one target directory (one filesystem). The ranks are started with
``wb.launch`` (gloo on CPU by default; ``--backend nccl --ranks 1`` on one GPU) and hold a parameter-only
Qwen3-MoE built by ``build_qwen3_moe`` on a (fsdp, ep, etp) mesh, filled with random values. Measured:

1. the disk, each probe about the checkpoint's size: the **write limit** is the fastest O_DIRECT writing this run
   sees, one ``dd bs=64M oflag=direct conv=fsync`` or 2, 4 or 8 such ``dd`` in parallel (each its share); for
   reference ``dd ... conv=fsync`` and a Python write + fsync through the page cache, and the ranks each writing
   their share through the page cache (not part of the limit: the page cache can absorb a save faster than the
   disk writes, so a save may beat a limit measured that way);
2. the naive baseline: every parameter's ``full_tensor()``, then rank 0 alone ``save_file``-s the whole state dict
   under HF keys (fused tensors split into their keys), fsynced;
3. torch DCP's HF path: ``dcp.save`` with ``HuggingFaceStorageWriter(save_distributed=True)`` (every rank writes its
   shards), then ``consolidate_safetensors_files_on_every_rank`` into HF files (fsynced here: torch does not);
4. ``wb.save_hf`` synchronous (budgets 256 MiB and 1 GiB; direct with the writeback window off) and asynchronous
   (until the call returns, until ``wait()`` returns);
5. ``wb.load_hf`` of that checkpoint into another topology (default fsdp=N x ep=1 x etp=1), ``--repeats`` times cold
   (page cache dropped first), round robin with the read limit: ``dd bs=64M`` of the same files through the page
   cache and with ``iflag=direct`` (the faster median counts); then ``--warm-repeats`` times (default as often) warm
   (the files read through the page cache first: a cold load with O_DIRECT leaves it empty). Medians, and the bytes
   the disk read for the ranks (``/proc/self/io`` ``read_bytes``, readahead included) over the bytes they own, summed
   over ranks; beside it the slices ``load_hf`` returned over owned (1.000 up to O_DIRECT's 4 KiB alignment: it
   cannot show read amplification, the OS count can);
6. each rank's peak RSS increase during each ``wb.save_hf`` (``ru_maxrss``, peak reset just before the save) over the
   schedule's predicted peak (``SaveResult.predicted_peak_bytes``); on CUDA the device peak too.

Then it checks once that the checkpoints agree: ``wb.save_hf``'s files hold the naive file's keys and bytes, DCP's
consolidated files hold the same bytes (its fused tensors stay fused: DCP cannot split a tensor into HF keys),
and the checkpoint loads back bit for bit, into the same topology and into the other one.

torch's ``full_tensor()`` cannot redistribute the ``InterleavedShard`` of expert-TP weights (torch 2.13 raises in
``_StridedShard._to_replicate_tensor``), even on an etp=1 dim. So the default mesh has etp=1, where that placement is
the identity, and the naive baseline re-wraps those local tensors with ``Shard`` (the same layout); every method
saves the same model on the same mesh. With ``--etp`` > 1 the naive baseline is skipped.

    .venv/bin/python bench/save_load.py [--ranks 4] [--size-gb 1.5] [--repeats 2] [--dir /tmp] [--profile]
    .venv/bin/python bench/save_load.py --backend nccl --ranks 1          # one GPU
    .venv/bin/python bench/save_load.py --backend nccl --ranks 2 --mesh 1 1 2 --load-mesh 1 1 2 --load-only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cloudpickle
import page_cache
import torch
from page_cache import cached, evict, fill, os_read_bytes

import workbench as wb
from workbench.models import Qwen3MoeShape

cloudpickle.register_pickle_by_value(page_cache)  # the ranks get these helpers by value, not by import

MiB = 1 << 20
GB = 10**9
DIMS = ("fsdp", "ep", "etp")
LIMIT_WRITERS = (2, 4, 8)  # parallel O_DIRECT writers tried for the write limit, beside one dd


# -- the model -------------------------------------------------------------------------------------


def layer_bytes(shape: Qwen3MoeShape, itemsize: int = 2, norm_itemsize: int = 4) -> int:
    h, hd = shape.hidden_size, shape.head_dim
    attn = (2 * shape.num_attention_heads + 2 * shape.num_key_value_heads) * hd * h
    experts = 3 * shape.num_experts * shape.moe_intermediate_size * h
    return (attn + experts + shape.num_experts * h) * itemsize + (2 * hd + 2 * h) * norm_itemsize


def model_bytes(shape: Qwen3MoeShape, itemsize: int = 2, norm_itemsize: int = 4) -> int:
    """Checkpoint tensor bytes of ``build_qwen3_moe(shape)`` (bf16 weights, fp32 norms)."""
    outer = 2 * shape.vocab_size * shape.hidden_size * itemsize + shape.hidden_size * norm_itemsize
    return outer + shape.num_hidden_layers * layer_bytes(shape, itemsize, norm_itemsize)


def pick_shape(args: argparse.Namespace) -> Qwen3MoeShape:
    """The model's sizes; without ``--layers``, as many layers as bring it closest to ``--size-gb``."""
    shape = Qwen3MoeShape(
        vocab_size=args.vocab, hidden_size=args.hidden, moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers or 1, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, num_experts=args.experts,
    )
    if args.layers is None:
        outer = model_bytes(shape) - layer_bytes(shape)
        layers = max(1, round((args.size_gb * GB - outer) / layer_bytes(shape)))
        shape = Qwen3MoeShape(**{**{f: getattr(shape, f) for f in Qwen3MoeShape.__slots__},
                                 "num_hidden_layers": layers})
    return shape


# -- the machine and the disk ------------------------------------------------------------------------


def machine() -> str:
    """CPU model, cores and RAM, for RESULTS.md."""
    model = platform.processor() or platform.machine()
    ram = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                ram = f"{int(line.split()[1]) / (1 << 20):.0f} GiB"
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{model}, {os.cpu_count()} cores, {ram} RAM{gpu}"


def filesystem(path: Path) -> str:
    """``df -T``'s device, type and free space of the filesystem holding ``path``."""
    try:
        lines = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=True).stdout.splitlines()
        dev, kind, _, _, free, *_ = lines[-1].split()
        return f"{kind} on {dev} ({int(free) / (1 << 20):.0f} GiB free)"
    except (OSError, subprocess.CalledProcessError, ValueError):
        return "unknown"


def dd(path: Path, count: int, direct: bool) -> float | None:
    """Seconds for ``dd`` to write ``count`` x 64 MiB of zeros and fsync (O_DIRECT or through the page cache)."""
    cmd = ["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}", "conv=fsync"]
    if direct:
        cmd.append("oflag=direct")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    path.unlink(missing_ok=True)
    if done.returncode:
        print(f"  {' '.join(cmd)} failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return seconds


def direct_writers(root: Path, count: int, writers: int) -> float | None:
    """Seconds for ``writers`` concurrent ``dd oflag=direct conv=fsync`` processes to write ``count`` x 64 MiB in
    all (each its own file, its share of the blocks rounded up): the disk's parallel write rate, no page cache."""
    share = math.ceil(count / writers)
    cmds = [["dd", "if=/dev/zero", f"of={root / f'direct-{writers}-{i}.bin'}", "bs=64M", f"count={share}",
             "conv=fsync", "oflag=direct"] for i in range(writers)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in cmds]
    errors = [err for proc in procs if (err := proc.communicate()[1]) and proc.returncode]
    seconds = time.perf_counter() - t0
    for c in cmds:
        Path(c[2][3:]).unlink(missing_ok=True)
    if errors:
        print(f"  {writers} parallel dd oflag=direct failed: {errors[0].strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return seconds * count / (share * writers)  # the time for exactly count blocks at the measured rate


def python_write(path: Path, count: int) -> float:
    """Seconds to write ``count`` x 64 MiB from one buffer with ``write`` and fsync it."""
    block = bytes(64 * MiB)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(count):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


# -- inside every rank -------------------------------------------------------------------------------


def _rank_main(cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank's run of every method, in order; rank 0 returns the world's timings."""
    import gc

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from workbench.models import build_qwen3_moe, qwen3_moe_key_map
    from workbench.run.simulated import plan_save

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = cfg["backend"] == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    shape: Qwen3MoeShape = cfg["shape"]
    key_map = qwen3_moe_key_map(shape.num_experts)
    root = Path(cfg["root"])
    out: dict[str, Any] = {"rank": rank, "times": {}, "mem": {}, "saves": {}, "notes": []}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    def start() -> float:
        if rank == 0:
            os.sync()  # earlier methods' dirty pages are not this method's to write back
        sync()
        return time.perf_counter()

    def stop(t0: float) -> float:
        sync()
        return time.perf_counter() - t0

    def build(dims: tuple[int, int, int]) -> torch.nn.Module:
        mesh = init_device_mesh(device.type, dims, mesh_dim_names=DIMS)
        return build_qwen3_moe(shape, mesh, device=device)

    t0 = time.perf_counter()
    model = build(cfg["mesh"])
    _fill(model, cfg["seed"])
    sync()
    out["setup_s"] = time.perf_counter() - t0

    times: dict[str, list[float]] = out["times"]

    def naive() -> None:  # 2. full_tensor() of every parameter, rank 0 writes one file
        t0 = start()
        profiler = _start_profile() if cfg["profile"] and rank == 0 and "naive" not in times else None
        _naive_save(model, key_map, root / "naive", rank)
        if profiler is not None:
            out.setdefault("profile", {})["naive"] = _stop_profile(profiler, root / "profile-naive-rank0.txt")
        times.setdefault("naive", []).append(stop(t0))

    def dcp() -> None:  # 3. HuggingFaceStorageWriter(save_distributed=True), then consolidation on every rank
        if out.get("dcp_failed"):
            return
        if rank == 0:
            shutil.rmtree(root / "dcp", ignore_errors=True)
        dcp_out = _dcp_save(model, key_map, root / "dcp", rank, world, cfg["threads"], start, stop)
        out["dcp_failed"] = dcp_out.get("failed", False)
        for k, v in dcp_out["times"].items():
            times.setdefault(k, []).append(v)
        out["notes"].extend(dcp_out["notes"])

    layout = wb.Layout.from_model(model, key_map)

    host_copies: list[torch.Tensor] = []

    def host_copy() -> None:  # 1c. the async call's floor: every local tensor into host buffers allocated before
        if not host_copies:
            host_copies.extend(torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in map(_local, params))
        t0 = start()
        for buf, t in zip(host_copies, map(_local, params)):
            buf.copy_(t, non_blocking=cuda)
        times.setdefault("host-copy", []).append(stop(t0))

    params = [p for p in model.parameters()]

    def parallel_disk() -> None:  # 1b. the parallel write limit: every rank writes its share to its own file
        share = math.ceil(cfg["nbytes"] / world / (64 * MiB))
        block = bytearray(os.urandom(1 << 20)) * 64
        t0 = start()
        path = root / f"parallel-{rank}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for _ in range(share):
            os.write(fd, block)
        os.fsync(fd)
        os.close(fd)
        times.setdefault("disk-parallel", []).append(stop(t0))
        out["parallel_bytes"] = share * 64 * MiB * world
        path.unlink()

    def save_hf(tag: str, budget: int, async_save: bool, profile: bool, extra: dict) -> None:  # 4 + 6
        policy = wb.SavePolicy.full() if "full" in tag else wb.SavePolicy.minimal()
        received = plan_save(layout, ranks=[rank], budget_bytes=budget, policy=policy).schedules[rank].bytes_moved
        if async_save and "warm-pool" not in times:  # once, before the first async save, outside its timing
            t0 = start()
            warmed = wb.warm_host_pool(model, key_map=key_map)
            times["warm-pool"] = [stop(t0)]
            out["warm_pool_bytes"] = warmed
        extra = dict(extra)
        if not extra.pop("writeback", True):  # the baseline: every byte left to the final fsync
            os.environ["WORKBENCH_WRITEBACK_BYTES"] = "0"
        base = _reset_peak(device)
        t0 = start()
        profiler = _start_profile() if profile else None
        handle = wb.save_hf(model, root / tag, key_map=key_map, budget_bytes=budget, async_save=async_save,
                            policy=policy, write_threads=cfg["threads"], **cfg["save_kwargs"], **extra)
        t_call = time.perf_counter() - t0
        if profiler is not None and async_save:  # the call alone: what blocks training
            out.setdefault("profile", {})[tag + ":call"] = _stop_profile(profiler, root / f"profile-{tag}-rank0.txt")
            profiler = None
        result = handle.wait() if async_save else handle
        os.environ.pop("WORKBENCH_WRITEBACK_BYTES", None)
        if profiler is not None:
            out.setdefault("profile", {})[tag] = _stop_profile(profiler, root / f"profile-{tag}-rank0.txt")
        times.setdefault(tag, []).append(stop(t0))
        if async_save:
            times.setdefault(tag + ":call", []).append(t_call)
        out["mem"].setdefault(tag, []).append(_peak_since(base, device))
        out.setdefault("timings", {}).setdefault(tag, []).append(str(result.timings))
        out["saves"][tag] = {"predicted": result.predicted_peak_bytes, "bytes": result.bytes_written,
                             "calls": result.calls, "files": len(result.files), "budget": budget,
                             "received": received, "mode": result.write_mode, "direct": result.direct_tensors}

    methods: list[tuple[str, Any]] = [("disk-parallel", parallel_disk), ("host-copy", host_copy)]
    if cfg["load_only"]:  # the one save the loads read, once
        methods = []
        save_hf("wb-1G", 1024 * MiB, False, False, {})
    elif cfg["mesh"][2] == 1:
        methods.append(("naive", naive))
    else:
        out["notes"].append("naive baseline skipped: torch's full_tensor() cannot undo InterleavedShard on etp > 1")
    if not cfg["skip_dcp"] and not cfg["load_only"]:
        methods.append(("dcp", dcp))
    gather = {"write_mode": "gather"}
    for tag, budget, async_save, extra in (
        ("wb-256M", 256 * MiB, False, {}), ("wb-1G", 1024 * MiB, False, {}),
        ("wb-1G-nowb", 1024 * MiB, False, {"writeback": False}),
        ("wb-gather-1G", 1024 * MiB, False, gather),
        ("wb-full-1G", 1024 * MiB, False, gather), ("wb-async-1G", 1024 * MiB, True, {}),
        ("wb-async-gather-1G", 1024 * MiB, True, gather),
    ):
        if (cfg["lean"] and tag in ("wb-256M", "wb-full-1G", "wb-async-gather-1G")) or cfg["load_only"]:
            continue
        methods.append((tag, lambda rep, tag=tag, budget=budget, a=async_save, e=extra: save_hf(
            tag, budget, a, cfg["profile"] and rank == 0 and (tag, rep) in (("wb-1G", 0), ("wb-async-1G", 1)), e)))
    for rep in range(cfg["repeats"]):  # round robin, so that a slow spell of the machine hits every method
        for tag, run in methods:
            run(rep) if tag.startswith("wb") else run()
            gc.collect()

    # 5. wb.load_hf into another topology: cold, round robin with the read limit (dd of the same files, through the
    # page cache and with O_DIRECT), then warm (the files read through the page cache first)
    ckpt = root / "wb-1G"
    model_b = build(cfg["load_mesh"])
    files = sorted(ckpt.glob("*.safetensors"))
    out["read_dd_bytes"] = sum(f.stat().st_size for f in files)
    for _ in range(cfg["repeats"]):
        if rank == 0:
            for name, flags in (("read-dd", []), ("read-dd-direct", ["iflag=direct"])):
                evict(files)
                t0 = time.perf_counter()
                for f in files:
                    subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=64M", *flags], check=True,
                                   capture_output=True)
                times.setdefault(name, []).append(time.perf_counter() - t0)
            evict(files)
        t0 = start()
        os_before = os_read_bytes()
        report = wb.load_hf(model_b, ckpt, key_map=key_map, cast=True)
        os_read = os_read_bytes() - os_before  # what the disk read for this rank; page-cache hits are free
        times.setdefault("load", []).append(stop(t0))
        out.setdefault("os_read", []).append(os_read)
        if rank == 0:
            out.setdefault("cached_after_cold", []).append(cached(files))
    out["load"] = {"read": report.bytes_read, "owned": report.bytes_owned, "seconds": report.seconds, "ok": report.ok,
                   "os_read": statistics.median(out["os_read"]), "stages": str(report.timings)}
    for rep in range(cfg["warm_repeats"]):
        if rank == 0 and not cached(files) >= 1.0:
            fill(files)
        t0 = start()
        profiler = _start_profile() if cfg["profile_load"] and rank == 0 and rep == cfg["warm_repeats"] - 1 else None
        report = wb.load_hf(model_b, ckpt, key_map=key_map, cast=True)
        if profiler is not None:
            out.setdefault("profile", {})["load-warm"] = _stop_profile(profiler, root / "profile-load-warm-rank0.txt")
        times.setdefault("load-warm", []).append(stop(t0))
    out["load_warm"] = {"read": report.bytes_read, "owned": report.bytes_owned, "stages": str(report.timings)}

    # correctness, once: same topology bit for bit; the other topology against the naive file
    if cfg["verify"]:
        model_a = build(cfg["mesh"])
        wb.load_hf(model_a, ckpt, key_map=key_map, cast=True)
        same = all(
            torch.equal(_bits(_local(a)), _bits(_local(b)))
            for a, b in zip(model.state_dict(keep_vars=True).values(), model_a.state_dict(keep_vars=True).values())
        )
        flag = torch.tensor([int(same)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        out["roundtrip_same_topology"] = bool(flag.item())
        del model_a
        if cfg["load_mesh"][2] == 1 and (root / "naive").is_dir():
            out["roundtrip_other_topology"] = _matches_naive(model_b, key_map, root / "naive", rank)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    from workbench import _compat

    return _compat.dtensor_local(t) if _compat.is_dtensor(t) else t


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that NaNs and -0.0 compare by bits."""
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def _fill(model: torch.nn.Module, seed: int) -> None:
    """Random values, a function of (parameter, the rank's coordinate on that parameter's mesh): replicas agree."""
    from workbench import _compat

    for i, tensor in enumerate(model.state_dict(keep_vars=True).values()):
        local = _local(tensor)
        coord = tensor.device_mesh.get_coordinate() if _compat.is_dtensor(tensor) else []
        mix = (seed * 1_000_003 + i) * 7919 + sum(c * 131**k for k, c in enumerate(coord or []))
        g = torch.Generator().manual_seed(mix % (2**63))
        values = torch.randn(tuple(local.shape), generator=g, dtype=torch.float32).to(local.dtype)
        with torch.no_grad():
            local.copy_(values.to(local.device))


def _plain(tensor: torch.Tensor) -> torch.Tensor | None:
    """The DTensor with each InterleavedShard on a mesh dim of size 1 (the identity) written as Shard; None if
    one is on a larger dim (torch cannot gather it)."""
    from torch.distributed.tensor import DTensor, Shard

    from workbench import InterleavedShard, _compat

    if not _compat.is_dtensor(tensor):
        return tensor
    placements = []
    for i, p in enumerate(tensor.placements):
        if isinstance(p, InterleavedShard):
            if tensor.device_mesh.size(i) != 1:
                return None
            p = Shard(p.dim)
        placements.append(p)
    if placements == list(tensor.placements):
        return tensor
    return DTensor.from_local(_local(tensor), tensor.device_mesh, placements, run_check=False,
                              shape=tensor.shape, stride=tensor.stride())


def _hf_split(name: str, full: torch.Tensor, key_map: Any) -> dict[str, torch.Tensor]:
    """A runtime tensor as its HF keys (equal parts along the fused dim: Qwen3-MoE's experts)."""
    from workbench.layout.key_map import HFKeys

    keys = key_map(name)
    if isinstance(keys, str):
        return {keys: full}
    assert isinstance(keys, HFKeys)
    return dict(zip(keys.keys, full.chunk(len(keys.keys), dim=keys.fused_dim or 0)))


def _naive_save(model: torch.nn.Module, key_map: Any, path: Path, rank: int) -> None:
    from safetensors.torch import save_file

    from workbench.io.files.write import fsync_dir, fsync_file

    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        full = _plain(tensor.detach()).full_tensor()  # a collective: every rank
        if rank == 0:
            state.update(_hf_split(name, full.cpu(), key_map))
        del full
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        fsync_file(path / "model.safetensors")
        fsync_dir(path)


def _dcp_save(model: torch.nn.Module, key_map: Any, path: Path, rank: int, world: int, threads: int,
              start: Any, stop: Any) -> dict[str, Any]:
    """dcp.save through HuggingFaceStorageWriter(save_distributed=True), then consolidation; both timed."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.api import CheckpointException

    from workbench.io.files.write import fsync_dir, fsync_file

    try:
        from torch.distributed.checkpoint._consolidate_hf_safetensors import (
            consolidate_safetensors_files_on_every_rank as consolidate,
        )
    except ImportError:  # older torch: rank 0 consolidates alone
        consolidate = None

    out: dict[str, Any] = {"times": {}, "notes": []}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        keys = key_map(name)
        state[keys if isinstance(keys, str) else f"model.{name}"] = tensor.detach()  # fused tensors stay fused
    # as many output files as ranks, contiguous and balanced by bytes, so every rank consolidates one
    total = sum(t.numel() * t.element_size() for t in state.values())
    files = max(world, math.ceil(total / (5 * GB)))
    mapping, acc = {}, 0
    for fqn, t in state.items():
        mapping[fqn] = min(files, 1 + acc * files // total)
        acc += t.numel() * t.element_size()
    sharded = path / "sharded"

    def save(sd: dict[str, torch.Tensor]) -> None:
        writer = HuggingFaceStorageWriter(str(sharded), fqn_to_index_mapping=mapping, thread_count=threads,
                                          save_distributed=True)
        dcp.save(sd, storage_writer=writer)

    t0 = start()
    try:
        save(state)
    except (Exception, CheckpointException) as exc:  # a failed global plan reaches every rank alike
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:400]}"
        plain = {k: _plain(v) for k, v in state.items()}
        if any(v is None for v in plain.values()):
            out["notes"].append(f"torch DCP cannot save these DTensors ({why}); no DCP figures")
            out["failed"] = True
            return out
        out["notes"].append(f"torch DCP refused the model's DTensors ({why}); saved them re-wrapped with Shard "
                            "for InterleavedShard on etp=1 (the same layout)")
        if rank == 0:
            shutil.rmtree(sharded, ignore_errors=True)
        t0 = start()
        save(plain)  # type: ignore[arg-type]
    out["times"]["dcp-save"] = stop(t0)

    t0 = start()
    if consolidate is not None:
        consolidate(str(sharded), str(path), mapping, num_threads=threads)
        mine = {i for i in set(mapping.values()) if i % world == rank}
    else:
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        if rank == 0:
            consolidate_safetensors_files(str(sharded), str(path), mapping, num_threads=threads)
        mine = set(mapping.values()) if rank == 0 else set()
    n = max(mapping.values())
    for i in sorted(mine):  # torch's consolidation does not fsync; the other methods do
        fsync_file(path / f"model-{i:05d}-of-{n:05d}.safetensors")
    if rank == 0:
        for index in path.glob("*.json"):
            fsync_file(index)
        fsync_dir(path)
    dist.barrier()
    out["times"]["dcp-consolidate"] = stop(t0)
    return out


def _reset_peak(device: torch.device) -> dict[str, int]:
    """Return this process's memory to the OS where it can, reset the peaks; the baseline."""
    import ctypes
    import gc
    import resource

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    reset = True
    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (Linux >= 4.0)
            f.write("5")
    except OSError:
        reset = False
    base = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "reset": int(reset)}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base["cuda"] = torch.cuda.memory_allocated(device)
    return base


def _peak_since(base: dict[str, int], device: torch.device) -> dict[str, int]:
    import resource

    out = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base["rss"], "reset": base["reset"]}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.max_memory_allocated(device) - base["cuda"]
    return out


def _start_profile() -> Any:
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _stop_profile(profiler: Any, path: Path) -> str:
    import io
    import pstats

    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)
    path.write_text(text.getvalue())
    return text.getvalue()


def _matches_naive(model: torch.nn.Module, key_map: Any, naive: Path, rank: int) -> bool:
    """Every parameter of ``model`` (gathered with full_tensor) equals the naive file's keys, bit for bit."""
    import torch.distributed as dist
    from safetensors import safe_open

    ok = True
    handle = safe_open(str(naive / "model.safetensors"), framework="pt", device="cpu") if rank == 0 else None
    for name, tensor in model.state_dict(keep_vars=True).items():
        full = _plain(tensor.detach()).full_tensor()
        if rank == 0:
            for key, part in _hf_split(name, full.cpu(), key_map).items():
                ok = ok and torch.equal(_bits(part), _bits(handle.get_tensor(key)))
        del full
    flag = [ok]
    dist.broadcast_object_list(flag, src=0)
    return bool(flag[0])


# -- after the run: compare the files ------------------------------------------------------------------


def compare_checkpoints(root: Path, tags: list[str], key_map: Any, shape: Qwen3MoeShape) -> dict[str, str]:
    """Each checkpoint against the naive one: same keys, same dtypes and shapes, same bytes."""
    from safetensors import safe_open

    naive = root / "naive" / "model.safetensors"
    if not naive.is_file():
        return {}
    out = {}
    with safe_open(str(naive), framework="pt", device="cpu") as ref:
        want = set(ref.keys())
        for tag in tags:
            index = root / tag / "model.safetensors.index.json"
            if not index.is_file():
                out[tag] = "no index file"
                continue
            weight_map = json.loads(index.read_text())["weight_map"]
            handles: dict[str, Any] = {}
            bad: list[str] = []
            expected = set(want)
            if tag == "dcp":  # DCP keeps fused tensors under their runtime names
                expected = {k for k in want if ".mlp.experts." not in k}
                expected |= {f"model.layers.{i}.mlp.experts.{f}" for i in range(shape.num_hidden_layers)
                             for f in ("fused_w1w3", "fused_w2")}
            if set(weight_map) != expected:
                out[tag] = f"keys differ: {len(set(weight_map) ^ expected)} key(s) in one only"
                continue
            for key, file in weight_map.items():
                if file not in handles:
                    handles[file] = safe_open(str(root / tag / file), framework="pt", device="cpu")
                got = handles[file].get_tensor(key)
                if key.endswith(("fused_w1w3", "fused_w2")):
                    name = key.removeprefix("model.")
                    parts = [ref.get_tensor(k) for k in key_map(name).keys]
                    same = torch.equal(_bits(got), _bits(torch.cat(parts)))
                else:
                    same = torch.equal(_bits(got), _bits(ref.get_tensor(key)))
                if not same:
                    bad.append(key)
            out[tag] = f"{len(weight_map)} keys, bytes equal" if not bad else f"{len(bad)} key(s) differ: {bad[:3]}"
    return out


# -- the report ------------------------------------------------------------------------------------------


def fmt_gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="world size (default 4)")
    parser.add_argument("--mesh", type=int, nargs=3, metavar=("FSDP", "EP", "ETP"),
                        help="save mesh (default: ranks=1: 1 1 1; else ranks/2 2 1)")
    parser.add_argument("--load-mesh", type=int, nargs=3, metavar=("FSDP", "EP", "ETP"),
                        help="load mesh (default: ranks 1 1)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--size-gb", type=float, default=1.5, help="model size in GB (bf16); picks --layers")
    parser.add_argument("--layers", type=int, default=None, help="number of layers (overrides --size-gb)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--min-segment-kb", type=int, default=None,
                        help="save_hf's min_segment_bytes in KiB (0: every tensor written directly, no gathers)")
    parser.add_argument("--threads", type=int, default=4, help="writer threads per rank (wb and DCP alike)")
    parser.add_argument("--max-shard-mb", type=int, default=None,
                        help="wb.save_hf's max_shard_bytes in MB (default: wb's own, 5 GB)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each disk test and each save method (round robin); the best counts")
    parser.add_argument("--warm-repeats", type=int, default=None,
                        help="warm loads (default: --repeats); the first after the cold loads plans the warm page "
                             "cache's landing once (its pieces pack cached files fuller), the rest reuse it")
    parser.add_argument("--dir", default=None, help="target directory (default: a new one under /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--lean", action="store_true", help="skip the 256 MiB and full-policy saves (small disks)")
    parser.add_argument("--skip-dcp", action="store_true")
    parser.add_argument("--load-only", action="store_true",
                        help="no disk probes and one save (wb.save_hf, 1 GiB): only the loads, cold and warm")
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile rank 0's first 1 GiB sync save and its second async call")
    parser.add_argument("--profile-load", action="store_true", help="cProfile rank 0's last warm load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()

    wall = time.perf_counter()
    mesh = tuple(args.mesh) if args.mesh else ((1, 1, 1) if args.ranks == 1 else (args.ranks // 2, 2, 1))
    load_mesh = tuple(args.load_mesh) if args.load_mesh else (args.ranks, 1, 1)
    for m in (mesh, load_mesh):
        if math.prod(m) != args.ranks:
            parser.error(f"mesh {m} has {math.prod(m)} ranks, not --ranks {args.ranks}")
    shape = pick_shape(args)
    if shape.num_experts % mesh[1] or shape.num_experts % load_mesh[1]:
        parser.error(f"{shape.num_experts} experts do not split over ep={mesh[1]} / {load_mesh[1]}")
    nbytes = model_bytes(shape)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="wb-save-load-", dir=args.dir))
    from workbench.models import qwen3_moe_key_map

    print(f"machine     {machine()}; torch {torch.__version__}; Python {platform.python_version()}")
    print(f"target      {root}: {filesystem(root)}")
    print(f"model       Qwen3-MoE {shape}")
    print(f"            {nbytes / GB:.2f} GB ({fmt_gib(nbytes)}); save mesh {dict(zip(DIMS, mesh))}, load mesh "
          f"{dict(zip(DIMS, load_mesh))}; {args.ranks} rank(s), {args.backend}")

    # 1. the disk, in the same directory
    count = max(1, math.ceil(nbytes / (64 * MiB)))
    disk_bytes = count * 64 * MiB
    disk: dict[str, list[float]] = {}
    probes: list[tuple[str, Any]] = [("dd-direct", lambda: dd(root / "dd.bin", count, True))]
    probes += [(f"direct-x{n}", lambda n=n: direct_writers(root, count, n)) for n in LIMIT_WRITERS]
    probes += [("dd-fsync", lambda: dd(root / "dd.bin", count, False)),
               ("python", lambda: python_write(root / "py.bin", count))]
    if args.load_only:
        probes = []
    for _ in range(args.repeats):  # round robin, so that a slow spell of the disk hits every probe
        for name, run in probes:
            seconds = run()
            disk.setdefault(name, [])
            if seconds is not None:
                disk[name].append(seconds)
    # the write limit: the fastest O_DIRECT writing this run saw, one dd or 2/4/8 in parallel, nothing cached
    limit_names = ["dd-direct"] + [f"direct-x{n}" for n in LIMIT_WRITERS]
    limit_runs = [t for name in limit_names for t in disk.get(name, [])]
    limit = disk_bytes / min(limit_runs) if limit_runs else float("nan")

    cfg = {"shape": shape, "mesh": mesh, "load_mesh": load_mesh, "root": str(root), "backend": args.backend,
           "threads": args.threads, "seed": args.seed, "profile": args.profile, "verify": not args.no_verify,
           "skip_dcp": args.skip_dcp, "repeats": args.repeats,
           "warm_repeats": args.warm_repeats or args.repeats, "lean": args.lean, "load_only": args.load_only,
           "profile_load": args.profile_load,
           "save_kwargs": ({} if args.max_shard_mb is None else {"max_shard_bytes": args.max_shard_mb * 10**6})
           | ({} if args.min_segment_kb is None else {"min_segment_bytes": args.min_segment_kb << 10}),
           "nbytes": nbytes}
    t_launch = time.perf_counter()
    results = wb.launch(_rank_main, nprocs=args.ranks, backend=args.backend, args=(cfg,), timeout=args.timeout)
    t_launch = time.perf_counter() - t_launch
    r0 = results[0]
    times = r0["times"]
    key_map = qwen3_moe_key_map(shape.num_experts)
    load_rows, load = load_report(results, nbytes, load_mesh)
    if args.load_only:
        save = times["wb-1G"][0]
        print(f"\nsave        wb.save_hf sync, budget 1 GiB, write_mode={r0['saves']['wb-1G']['mode']}: {save:.2f} s, "
              f"{nbytes / save / GB:.2f} GB/s (one run, no disk probes: --load-only)\n")
        print("\n".join(load_rows))
        print(f"\ntargets     cold >= 0.95 x read limit: {'met' if load['cold_ratio'] >= 0.95 else 'MISSED'} "
              f"({load['cold_ratio']:.2f}); warm >= 20 GB/s per GPU: "
              f"{'met' if load['warm_per_gpu'] >= 20 else 'MISSED'} ({load['warm_per_gpu']:.2f}); disk reads (OS) "
              f"<= 1.05 x owned: {'met' if load['os_ratio'] <= 1.05 else 'MISSED'} ({load['os_ratio']:.3f})")
        if "roundtrip_same_topology" in r0:
            print(f"check       wb.load_hf into the save mesh equals the saved locals bit for bit: "
                  f"{r0['roundtrip_same_topology']}")
        print(f"run         setup (build + fill) {r0['setup_s']:.1f} s; ranks {t_launch:.0f} s; "
              f"whole run {time.perf_counter() - wall:.0f} s")
        for tag, text in r0.get("profile", {}).items():
            print(f"\ncProfile of rank 0's {tag}:\n{text}")
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        return
    saved = ("wb-256M", "wb-1G", "wb-1G-nowb", "wb-gather-1G", "wb-full-1G", "wb-async-1G", "wb-async-gather-1G", "dcp")
    checks = {} if args.no_verify else compare_checkpoints(
        root, [t for t in saved if (root / t / "model.safetensors.index.json").is_file()], key_map, shape)

    rows = [f"| method | seconds (best of {args.repeats}) | GB/s | vs disk limit | all runs (s) |",
            "|---|---|---|---|---|"]

    def row(label: str, runs: list[float], size: int = nbytes, rate_too: bool = True) -> None:
        if not runs:
            rows.append(f"| {label} | failed | — | — | — |")
            return
        best = min(runs)
        rate = f"{size / best / GB:.2f} | {size / best / limit:.2f}" if rate_too else "— | —"
        rows.append(f"| {label} | {best:.2f} | {rate} | {', '.join(f'{s:.2f}' for s in runs)} |")

    par = r0.get("parallel_bytes", nbytes)
    fastest = min(limit_names, key=lambda n: min(disk[n], default=math.inf))
    row(f"disk: `dd bs=64M count={count} oflag=direct conv=fsync`" + (" (the limit)" if fastest == "dd-direct"
                                                                        else ""), disk["dd-direct"], disk_bytes)
    for n in LIMIT_WRITERS:
        row(f"disk: {n} parallel `dd oflag=direct conv=fsync`, each 1/{n}"
            + (" (the limit)" if fastest == f"direct-x{n}" else ""), disk[f"direct-x{n}"], disk_bytes)
    row(f"disk: {args.ranks} ranks each write their share through the page cache + fsync (not part of the limit)",
        times["disk-parallel"], par)
    row("disk: `dd bs=64M conv=fsync` (through the page cache)", disk["dd-fsync"], disk_bytes)
    row("disk: Python `write` 64 MiB blocks + `fsync`", disk["python"], disk_bytes)
    if "naive" in times:
        row("naive: `full_tensor()` per param + rank-0 `save_file`", times["naive"])
    if "dcp-save" in times:
        row("torch DCP: `HuggingFaceStorageWriter(save_distributed=True)`", times["dcp-save"])
        row("torch DCP: `consolidate_safetensors_files_on_every_rank` + fsync", times["dcp-consolidate"])
        row("torch DCP: save + consolidation", [a + b for a, b in zip(times["dcp-save"], times["dcp-consolidate"])])
    if "wb-256M" in times:
        row("wb.save_hf sync, budget 256 MiB", times["wb-256M"])
    row(f"wb.save_hf sync, budget 1 GiB, write_mode={r0['saves']['wb-1G']['mode']} "
        f"({r0['saves']['wb-1G']['direct']} tensors direct)", times["wb-1G"])
    if "wb-1G-nowb" in times:
        row("wb.save_hf sync, budget 1 GiB, direct, writeback window off (fsync at the end does it all)",
            times["wb-1G-nowb"])
    row("wb.save_hf sync, budget 1 GiB, write_mode=gather", times["wb-gather-1G"])
    if "wb-full-1G" in times:
        row("wb.save_hf sync, budget 1 GiB, SavePolicy.full() (gather everything)", times["wb-full-1G"])
    calls = [max(r["times"]["wb-async-1G:call"][i] for r in results.values()) for i in range(args.repeats)]
    row(f"`wb.warm_host_pool(model)` once, before the first async save ({fmt_gib(r0['warm_pool_bytes'])} / rank)",
        times["warm-pool"], rate_too=False)
    row("each rank copies its local tensors into host buffers allocated beforehand (the async floor)",
        times["host-copy"], rate_too=False)
    row("wb.save_hf async, budget 1 GiB: until the call returns (slowest rank)", calls, rate_too=False)
    row("wb.save_hf async, budget 1 GiB: until `wait()` returns", times["wb-async-1G"])
    if "wb-async-gather-1G" in times:
        calls = [max(r["times"]["wb-async-gather-1G:call"][i] for r in results.values()) for i in range(args.repeats)]
        row("wb.save_hf async, write_mode=gather: until the call returns (slowest rank)", calls, rate_too=False)

    key = "cuda" if args.backend == "nccl" else "rss"
    what = "device memory" if key == "cuda" else "RSS"
    mem_rows = [f"| wb.save_hf | predicted peak / rank | measured peak {what} increase / rank (max of runs) | "
                "measured / predicted (worst rank) | budget + largest tensor | receives / rank | writes / rank |",
                "|---|---|---|---|---|---|---|"]
    largest = max(2 * shape.num_experts * shape.moe_intermediate_size * shape.hidden_size,
                  shape.vocab_size * shape.hidden_size) * 2
    wb_tags = [t for t in ("wb-256M", "wb-1G", "wb-1G-nowb", "wb-gather-1G", "wb-full-1G", "wb-async-1G",
                           "wb-async-gather-1G") if t in times]
    for tag in wb_tags:
        pred = [r["saves"][tag]["predicted"] for r in results.values()]
        meas = [_peak(r, tag, key) for r in results.values()]
        w = [r["saves"][tag]["bytes"] for r in results.values()]
        recv = [r["saves"][tag]["received"] for r in results.values()]
        ratio = f"{max(m / p for m, p in zip(meas, pred)):.2f}" if min(pred) else "n/a (no gathers)"
        budget = r0["saves"][tag]["budget"]
        mem_rows.append(f"| {tag} ({r0['saves'][tag]['calls']} gather calls) | {fmt_gib(min(pred))} – "
                        f"{fmt_gib(max(pred))} | {fmt_gib(min(meas))} – {fmt_gib(max(meas))} | {ratio} | "
                        f"{fmt_gib(budget + largest)} | {fmt_gib(max(recv))} | "
                        f"{fmt_gib(min(w))} – {fmt_gib(max(w))} |")

    print()
    print("\n".join(rows))
    print()
    print("\n".join(load_rows))
    print()
    print("\n".join(mem_rows))
    print()
    ratio = nbytes / min(times.get("wb-256M", []) + times["wb-1G"]) / limit
    print(f"targets     save >= 0.9 x disk limit: {'met' if ratio >= 0.9 else 'MISSED'} ({ratio:.2f}, best sync run); "
          f"disk reads (OS) <= 1.05 x owned: {'met' if load['os_ratio'] <= 1.05 else 'MISSED'} "
          f"({load['os_ratio']:.3f}); load cold >= 0.95 x read limit: "
          f"{'met' if load['cold_ratio'] >= 0.95 else 'MISSED'} ({load['cold_ratio']:.2f}); "
          f"warm >= 20 GB/s per GPU: {'met' if load['warm_per_gpu'] >= 20 else 'MISSED'} "
          f"({load['warm_per_gpu']:.2f}); "
          f"measured peak <= 1.1 x predicted: "
          + ", ".join(f"{t} {_within(results, t, key)}" for t in wb_tags))
    best_call = min(max(r["times"]["wb-async-1G:call"][i] for r in results.values()) for i in range(args.repeats))
    floor = min(times["host-copy"])
    naive_best = f"{best_call / min(times['naive']):.1%} of the naive save" if "naive" in times else "no naive run"
    print(f"async       call {best_call:.3f} s (best run, slowest rank): {naive_best} (target <= 5%); "
          f"{best_call / floor:.2f}x the host copy of the rank's own bytes, {floor:.3f} s (target <= 1.2x)")
    for tag, verdict in checks.items():
        print(f"check       {tag} vs naive: {verdict}")
    if "roundtrip_same_topology" in r0:
        print(f"check       wb.load_hf into the save mesh equals the saved locals bit for bit: "
              f"{r0['roundtrip_same_topology']}")
    if "roundtrip_other_topology" in r0:
        lm = " x ".join(f"{d}={n}" for d, n in zip(DIMS, load_mesh))
        print(f"check       wb.load_hf into {lm}, gathered with full_tensor, equals the naive file bit for bit: "
              f"{r0['roundtrip_other_topology']}")
    for tag in wb_tags:  # where each rank's fastest run of the save spent its time (SaveResult.timings)
        best = min(range(len(times[tag])), key=times[tag].__getitem__)
        for rank, r in sorted(results.items()):
            print(f"timings     {tag} rank {rank} (run {best + 1}): {r['timings'][tag][best]}")
    for note in dict.fromkeys(r0["notes"]):
        print(f"note        {note}")
    if not all(m["reset"] for r in results.values() for m in r["mem"]["wb-1G"]):
        print("note        /proc/self/clear_refs was not writable: peaks are since process start")
    print(f"run         setup (build + fill) {r0['setup_s']:.1f} s; ranks {t_launch:.0f} s; "
          f"whole run {time.perf_counter() - wall:.0f} s")
    for tag, text in r0.get("profile", {}).items():
        print(f"\ncProfile of rank 0's first {tag} save, also in {root / f'profile-{tag}-rank0.txt'}:")
        print(text)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"kept        {root}")


def load_report(results: dict[int, Any], nbytes: int, load_mesh: tuple[int, ...]) -> tuple[list[str], dict[str, float]]:
    """The load table (medians of the cold and warm runs beside the two ``dd`` reads) and its ratios."""
    r0 = results[0]
    times = r0["times"]
    ranks = len(results)
    read = sum(r["load"]["read"] for r in results.values())
    owned = sum(r["load"]["owned"] for r in results.values())
    os_read = sum(r["load"]["os_read"] for r in results.values())
    warm_read = sum(r["load_warm"]["read"] for r in results.values())
    warm_owned = sum(r["load_warm"]["owned"] for r in results.values())
    lm = " x ".join(f"{d}={n}" for d, n in zip(DIMS, load_mesh))
    med = {k: statistics.median(times[k]) for k in ("read-dd", "read-dd-direct", "load", "load-warm")}
    limit_key = min(("read-dd", "read-dd-direct"), key=med.__getitem__)
    limit = r0["read_dd_bytes"] / med[limit_key]
    n = len(times["load"])
    left = statistics.median(r0["cached_after_cold"])

    def row(label: str, key: str, size: int, tail: str) -> str:
        rate = size / med[key]
        runs = ", ".join(f"{t:.2f}" for t in times[key])
        return (f"| {label} | {med[key]:.2f} | {rate / GB:.2f} | {rate / GB / ranks:.2f} | {rate / limit:.2f} | "
                f"{tail} | {runs} |")

    rows = [f"| load (median of {n}) | seconds | GB/s | GB/s per GPU | vs read limit | disk read (OS) / owned; "
            "slices / owned | runs (s) |", "|---|---|---|---|---|---|---|",
            row("disk: `dd bs=64M` of the checkpoint's files, page cache dropped"
                + (" (the read limit)" if limit_key == "read-dd" else ""), "read-dd", r0["read_dd_bytes"], "—"),
            row("disk: `dd bs=64M iflag=direct`, the same files"
                + (" (the read limit)" if limit_key != "read-dd" else ""), "read-dd-direct", r0["read_dd_bytes"], "—"),
            row(f"wb.load_hf into {lm}, page cache dropped ({left:.0%} of the files cached after)", "load", nbytes,
                f"{os_read / GB:.3f} GB / {owned / GB:.3f} GB = {os_read / owned:.3f}; {read / owned:.4f}"),
            row(f"wb.load_hf into {lm}, warm page cache (median of {len(times['load-warm'])})", "load-warm", nbytes,
                f"—; {warm_read / warm_owned:.4f}"),
            "", "Each rank's last load, by stage (`LoadReport.timings`):", ""]
    rows += [f"- rank {rank} {what}: {r[key]['stages']}" for rank, r in sorted(results.items())
             for what, key in (("cold", "load"), ("warm", "load_warm"))]
    summary = {"cold_ratio": nbytes / med["load"] / limit, "warm_per_gpu": nbytes / med["load-warm"] / GB / ranks,
               "os_ratio": os_read / owned}
    return rows, summary


def _peak(r: dict[str, Any], tag: str, key: str) -> int:
    return max(m[key] for m in r["mem"][tag])


def _within(results: dict[int, Any], tag: str, key: str) -> str:
    if not all(r["saves"][tag]["predicted"] for r in results.values()):
        return "n/a"
    ok = all(_peak(r, tag, key) <= 1.1 * r["saves"][tag]["predicted"] for r in results.values())
    return "met" if ok else "MISSED"


if __name__ == "__main__":
    main()
