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
from workbench.errors import CheckpointError
from workbench.io.files import box_reads as box_reads_module
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


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("ep", "etp"), [(1, 2), (2, 1), (2, 2)])
def test_fused_experts_land_on_the_gpu_bit_for_bit(disk: Path, ep: int, etp: int, dtype: torch.dtype,
                                                   direct: bool) -> None:
    """The boxes of a Qwen3-MoE-like layer's EP/ETP locals land in CUDA tensors (copied straight from a slot, or
    through its device twin: strided places, casts), as the placements define them."""
    from tests.io import test_load_batched as moe

    experts = 8
    path = disk / f"ck-{ep}-{etp}-{str(dtype)[6:]}-{direct}"
    full = moe._checkpoint(path, experts)
    layout = moe._layout(experts, ep, etp)
    for rank in range(ep * etp):
        targets = {name: torch.full(spec.local_shape(rank), float("nan"), dtype=dtype, device="cuda")
                   for name, spec in layout.specs.items()}
        report = wb.load_hf(targets, path, layout=layout, rank=rank, read_direct=direct,
                            cast=dtype != torch.bfloat16)
        assert report.ok
        want = moe._expected(full, experts, ep, etp, rank)
        for name, t in targets.items():
            got = t.cpu()
            if dtype == torch.bfloat16:
                assert torch.equal(got.view(torch.int16), want[name].view(torch.int16)), (name, rank)
            else:
                assert torch.equal(got.nan_to_num(7.0), want[name].float().nan_to_num(7.0)), (name, rank)


def test_a_load_through_device_buffers_holds_no_gpu_memory_after_it_and_one_slot_during_it(tmp_path: Path) -> None:
    """Casting pieces (bf16 in the file, fp32 targets) go through a buffer on the GPU: one slot's worth at a time,
    from the caching allocator, and none of it held once the load is done (slots that kept a device twin each held
    a slot's bytes for the life of the process). Counted by torch's allocator, not by the loader."""
    from workbench.io.files.staging import SLOT_BYTES

    gen = torch.Generator().manual_seed(3)
    state = {f"model.layers.{i}.w.weight": torch.randn(3072, 4096, generator=gen).to(torch.bfloat16)
             for i in range(6)}  # 24 MiB each in the file, 48 MiB each as fp32 targets
    wb.save_hf(state, tmp_path / "ckpt")
    model = {k: torch.empty(v.shape, dtype=torch.float32, device="cuda") for k, v in state.items()}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    report = wb.load_hf(model, tmp_path / "ckpt", cast=True)
    torch.cuda.synchronize()
    assert report.ok and all(torch.equal(model[k].cpu(), v.float()) for k, v in state.items())
    assert torch.cuda.memory_allocated() == before
    block = -(-SLOT_BYTES // (2 << 20)) * (2 << 20)  # the allocator rounds a large block up to 2 MiB
    assert torch.cuda.max_memory_allocated() - before <= 2 * block


def test_a_read_that_fails_mid_landing_fails_the_load_and_gives_every_slot_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from workbench.io.files.staging import SLOT_BYTES

    gen = torch.Generator().manual_seed(3)
    rows = (SLOT_BYTES - 2 * 4096) // 2 // (4096 * 2)  # two keys a slot: 12 keys make 6 pieces, at least 6 reads
    state = {f"w{i}": torch.randn(rows, 4096, generator=gen).to(torch.bfloat16) for i in range(12)}
    wb.save_hf(state, tmp_path / "ckpt")
    ring = staging_ring()
    calls = []
    real = box_reads_module.os.preadv

    def preadv(fd: int, bufs: list, offset: int, *args: object) -> int:
        calls.append(offset)
        if len(calls) == 4:  # in the middle: pieces before it landed, pieces after it are in flight
            raise OSError(5, "Input/output error")
        return real(fd, bufs, offset, *args)

    monkeypatch.setattr(box_reads_module.os, "preadv", preadv)
    model = {k: torch.zeros_like(v, device="cuda") for k, v in state.items()}
    with pytest.raises(wb.LoadFailed, match="Input/output error"):
        wb.load_hf(model, tmp_path / "ckpt", read_direct=False)
    monkeypatch.undo()
    free = [ring.try_take() for _ in range(ring.slots)]
    assert all(s is not None for s in free), "a slot was not given back"
    for s in free:
        ring.give(s)
    report = wb.load_hf(model, tmp_path / "ckpt", read_direct=False)  # the ring still serves a load
    assert report.ok and all(torch.equal(model[k].cpu(), v) for k, v in state.items())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_one_ring_lands_on_two_gpus_in_turn(tmp_path: Path) -> None:
    """The process's ring serves every GPU: a slot's event belongs to one device, so each device has its own (a
    load into ``cuda:1`` after one into ``cuda:0`` is exact, and so is the next one into ``cuda:0``)."""
    gen = torch.Generator().manual_seed(3)
    state = {f"model.layers.{i}.w.weight": torch.randn(512, 4096, generator=gen).to(torch.bfloat16) for i in range(8)}
    wb.save_hf(state, tmp_path / "ckpt")
    for device in ("cuda:0", "cuda:1", "cuda:0"):
        with torch.cuda.device(device):
            model = {k: torch.zeros_like(v, device=device) for k, v in state.items()}
            wb.load_hf(model, tmp_path / "ckpt")
            torch.cuda.synchronize(device)
        assert all(torch.equal(model[k].cpu(), v) for k, v in state.items()), device


@pytest.mark.parametrize(("stored", "target", "big"), [(torch.int64, torch.int32, 2**40),
                                                       (torch.float32, torch.float16, 1e5)])
def test_a_narrowing_cast_into_cuda_tensors_is_checked_and_exact(tmp_path: Path, stored, target, big) -> None:
    """A GPU load lands its boxes from the reading threads, and a cast there is the device's copy: a narrowing one
    takes the loading thread's path, each piece checked (``plan.casts``). Expected values: torch's ``.to``."""
    values = (torch.arange(512 * 256, dtype=torch.float64).reshape(512, 256) % 300 - 150).to(stored)
    values[400, 7] = big
    save_file({"w": values, "b": values[0].clone()}, str(tmp_path / "model.safetensors"))
    state = {"w": torch.zeros(512, 256, dtype=target, device="cuda"), "b": torch.zeros(256, dtype=target,
                                                                                          device="cuda")}
    with pytest.raises((wb.LoadFailed, CheckpointError), match=r"w, read into the model's 'w'.*do not fit"):
        wb.load_hf(state, tmp_path, cast=True)
    values[400, 7] = 3
    save_file({"w": values, "b": values[0].clone()}, str(tmp_path / "model.safetensors"))
    wb.load_hf(state, tmp_path, cast=True)
    assert torch.equal(state["w"].cpu(), values.to(target)) and torch.equal(state["b"].cpu(), values[0].to(target))
