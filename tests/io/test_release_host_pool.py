"""``wb.release_host_pool()``: the host buffers an async save keeps for the next one are freed on request. They
were held until the process exited (a default async save bounds them by nothing but its share of the model, pinned
on a GPU). Expected values come from the process's resident memory (``/proc/self/statm``), not from the pool's own
count."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from pathlib import Path

import torch
from safetensors.torch import load_file

import workbench as wb
from workbench.io.files.host_pool import host_pool

_MIB = 1 << 20


def _rss() -> int:
    """Resident bytes once freed memory is given back: glibc keeps freed heap memory (and serves big buffers from the
    heap once it has freed a big mapping), so ``malloc_trim`` first."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_release_frees_the_buffers_an_async_save_kept(tmp_path: Path) -> None:
    wb.release_host_pool()  # whatever earlier tests of this process left
    state = {f"layers.{i}.w": torch.randn(1024, 4096) for i in range(4)}  # 64 MiB
    wb.save_hf(state, tmp_path / "a", async_save=True).wait()
    gc.collect()
    before = _rss()
    freed = wb.release_host_pool()
    gc.collect()
    dropped = before - _rss()
    assert freed >= 64 * _MIB
    assert dropped >= 48 * _MIB, f"resident memory fell by {dropped / _MIB:.1f} MiB only"
    assert wb.release_host_pool() == 0  # nothing left to free

    # the next save allocates again and writes the same values
    wb.save_hf(state, tmp_path / "b", async_save=True).wait()
    written = load_file(str(next((tmp_path / "b").glob("*.safetensors"))))
    assert all(torch.equal(written[k], v) for k, v in state.items())


def test_release_leaves_a_pending_save_its_buffers(tmp_path: Path) -> None:
    state = {"w": torch.randn(2048, 2048)}  # 16 MiB
    at_call = state["w"].clone()
    handle = wb.save_hf(state, tmp_path / "a", async_save=True)
    wb.release_host_pool()
    state["w"].zero_()  # the snapshot is the save's own: neither this nor the release changes what it writes
    handle.wait()
    written = load_file(str(next((tmp_path / "a").glob("*.safetensors"))))
    assert torch.equal(written["w"], at_call)
    assert host_pool(pinned=False).bytes_out == 0
