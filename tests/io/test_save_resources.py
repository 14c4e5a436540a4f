"""What a save holds (host buffers, file descriptors, memory maps) on its hard paths: a snapshot larger than its
bounded pool, a failure halfway through the snapshot, a close that reports an error."""

from __future__ import annotations

import errno
import mmap
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import Shard

import workbench as wb
from tests.io.test_direct import _files_for
from workbench.errors import CheckpointError
from workbench.io.files import host_pool as pools
from workbench.io.files.host_pool import HostPool
from workbench.io.files.index import INDEX_NAME
from workbench.io.files.snapshot import HostCopy

MiB = 1 << 20


@pytest.fixture
def fresh_pools(monkeypatch: pytest.MonkeyPatch) -> dict:
    """A fresh process's host pools (a bounded save resizes the process-wide ones)."""
    monkeypatch.setattr(pools, "_POOLS", {})
    return pools._POOLS


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _in_thread(work, seconds: float = 60.0) -> dict:
    """Run ``work`` in a thread; a hang fails the test instead of the whole run."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = work()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s (a hang)"
    if "error" in box:
        raise box["error"]
    return box


@pytest.mark.parametrize("write_mode", ["direct", "gather"])
def test_an_async_save_larger_than_its_bounded_pool_completes(tmp_path: Path, fresh_pools, write_mode: str) -> None:
    """32 MiB to snapshot through a 16 MiB pool: the save's writers (gated until its snapshot is complete) must
    start once the pool is full, so the call returns late rather than never; the file holds call-time values."""
    gen = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(1024, 1024, generator=gen) for i in range(8)}  # 8 x 4 MiB
    want = {k: v.clone() for k, v in state.items()}

    def save() -> wb.SaveResult:
        handle = wb.save_hf(state, tmp_path / "ckpt", async_save=True, write_mode=write_mode,
                            host_buffer_bytes=16 * MiB)
        for t in state.values():
            t.add_(1)  # after the call: not in the checkpoint
        return handle.wait()

    _in_thread(save)
    read = _safetensors(tmp_path / "ckpt")
    assert read.keys() == want.keys() and all(torch.equal(read[k], want[k]) for k in want)
    pool = fresh_pools[False]
    assert pool.bytes_out == 0 and pool.bytes_held <= 16 * MiB


def test_a_failure_halfway_through_the_snapshot_gives_every_buffer_back(tmp_path: Path, fresh_pools,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An async direct save whose third tensor's copy fails: the copies already taken (in a batch not yet handed
    to a writer) go back to the pool, and a later bounded save on the same pool does not wait for them."""
    from workbench.io.hf import direct_queue

    state = {f"w{i}": torch.ones(256, 1024) for i in range(4)}  # 1 MiB each
    real, calls = direct_queue.take_step, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("no pinned memory left (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(direct_queue, "take_step", failing)
    with pytest.raises(wb.SaveFailed, match="no pinned memory left"):
        wb.save_hf(state, tmp_path / "a", async_save=True, write_mode="direct").wait()
    assert fresh_pools[False].bytes_out == 0
    monkeypatch.setattr(direct_queue, "take_step", real)
    _in_thread(lambda: wb.save_hf(state, tmp_path / "b", async_save=True, write_mode="direct",
                                  host_buffer_bytes=2 * MiB).wait())
    assert (tmp_path / "b" / INDEX_NAME).is_file()


def test_a_failure_between_the_pieces_of_one_tensor_gives_their_buffers_back(
    tmp_path: Path, fresh_pools, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fused tensor whose keys are saved in two dtypes is copied piece by piece; the second piece's copy fails:
    the first piece's buffer (a copy of the model's own storage) goes back to the pool."""
    from workbench.io.files.snapshot import Snapshotter

    mesh = wb.MeshSpec((1,), ("world",))
    spec = wb.LoadSpec.from_placements("w", ["a", "b"], (2 * 512, 1024), mesh, [Shard(0)], fused_dim=0)
    layout = wb.Layout(mesh, {"w": spec})
    state = {"w": torch.ones(1024, 1024)}
    real, calls = Snapshotter.take, []

    def failing(self, value, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("no pinned memory left (injected)")
        return real(self, value, **kwargs)

    monkeypatch.setattr(Snapshotter, "take", failing)
    with pytest.raises(wb.SaveFailed, match="no pinned memory left"):
        wb.save_hf(state, tmp_path / "a", layout=layout, async_save=True, write_mode="direct",
                   fp32_keys_pattern="^a$", dtype=torch.bfloat16).wait()
    assert len(calls) == 2 and fresh_pools[False].bytes_out == 0


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_an_error_closing_its_files_fails_the_save_and_closes_every_file(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A network filesystem may report a deferred write error only at close: the save fails through the status
    exchange (SaveFailed, as its peers would see it), not with a raw OSError before it; every descriptor is
    closed, and nothing is published."""
    import workbench.io.files.direct as direct

    state = {f"w{i}": torch.ones(64, 64) for i in range(3)}
    real_close, real_fd = os.close, direct.CheckpointFiles._fd
    writing: set[int] = set()  # the descriptors the ranks write through (not rank 0's while it creates the files)

    def fd(self, name: str) -> int:
        writing.add(found := real_fd(self, name))
        return found

    class ClosingWithError:
        def __getattr__(self, name: str):
            return getattr(os, name)

        @staticmethod
        def close(fd: int) -> None:
            real_close(fd)
            if fd in writing:
                raise OSError(errno.EIO, "Input/output error")

    before = _open_fds()
    monkeypatch.setattr(direct.CheckpointFiles, "_fd", fd)
    monkeypatch.setattr(direct, "os", ClosingWithError())
    with pytest.raises(wb.SaveFailed, match="closing its files"):
        wb.save_hf(state, tmp_path / "ckpt", write_mode="direct", max_shard_bytes=64 * 64 * 4)  # 3 files
    monkeypatch.undo()
    assert len(writing) == 3 and _open_fds() <= before
    assert not (tmp_path / "ckpt").exists()


def test_checkpoint_files_close_every_descriptor_then_name_the_first_failure(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import workbench.io.files.direct as direct

    mesh = wb.MeshSpec((1,), ("world",))
    specs = {n: wb.LoadSpec.from_placements(n, f"{n}.w", (64, 64), mesh, [Shard(0)]) for n in "abc"}
    _, files = _files_for(tmp_path / "f", wb.Layout(mesh, specs))  # files of at most 4 KiB: one per key
    fds = [files._fd(name) for name in files.headers]
    assert len(fds) == 3
    closed: list[int] = []
    real_close = os.close

    def close(fd: int) -> None:
        closed.append(fd)
        real_close(fd)
        if len(closed) == 1:
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(direct.os, "close", close)
    with pytest.raises(OSError, match=r"closing .*\.safetensors: Input/output error"):
        files.close()
    assert sorted(closed) == sorted(fds)
    files.close()  # idempotent: nothing left to close
    assert len(closed) == 3


def _column_cut(tmp_path: Path) -> tuple[wb.LoadSpec, object]:
    """A fused tensor cut by columns over 2 ranks: 2 keys of 128 rows of 4 floats per rank (short runs, mapped)."""
    mesh = wb.MeshSpec((2,), ("tp",))
    spec = wb.LoadSpec.from_placements("w", ["a", "b"], (2 * 128, 8), mesh, [Shard(1)], fused_dim=0)
    _, files = _files_for(tmp_path / "f", wb.Layout(mesh, {"w": spec}), map_short_runs=True)
    assert all(files._mapped(r) for r in spec.key_regions(0))
    return spec, files


def test_a_failed_copy_into_the_map_raises_its_own_error(tmp_path: Path) -> None:
    """A copy into the memory map that fails (here: a piece of the wrong shape) raises that error, not the map's
    'exported pointers exist' on the way out, and leaves the map closed."""
    import numpy as np

    spec, files = _column_cut(tmp_path)
    region = spec.key_regions(0)[0]
    with pytest.raises(ValueError, match="broadcast"):
        files._write_mapped(region, np.zeros((3, 3, 4), dtype=np.uint8))
    files.close()


def test_mapped_boxes_check_every_key_dtype(tmp_path: Path) -> None:
    import dataclasses

    spec, files = _column_cut(tmp_path)
    files.slots = {**files.slots, "b": dataclasses.replace(files.slots["b"], dtype=torch.float16)}
    with pytest.raises(CheckpointError, match=r"b: saved as torch.float16, the tensor's other keys as torch.float32"):
        files.write_local(spec.key_regions(0), torch.ones(256, 4))
    assert files.mapped_boxes == 0
    files.close()


def test_blocks_are_allocated_for_whole_pages_before_a_store_into_the_map(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A store dirties its whole page: where a page spans several blocks (64 KiB pages on 4 KiB blocks), every block
    of it must be allocated, or a full disk is a SIGBUS. Allocations are page-aligned, clipped to the file."""
    import workbench.io.files.direct as direct

    spec, files = _column_cut(tmp_path)
    asked: list[tuple[int, int]] = []
    real = direct._allocate
    monkeypatch.setattr(direct, "_allocate", lambda fd, offset, n: (asked.append((offset, n)), real(fd, offset, n))[1])
    for rank in (0, 1):
        files.write_local(spec.key_regions(rank), torch.full((256, 4), float(rank)))
    size = next(iter(files.headers.values()))[1]
    assert asked and all(o % mmap.PAGESIZE == 0 and ((o + n) % mmap.PAGESIZE == 0 or o + n == size) for o, n in asked)
    files.close()


def test_a_full_pool_asks_its_caller_before_it_waits() -> None:
    """``on_full`` hands the caller's buffers over (here it gives one back itself): the request is served from it.
    When it says nobody will give one back, the request is served beyond the capacity and dropped when given
    back."""
    pool = HostPool(2 * MiB)
    held = [pool.acquire((MiB,), torch.uint8), pool.acquire((MiB,), torch.uint8)]
    served = pool.acquire((MiB,), torch.uint8, on_full=lambda: (held.pop().release(), True)[1])
    assert pool.allocations == 2 and pool.bytes_out == 2 * MiB
    beyond = pool.acquire((MiB,), torch.uint8, on_full=lambda: False)
    assert pool.allocations == 3 and pool.bytes_held == 3 * MiB
    beyond.release()
    served.release()
    held.pop().release()
    assert pool.bytes_out == 0 and pool.bytes_held == 2 * MiB


def test_a_discarded_copy_waits_for_its_transfer_before_its_buffer_is_reused() -> None:
    pool = HostPool(4 * MiB)
    buffer = pool.acquire((MiB,), torch.uint8)
    order: list[str] = []

    class Event:
        def synchronize(self) -> None:
            order.append(f"waited, {pool.bytes_out} bytes out")

    HostCopy(buffer.tensor, buffer, Event()).discard()
    assert order == [f"waited, {MiB} bytes out"] and pool.bytes_out == 0
