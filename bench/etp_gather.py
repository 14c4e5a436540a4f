"""Benchmark: one expert-TP rank's warm load on one GPU, its half rows gathered or read as spans.

Expert tensor parallelism over 2 ranks gives each rank half of every row of each expert's ``down_proj`` (runs of
``--moe-intermediate`` bytes, half of a 2-byte row of that many elements), and whole rows of ``gate_up``. Without a
second GPU, this script loads one rank's shards (``rank=``, no process group) into CUDA tensors of one process, from
files in the page cache, and goes round robin over two ways of reading the half rows in the same process:

- ``gathered``: the native gather (``workbench/io/files/gather.py``) packs the rank's runs into the staging slot;
- ``spans``: the spans, the peer's halves riding along (the code before the gather, and what runs without a C
  compiler).

Each way keeps its own landing plans (``landing._KEPT``), so a repeat load plans nothing in either. Printed: the
median of loads 2..N of each, GB/s by the rank's owned bytes, the load's stages, and whether the last load of each
(into zeroed tensors) gave back the saved values bit for bit.

    python bench/etp_gather.py --size-gb 4 --loads 7 [--rank 1] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import Shard

import workbench as wb
from workbench.io.files import box_reads, gather, landing
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.memo import LRU

sys.path.insert(0, str(Path(__file__).resolve().parent))
import page_cache


def build(folder: Path, size_gb: float, experts: int, hidden: int, inter: int
          ) -> tuple[Layout, dict[str, torch.Tensor]]:
    """Write the experts of as many layers as make ``size_gb`` (one file a layer) and return their layout over
    ``etp=2`` and the full tensors."""
    layer_bytes = experts * 3 * hidden * inter * 2
    layers = max(1, round(size_gb * 1e9 / layer_bytes))
    mesh = wb.MeshSpec((2,), ("etp",))
    specs, full, weight_map = {}, {}, {}
    generator = torch.Generator().manual_seed(0)
    for layer in range(layers):
        gate_up = torch.randn(experts, 2 * inter, hidden, generator=generator).to(torch.bfloat16)
        down = torch.randn(experts, hidden, inter, generator=generator).to(torch.bfloat16)
        names = {f"layers.{layer}.gate_up": (gate_up, Shard(1)), f"layers.{layer}.down": (down, Shard(2))}
        file = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        save_file({name: t for name, (t, _) in names.items()}, str(folder / file))
        for name, (t, placement) in names.items():
            weight_map[name] = file
            specs[name] = LoadSpec.from_placements(name, [name], tuple(t.shape), mesh, [placement])
            full[name] = t
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return Layout(mesh, specs), full


def _owned(t: torch.Tensor, name: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s half of ``t`` (``gate_up``: of its rows; ``down``: of its columns), by torch's slicing."""
    dim = 1 if name.endswith("gate_up") else 2
    width = t.shape[dim] // 2
    return t.narrow(dim, rank * width, width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=4.0)
    parser.add_argument("--loads", type=int, default=7)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--device", default="cuda", help="cpu: the GPU's landing path into CPU tensors (a smoke test)")
    args = parser.parse_args()
    print(f"native gather: {gather.why_not_native() or 'built'}")
    folder = Path(tempfile.mkdtemp(prefix="wb-etp-gather-", dir=args.dir))
    try:
        layout, full = build(folder, args.size_gb, args.experts, args.hidden, args.moe_intermediate)
        files = sorted(folder.glob("*.safetensors"))
        time.sleep(1.5)  # a file changed within a second of its parse is not kept (io/files/index.py)
        page_cache.fill(files)
        device = torch.device(args.device)
        if device.type == "cpu":
            from workbench.io.files.staging import StagingRing
            from workbench.io.hf import load as load_module

            load_module._CPU_LANDING_RING = StagingRing(pinned=False)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        targets = {n: torch.zeros(s.local_shape(args.rank), dtype=torch.bfloat16, device=device)
                   for n, s in layout.specs.items()}
        real = box_reads.native_gather
        ways = {"gathered": (real, LRU(4)), "spans": (lambda: None, LRU(4))}
        runs: dict[str, list[tuple[float, str, int]]] = {w: [] for w in ways}
        exact = {}
        for i in range(args.loads * len(ways)):
            way = list(ways)[i % len(ways)]
            box_reads.native_gather, landing._KEPT = ways[way]
            last = i >= (args.loads - 1) * len(ways)
            if last:
                for t in targets.values():
                    t.zero_()
            sync()
            began = time.perf_counter()
            report = wb.load_hf(targets, folder, layout=layout, rank=args.rank)
            sync()
            runs[way].append((time.perf_counter() - began, str(report.timings), report.bytes_read))
            if last:
                exact[way] = all(torch.equal(targets[n].cpu(), _owned(full[n], n, args.rank)) for n in targets)
        box_reads.native_gather = real
        owned = sum(t.numel() * t.element_size() for t in targets.values())
        size = sum(f.stat().st_size for f in files)
        print(f"{len(files)} files, {size / 1e9:.2f} GB; rank {args.rank} of etp=2 owns {owned / 1e9:.2f} GB; "
              f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}")
        for way, got in runs.items():
            later = got[1:]
            median = statistics.median(r[0] for r in later)
            at = sorted(later, key=lambda r: r[0])[len(later) // 2]
            print(f"  {way}: warm load {median:.3f} s (median of loads 2-{len(got)}), {owned / median / 1e9:.2f} GB/s "
                  f"owned; read {at[2] / owned:.3f}x owned; {at[1]}; loads {[round(r[0], 3) for r in got]}; "
                  f"bit for bit: {exact[way]}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
