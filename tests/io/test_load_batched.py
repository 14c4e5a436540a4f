"""load_hf of fused MoE experts moves a rank's many small key boxes with few reads and few copies, bit for bit.

One process loads the local tensors of one rank of an expert-parallel (EP2) or expert-TP (ETP2, interleaved)
layout of a Qwen3-MoE-like layer, from a file written here (header and bytes by hand, keys in the order our
checkpoints hold them: every expert's gate_proj, then every up_proj, then every down_proj). Expected values are
cut from the full tensors by the placements' definitions; reads are counted at the file layer (``os.preadv``) and
copies with torch's profiler (``aten::copy_``), so the counts come from what ran, not from any plan.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Shard

import workbench as wb
from workbench.io.files import box_reads

H = 128  # hidden size: a down_proj row of 64 bf16 is 128 bytes, half a row 64 (every gap shorter than a page)
I = 64  # noqa: E741  # expert intermediate size: a gate_proj row is 256 bytes


def _keys(e: int, proj: str) -> str:
    return f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight"


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file with the keys in the order given (not safetensors' own sorted order)."""
    header, at, blobs = {}, 0, []
    for key, t in tensors.items():
        data = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        header[key] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [at, at + len(data)]}
        at += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _checkpoint(path: Path, experts: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(experts)
    full = {}
    for proj, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
        for e in range(experts):  # random bit patterns: NaN payloads and denormals too
            full[_keys(e, proj)] = torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16).view(
                torch.bfloat16)
    path.mkdir()
    _write(path / "model.safetensors", full)
    return full


def _layout(experts: int, ep: int, etp: int) -> wb.Layout:
    mesh = wb.MeshSpec((ep, etp), ("ep", "etp"))
    w1w3 = wb.LoadSpec.from_placements(
        "w1w3", [_keys(e, p) for e in range(experts) for p in ("gate", "up")], (experts * 2 * I, H), mesh,
        (Shard(0), wb.InterleavedShard(0, num_local_stripes=2 * experts // ep)), fused_dim=0)
    w2 = wb.LoadSpec.from_placements("w2", [_keys(e, "down") for e in range(experts)], (experts * H, I), mesh,
                                     (Shard(0), Shard(1)), fused_dim=0)
    return wb.Layout(mesh, {"w1w3": w1w3, "w2": w2}, {"w1w3": "bfloat16", "w2": "bfloat16"})


def _expected(full: dict[str, torch.Tensor], experts: int, ep: int, etp: int, rank: int) -> dict[str, torch.Tensor]:
    """The rank's locals by the placements' definitions: EP gives rank r experts [r*E/ep, (r+1)*E/ep); expert-TP
    gives group rank t the t-th 1/etp of every key's rows (w1w3, interleaved) or of every row (w2, columns)."""
    e_rank, t = divmod(rank, etp)
    mine = range(e_rank * experts // ep, (e_rank + 1) * experts // ep)
    rows, cols = slice(t * I // etp, (t + 1) * I // etp), slice(t * I // etp, (t + 1) * I // etp)
    return {
        "w1w3": torch.cat([full[_keys(e, p)][rows] for e in mine for p in ("gate", "up")]),
        "w2": torch.cat([full[_keys(e, "down")] for e in mine])[:, cols],
    }


def _load(path: Path, layout: wb.Layout, rank: int, monkeypatch: pytest.MonkeyPatch,
          dtype: torch.dtype = torch.bfloat16) -> tuple[dict, int, int]:
    """Load ``rank``'s locals (of ``dtype``: float32 is a cast, so the bytes cannot land in them as read); returns
    them, the ``preadv`` calls and the torch copies into them the load made."""
    targets = {name: torch.full(spec.local_shape(rank), float("nan"), dtype=dtype)
               for name, spec in layout.specs.items()}
    storages = {t.untyped_storage().data_ptr() for t in targets.values()}
    preads, copies = [], []
    real_preadv, real_copy = os.preadv, torch.Tensor.copy_

    def copy_(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.untyped_storage().data_ptr() in storages:
            copies.append(tuple(self.shape))
        return real_copy(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(box_reads.os, "preadv", lambda fd, bufs, off, *a: preads.append(off) or real_preadv(
            fd, bufs, off, *a))
        patch.setattr(torch.Tensor, "copy_", copy_)
        report = wb.load_hf(targets, path, layout=layout, rank=rank, read_direct=False, cast=dtype != torch.bfloat16)
    assert report.ok and report.bytes_owned == sum(t.numel() * 2 for t in targets.values())
    return targets, len(preads), len(copies)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("ep", "etp"), [(1, 2), (2, 1), (2, 2)])
def test_fused_experts_load_bit_for_bit_on_every_rank(tmp_path: Path, ep: int, etp: int, dtype: torch.dtype,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    experts = 8
    full = _checkpoint(tmp_path / "ck", experts)
    layout = _layout(experts, ep, etp)
    for rank in range(ep * etp):
        got, _, _ = _load(tmp_path / "ck", layout, rank, monkeypatch, dtype)
        want = _expected(full, experts, ep, etp, rank)
        for name in want:
            assert got[name].shape == want[name].shape, (name, rank)
            if dtype == torch.bfloat16:
                assert torch.equal(got[name].view(torch.int16), want[name].view(torch.int16)), (name, rank)
            else:  # bf16 -> float32 is exact (NaNs stay NaNs)
                assert torch.equal(got[name].nan_to_num(7.0), want[name].float().nan_to_num(7.0)), (name, rank)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("ep", "etp"), [(1, 2), (2, 1)])
def test_reads_and_copies_of_fused_experts_do_not_grow_with_the_expert_count(
        tmp_path: Path, ep: int, etp: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {}
    for experts in (8, 32):
        if not (tmp_path / f"ck{experts}").exists():
            _checkpoint(tmp_path / f"ck{experts}", experts)
        _, preads, copies = _load(tmp_path / f"ck{experts}", _layout(experts, ep, etp), 0, monkeypatch, dtype)
        counts[experts] = (preads, copies)
    if dtype == torch.bfloat16:  # the checkpoint's dtype on the CPU: the bytes land in the tensors, no torch copy
        assert counts[32][1] == counts[8][1] == 0, counts
    else:  # one copy (a cast) per run of keys one step apart in the file: gate_proj's keys, up_proj's, down_proj's
        assert counts[32][1] == counts[8][1] <= 3, counts
    if etp == 2:  # each gate/up half is its own run (the other half is the peer's); the down_proj halves of every
        # row touch every page: they are read as one span, not key by key
        assert counts[32][0] <= 2 * 32 + 1, counts
    else:  # whole keys one after another: one read per file range (gate, up, down)
        assert counts[32][0] == counts[8][0] <= 3, counts
