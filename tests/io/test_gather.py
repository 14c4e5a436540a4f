"""``gather_runs``: short runs of a file read packed, the gaps dropped. Expected bytes are the file's own bytes, sliced
with Python from ``Path.read_bytes``; reads are counted at the C library call."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import numpy as np
import pytest

from workbench.io.files import gather
from workbench.io.files.gather import SCRATCH_BYTES, gather_runs


def _file(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "blob"
    path.write_bytes(data)
    return path, data


def _gathered(path: Path, offsets: list[int], run: int) -> tuple[bytes, int]:
    out = np.zeros(run * len(offsets) + 16, dtype=np.uint8)  # 16 bytes past the runs: must stay untouched
    fd = os.open(path, os.O_RDONLY)
    try:
        asked = gather_runs(fd, np.array(offsets, dtype=np.int64), run, memoryview(out))
    finally:
        os.close(fd)
    assert not out[run * len(offsets):].any()
    return out[:run * len(offsets)].tobytes(), asked


@pytest.mark.parametrize(("run", "stride", "count"), [(512, 1024, 3000), (768, 1536, 7), (100, 100, 40), (8, 24, 1)])
def test_evenly_spaced_runs_land_packed(tmp_path: Path, run: int, stride: int, count: int) -> None:
    path, data = _file(tmp_path, stride * count + 4096)
    offsets = [300 + i * stride for i in range(count)]
    got, asked = _gathered(path, offsets, run)
    assert got == b"".join(data[o:o + run] for o in offsets)
    batches = -(-count // 512)  # one preadv takes 512 runs and the gaps between them (1,024 buffers)
    assert asked == offsets[-1] + run - offsets[0] - (batches - 1) * (stride - run)


def test_a_gap_wider_than_the_scratch_buffer_is_not_read(tmp_path: Path) -> None:
    wide = SCRATCH_BYTES + 1
    path, data = _file(tmp_path, 4 * wide)
    offsets = [0, 1000, 1000 + 512 + wide, 1000 + 2 * (512 + wide)]
    got, asked = _gathered(path, offsets, 512)
    assert got == b"".join(data[o:o + 512] for o in offsets)
    assert asked == 4 * 512 + (1000 - 512)  # the first gap only


def test_short_reads_go_on_where_they_stopped(tmp_path: Path, monkeypatch) -> None:
    """A C library that returns at most 37 bytes a call, from the first buffer only: the bytes are the same."""
    path, data = _file(tmp_path, 200_000)
    calls = []

    def stingy(fd: int, iov: int, count: int, offset: int) -> int:
        calls.append(count)
        base, length = np.frombuffer((ctypes.c_uint64 * 2).from_address(iov), dtype=np.uint64).tolist()
        chunk = os.pread(fd, min(int(length), 37), offset)
        ctypes.memmove(int(base), chunk, len(chunk))
        return len(chunk)

    monkeypatch.setattr(gather, "_preadv", lambda: stingy)
    offsets = [i * 700 + 5 for i in range(60)]
    got, _ = _gathered(path, offsets, 300)
    assert got == b"".join(data[o:o + 300] for o in offsets)
    assert len(calls) > 60


def test_a_file_that_ends_before_the_last_run_is_an_error(tmp_path: Path) -> None:
    path, _ = _file(tmp_path, 10_000)
    with pytest.raises(OSError) as caught:
        _gathered(path, [0, 2000, 9900], 512)
    assert caught.value.errno == errno.EIO and "truncated" in str(caught.value)


def test_runs_out_of_order_are_refused(tmp_path: Path) -> None:
    path, _ = _file(tmp_path, 10_000)
    with pytest.raises(ValueError, match="not in file order"):
        _gathered(path, [2000, 0], 512)
