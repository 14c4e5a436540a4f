"""Direct writes: a box of a row-major tensor is the segments ``segment_starts`` says (checked against numpy
indexing), replicas are written by exactly one rank, and a direct save's files are byte for byte what
safetensors' own ``save_file`` writes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch.distributed.tensor import Replicate, Shard

import workbench as wb
from workbench.io.direct import direct_names, segment_starts, writes_piece
from workbench.io.index import INDEX_NAME


@st.composite
def boxes(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=4)))
    offset = tuple(draw(st.integers(0, n - 1)) for n in shape)
    sizes = tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, offset))
    return shape, offset, sizes


@given(boxes())
def test_segments_are_the_box_in_row_major_order(box) -> None:
    shape, offset, sizes = box
    flat = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    want = flat[tuple(slice(o, o + s) for o, s in zip(offset, sizes))].reshape(-1)
    starts, run = segment_starts(shape, offset, sizes)
    got = (starts[:, None] + np.arange(run)[None, :]).reshape(-1)
    assert np.array_equal(got, want)
    assert len(starts) == 1 or run == sizes[-1] or sizes[-1] == shape[-1]  # segments are maximal


def test_each_replicated_piece_has_exactly_one_writer() -> None:
    mesh = wb.MeshSpec((2, 2, 2), ("dp_replicate", "dp_shard", "tp"))
    spec = wb.LoadSpec.from_placements("w", [f"k{i}" for i in range(5)], (40, 4), mesh,
                                       [Replicate(), Shard(0), Replicate()], fused_dim=0)
    for key_index in range(5):
        for shard in range(2):
            holders = [r for r in mesh.all_ranks() if mesh.coordinate(r)[1] == shard]
            writers = [r for r in holders if writes_piece(spec, mesh, r, key_index)]
            assert len(writers) == 1, (key_index, shard, writers)
    # the 4 replicas of each shard take turns over the keys
    firsts = {next(r for r in mesh.all_ranks() if mesh.coordinate(r)[1] == 0 and writes_piece(spec, mesh, r, k))
              for k in range(4)}
    assert len(firsts) == 4


def test_short_segments_are_gathered_long_ones_written_directly() -> None:
    mesh = wb.MeshSpec((4,), ("tp",))
    specs = {
        "rows": wb.LoadSpec.from_placements("rows", "rows", (64, 256), mesh, [Shard(0)]),  # 1 segment per rank
        "cols": wb.LoadSpec.from_placements("cols", "cols", (64, 256), mesh, [Shard(1)]),  # 64 rows of 256 B
    }
    layout = wb.Layout(mesh, specs)
    meta = {k: (torch.float32, (64, 256)) for k in ("rows", "cols")}
    assert direct_names(layout, meta, 64 << 10) == ("rows",)
    assert direct_names(layout, meta, 256) == ("rows", "cols")


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}


def test_a_direct_save_writes_what_save_file_writes(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    state = {
        "a.weight": torch.randn(8, 4, generator=gen),
        "b.weight": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
        "c.bias": torch.randn(7, generator=gen).to(torch.float16),
        "step": torch.tensor(3),
    }
    result = wb.save_hf(state, tmp_path / "direct", write_mode="direct", max_shard_bytes=100)
    assert result.write_mode == "direct" and result.direct_tensors == 4
    gathered = wb.save_hf(state, tmp_path / "gather", write_mode="gather", max_shard_bytes=100)
    assert gathered.write_mode == "gather" and gathered.direct_tensors == 0
    index = json.loads((tmp_path / "direct" / INDEX_NAME).read_text())
    for name, data in _files(tmp_path / "direct").items():
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        keys = [k for k in header if k != "__metadata__"]
        assert all(index["weight_map"][k] == name for k in keys)
        reference = tmp_path / f"ref-{name}"
        save_file({k: state[k] for k in keys}, reference, metadata=header["__metadata__"])
        want = reference.read_bytes()
        # the same bytes, except that safetensors orders __metadata__ keys at random (a Rust HashMap, per process)
        (m,) = struct.unpack("<Q", want[:8])
        assert n == m and json.loads(want[8 : 8 + m]) == header, name
        assert data[8 + n :] == want[8 + m :], name


def test_fused_tensors_written_from_one_snapshot_each_hold_their_own_values(tmp_path: Path) -> None:
    # several fused tensors, each written as many pieces from one shared snapshot; async: every write runs after the
    # last snapshot was taken, so a write that picked up another tensor's snapshot would show here
    mesh = wb.MeshSpec((1,), ("fsdp",))
    specs, state, want = {}, {}, {}
    for p in range(3):
        keys = [f"layers.{p}.experts.{e}.weight" for e in range(4)]
        specs[f"w{p}"] = wb.LoadSpec.from_placements(f"w{p}", keys, (16, 8), mesh, [Shard(0)], fused_dim=0)
        state[f"w{p}"] = torch.arange(128.0).reshape(16, 8) + 1000 * p
        want.update({k: state[f"w{p}"][4 * e : 4 * (e + 1)].clone() for e, k in enumerate(keys)})
    layout = wb.Layout(mesh, specs)
    handle = wb.save_hf(state, tmp_path / "ckpt", layout=layout, async_save=True, write_mode="direct")
    for tensor in state.values():
        tensor.add_(41)
    assert handle.wait().direct_tensors == 3
    from workbench.io.read import CheckpointReader

    with CheckpointReader(tmp_path / "ckpt") as reader:
        for key, value in want.items():
            assert torch.equal(reader.read(key), value), key
