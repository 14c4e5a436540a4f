"""Benchmark: torch DCP save and load with workbench's planners against torch's default planners.

One run, one machine, one directory. ``wb.launch`` starts the ranks (gloo on CPU), each holding a parameter-only
Qwen3-MoE from ``build_qwen3_moe`` filled with random values plus Adam state laid out like each parameter
(``exp_avg``, ``exp_avg_sq``, scalar ``step``): the state ``get_state_dict`` returns. On a layout both planners
accept (FSDP x EP with etp=1: every shard is one box), the methods save ``--repeats`` times in turn and load
back what they wrote, timed between barriers (``dcp.save`` fsyncs its files). Then, once, our planner loads torch's
checkpoint and torch's planner loads ours (the metadata is standard DCP either way), checked bit for bit against
the saved values. Reported: median seconds, the ratio ours / torch, storage chunks in the metadata and GB/s.

On the layout only ours accepts (``--etp 2``: interleaved expert TP), torch's planner is run once to show it
refuses, and ours is timed alone.

    .venv/bin/python bench/dcp.py [--ranks 4] [--size-gb 0.5] [--repeats 3] [--etp 1] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from workbench.models import Qwen3MoeShape
from workbench.run import launch


def _shape(size_gb: float) -> Qwen3MoeShape:
    """A Qwen3-MoE of about ``size_gb`` GB of bf16 weights (plus 2x that of Adam moments)."""
    hidden, inter, experts, vocab = 1024, 512, 16, 8192
    per_layer = 2 * (experts * 3 * inter * hidden + 3 * hidden * hidden)  # experts + attention, bf16
    layers = max(1, round((size_gb * 1e9 - 2 * 2 * vocab * hidden) / per_layer))
    return Qwen3MoeShape(vocab_size=vocab, hidden_size=hidden, moe_intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_experts=experts)


def _state(model: Any) -> dict:
    import zlib

    from torch.distributed.checkpoint.state_dict import get_state_dict

    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for name, p in model.named_parameters():
        optim.state[p] = {"step": torch.tensor(3.0),
                          "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                          "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        # seeded by the shard's coordinate on the tensor's own mesh: replicas (other mesh dims) hold equal values
        seed = zlib.crc32(f"{name}{p.device_mesh.get_coordinate()}".encode())
        generator = torch.Generator().manual_seed(seed)
        for t in (p, optim.state[p]["exp_avg"], optim.state[p]["exp_avg_sq"]):
            local = t.to_local()
            local.copy_(torch.randn(local.shape, generator=generator).to(local.dtype))
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def _leaves(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict by dotted path, as its local tensor (a view, not a copy)."""
    if isinstance(value, torch.Tensor):
        return {prefix: value.to_local() if hasattr(value, "to_local") else value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    out: dict[str, torch.Tensor] = {}
    for key, item in items:
        out.update(_leaves(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _locals(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _leaves(state).items()}


def _ranks(root: str, shape: Qwen3MoeShape, mesh_shape: tuple[int, int, int], repeats: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh

    from workbench.io.dcp.planners import DCPLoadPlanner, DCPSavePlanner
    from workbench.models import build_qwen3_moe

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("fsdp", "ep", "etp"))
    model = build_qwen3_moe(shape, mesh)
    state = _state(model)
    saved = _locals(state)
    local_bytes = sum(t.numel() * t.element_size() for t in saved.values())
    methods = {"torch": (DefaultSavePlanner, DefaultLoadPlanner), "workbench": (lambda: DCPSavePlanner(model),
                                                                              lambda: DCPLoadPlanner(model))}
    out: dict[str, Any] = {"local_bytes": local_bytes, "times": {}, "chunks": {}}

    def timed(op, path: str, planner: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        op(state, checkpoint_id=path, planner=planner)
        dist.barrier()
        return time.perf_counter() - start

    accepted = []
    for name, (save_planner, _) in methods.items():  # warm-up save; torch's planner may refuse the layout
        try:
            timed(dcp.save, f"{root}/{name}", save_planner())
            accepted.append(name)
            out["times"][name] = {"save": [], "load": []}
        except BaseException as exc:  # DCP raises CheckpointException (a BaseException) on every rank
            out["times"][name] = f"refused: {str(exc).splitlines()[-1][:160]}"
    for _ in range(repeats):  # methods alternate, so drift on a shared machine hits both alike
        for name in accepted:
            out["times"][name]["save"].append(timed(dcp.save, f"{root}/{name}", methods[name][0]()))
        for name in accepted:
            out["times"][name]["load"].append(timed(dcp.load, f"{root}/{name}", methods[name][1]()))
    out["plan_ms"] = {}
    for name in accepted:  # the planners' own work: the local save plan (no I/O, no collectives), best of 5
        best = float("inf")
        for _ in range(5):
            planner = methods[name][0]()
            start = time.perf_counter()
            planner.set_up_planner(state, is_coordinator=dist.get_rank() == 0)
            planner.create_local_plan()
            best = min(best, time.perf_counter() - start)
        out["plan_ms"][name] = best * 1e3
    for name in accepted:
        metadata = dcp.FileSystemReader(f"{root}/{name}").read_metadata()
        out["chunks"][name] = sum(len(md.chunks) for md in metadata.state_dict_metadata.values()
                                  if hasattr(md, "chunks"))
    cross = {}
    if isinstance(out["times"].get("torch"), dict):
        for reader, writer in (("workbench", "torch"), ("torch", "workbench")):
            for v in _leaves(state).values():
                v.zero_()
            dcp.load(state, checkpoint_id=f"{root}/{writer}", planner=methods[reader][1]())
            now = _locals(state)
            bad = [k for k in saved if not torch.equal(now[k], saved[k])]
            zero = [k for k in bad if not now[k].any()]
            cross[f"{reader} loads {writer}'s"] = (
                "bit-exact" if not bad else f"{len(bad)} of {len(saved)} differ ({len(zero)} all zero), e.g. {bad[:2]}")
    out["cross"] = cross
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--size-gb", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--etp", type=int, default=1)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    shape = _shape(args.size_gb)
    ep = 2 if args.ranks % (2 * args.etp) == 0 else 1
    mesh_shape = (args.ranks // (ep * args.etp), ep, args.etp)
    root = Path(tempfile.mkdtemp(prefix="bench-dcp-", dir=args.dir))
    try:
        results = launch(_ranks, nprocs=args.ranks, args=(str(root), shape, mesh_shape, args.repeats), timeout=3600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    first = results[0]
    total = sum(r["local_bytes"] for r in results.values())
    print(f"machine: {platform.machine()}, {platform.python_version()}, torch {torch.__version__}; "
          f"{args.ranks} gloo ranks, mesh (fsdp, ep, etp) = {mesh_shape}; {shape.num_hidden_layers} layers; "
          f"local state (params + Adam moments) summed over ranks {total / 1e9:.2f} GB")
    row = "| {:<10} | {:>9} | {:>9} | {:>9} | {:>9} | {:>7} | {:>13} |"
    print(row.format("planner", "save s", "save GB/s", "load s", "load GB/s", "chunks", "local plan ms"))
    medians = {}
    for name, times in first["times"].items():
        if not isinstance(times, dict):
            print(f"| {name:<10} | {times} |")
            continue
        save, load = statistics.median(times["save"]), statistics.median(times["load"])
        medians[name] = (save, load)
        print(row.format(name, f"{save:.3f}", f"{total / save / 1e9:.2f}", f"{load:.3f}", f"{total / load / 1e9:.2f}",
                         first["chunks"][name], f"{first['plan_ms'][name]:.1f}"))
    if len(medians) == 2:
        (ts, tl), (ws, wl) = medians["torch"], medians["workbench"]
        print(f"ratio workbench / torch: save {ws / ts:.2f}x, load {wl / tl:.2f}x")
    print("cross loads:", json.dumps(first["cross"]))


if __name__ == "__main__":
    main()
