"""Direct writes: a box of a row-major tensor is the segments ``segment_starts`` says (checked against numpy
indexing), replicas are written by exactly one rank, and a direct save's files are byte for byte what
safetensors' own ``save_file`` writes."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch.distributed.tensor import Replicate, Shard

import workbench as wb
from workbench.io.files.direct import direct_names, segment_starts, writes_piece
from workbench.io.files.index import INDEX_NAME


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
    from workbench.io.files.read import CheckpointReader

    with CheckpointReader(tmp_path / "ckpt") as reader:
        for key, value in want.items():
            assert torch.equal(reader.read(key), value), key


def _files_for(tmp: Path, layout: wb.Layout, *, map_short_runs: bool = False) -> tuple[dict, object]:
    from workbench.io.files.direct import CheckpointFiles
    from workbench.io.files.file_plan import plan_files
    from workbench.plan.load_plan import expected_key_shape

    meta = {k: (torch.float32, tuple(expected_key_shape(s))) for s in layout.specs.values() for k in s.hf_keys}
    sizes = {k: 4 * int(np.prod(shape)) for k, (_, shape) in meta.items()}
    plan = plan_files(dict.fromkeys(meta, 0), sizes, list(meta), max_shard_bytes=1 << 12)  # several files
    tmp.mkdir()
    files = CheckpointFiles(tmp, plan, meta, {"format": "pt"}, map_short_runs=map_short_runs)
    files.create_all()
    return meta, files


def test_whole_local_writes_merge_runs_and_equal_piece_writes(tmp_path: Path, monkeypatch) -> None:
    """``write_local`` (a rank's whole local tensor, runs merged across keys) writes the same bytes as one
    ``write_piece`` per box, and a rank's block of consecutive fused keys is one pwrite per file."""
    import workbench.io.files.direct as direct

    mesh = wb.MeshSpec((2, 2), ("fsdp", "tp"))
    experts = [f"e{i}.w" for i in range(8)]
    specs = {
        "experts": wb.LoadSpec.from_placements("experts", experts, (8 * 6, 16), mesh, [Shard(0), Replicate()],
                                               fused_dim=0),
        "cols": wb.LoadSpec.from_placements("cols", "cols.w", (12, 40), mesh, [Shard(0), Shard(1)]),
        "rows_tp": wb.LoadSpec.from_placements("rows_tp", ["a.w", "b.w"], (2 * 10, 8), mesh, [Shard(1), Shard(0)],
                                               fused_dim=0),
    }
    layout = wb.Layout(mesh, specs)
    gen = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s.global_shape, generator=gen) for n, s in specs.items()}
    calls: list[int] = []
    real = direct._pwrite_all
    monkeypatch.setattr(direct, "_pwrite_all", lambda fd, data, offset: (calls.append(len(data)), real(fd, data,
                                                                                                        offset)))
    _, by_piece = _files_for(tmp_path / "piece", layout)
    _, by_local = _files_for(tmp_path / "local", layout)
    for rank in mesh.all_ranks():
        for name, spec in specs.items():
            box = tuple(slice(o, o + n) for o, n in zip(*_local_box(spec, rank)))
            local = full[name][box].contiguous()
            regions = [r for r in spec.key_regions(rank) if writes_piece(spec, mesh, rank, 0)]
            for region in regions:
                by_piece.write_piece(region, local[tuple(slice(o, o + n) for o, n in zip(region.local_offset,
                                                                                     region.sizes))].contiguous())
            calls.clear()
            by_local.write_local(regions, local)
            if name == "experts":  # 4 consecutive keys of rank's half, in files of at most 4 KiB: one write each
                assert len(calls) == len({by_local.slots[r.hf_key].file for r in regions}), calls
    by_piece.close()
    by_local.close()
    for f in sorted((tmp_path / "piece").iterdir()):
        assert f.read_bytes() == (tmp_path / "local" / f.name).read_bytes(), f.name


@pytest.mark.parametrize("allocate", [True, False])
def test_short_runs_written_through_a_memory_map_are_the_same_bytes(tmp_path: Path, monkeypatch,
                                                                    allocate: bool) -> None:
    """With ``map_short_runs`` (one host), boxes of many short runs (a column cut, a 3-d box) are copied through a
    shared map of the file by every rank into the same files, with no pwrite; a box of few runs is still
    pwritten. The bytes equal one pwrite per run. Where blocks cannot be allocated first, the runs are pwritten."""
    import workbench.io.files.direct as direct

    if not allocate:
        monkeypatch.setattr(direct, "_allocate", lambda fd, offset, nbytes: False)
    mesh = wb.MeshSpec((2, 2), ("fsdp", "tp"))
    specs = {
        "cols": wb.LoadSpec.from_placements("cols", "cols.w", (256, 40), mesh, [Shard(0), Shard(1)]),
        "experts": wb.LoadSpec.from_placements("experts", [f"e{i}.w" for i in range(4)], (4 * 6, 16), mesh,
                                               [Shard(0), Replicate()], fused_dim=0),
        "cube": wb.LoadSpec.from_placements("cube", "cube.w", (4, 64, 10), mesh, [Shard(2), Shard(1)]),
    }
    layout = wb.Layout(mesh, specs)
    gen = torch.Generator().manual_seed(1)
    full = {n: torch.randn(s.global_shape, generator=gen) for n, s in specs.items()}
    _, by_pwrite = _files_for(tmp_path / "pwrite", layout)
    _, by_map = _files_for(tmp_path / "map", layout, map_short_runs=True)
    pwrites: dict[str, int] = {}
    real = direct._pwrite_all
    mapped = 0
    for rank in mesh.all_ranks():
        for name, spec in specs.items():
            box = tuple(slice(o, o + n) for o, n in zip(*_local_box(spec, rank)))
            local = full[name][box].contiguous()
            regions = [r for r in spec.key_regions(rank) if writes_piece(spec, mesh, rank, 0)]
            by_pwrite.write_local(regions, local)
            monkeypatch.setattr(direct, "_pwrite_all", lambda fd, data, offset, name=name: (
                pwrites.__setitem__(name, pwrites.get(name, 0) + 1), real(fd, data, offset)))
            written = by_map.write_local(regions, local) if name != "cube" else sum(
                by_map.write_piece(r, local[tuple(slice(o, o + n) for o, n in zip(r.local_offset, r.sizes))]
                                   .contiguous()) for r in regions)
            monkeypatch.setattr(direct, "_pwrite_all", real)
            assert written == sum(int(np.prod(r.sizes)) * 4 for r in regions)
            mapped += len(regions) if name != "experts" else 0
    if allocate:
        assert set(pwrites) == {"experts"} and by_map.mapped_boxes == mapped
    else:
        assert pwrites["cols"] == 4 * 128 and by_map.mapped_boxes == 0  # 128 rows of 20 floats per rank
    assert by_map.written == by_pwrite.written
    by_pwrite.close()
    by_map.close()
    for f in sorted((tmp_path / "pwrite").iterdir()):
        assert f.read_bytes() == (tmp_path / "map" / f.name).read_bytes(), f.name


def _local_box(spec: wb.LoadSpec, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The global box a rank holds when its runs make one box (these layouts): its offset and sizes."""
    runs = spec.runs(rank)
    lo = tuple(min(r.global_offset[d] for r in runs) for d in range(len(spec.global_shape)))
    hi = tuple(max(r.global_offset[d] + r.sizes[d] for r in runs) for d in range(len(spec.global_shape)))
    return lo, tuple(h - low for low, h in zip(lo, hi))


def test_whole_local_writes_refuse_a_tensor_of_another_dtype(tmp_path: Path) -> None:
    import pytest

    from workbench.errors import CheckpointError

    mesh = wb.MeshSpec((1,), ("world",))
    spec = wb.LoadSpec.from_placements("w", ["a", "b"], (4, 2), mesh, [Replicate()], fused_dim=0)
    _, files = _files_for(tmp_path / "f", wb.Layout(mesh, {"w": spec}))
    with pytest.raises(CheckpointError, match=r"a: local tensor is torch.float64, expected torch.float32"):
        files.write_local(spec.key_regions(0), torch.zeros(4, 2, dtype=torch.float64))
    files.slots = {**files.slots, "b": dataclasses.replace(files.slots["b"], dtype=torch.bfloat16)}  # saved otherwise
    with pytest.raises(CheckpointError, match=r"b: saved as torch.bfloat16, the tensor's other keys as torch.float32"):
        files.write_local(spec.key_regions(0), torch.zeros(4, 2))
    files.close()


def test_a_world_known_to_be_on_one_host_writes_no_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from workbench.io.hf import save as hf_save

    probes: list[Path] = []
    real = hf_save._write_probe
    monkeypatch.setattr(hf_save, "_write_probe", lambda path: probes.append(path) or real(path))
    monkeypatch.setattr(hf_save, "_ONE_HOST", set())
    state = {"w": torch.ones(4, 4)}
    first = wb.save_hf(state, tmp_path / "a")
    second = wb.save_hf(state, tmp_path / "b")
    assert first.write_mode == second.write_mode == "direct"
    assert probes == [tmp_path / "a"]  # the first save learnt the hosts; the second needed no probe
    assert not list(tmp_path.glob(".*probe*"))


def test_block_allocation_failures_name_the_bytes_and_the_cause(tmp_path: Path) -> None:
    import errno
    import os

    import workbench.io.files.direct as direct

    if direct._FALLOCATE is None:
        pytest.skip("no fallocate on this platform")
    path = tmp_path / "f"
    path.write_bytes(b"x")
    fd = os.open(path, os.O_RDONLY)  # allocating through a read-only descriptor fails with EBADF
    try:
        with pytest.raises(OSError, match=r"allocating 4096 bytes of a checkpoint file") as caught:
            direct._allocate(fd, 0, 4096)
        assert caught.value.errno == errno.EBADF
    finally:
        os.close(fd)
