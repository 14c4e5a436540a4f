"""Benchmark: how long ``workbench inspect`` takes to prove a torch DCP ``.metadata`` is one whole pickle.

Without ``--allow-pickle`` the inspection must not run the pickle, yet says whether it is cut short or not a pickle
at all. A synthetic ``.metadata`` of a large run (``--params`` tensors in ``--chunks`` storage chunks each, torch's
own ``Metadata`` classes, pickled as ``dcp.save`` does) is checked three ways in one run:

* ``opcode walk``: ``pickletools.genops`` over every opcode (what the inspection did before);
* ``inert unpickler``: ``workbench.debug.inspect._pickle_break``, C's unpickler with every global replaced by an
  inert stand-in (what it does now; the opcode walk runs only on a broken file);
* ``pickle.load``: the real unpickling that ``--allow-pickle`` adds.

    .venv/bin/python bench/dcp_metadata.py [--params 4000] [--chunks 64] [--repeats 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import pickle
import pickletools
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from workbench.debug.inspect import _pickle_break


def synthetic_metadata(params: int, chunks: int) -> Metadata:
    """``params`` (4096, 1024) bf16 tensors, each in ``chunks`` row blocks held by as many ranks' files."""
    rows = 4096 // chunks
    tensors, storage = {}, {}
    for p in range(params):
        fqn = f"model.layers.{p // 64}.mlp.experts.{p % 64}.down_proj.weight"
        blocks = [ChunkStorageMetadata(offsets=torch.Size([c * rows, 0]), sizes=torch.Size([rows, 1024]))
                  for c in range(chunks)]
        tensors[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([4096, 1024]), blocks)
        for c, block in enumerate(blocks):
            storage[MetadataIndex(fqn, block.offsets, c)] = _StorageInfo(f"__{c}_0.distcp", p * rows * 2048,
                                                                         rows * 2048)
    return Metadata(state_dict_metadata=tensors, storage_data=storage)


def _walk(path: Path) -> None:
    with path.open("rb") as stream:
        for _ in pickletools.genops(stream):
            pass


def _load(path: Path) -> None:
    with path.open("rb") as stream:
        pickle.load(stream)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=4000)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        path = Path(root) / ".metadata"
        path.write_bytes(pickle.dumps(synthetic_metadata(args.params, args.chunks)))
        size = path.stat().st_size
        print(f"{platform.node()} ({platform.processor() or platform.machine()}), torch {torch.__version__}: "
              f".metadata of {args.params} tensors x {args.chunks} chunks, {size / 1e6:.1f} MB")
        ways = {"opcode walk": _walk, "inert unpickler": _pickle_break, "pickle.load": _load}
        seconds = {name: [] for name in ways}
        for _ in range(args.repeats):  # round robin: the ways share the machine's state
            for name, way in ways.items():
                started = time.perf_counter()
                way(path)
                seconds[name].append(time.perf_counter() - started)
        base = statistics.median(seconds["opcode walk"])
        for name, runs in seconds.items():
            median = statistics.median(runs)
            print(f"  {name:16s} {median:7.3f} s  {size / 1e6 / median:7.1f} MB/s  {median / base:5.2f}x the walk  "
                  f"runs {', '.join(f'{s:.3f}' for s in runs)}")


if __name__ == "__main__":
    main()
