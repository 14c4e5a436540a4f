"""On a GPU (skipped without CUDA): reads staged through the pinned ring into device buffers are the file's bytes
for boxes spanning many slots, and ``load_hf`` into CUDA tensors is bit for bit and pins nothing after the process's
ring. Every other kind of box (row and column cuts, packed runs, spans, O_DIRECT covers, out of order) is staged by
``tests/io/test_box_reads.py::test_boxes_match_safetensors_bit_for_bit`` when CUDA is there: run it beside these."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import workbench as wb
from tests.io import test_box_reads as box_reads_tests
from workbench.io.files.box_reads import BoxReader
from workbench.io.files.index import read_checkpoint
from workbench.io.files.staging import staging_ring

disk = box_reads_tests.disk  # the fixture: a directory on a disk that does O_DIRECT reads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")


@pytest.mark.parametrize("direct", [False, True])
def test_big_boxes_cross_many_slots(disk: Path, direct: bool) -> None:
    """Keys of 20-40 MiB: a request spans several 8 MiB slots, read by several threads, some columns cut."""
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(2560, 4096, generator=gen).to(torch.bfloat16),  # 20 MiB
               "b": torch.randn(1280, 8192, generator=gen)}  # 40 MiB, float32
    save_file(tensors, str(disk / "model.safetensors"))
    boxes = [("a", None), ("b", (slice(3, 1100), slice(None))), ("a", (slice(None), slice(1000, 3000))),
             ("b", (slice(None), slice(0, 4096)))]
    with BoxReader(read_checkpoint(disk), boxes, threads=4, direct=direct, device="cuda") as r:
        for key, box in boxes:
            got = r.read(key, box)
            want = tensors[key] if box is None else tensors[key][box]
            assert torch.equal(got.cpu(), want), (key, box)
        assert r.bytes_read == sum((tensors[k] if b is None else tensors[k][b]).nbytes for k, b in boxes)


def test_load_hf_into_cuda_tensors_is_exact_and_the_ring_is_pinned_once(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    state = {f"model.layers.{i}.w.weight": torch.randn(300 + i, 4096 + 8 * i, generator=gen).to(torch.bfloat16)
             for i in range(6)}
    wb.save_hf(state, tmp_path / "ckpt")
    ring = staging_ring()
    for attempt in range(2):
        model = {k: torch.empty_like(v, device="cuda") for k, v in state.items()}
        report = wb.load_hf(model, tmp_path / "ckpt", read_direct=attempt == 1)
        assert all(torch.equal(model[k].cpu(), v) for k, v in state.items()), attempt
        owned = sum(v.nbytes for v in state.values())
        if attempt == 0:
            assert report.bytes_read == owned and report.bytes_direct == 0
        else:  # O_DIRECT reads each request's range rounded out to 4 KiB pages
            assert owned < report.bytes_read <= owned + 2 * 4096 * len(state) and report.bytes_direct > 0
    assert staging_ring() is ring and ring.allocations == 1
