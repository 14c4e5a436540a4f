"""BoxReader against safetensors' own slicing: every box of every dtype, bit for bit, in and out of order, through
the page cache and with O_DIRECT (on a disk directory: tmpfs may not do direct I/O), and its fallbacks."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from workbench.errors import CheckpointError
from workbench.io.files import box_reads
from workbench.io.files.box_reads import BoxReader, box_runs, cached_share, gap_pages
from workbench.io.files.index import read_checkpoint
from workbench.io.files.transfers import FileBox

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.float8_e4m3fn)


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (*shape, dtype.itemsize), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@st.composite
def _boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], list[tuple[slice, ...] | None]]:
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=0, max_size=4)))
    boxes: list[tuple[slice, ...] | None] = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            boxes.append(None)
            continue
        dims = draw(st.integers(0, len(shape)))
        box = []
        for n in shape[:dims]:
            a = draw(st.integers(0, n))
            b = draw(st.integers(a, n))
            box.append(slice(a, b))
        boxes.append(tuple(box))
    return shape, boxes


@pytest.fixture(scope="module")
def disk() -> Iterator[Path]:
    """A directory on a disk that does O_DIRECT reads (``/var/tmp``: ``/tmp`` may be a tmpfs), removed after."""
    root = Path(tempfile.mkdtemp(prefix="wb-box-reads-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    probe = root / "probe.bin"
    probe.write_bytes(os.urandom(3 * 4096))
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, 4096)  # page-aligned
            os.preadv(fd, [buf], 4096)
        finally:
            os.close(fd)
    except (OSError, AttributeError) as exc:
        shutil.rmtree(root)
        pytest.skip(f"{root.parent} does not do O_DIRECT reads here: {exc}")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _evict(path: Path) -> None:
    """Write back, then drop the file's pages; skip the test where the kernel keeps them (a tmpfs)."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if cached_share(fd, 0, os.path.getsize(path)) != 0.0:
            pytest.skip(f"{path.parent}: the page cache keeps a file's pages after POSIX_FADV_DONTNEED")
    finally:
        os.close(fd)


def _cached(fd: int, offset: int) -> bool:
    """Whether the page at ``offset`` is in the page cache, asked with a non-blocking read (not with mincore). The
    kernel starts reading a missing page when asked, so a page asked about is cached soon after."""
    try:
        os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT)
        return True
    except BlockingIOError:
        return False
    except (OSError, AttributeError) as exc:
        pytest.skip(f"preadv(RWF_NOWAIT) does not work here: {exc}")


def _data_start(path: Path) -> tuple[int, dict]:
    """The data section's file offset and the header, parsed here (not by the code under test)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))


DEVICES = [None, "cuda"] if torch.cuda.is_available() else [None]  # "cuda": through the staging ring (on a GPU)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_boxes(), dtypes=st.lists(st.sampled_from(DTYPES), min_size=3, max_size=3), order=st.randoms(),
       direct=st.sampled_from([False, True]), device=st.sampled_from(DEVICES))
def test_boxes_match_safetensors_bit_for_bit(disk: Path, case, dtypes, order, direct, device) -> None:
    shape, boxes = case
    folder = disk / f"ck{abs(hash((shape, tuple(dtypes)))) % 10**9}"
    folder.mkdir(exist_ok=True)
    tensors = {f"k{i}": _tensor(shape, d, i) for i, d in enumerate(dtypes)}
    save_file(tensors, str(folder / "model.safetensors"))
    expected = [(k, b) for k in tensors for b in boxes]
    asked = list(expected)
    if order.random() < 0.5:  # out of the expected order: still served, by reads of their own
        order.shuffle(asked)
    with BoxReader(read_checkpoint(folder), expected, threads=3, budget_bytes=order.choice([1, 64, 1 << 20]),
                   direct=direct, device=device) as r, safe_open(str(folder / "model.safetensors"), "pt") as ref:
        for key, box in asked:
            got = r.read(key, box)
            want = ref.get_tensor(key) if box is None else ref.get_slice(key)[box] if box else ref.get_tensor(key)
            assert got.device.type == (device or "cpu"), (key, box)
            assert got.dtype == want.dtype and got.shape == want.shape, (key, box)
            assert torch.equal(_bytes(got.cpu()), _bytes(want)), (key, box)
        read_any = any(t.numel() for t in tensors.values()) and r.bytes_read > 0
        # these tensors are a few pages at most: every box is one span, read with O_DIRECT when asked
        assert (r.bytes_direct > 0) == (direct and read_any), (r.bytes_direct, direct)
        assert not r.direct_refused


def test_direct_reads_the_aligned_cover_of_a_box_and_hands_on_only_the_box(disk: Path) -> None:
    folder = disk / "cover"
    folder.mkdir()
    full = _tensor((300, 1000), torch.bfloat16, 1)  # 2000-byte rows: the box starts and ends inside pages
    save_file({"pad": torch.ones(3, dtype=torch.int8), "w": full}, str(folder / "model.safetensors"))
    data, header = _data_start(folder / "model.safetensors")
    begin = data + header["w"]["data_offsets"][0] + 7 * 2000
    end = data + header["w"]["data_offsets"][0] + 290 * 2000
    assert begin % 4096 and end % 4096  # the case this test is about
    cover = (end + 4095) // 4096 * 4096 - begin // 4096 * 4096
    box = (slice(7, 290),)
    with BoxReader(read_checkpoint(folder), [("w", box)], direct=True) as r:
        got = r.read("w", box)
        assert torch.equal(_bytes(got), _bytes(full[box]))
        assert r.bytes_fetched == r.bytes_direct == cover  # the box and at most a page on either side
        assert cover - (end - begin) < 2 * 4096


def test_a_filesystem_that_refuses_o_direct_at_open_is_read_through_the_page_cache(
        disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = disk / "refuse-open"
    folder.mkdir()
    full = _tensor((64, 4096), torch.float32, 2)
    save_file({"w": full}, str(folder / "model.safetensors"))
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(box_reads.os, "open", refusing_open)
    with BoxReader(read_checkpoint(folder), [("w", None), ("w", (slice(3, 40),))], direct=True) as r:
        assert torch.equal(_bytes(r.read("w")), _bytes(full))
        assert torch.equal(_bytes(r.read("w", (slice(3, 40),))), _bytes(full[3:40]))
        assert r.bytes_direct == 0 and r.bytes_fetched == (64 + 37) * 4096 * 4
        assert "opening with O_DIRECT" in r.direct_refused["model.safetensors"]
        assert "Invalid argument" in r.direct_refused["model.safetensors"]


def test_a_file_that_refuses_o_direct_reads_falls_back_mid_request(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = disk / "refuse-read"
    folder.mkdir()
    full = _tensor((1024, 24576), torch.uint8, 3)  # 24 MiB: a piece of CHUNK_BYTES (16 MiB), then the rest
    save_file({"w": full}, str(folder / "model.safetensors"))
    real_open, real_preadv = os.open, os.preadv
    direct_fds: set[int] = set()
    calls = {"direct": 0}

    def tracking_open(path, flags, *args):
        fd = real_open(path, flags, *args)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def refusing_preadv(fd, buffers, offset, *args):
        if fd in direct_fds:
            calls["direct"] += 1
            if calls["direct"] > 1:  # the first direct read succeeds, the next ones are refused
                raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(box_reads.os, "open", tracking_open)
    monkeypatch.setattr(box_reads.os, "preadv", refusing_preadv)
    with BoxReader(read_checkpoint(folder), [("w", None)], threads=1, direct=True) as r:
        assert torch.equal(r.read("w"), full)
        assert 0 < r.bytes_direct < full.numel()
        assert "reading with O_DIRECT" in r.direct_refused["model.safetensors"]


def test_auto_reads_cold_large_requests_direct_and_warm_or_small_ones_through_the_page_cache(disk: Path) -> None:
    folder = disk / "auto"
    folder.mkdir()
    big, small = _tensor((512, 4096), torch.uint8, 4), _tensor((16, 4096), torch.uint8, 5)  # 2 MiB and 64 KiB
    path = folder / "model.safetensors"
    save_file({"big": big, "gap": torch.zeros(4096, dtype=torch.uint8), "small": small}, str(path))
    data, header = _data_start(path)
    index = read_checkpoint(folder)
    _evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        at = data + header["big"]["data_offsets"][0]
        assert cached_share(fd, at, big.numel()) == 0.0
        with BoxReader(index, [("big", None), ("small", None)], direct="auto") as r:
            assert torch.equal(r.read("big"), big) and torch.equal(r.read("small"), small)
            assert r.bytes_direct >= big.numel()  # cold and large: O_DIRECT
            assert r.bytes_direct < big.numel() + 2 * 4096  # the small key went through the page cache
        assert not _cached(fd, at + 4096 * 100)  # O_DIRECT left the big key's pages out of the cache
        assert _cached(fd, data + header["small"]["data_offsets"][0])
        with open(path, "rb") as f:  # warm the cache
            f.read()
        assert cached_share(fd, at, big.numel()) == 1.0
        with BoxReader(index, [("big", None)], direct="auto") as r:
            assert torch.equal(r.read("big"), big)
            assert r.bytes_direct == 0  # warm: the page cache
    finally:
        os.close(fd)


def test_direct_mode_comes_from_the_argument_or_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    save_file({"w": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    index = read_checkpoint(tmp_path)
    monkeypatch.delenv("WORKBENCH_READ_DIRECT", raising=False)
    assert BoxReader(index, []).direct == "auto"
    for text, mode in (("1", True), ("0", False), ("auto", "auto"), ("OFF", False)):
        monkeypatch.setenv("WORKBENCH_READ_DIRECT", text)
        assert BoxReader(index, []).direct == mode
        assert BoxReader(index, [], direct=True).direct is True  # the argument wins
    monkeypatch.setenv("WORKBENCH_READ_DIRECT", "sometimes")
    with pytest.raises(ValueError, match="WORKBENCH_READ_DIRECT='sometimes': expected auto, 1 or 0"):
        BoxReader(index, [])
    with pytest.raises(ValueError, match=r"direct='yes': expected True, False or 'auto'"):
        BoxReader(index, [], direct="yes")  # type: ignore[arg-type]


def test_runs_of_a_column_cut_are_one_per_row() -> None:
    # 4 x 6 float32: columns 2:5 of rows 1:3 are two runs of 12 bytes at rows 1 and 2
    assert box_runs((4, 6), 4, (slice(1, 3), slice(2, 5))) == [(1 * 24 + 8, 12), (2 * 24 + 8, 12)]
    # a row cut is one run; whole trailing dims fold into it
    assert box_runs((4, 6, 2), 2, (slice(1, 3),)) == [(24, 48)]


def test_wide_rows_cut_by_columns_read_only_the_owned_bytes(tmp_path: Path) -> None:
    full = _tensor((8, 65536), torch.float32, 0)  # 256 KiB rows: a half-column box is 8 runs of 128 KiB
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    box = (slice(0, 8), slice(0, 32768))
    with BoxReader(read_checkpoint(tmp_path), [("w", box)]) as r:
        got = r.read("w", box)
        assert torch.equal(_bytes(got), _bytes(full[box]))
        assert r.bytes_fetched == 8 * 32768 * 4  # not the 2 MiB span


def test_runs_that_touch_every_page_are_read_as_one_span(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = _tensor((1024, 512), torch.bfloat16, 6)  # 1 KiB rows: the half-column box touches every page anyway
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    box = (slice(0, 1024), slice(0, 256))
    real_preadv = os.preadv
    calls = []
    monkeypatch.setattr(box_reads.os, "preadv", lambda fd, bufs, off, *a: calls.append(off) or real_preadv(
        fd, bufs, off, *a))
    with BoxReader(read_checkpoint(tmp_path), [("w", box)], direct=False) as r:
        got = r.read("w", box)
        assert torch.equal(_bytes(got), _bytes(full[box]))
        assert got.is_contiguous()  # copied out of the span: a copy to a GPU needs no staging
        assert len(calls) == 1  # not 1024 reads of 512 bytes
        assert r.bytes_fetched == 1023 * 1024 + 512  # the span from the first owned byte to the last


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int64])
@pytest.mark.parametrize("box", [(slice(1, 6), slice(1, 3)), (slice(0, 7), slice(0, 5), slice(1, 2)),
                                 (slice(2, 4), slice(1, 5), slice(0, 2), slice(1, 4)), (slice(0, 7), slice(2, 3))])
def test_boxes_read_as_their_span_come_out_contiguous_and_exact(tmp_path: Path, dtype, box) -> None:
    full = _tensor((7, 5, 3, 4), dtype, 7)  # rows of at most 480 bytes: every gap is shorter than a page
    save_file({"pad": torch.ones(5, dtype=torch.int8), "w": full}, str(tmp_path / "model.safetensors"))
    with BoxReader(read_checkpoint(tmp_path), [("w", box)]) as r:
        got = r.read("w", box)
        assert got.is_contiguous() and got.shape == full[box].shape
        assert torch.equal(_bytes(got), _bytes(full[box]))
        assert r.bytes_fetched > r.bytes_read  # the span, with the bytes between the box's runs


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=4), itemsize=st.sampled_from([1, 2, 4, 512]),
       data=st.data())
def test_gap_pages_bounds_the_pages_a_span_read_fetches_for_nothing(shape, itemsize, data) -> None:
    box = []
    for n in shape:
        a = data.draw(st.integers(0, n - 1))
        box.append(slice(a, data.draw(st.integers(a + 1, n))))
    runs = box_runs(shape, itemsize, tuple(box))
    touched = {page for offset, length in runs for page in range(offset // 4096, (offset + length - 1) // 4096 + 1)}
    first, last = runs[0][0] // 4096, (runs[-1][0] + runs[-1][1] - 1) // 4096
    untouched = (last - first + 1) - len(touched)  # pages of the span (file at offset 0) that hold none of the box
    got = gap_pages(shape, itemsize, tuple(box))
    assert untouched <= got <= untouched + len(runs) - 1, (shape, box, untouched, got)


@pytest.mark.parametrize("direct", [False, True])
def test_a_truncated_file_is_a_checkpoint_error(disk: Path, direct: bool) -> None:
    folder = disk / f"truncated-{direct}"
    folder.mkdir()
    save_file({"w": torch.ones(1024, 1024)}, str(folder / "model.safetensors"))
    index = read_checkpoint(folder)
    with open(folder / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(folder / "model.safetensors") - 1000)
    # the reader sees at open that the file is not the one indexed; without that record, the read comes up short
    with BoxReader(index, [("w", None)], direct=direct) as r, pytest.raises(CheckpointError,
                                                                           match="rewritten in place since"):
        r.read("w")
    unrecorded = dataclasses.replace(index, file_ids={})
    with BoxReader(unrecorded, [("w", None)], direct=direct) as r, pytest.raises(CheckpointError, match="short read"):
        r.read("w")


@pytest.mark.parametrize("direct", [False, True])
def test_small_requests_share_slabs_and_direct_buffers_follow_the_file_alignment(disk: Path, direct: bool) -> None:
    folder = disk / f"slabs-{direct}"
    folder.mkdir()
    tensors = {f"k{i:03d}": _tensor((64, 1024), torch.float32, i) for i in range(200)}  # 256 KiB keys
    save_file(tensors, str(folder / "model.safetensors"))
    data, header = _data_start(folder / "model.safetensors")
    box = (slice(0, 32),)  # half of each key: 200 requests of 128 KiB, none touching the next
    got = {}
    with BoxReader(read_checkpoint(folder), [(k, box) for k in tensors], direct=direct) as r:
        for k in tensors:
            got[k] = r.read(k, box)
            assert torch.equal(_bytes(got[k]), _bytes(tensors[k][box])), k
            if direct:  # read into a 4 KiB-aligned cover: the box sits at its file offset's place in a page
                assert (got[k].data_ptr() - data - header[k]["data_offsets"][0]) % 4096 == 0, k
        assert r.bytes_direct == (r.bytes_fetched if direct else 0)
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1  # 200 buffers, one allocation


def _file_box(folder: Path, key: str, box: tuple[slice, ...]) -> FileBox:
    """The FileBox of ``box`` of ``key``, from the header parsed here."""
    _, header = _data_start(folder / "model.safetensors")
    meta = header[key]
    dtype = {"F32": torch.float32, "BF16": torch.bfloat16}[meta["dtype"]]
    shape = meta["shape"]
    strides = [dtype.itemsize * math.prod(shape[d + 1:]) for d in range(len(shape))]
    offset = meta["data_offsets"][0] + sum(s.start * st for s, st in zip(box, strides))
    return FileBox("model.safetensors", offset, tuple(s.stop - s.start for s in box), tuple(strides), dtype)


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize(("shape", "box"), [
    ((8, 65536), (slice(1, 7), slice(0, 32768))),  # 128 KiB runs: read straight into the tensor
    ((64, 4096), (slice(3, 60), slice(0, 4096))),  # whole rows: one run (O_DIRECT can read it), or 16 KiB ones
    ((1024, 256), (slice(0, 1024), slice(0, 128))),  # 512-byte runs: the span into a buffer, then copied
])
def test_boxes_read_into_a_tensor_land_in_it_bit_for_bit(disk: Path, direct: bool, strided: bool, shape, box,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    folder = disk / f"into-{direct}-{strided}-{shape[0]}"
    folder.mkdir()
    full = _tensor(shape, torch.float32, 11)
    save_file({"pad": torch.ones(3, dtype=torch.int8), "w": full}, str(folder / "model.safetensors"))
    sizes = tuple(s.stop - s.start for s in box)
    # the tensor it lands in: a view into a larger one (every other column block), NaN elsewhere
    holder = torch.full((sizes[0], 2 * sizes[1]) if strided else sizes, float("nan"))
    into = holder[:, sizes[1]:] if strided else holder
    fb = _file_box(folder, "w", box)
    real = os.preadv
    targets = []  # whether each read landed in the tensor's storage
    low = holder.data_ptr()
    high = low + holder.numel() * 4

    def preadv(fd, bufs, off, *a):
        address = torch.frombuffer(bufs[0], dtype=torch.uint8).data_ptr() if len(bufs[0]) else 0
        targets.append(low <= address < high)
        return real(fd, bufs, off, *a)

    monkeypatch.setattr(box_reads.os, "preadv", preadv)
    with BoxReader(read_checkpoint(folder), [(fb, into)], direct=direct) as r:
        got = r.read(fb)
        assert got is into
        assert torch.equal(_bytes(into), _bytes(full[box]))
        if strided:
            assert holder[:, :sizes[1]].isnan().all()  # nothing written beside the box
        solid = sizes[1] == shape[1]  # whole rows: one range of the file
        run = sizes[1] * 4 * (sizes[0] if solid and not strided else 1)  # contiguous in the file and in the tensor
        lands = run >= 64 << 10
        if direct and (solid or not lands):  # one range of the file: O_DIRECT into an aligned buffer, copied in
            assert r.bytes_direct > 0 and not any(targets)
        else:
            assert r.bytes_direct == 0
            assert all(targets) if lands else not any(targets), targets
            span = (sizes[0] - 1) * shape[1] * 4 + sizes[1] * 4
            assert r.bytes_fetched == (full[box].numel() * 4 if lands else span)


def test_auto_reads_a_cold_span_shared_with_a_peer_through_the_page_cache(disk: Path) -> None:
    # half of each 1 KiB row of a 4 MiB key: the span is 4 MiB, cold, and holds the other half, a peer's box
    folder = disk / "auto-compact"
    folder.mkdir()
    full = _tensor((4096, 512), torch.bfloat16, 12)
    path = folder / "model.safetensors"
    save_file({"w": full}, str(path))
    _evict(path)
    box = (slice(0, 4096), slice(0, 256))
    with BoxReader(read_checkpoint(folder), [("w", box)], direct="auto") as r:
        assert torch.equal(_bytes(r.read("w", box)), _bytes(full[box]))
        assert r.bytes_direct == 0  # through the page cache, where the peer's read of the same pages is free
    data, header = _data_start(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _cached(fd, data + header["w"]["data_offsets"][0] + 2048 * 1024)
    finally:
        os.close(fd)


def test_reads_ahead_stop_at_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the consumer paused after its first box, the bytes the threads asked the files for (counted at
    ``os.preadv``, not from the reader's own counters) stay within the budget plus one request."""
    tensors = {f"k{i:02d}": _tensor((256, 1024), torch.float32, i) for i in range(16)}  # 1 MiB each
    save_file(tensors, str(tmp_path / "model.safetensors"))
    boxes = [(k, (slice(0, 128),)) for k in tensors]  # half of each key: 16 requests of 512 KiB, none touching
    asked: list[int] = []
    preadv = os.preadv

    def counted(fd: int, buffers: list, offset: int, *flags: int) -> int:
        asked.append(sum(len(memoryview(b)) for b in buffers))
        return preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", counted)
    budget = 2 << 20
    with BoxReader(read_checkpoint(tmp_path), boxes, threads=4, budget_bytes=budget, direct=False) as r:
        first = r.read(*boxes[0])
        time.sleep(0.3)  # every read issued so far has landed
        ahead = sum(asked)
        assert 1 << 20 <= ahead <= budget + 2 * (512 << 10), ahead  # read ahead, but not all 8 MiB
        got = [first] + [r.read(*b) for b in boxes[1:]]
    assert sum(asked) == 16 * (512 << 10)
    assert all(torch.equal(_bytes(g), _bytes(tensors[k][box])) for g, (k, box) in zip(got, boxes, strict=True))


def test_staging_into_a_device_other_than_cuda_is_refused(tmp_path: Path) -> None:
    save_file({"k": _tensor((4, 4), torch.float32, 0)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"stages reads into a CUDA device, not cpu"):
        BoxReader(read_checkpoint(tmp_path), [("k", None)], device="cpu")


def test_upcoming_pieces_come_in_order_as_taken_and_a_failure_to_make_one_stays() -> None:
    """``BoxReader``'s queue of landing pieces: taken in order from iterators joined one after the other, made only
    as they are looked at, and an error making one raised again on every later look (no piece after it is lost)."""
    from workbench.io.files.box_reads import _Upcoming

    made = []

    def pieces(names, fail_at=None):
        for name in names:
            if name == fail_at:
                raise RuntimeError(f"cannot make {name}")
            made.append(name)
            yield name

    queue = _Upcoming()
    assert not queue
    with pytest.raises(IndexError):
        queue.popleft()
    queue.extend(pieces("ab"))
    queue.extend(pieces("cd", fail_at="d"))
    assert made == []  # nothing made before it is looked at
    assert queue.popleft() == "a" and made == ["a"]
    assert queue and made == ["a", "b"]  # one looked at ahead
    assert [queue.popleft(), queue.popleft()] == ["b", "c"]
    for _ in range(2):
        with pytest.raises(RuntimeError, match="cannot make d"):
            bool(queue)
    queue.clear()
    assert not queue
