"""The native gather: short runs of a file read packed. Expected bytes are the file's own, sliced with numpy from
``Path.read_bytes``; bytes asked of the file are counted by the kernel (``/proc/self/io`` ``rchar``)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.io.files import gather
from workbench.io.files.gather import SCRATCH_BYTES, gather_runs, native_gather

pytestmark = pytest.mark.skipif(native_gather() is None, reason=f"no native gather: {gather.why_not_native()}")


def _rchar() -> int:
    """Bytes this process's reads returned so far; reading it adds its own text (under 256 bytes), allowed for."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


def _gathered(path: Path, offset: int, run: int, sizes: tuple[int, ...], steps: tuple[int, ...]) -> tuple[bytes, int]:
    count = int(np.prod(sizes)) if sizes else 1
    out = np.zeros(run * count + 16, dtype=np.uint8)  # 16 bytes past the runs: must stay untouched
    fd = os.open(path, os.O_RDONLY)
    try:
        asked = gather_runs(fd, offset, run, sizes, steps, out.ctypes.data, run * count)
    finally:
        os.close(fd)
    assert not out[run * count:].any()
    return out[:run * count].tobytes(), asked


def _expected(data: bytes, offset: int, run: int, sizes: tuple[int, ...], steps: tuple[int, ...]) -> bytes:
    starts = np.full(1, offset, dtype=np.int64)
    for n, s in zip(sizes, steps):
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * s).reshape(-1)
    return b"".join(data[a:a + run] for a in starts.tolist())


@st.composite
def _geometry(draw: st.DrawFn) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    """Runs of a row-major box: a run, then dims outward, each step at least the extent of what it repeats."""
    run = draw(st.integers(1, 3000))
    sizes, steps, extent = [], [], run
    for _ in range(draw(st.integers(0, 3))):
        step = extent + draw(st.sampled_from([0, 1, 7, 512, 4096, SCRATCH_BYTES, SCRATCH_BYTES + 1]))
        n = draw(st.integers(1, 40))
        sizes.insert(0, n)
        steps.insert(0, step)
        extent = (n - 1) * step + extent
    return draw(st.integers(0, 5000)), run, tuple(sizes), tuple(steps)


@settings(max_examples=60, deadline=None)
@given(_geometry())
def test_runs_of_any_box_land_packed_in_order(tmp_path_factory: pytest.TempPathFactory, geometry: tuple) -> None:
    offset, run, sizes, steps = geometry
    span = sum((n - 1) * s for n, s in zip(sizes, steps)) + run
    path = tmp_path_factory.mktemp("gather") / "blob"
    data = np.random.default_rng(span).integers(0, 256, offset + span + 100, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    before = _rchar()
    got, asked = _gathered(path, offset, run, sizes, steps)
    read = _rchar() - before
    assert got == _expected(data, offset, run, sizes, steps)
    assert asked <= read <= asked + 256 and run * (int(np.prod(sizes)) if sizes else 1) <= asked <= span


def test_more_runs_than_one_preadv_takes_and_a_wide_gap(tmp_path: Path) -> None:
    """3,000 half rows need six calls of 511 runs (1,024 buffers each); a gap wider than the scratch buffer is not
    read at all (the kernel's count)."""
    data = np.random.default_rng(1).integers(0, 256, 3000 * 1024 + 4096, dtype=np.uint8).tobytes()
    (tmp_path / "rows").write_bytes(data)
    before = _rchar()
    got, asked = _gathered(tmp_path / "rows", 100, 512, (3000,), (1024,))
    assert got == _expected(data, 100, 512, (3000,), (1024,)) and asked <= _rchar() - before <= asked + 256
    batches = -(-3000 // 512)
    assert asked == 2999 * 1024 + 512 - (batches - 1) * 512  # every gap but the one between two calls
    wide = SCRATCH_BYTES + 1
    (tmp_path / "far").write_bytes(data[:4 * (512 + wide)])
    before = _rchar()
    got, asked = _gathered(tmp_path / "far", 0, 512, (4,), (512 + wide,))
    assert got == _expected(data, 0, 512, (4,), (512 + wide,)) and asked == 4 * 512
    assert asked <= _rchar() - before <= asked + 256


def test_a_file_that_ends_before_the_last_run_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "short").write_bytes(bytes(10_000))
    with pytest.raises(OSError) as caught:
        _gathered(tmp_path / "short", 0, 512, (3,), (4800,))
    assert caught.value.errno == errno.EIO and "truncated" in str(caught.value)


def test_runs_that_overlap_or_do_not_fit_are_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(bytes(10_000))
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    out = np.zeros(4096, dtype=np.uint8)
    try:
        with pytest.raises(ValueError, match="overlap, go backwards or do not fit"):
            gather_runs(fd, 0, 512, (2,), (100,), out.ctypes.data, out.nbytes)  # the second run starts inside
        with pytest.raises(ValueError, match="do not fit 1000 bytes"):
            gather_runs(fd, 0, 512, (2,), (1024,), out.ctypes.data, 1000)
    finally:
        os.close(fd)


def _native_in(env: dict[str, str]) -> str:
    """What a fresh interpreter says of the native gather under ``env``."""
    code = "from workbench.io.files import gather; print(gather.why_not_native() or 'built')"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_it_is_built_into_a_private_cache_and_can_be_turned_off(tmp_path: Path) -> None:
    assert _native_in({"XDG_CACHE_HOME": str(tmp_path / "cache")}) == "built"
    folder = tmp_path / "cache" / "workbench" / "native"
    assert folder.stat().st_mode & 0o777 == 0o700 and len(list(folder.glob("gather-*.so"))) == 1
    assert _native_in({"WORKBENCH_NATIVE": "0"}) == "WORKBENCH_NATIVE=0"
    folder.chmod(0o777)  # others may write it: a library from there is not loaded
    assert "is not this user's alone" in _native_in({"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert "no C compiler" in _native_in({"CC": "no-such-compiler-here"})
