"""Benchmark: what ``load_hf(cast=True)``'s range check costs on many small keys.

1,000 float32 keys of 16 x 8 in one file, loaded from the page cache into three models of the same shapes: float32
(no cast: the baseline), bfloat16 (a cast that keeps the range: never checked) and float16 (a narrowing cast: every
piece checked by ``plan.casts.check_fits``). Median of ``--repeats`` loads each, interleaved, and each as a ratio to
the baseline of the same run.

    .venv/bin/python bench/cast_load.py [--keys 1000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import workbench as wb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        values = {f"model.layers.{i}.w": torch.randn(16, 8) for i in range(args.keys)}
        save_file(values, str(Path(root) / "model.safetensors"))
        dtypes = {"float32 (no cast)": torch.float32, "bfloat16 (cast, unchecked)": torch.bfloat16,
                  "float16 (cast, checked)": torch.float16}
        models = {label: {k: torch.zeros(16, 8, dtype=d) for k in values} for label, d in dtypes.items()}
        times: dict[str, list[float]] = {label: [] for label in dtypes}
        for model in models.values():  # parse and plan once: repeat loads are what is compared
            wb.load_hf(model, root, cast=True)
        for _ in range(args.repeats):
            for label, model in models.items():
                start = time.perf_counter()
                wb.load_hf(model, root, cast=True)
                times[label].append(time.perf_counter() - start)
        assert torch.equal(models["float16 (cast, checked)"]["model.layers.7.w"], values["model.layers.7.w"].half())
    base = statistics.median(times["float32 (no cast)"])
    print(f"{args.keys} keys of 16 x 8 float32, page cache; {platform.node()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; median of {args.repeats}")
    print("| model dtype | load ms (median) | / no cast |")
    print("|---|---|---|")
    for label, runs in times.items():
        median = statistics.median(runs)
        print(f"| {label} | {median * 1e3:.1f} | {median / base:.2f} |")


if __name__ == "__main__":
    main()
