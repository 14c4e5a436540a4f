"""Debug benchmarks: inspect a synthetic DeepSeek-V3-sized checkpoint (headers only), diagnose a 2 GB pair, and
diagnose a 100k-key checkpoint with one swap.

    .venv/bin/python bench/debug.py [--gb 2] [--keys 100000] [--dir /tmp/wb-debug-bench] [--skip-inspect]

1. ~100k keys, ~1T parameters (61 layers x 256 experts x 3 + attention + norms), 160 files written as real
   headers followed by *sparse* data (``truncate``): no disk is used for the data, the headers are real.
   ``inspect_checkpoint`` is timed against the baseline of opening every file with ``safe_open`` and listing
   its keys (what people do by hand), in the same run.
2. Two ~2 GB checkpoints differing in one permuted tensor: ``diagnose`` in a subprocess; its peak RSS
   minus the RSS after imports is the extra memory (target < 300 MB).
3. Two checkpoints of ~100k small keys (DeepSeek-V3's key names, 160 files) where two experts' down_proj, in two
   different files, are swapped: ``diagnose`` in a subprocess must name the swap (``misplaced_tensor``) at a cost
   linear in the keys (content fingerprints looked up by value, no pairwise compares); a 10x smaller copy in the
   same run shows the scaling.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _write_sparse(directory: Path, experts: int = 256, scales: bool = True) -> tuple[int, int]:
    """DeepSeek-V3's key set (FP8 weights with their block scales when ``scales``); 384 experts ~ Kimi-K2 (1T)."""
    directory.mkdir(parents=True, exist_ok=True)
    hidden, inter, layers = 7168, 2048, 61
    vocab = [129280, hidden]
    keys: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", vocab), ("lm_head.weight", vocab)]
    for i in range(layers):
        p = f"model.layers.{i}."
        keys += [(p + "input_layernorm.weight", [hidden]), (p + "post_attention_layernorm.weight", [hidden]),
                 (p + "self_attn.q_a_proj.weight", [1536, hidden]), (p + "self_attn.q_b_proj.weight", [24576, 1536]),
                 (p + "self_attn.kv_a_proj_with_mqa.weight", [576, hidden]),
                 (p + "self_attn.kv_b_proj.weight", [32768, 512]), (p + "self_attn.o_proj.weight", [hidden, 16384])]
        if i < 3:
            keys += [(p + f"mlp.{n}.weight", s) for n, s in (("gate_proj", [18432, hidden]),
                     ("up_proj", [18432, hidden]), ("down_proj", [hidden, 18432]))]
            continue
        keys.append((p + "mlp.gate.weight", [experts, hidden]))
        for e in range(experts):
            keys += [(p + f"mlp.experts.{e}.gate_proj.weight", [inter, hidden]),
                     (p + f"mlp.experts.{e}.up_proj.weight", [inter, hidden]),
                     (p + f"mlp.experts.{e}.down_proj.weight", [hidden, inter])]
    n_files = 160
    per = -(-len(keys) // n_files)
    weight_map, params = {}, 0
    for f in range(n_files):
        name = f"model-{f + 1:05d}-of-{n_files:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, shape in keys[f * per : (f + 1) * per]:
            fp8 = scales and len(shape) == 2
            entries = [(key, "F8_E4M3" if fp8 else "BF16", shape, 1 if fp8 else 2)]
            if scales and len(shape) == 2:
                scale = [-(-shape[0] // 128), -(-shape[1] // 128)]
                entries.append((key.replace(".weight", ".weight_scale_inv"), "F32", scale, 4))
            for k, dtype, s, itemsize in entries:
                size = math.prod(s) * itemsize
                header[k] = {"dtype": dtype, "shape": s, "data_offsets": [offset, offset + size]}
                offset += size
                weight_map[k] = name
                params += math.prod(s)
        raw = json.dumps(header).encode()
        with open(directory / name, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            fh.truncate(8 + len(raw) + offset)
    total = 0
    for n in set(weight_map.values()):
        with open(directory / n, "rb") as fh:
            total += (directory / n).stat().st_size - 8 - struct.unpack("<Q", fh.read(8))[0]
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return len(weight_map), params


def bench_inspect(root: Path, experts: int, scales: bool) -> None:
    from safetensors import safe_open

    from workbench.debug import inspect_checkpoint

    path = root / "dsv3"
    n_keys, params = _write_sparse(path, experts, scales)
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        ins = inspect_checkpoint(path)
        best = min(best, time.perf_counter() - t)
    assert ins.ok and ins.num_keys == n_keys, ins.to_text()[:2000]
    base = math.inf
    for _ in range(3):
        t = time.perf_counter()
        listed = 0
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                listed += len(list(h.keys()))
        base = min(base, time.perf_counter() - t)
    print(f"inspect: {n_keys} keys, {params / 1e12:.3f}T params, {len(ins.groups)} groups: {best:.3f} s "
          f"(baseline safe_open + keys() on every file: {base:.3f} s, ratio {best / base:.2f}x)")
    shutil.rmtree(path)


_CHILD = r"""
import threading, time
def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
class Peak:
    def __enter__(self):
        self.base = _rss(); self.peak = self.base; self._stop = False
        def run():
            while not self._stop:
                self.peak = max(self.peak, _rss()); time.sleep(0.005)
        self._t = threading.Thread(target=run, daemon=True); self._t.start(); return self
    def __exit__(self, *exc):
        self._stop = True; self._t.join(); self.peak = max(self.peak, _rss())
import sys
from workbench.debug import diagnose
import workbench.debug.analyze, torch
with Peak() as p:
    t = time.perf_counter()
    report = diagnose(sys.argv[2], expected=sys.argv[1])
    took = time.perf_counter() - t
print(report.to_text().splitlines()[0]); print([(f.kind, f.key, f.transform) for f in report.findings][:4])
extra = (p.peak - p.base) / 2**20
print(f"RESULT diagnose {took:.2f} s, RSS before {p.base / 2**20:.0f} MiB, extra peak RSS {extra:.1f} MiB, "
      f"read {report.stats.get('bytes_read', 0) / 2**20:.1f} MiB")
"""


def _run_child(a: Path, b: Path) -> str:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(a), str(b)], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def bench_diff(root: Path, gb: float) -> None:
    import torch

    from workbench.io.files.file_plan import plan_files
    from workbench.io.files.index import write_index
    from workbench.io.files.write import write_safetensors

    n = max(1, int(gb * (1 << 30) / (8192 * 4096 * 2)))  # 64 MiB bf16 tensors
    for side in ("a", "b"):
        d = root / side
        d.mkdir()
        sizes = {f"model.layers.{i}.mlp.down_proj.weight": 8192 * 4096 * 2 for i in range(n)}
        plan = plan_files(dict.fromkeys(sizes, 0), sizes, list(sizes), max_shard_bytes=1 << 30)
        for spec in plan.files:
            tensors = {}
            for k in spec.keys:
                i = int(k.split(".")[2])
                t = torch.randn(8192, 4096, generator=torch.Generator().manual_seed(i)).bfloat16()
                if side == "b" and i == n - 1:
                    t = torch.cat(t.chunk(4)[::-1])  # rank order reversed on one tensor
                tensors[k] = t
            write_safetensors(d / spec.name, tensors)
            del tensors
        write_index(d, plan)
    total = sum(f.stat().st_size for f in (root / "a").glob("*.safetensors"))
    print(f"diagnose pair: 2 x {total / (1 << 30):.2f} GiB, {n} tensors each, one permuted")
    print(_run_child(root / "a", root / "b"))
    shutil.rmtree(root / "a")
    shutil.rmtree(root / "b")


def _write_small(directory: Path, keys: list[str], swap: tuple[str, str] | None, n_files: int = 160) -> None:
    """Real safetensors files of ``keys`` (bf16 [4, 8], random bits seeded by key index), ``swap``'s data swapped."""
    import numpy as np

    directory.mkdir(parents=True)
    index = {k: i for i, k in enumerate(keys)}
    per = -(-len(keys) // n_files)
    weight_map = {}
    rng = np.random.default_rng(0)
    data = rng.integers(0, 2**16, size=(len(keys), 32), dtype=np.uint16)  # every key's bits, 64 bytes each
    if swap is not None:
        a, b = index[swap[0]], index[swap[1]]
        data[[a, b]] = data[[b, a]]
    for f in range(n_files):
        name = f"model-{f + 1:05d}-of-{n_files:05d}.safetensors"
        chunk = keys[f * per : (f + 1) * per]
        header = {"__metadata__": {"format": "pt"}}
        for j, key in enumerate(chunk):
            header[key] = {"dtype": "BF16", "shape": [4, 8], "data_offsets": [64 * j, 64 * (j + 1)]}
            weight_map[key] = name
        raw = json.dumps(header).encode()
        first = f * per
        with open(directory / name, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw + data[first : first + len(chunk)].tobytes())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 64 * len(keys)}, "weight_map": weight_map}))


def bench_swap(root: Path, n_keys: int) -> None:
    layers = max(1, n_keys // (3 * 256))
    keys = [f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight"
            for i in range(layers) for e in range(256) for p in ("gate", "up", "down")]
    swap = (keys[2], keys[-1])  # layer 0 expert 0's down_proj <-> the last layer's expert 255's: first and last file
    _write_small(root / "a", keys, None)
    _write_small(root / "b", keys, swap)
    print(f"swap: {len(keys)} keys of bf16[4, 8] in 160 files, {swap[0]} <-> {swap[1]}")
    print(_run_child(root / "a", root / "b"))
    shutil.rmtree(root / "a")
    shutil.rmtree(root / "b")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--skip-inspect", action="store_true")
    parser.add_argument("--skip-diff", action="store_true")
    parser.add_argument("--skip-swap", action="store_true")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="wb-debug-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        if not args.skip_inspect:
            bench_inspect(root, 256, True)   # DeepSeek-V3 as shipped: FP8 weights + scales
            bench_inspect(root, 384, False)  # Kimi-K2-sized: 1T params in BF16
        if not args.skip_swap:
            bench_swap(root, args.keys // 10)
            bench_swap(root, args.keys)
        if not args.skip_diff:
            bench_diff(root, args.gb)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"max RSS of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
