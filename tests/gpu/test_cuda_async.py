"""On a GPU (skipped without CUDA): an async save of CUDA tensors is a snapshot of the values at call time, through
pinned host buffers that the next save reuses; and 2 NCCL ranks save directly and by gathers, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.io.files.read import CheckpointReader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")


def _read(path: Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as reader:
        keys = reader.keys()
        return {k: reader.read(k) for k in keys}


def test_an_async_save_of_cuda_tensors_holds_the_call_time_values(tmp_path: Path) -> None:
    from workbench.io.files.host_pool import host_pool

    gen = torch.Generator(device="cuda").manual_seed(0)
    state = {f"w{i}": torch.randn(1024, 1024, device="cuda", generator=gen).to(torch.bfloat16) for i in range(8)}
    expected = {k: v.cpu().clone() for k, v in state.items()}
    for attempt in range(2):
        handle = wb.save_hf(state, tmp_path / f"ckpt{attempt}", async_save=True)
        for tensor in state.values():
            tensor.add_(41)  # the optimizer step, at once, on the device
        result = handle.wait()
        read = _read(tmp_path / f"ckpt{attempt}")
        assert all(torch.equal(read[k], expected[k]) for k in expected), attempt
        assert result.snapshot_bytes == sum(t.numel() * 2 for t in state.values())
        expected = {k: v.cpu().clone() for k, v in state.items()}
        if attempt == 0:
            allocations = host_pool(pinned=True).allocations
    # the second save's 8 snapshots reused pinned buffers the first one gave back (without reuse: 8 new ones)
    assert host_pool(pinned=True).allocations - allocations < len(state)


def test_a_snapshot_does_not_keep_the_device_tensor() -> None:
    """A gather's output is freed when its wave ends (as the memory model counts), not when a writer gets to it."""
    from workbench.io.files.snapshot import Snapshotter

    snapshot = Snapshotter([], own_everything=False, pool_bytes=None)
    value = torch.randn(2048, 2048, device="cuda")
    want = value.cpu()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    copy = snapshot.take(value)
    del value
    assert torch.cuda.memory_allocated() == before - 2048 * 2048 * 4
    assert torch.equal(copy.wait(), want)
    copy.release()


def test_copies_taken_as_a_batch_share_one_event_recorded_by_mark() -> None:
    from workbench.io.files.snapshot import Snapshotter

    snapshot = Snapshotter([], own_everything=False, pool_bytes=None)
    values = [torch.full((512, 512), float(i), device="cuda") for i in range(4)]
    copies = [snapshot.take(v, mark=False) for v in values]
    with pytest.raises(RuntimeError, match=r"before Snapshotter\.mark"):
        copies[0].wait()  # no event yet: waiting would read a copy that may not have landed
    snapshot.mark()
    assert len({id(c.event) for c in copies}) == 1
    for i, copy in enumerate(copies):
        assert torch.equal(copy.wait(), torch.full((512, 512), float(i)))
        copy.release()


def test_warm_host_pool_pins_what_the_first_async_save_needs(tmp_path: Path) -> None:
    from workbench.io.files.host_pool import host_pool

    state = {f"v{i}": torch.randn(512 * (i + 3), 1024, device="cuda") for i in range(3)}
    wb.warm_host_pool(state)
    allocated = host_pool(pinned=True).allocations
    wb.save_hf(state, tmp_path / "ckpt", async_save=True).wait()
    assert host_pool(pinned=True).allocations == allocated


def _two_ranks(root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    rank = dist.get_rank()
    mesh = wb.MeshSpec((2,), ("fsdp",))
    specs = {"w": wb.LoadSpec.from_placements("w", "model.w", (4096, 1024), mesh, [Shard(0)]),
             "c": wb.LoadSpec.from_placements("c", "model.c", (64, 1024), mesh, [Shard(1)])}
    layout = wb.Layout(mesh, specs, {"w": "bfloat16", "c": "float32"})
    gen = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(4096, 1024, generator=gen).to(torch.bfloat16), "c": torch.randn(64, 1024, generator=gen)}
    local = {"w": full["w"][rank * 2048 : (rank + 1) * 2048].cuda(),
             "c": full["c"][:, rank * 512 : (rank + 1) * 512].cuda()}
    pristine = {k: t.clone() for k, t in local.items()}
    out = {}
    for mode, async_save in (("direct", True), ("gather", False), ("gather", True)):
        name = f"{mode}-{'async' if async_save else 'sync'}"
        handle = wb.save_hf(local, Path(root) / name, layout=layout, write_mode=mode, async_save=async_save)
        for t in local.values():
            t.add_(1)
        out[name] = (handle.wait() if async_save else handle).write_mode
        for k, t in local.items():
            t.copy_(pristine[k])  # (x + 1) - 1 is not x in floating point
    return out


def test_two_nccl_ranks_save_directly_and_by_gathers(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = wb.launch(_two_ranks, nprocs=2, backend="nccl", args=(str(tmp_path),), timeout=300)
    assert results[0] == {"direct-async": "direct", "gather-sync": "gather", "gather-async": "gather"}
    gen = torch.Generator().manual_seed(0)
    want = {"model.w": torch.randn(4096, 1024, generator=gen).to(torch.bfloat16),
            "model.c": torch.randn(64, 1024, generator=gen)}
    wrong = []
    for name in results[0]:
        got = _read(tmp_path / name)
        wrong += [(name, k, float((got[k].float() - want[k].float()).abs().max())) for k in want
                  if not torch.equal(got[k], want[k])]
    assert not wrong, wrong


def test_a_repeat_async_save_copies_early_and_still_writes_call_time_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second async save of a CUDA module starts its copies before planning (they are claimed); a save with
    another dtype releases them and copies afresh; a replaced parameter takes none; every file holds the values
    of call time."""
    from workbench.io.hf import early_snapshot
    from workbench.io.hf import save as hf_save

    taken: list = []
    real = early_snapshot.take_early
    monkeypatch.setattr(hf_save, "take_early", lambda *a: taken.append(real(*a)) or taken[-1])
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 128)).cuda().to(torch.bfloat16)
    for attempt in range(5):
        dtype = torch.float32 if attempt == 3 else None
        if attempt == 4:
            model[1].weight = torch.nn.Parameter(torch.randn(128, 512, device="cuda", dtype=torch.bfloat16))
        expected = {k: v.detach().cpu().to(dtype or v.dtype) for k, v in model.state_dict().items()}
        handle = wb.save_hf(model, tmp_path / f"ckpt{attempt}", async_save=True, write_mode="direct", dtype=dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)  # the optimizer step, at once
        handle.wait()
        read = _read(tmp_path / f"ckpt{attempt}")
        assert all(torch.equal(read[k], expected[k]) for k in expected), attempt
    assert taken[0] is None  # nothing remembered before the first save
    assert taken[1] is not None and taken[1].claimed and taken[1].copies  # handed to the save
    assert taken[3] is not None and taken[3].claimed and not taken[3].copies  # another dtype: released
    assert taken[4] is None  # the remembered weight is gone: nothing to copy early


@pytest.mark.parametrize("write_mode", ["direct", "gather"])
def test_an_async_save_of_cuda_tensors_larger_than_its_pinned_pool_completes(tmp_path: Path, monkeypatch,
                                                                            write_mode: str) -> None:
    """32 MiB of CUDA tensors through a 16 MiB pinned pool: the writers start once the pool is full (the call
    returns late, not never), and every buffer reused after its copy landed holds the call-time values."""
    from workbench.io.files import host_pool as pools

    monkeypatch.setattr(pools, "_POOLS", {})
    gen = torch.Generator(device="cuda").manual_seed(1)
    state = {f"w{i}": torch.randn(1024, 1024, device="cuda", generator=gen) for i in range(8)}
    expected = {k: v.cpu() for k, v in state.items()}
    handle = wb.save_hf(state, tmp_path / "ckpt", async_save=True, write_mode=write_mode,
                        host_buffer_bytes=16 << 20)
    for tensor in state.values():
        tensor.add_(1)
    handle.wait()
    read = _read(tmp_path / "ckpt")
    assert all(torch.equal(read[k], expected[k]) for k in expected)
    pool = pools._POOLS[True]
    assert pool.bytes_out == 0 and pool.bytes_held <= 16 << 20


def test_a_failure_after_the_early_copies_are_claimed_gives_every_pinned_buffer_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repeat async save claims its early copies, then fails at its third tensor: the copies of the tensors it
    had not reached, and those of the batch not yet handed to a writer, go back to the pinned pool."""
    from workbench.faults import fault_hook
    from workbench.io.files import host_pool as pools
    from workbench.io.hf.early_snapshot import EarlySnapshot

    monkeypatch.setattr(pools, "_POOLS", {})
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).cuda()
    wb.save_hf(model, tmp_path / "first", async_save=True).wait()  # remembers its plan: the next copies early
    calls: list[str] = []

    def third_snapshot_fails(point: str, rank: int, *args) -> None:
        if point == "snapshot":
            calls.append(point)
            if len(calls) == 3:
                raise OSError("injected at the third tensor")

    claimed: list[bool] = []
    real_claim = EarlySnapshot.claim
    monkeypatch.setattr(EarlySnapshot, "claim", lambda self, *a: claimed.append(
        (got := real_claim(self, *a)) is not None) or got)
    with fault_hook(third_snapshot_fails), pytest.raises(wb.SaveFailed, match="injected at the third tensor"):
        wb.save_hf(model, tmp_path / "second", async_save=True).wait()
    assert claimed == [True] and len(calls) == 3 and pools._POOLS[True].bytes_out == 0
    assert not (tmp_path / "second").exists()
