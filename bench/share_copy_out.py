"""Benchmark: the copy out of a replica broadcast's buffer into the replicated parameters, one op against one copy
per tensor, on the CPU and (where there is one) a GPU.

The tensors are the replicated parameters one EP2 rank of ``bench/save_load.py``'s 8 GB Qwen3-MoE receives from its
peer (``load_hf``'s ``read_replicas_once``: the members take turns over them, so about every other one), bf16 and
float32 in one batch each, as ``_share_replicas`` copies them. Printed: milliseconds per copy-out, median of 20.

    python bench/share_copy_out.py [--size-gb 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from workbench.io.hf.load import _copy_out

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _received(size_gb: float) -> list[tuple[int, ...]]:
    """Shapes of the replicated parameters a member receives: attention and norms of every layer, the router gate,
    the embedding and head and the final norm, every other one."""
    from save_load import pick_shape

    s = pick_shape(argparse.Namespace(vocab=32768, hidden=1024, moe_intermediate=512, layers=None, heads=16,
                                      kv_heads=4, head_dim=64, experts=32, size_gb=size_gb))
    h, q, kv = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    shapes = [(s.vocab_size, h)]
    for _ in range(s.num_hidden_layers):
        shapes += [(q, h), (kv, h), (kv, h), (h, q), (s.head_dim,), (s.head_dim,), (h,), (h,), (s.num_experts, h)]
    shapes += [(h,), (s.vocab_size, h)]
    return shapes[1::2]


def _loop(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()


def _time(fn, flat: torch.Tensor, tensors: list[torch.Tensor]) -> float:
    runs = []
    for _ in range(22):
        if flat.is_cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn(flat, tensors)
        if flat.is_cuda:
            torch.cuda.synchronize()
        runs.append(time.perf_counter() - began)
    return statistics.median(runs[2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=8.0)
    args = parser.parse_args()
    shapes = _received(args.size_gb)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"{len(shapes)} tensors received, {sum(torch.Size(s).numel() for s in shapes) * 2 / 1e6:.0f} MB in bf16")
    for device in devices:
        tensors = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in shapes]
        flat = torch.randn(sum(t.numel() for t in tensors), device=device).to(torch.bfloat16)
        one, each = _time(_copy_out, flat, tensors), _time(_loop, flat, tensors)
        _copy_out(flat, tensors)
        check = [t.clone() for t in tensors]
        _loop(flat, tensors)
        same = all(torch.equal(a, b) for a, b in zip(check, tensors))
        print(f"{device}: one op {one:.2f} ms, a copy per tensor {each:.2f} ms ({each / one:.1f}x); "
              f"same values: {same}")


if __name__ == "__main__":
    main()
