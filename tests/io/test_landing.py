"""Landing boxes of file bytes in tensors through a ring of staging slots: ``plan_landing``'s pieces checked byte
for byte by executing them here on a fake file (and against the box's own bytes, from torch views of the file),
then ``BoxReader``'s landing on the CPU seam (an unpinned ring, copies that run at once) against torch indexing of
the saved tensors: splits across tiny slots, casts, strided destinations, faults mid-landing, ``close`` mid-flight
and O_DIRECT (on a disk directory: tmpfs may not do direct I/O)."""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import math
import os
import random
import re
import struct
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from tests.io import test_box_reads as box_reads_tests
from tests.io.support import all_slots_free
from workbench.errors import CheckpointError
from workbench.io.files import landing
from workbench.io.files.box_reads import BoxReader
from workbench.io.files.index import read_checkpoint
from workbench.io.files.landing import LandingPiece, plan_landing
from workbench.io.files.staging import StagingRing
from workbench.io.files.transfers import FileBox

ALIGN = 4096
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float8_e4m3fn)
FILES = ("a.safetensors", "b.safetensors")


# -- helpers ---------------------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes in its logical order (NaNs compare bit for bit)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def _cast_dtype(dtype: torch.dtype) -> torch.dtype:
    """A destination dtype other than ``dtype`` (a landing copy casts)."""
    return torch.float64 if dtype == torch.float32 else torch.float32


def _dest(sizes: tuple[int, ...], dtype: torch.dtype, order: list[int], pad: list[int], at: list[int]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """A zero target with dims permuted by ``order`` and padded by ``pad``, and the view of ``sizes`` at ``at`` in
    it (strided, not contiguous in general, with a storage offset)."""
    big = [sizes[d] + pad[d] for d in order]
    target = torch.zeros(big, dtype=dtype)
    view = target.permute([order.index(d) for d in range(len(order))])
    dest = view[tuple(slice(a, a + n) for a, n in zip(at, sizes))]
    return target, dest


def _byte_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1:]) * itemsize for d in range(len(shape)))


def _file_box(file: str, key_offset: int, shape: tuple[int, ...], dtype: torch.dtype,
              box: tuple[slice, ...]) -> FileBox:
    """The FileBox of ``key[box]`` for a key stored contiguously at ``key_offset`` of the data section."""
    strides = _byte_strides(shape, dtype.itemsize)
    offset = key_offset + sum(s.start * st_ for s, st_ in zip(box, strides))
    return FileBox(file, offset, tuple(s.stop - s.start for s in box), strides, dtype)


def _within(seconds: float, fn: Callable[[], object]) -> BaseException | None:
    """Run ``fn`` on a thread; fail if it does not return within ``seconds``; the exception it raised, if any."""
    out: list[BaseException | None] = [None]

    def body() -> None:
        try:
            fn()
        except BaseException as exc:
            out[0] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} did not return within {seconds} s (hang)"
    return out[0]


# -- the planner, executed here on a fake file -----------------------------------------------------------------------


@st.composite
def _case(draw: st.DrawFn) -> dict:
    ndim = draw(st.sampled_from([1, 1, 2, 3, 4]))
    budget = 150_000  # elements of the key, at most
    shape = []
    for _ in range(ndim):
        cap = max(1, min(5000, budget))
        n = draw(st.one_of(st.integers(1, cap), st.integers(cap // 2 + 1, max(cap, budget)),
                           st.sampled_from([budget, budget // 3 + 1])))
        shape.append(n)
        budget = max(1, budget // n)
    shape = tuple(draw(st.permutations(shape)))
    dtype = draw(st.sampled_from(DTYPES))
    boxes: list[dict] = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["random", "rows", "next", "whole"]))
        file = draw(st.sampled_from(FILES))
        first = 0
        if kind == "next" and boxes and boxes[-1]["rows"] and boxes[-1]["box"][0].stop < shape[0]:
            file, first = boxes[-1]["file"], boxes[-1]["box"][0].stop  # the rows after the last box's
        elif kind == "next":
            kind = "rows"
        if kind == "random":
            box = []
            for n in shape:
                a = draw(st.integers(0, n - 1))
                box.append(slice(a, draw(st.integers(a + 1, n))))
        else:  # whole rows: contiguous in the file
            a = first if kind == "next" else 0 if kind == "whole" else draw(st.integers(0, shape[0] - 1))
            b = shape[0] if kind == "whole" else draw(st.integers(a + 1, shape[0]))
            box = [slice(a, b), *(slice(0, n) for n in shape[1:])]
        pad = [draw(st.integers(0, 2)) for _ in range(ndim)]
        boxes.append({
            "rows": kind != "random",
            "file": file,
            "box": tuple(box),
            "how": draw(st.sampled_from(["runs", "span", "shared"])),
            "cast": draw(st.booleans()),
            "order": draw(st.permutations(range(ndim))),
            "pad": pad,
            "at": [draw(st.integers(0, p)) for p in pad],
        })
    return {
        "shape": shape,
        "dtype": dtype,
        "boxes": boxes,
        "slot_bytes": draw(st.one_of(st.integers(3, 6), st.integers(3, 64))) * ALIGN,  # tiny ones cut boxes
        "data_start": {f: draw(st.integers(1, 2000)) * 8 for f in FILES},
        "key_at": {f: draw(st.integers(0, 1200)) * 8 for f in FILES},
        "seed": draw(st.integers(0, 2**16)),
        "packed": draw(st.sampled_from([(), FILES[:1], FILES])),  # cached files: pieces packed full, one open each
    }


def _check_piece_shape(piece: LandingPiece, slot_bytes: int) -> np.ndarray:
    """The piece's own invariants; the slot bytes its reads fill."""
    covered = np.zeros(slot_bytes, dtype=bool)
    assert piece.reads and piece.parts
    for _, at, n in piece.reads:
        assert n > 0 and at >= 0 and at + n <= piece.used, (piece.reads, piece.used)
        assert not covered[at:at + n].any(), f"reads overlap in the slot: {piece.reads}"
        covered[at:at + n] = True
    assert piece.nbytes == sum(n for _, _, n in piece.reads)
    assert piece.used == max(p.at + p.nbytes for p in piece.parts)
    for p in piece.parts:
        size = p.dtype.itemsize
        assert p.at % size == 0, (p.at, p.dtype)
        assert p.at >= 0 and p.at + p.nbytes <= slot_bytes - ALIGN, (p.at, p.nbytes, slot_bytes)
        assert p.nbytes == sum((n - 1) * s for n, s in zip(p.sizes, p.strides)) * size + size  # its last byte
        assert covered[p.at:p.at + p.nbytes].all(), "a part's bytes are not all read"
        assert tuple(p.dest.shape) == p.sizes
    if piece.solid is not None:
        begin, end = piece.solid
        reads = sorted(piece.reads)
        assert reads[0][0] == begin and reads[-1][0] + reads[-1][2] == end
        for (o1, _, n1), (o2, _, _) in itertools.pairwise(reads):
            assert o1 + n1 == o2, f"a solid piece's reads are not one range: {reads}"
        for off, at, _ in reads:
            assert at == begin % ALIGN + (off - begin), (piece.solid, reads)
        assert -(-end // ALIGN) * ALIGN - begin // ALIGN * ALIGN <= slot_bytes
    return covered


def _asked(pieces: list[LandingPiece], length: int, file: str) -> np.ndarray:
    """How many times the pieces' reads ask each byte of ``file``."""
    out = np.zeros(length, dtype=np.int64)
    for piece in pieces:
        if piece.file == file:
            for off, _, n in piece.reads:
                assert off >= 0 and off + n <= length
                out[off:off + n] += 1
    return out


@settings(max_examples=200, deadline=None)
@given(case=_case())
def test_planned_pieces_land_every_box_exactly(case: dict) -> None:
    shape, dtype, slot_bytes = case["shape"], case["dtype"], case["slot_bytes"]
    data_start, key_at = case["data_start"], case["key_at"]
    key_bytes = math.prod(shape) * dtype.itemsize
    g = torch.Generator().manual_seed(case["seed"])
    files = {f: torch.randint(0, 256, (data_start[f] + key_at[f] + key_bytes + 100,), generator=g,
                              dtype=torch.uint8) for f in FILES}
    keys = {f: files[f][data_start[f] + key_at[f]:][:key_bytes].clone().view(dtype).view(shape) for f in FILES}

    plan, targets, dests, expected = [], [], [], []
    alone = {f: np.zeros(len(files[f]), dtype=np.int64) for f in FILES}  # per byte: asked by each box alone
    for b in case["boxes"]:
        fb = _file_box(b["file"], key_at[b["file"]], shape, dtype, b["box"])
        out_dtype = _cast_dtype(dtype) if b["cast"] else dtype
        target, dest = _dest(fb.sizes, out_dtype, b["order"], b["pad"], b["at"])
        plan.append((fb, dest, b["how"]))
        targets.append(target)
        dests.append(dest)
        expected.append(keys[b["file"]][b["box"]].to(out_dtype))
        # the box's own bytes, from a torch view of the file, and its span
        begin = data_start[b["file"]] + fb.offset
        own = np.zeros(len(files[b["file"]]), dtype=np.int64)
        pos = torch.arange(len(own)).as_strided((*fb.sizes, dtype.itemsize), (*fb.strides, 1), begin)
        own[pos.reshape(-1).numpy()] = 1
        span = np.zeros_like(own)
        span[begin:begin + fb.span] = 1
        pieces = plan_landing([(fb, torch.empty(fb.sizes, dtype=dtype), b["how"])], data_start, slot_bytes)
        asked = _asked(pieces, len(own), b["file"])
        if len(shape) == 1:  # one run cut at pages of the file: O_DIRECT reads each page once
            ends = [max(off + n for off, _, n in p.reads) for p in pieces]
            assert all(end % ALIGN == 0 for end in ends[:-1]), ends
            event(f"a 1-D run cut: {len(ends) > 1}")
        if b["how"] == "runs":
            assert np.array_equal(asked, own), "runs: the reads do not ask exactly the box's bytes"
        elif fb.span <= slot_bytes - 2 * ALIGN:
            assert np.array_equal(asked, span), "the reads do not ask exactly the box's span"
        else:  # cut into parts, each read as its own span: every byte of the box, nothing outside its span, once
            assert np.all(own <= asked) and np.all(asked <= span), "a span cut into parts reads the wrong bytes"
        alone[b["file"]] += asked

    pieces = plan_landing(plan, data_start, slot_bytes, case["packed"])
    event(f"pieces > boxes: {len(pieces) > len(plan)}")
    event(f"a solid piece: {any(p.solid for p in pieces)}")
    event(f"a piece of several parts: {any(len(p.parts) > 1 for p in pieces)}")
    event(f"a solid piece of several parts: {any(p.solid and len(p.parts) > 1 for p in pieces)}")

    owner = {t.untyped_storage().data_ptr(): i for i, t in enumerate(targets)}
    cover = [torch.zeros(t.numel(), dtype=torch.int64) for t in targets]
    garbage = torch.randint(0, 256, (slot_bytes,), generator=g, dtype=torch.uint8)
    for piece in pieces:
        _check_piece_shape(piece, slot_bytes)
        file = files[piece.file]
        slot = garbage.clone()
        for off, at, n in piece.reads:
            assert off + n <= len(file)
            slot[at:at + n] = file[off:off + n]
        direct = None
        if piece.solid is not None:  # what O_DIRECT lays in the slot: the aligned cover, from the slot's start
            low = piece.solid[0] // ALIGN * ALIGN
            high = min(-(-piece.solid[1] // ALIGN) * ALIGN, len(file))
            direct = garbage.clone()
            direct[:high - low] = file[low:high]
        for p in piece.parts:
            i = owner[p.dest.untyped_storage().data_ptr()]
            b = case["boxes"][i]
            assert b["file"] == piece.file and p.dtype == dtype and p.dest.dtype == dests[i].dtype
            assert not (b["how"] == "shared" and piece.solid is not None), "a shared box in a solid piece"
            cover[i].as_strided(p.dest.shape, p.dest.stride(), p.dest.storage_offset()).add_(1)
            source = slot[p.at:p.at + p.nbytes].view(p.dtype).as_strided(p.sizes, p.strides)
            p.dest.copy_(source)
            if direct is not None:
                assert torch.equal(_bits(direct[p.at:p.at + p.nbytes].view(p.dtype).as_strided(p.sizes, p.strides)),
                                   _bits(source))
    for f in FILES:  # packed together, the boxes read what each reads alone
        assert np.array_equal(_asked(pieces, len(files[f]), f), alone[f]), f
    for i, (target, dest) in enumerate(zip(targets, dests)):
        once = torch.zeros(target.numel(), dtype=torch.int64)
        once.as_strided(dest.shape, dest.stride(), dest.storage_offset()).fill_(1)
        assert torch.equal(cover[i], once), f"box {i}: not every element covered exactly once"
        assert torch.equal(_bits(dest), _bits(expected[i])), f"box {i} ({case['boxes'][i]['how']})"


def test_plan_landing_refuses_a_small_slot_and_a_dest_of_another_shape() -> None:
    fb = FileBox("a.safetensors", 0, (4, 4), (16, 4), torch.float32)
    with pytest.raises(ValueError, match="too small"):
        plan_landing([(fb, torch.zeros(4, 4), "runs")], {"a.safetensors": 8}, 3 * ALIGN - ALIGN)
    with pytest.raises(ValueError, match="cannot land"):
        plan_landing([(fb, torch.zeros(4, 5), "runs")], {"a.safetensors": 8}, 3 * ALIGN)
    with pytest.raises(ValueError, match="expected runs, span or shared"):
        plan_landing([(fb, torch.zeros(4, 4), "all")], {"a.safetensors": 8}, 3 * ALIGN)


def _small_boxes(files: list[str], rows: int = 4, cols: int = 256) -> list[tuple[FileBox, torch.Tensor, str]]:
    """A float32 box of ``rows`` x ``cols`` per entry of ``files``, each at its own offset (4 KiB apart, gaps between),
    landing in a tensor of its own."""
    return [(FileBox(f, 2 * ALIGN * i, (rows, cols), (cols * 4, 4), torch.float32), torch.empty(rows, cols), "span")
            for i, f in enumerate(files)]


def test_a_packed_file_keeps_its_piece_open_across_boxes_of_other_files() -> None:
    """Six 4 KiB boxes alternating between two files. Unpacked, each file change ends a piece: six pieces. Packed,
    each file keeps one piece open: two pieces of three parts, each part where the file's bytes are."""
    boxes = _small_boxes(["a.safetensors", "b.safetensors"] * 3)
    starts = {"a.safetensors": 64, "b.safetensors": 128}
    assert [len(p.parts) for p in plan_landing(boxes, starts, 64 * ALIGN)] == [1] * 6
    pieces = plan_landing(boxes, starts, 64 * ALIGN, packed=FILES)
    assert [(p.file, len(p.parts)) for p in pieces] == [("a.safetensors", 3), ("b.safetensors", 3)]
    for p in pieces:
        assert [off for off, _, _ in p.reads] == [starts[p.file] + 2 * ALIGN * i for i in (
            (0, 2, 4) if p.file == "a.safetensors" else (1, 3, 5))]
    only_a = plan_landing(boxes, starts, 64 * ALIGN, packed=("a.safetensors",))  # b's end each other, not a's
    assert sorted((p.file, len(p.parts)) for p in only_a) == [("a.safetensors", 3)] + [("b.safetensors", 1)] * 3


def test_a_large_solid_piece_is_joined_by_other_parts_only_in_a_packed_file() -> None:
    """A 2 MiB box (solid: O_DIRECT-able, above ``_KEEP_SOLID``), then a 4 KiB box 8 KiB after it: unpacked, the
    second starts its own piece (the first stays solid); packed, it joins the first, which is solid no more."""
    big = FileBox("a.safetensors", 0, (512, 1024), (4096, 4), torch.float32)
    small = FileBox("a.safetensors", (2 << 20) + 2 * ALIGN, (1024,), (4,), torch.float32)
    boxes = [(big, torch.empty(512, 1024), "span"), (small, torch.empty(1024), "span")]
    starts = {"a.safetensors": ALIGN}
    unpacked = plan_landing(boxes, starts, 1024 * ALIGN)
    assert [(len(p.parts), p.solid) for p in unpacked] == [
        (1, (ALIGN, ALIGN + (2 << 20))), (1, (ALIGN + (2 << 20) + 2 * ALIGN, (2 << 20) + 4 * ALIGN))]
    packed = plan_landing(boxes, starts, 1024 * ALIGN, packed=FILES)
    assert [(len(p.parts), p.solid) for p in packed] == [(2, None)]
    assert [(off, n) for off, _, n in packed[0].reads] == [(ALIGN, 2 << 20), ((2 << 20) + 3 * ALIGN, ALIGN)]


@pytest.mark.parametrize(("direct", "share", "packed"), [
    (False, 0.0, True),  # no O_DIRECT at all: nothing to keep a piece solid for
    (True, 1.0, False),  # always O_DIRECT
    ("auto", 1.0, True),  # cached
    ("auto", 0.95, True),
    ("auto", 0.5, False),  # partly cached: a cold read may want O_DIRECT
    ("auto", None, True),  # mincore cannot tell: auto reads through the page cache
])
def test_a_reader_packs_the_files_it_reads_through_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  direct, share, packed: bool) -> None:
    _check_packing(tmp_path, monkeypatch, direct, share, packed)


@pytest.mark.parametrize("direct", [True, "auto"])
def test_a_reader_packs_every_file_where_o_direct_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             direct) -> None:
    """No O_DIRECT on this platform: every read goes through the page cache, so every file is packed, even with
    ``direct=True`` and no page cached."""
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    _check_packing(tmp_path, monkeypatch, direct, 0.0, True)


def _check_packing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct, share, packed: bool) -> None:
    """A reader of two files' boxes (``direct``; ``mincore`` answering ``share``) plans with both files packed or
    neither, and lands every box bit for bit."""
    tensors = _tensors(5)
    _save_two_files(tmp_path, tensors)
    index = read_checkpoint(tmp_path)
    entries = _entries(index, tensors, 5, per_key=0)
    monkeypatch.setattr("workbench.io.files.box_reads._PageMap.share", lambda self, *a, **k: share)
    seen: list[tuple[str, ...]] = []
    real = landing.plan_landing

    def spy(boxes, data_start, slot_bytes, packed=()):
        seen.append(tuple(sorted(packed)))
        return real(boxes, data_start, slot_bytes, packed)

    monkeypatch.setattr(landing, "plan_landing", spy)
    landing._KEPT.clear()
    ring = StagingRing(4, 64 << 10, pinned=False)
    with BoxReader(index, [(fb, dest) for fb, dest, _ in entries], device="cpu", ring=ring, threads=2,
                   direct=direct) as r:
        assert _within(20, r.finish) is None
    files = tuple(sorted({fb.file for fb, _, _ in entries}))
    assert seen == [files if packed else ()]
    for fb, dest, want in entries:
        assert torch.equal(_bits(dest), _bits(want)), fb


# -- BoxReader's landing on the CPU seam -----------------------------------------------------------------------------


def _save_two_files(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` in two safetensors files with an HF index json."""
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in files.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {k: f for f, keys in files.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    out = {}
    for i in range(8):
        dtype = DTYPES[i % len(DTYPES)]
        shape = [tuple([rng.randint(1, 9000)]), (rng.randint(1, 300), rng.randint(1, 300)),
                 (rng.randint(1, 30), rng.randint(1, 30), rng.randint(1, 40))][i % 3]
        out[f"k{i}"] = torch.randint(0, 256, (*shape, dtype.itemsize), generator=g,
                                     dtype=torch.uint8).view(dtype).reshape(shape)
    out["big"] = torch.randn(70_000, generator=g)  # 280 KB: more than the largest slot
    return out


def _entries(index, tensors: dict[str, torch.Tensor], seed: int, per_key: int = 3
             ) -> list[tuple[FileBox, torch.Tensor, torch.Tensor]]:
    """Random boxes of every key (the whole key first), each with a strided zero destination (its dtype or a cast)
    and its expected value from torch indexing of the saved tensor."""
    rng = random.Random(seed)
    out = []
    for key, t in tensors.items():
        info = index.keys[key]
        shape = tuple(t.shape)
        for j in range(per_key + 1):
            box = tuple(slice(0, n) for n in shape)
            if j:
                box = tuple(slice(a, rng.randint(a + 1, n)) for n in shape for a in [rng.randint(0, n - 1)])
            fb = _file_box(info.file, info.data_offsets[0], shape, t.dtype, box)
            out_dtype = _cast_dtype(t.dtype) if rng.random() < 0.4 else t.dtype
            order = list(range(len(shape)))
            rng.shuffle(order)
            pad = [rng.randint(0, 2) for _ in shape]
            _, dest = _dest(fb.sizes, out_dtype, order, pad, [rng.randint(0, p) for p in pad])
            out.append((fb, dest, t[box].to(out_dtype)))
    return out


@pytest.mark.parametrize("slot_bytes", [3 * ALIGN, 16 << 10, 256 << 10])
def test_boxes_land_bit_for_bit_through_the_cpu_seam(tmp_path: Path, slot_bytes: int) -> None:
    tensors = _tensors(slot_bytes)
    _save_two_files(tmp_path, tensors)
    index = read_checkpoint(tmp_path)
    entries = _entries(index, tensors, slot_bytes)
    fb0, _, want0 = entries[1]  # the same box twice, into another tensor: handed back in order
    entries.append((fb0, torch.zeros(fb0.sizes, dtype=want0.dtype), want0))
    ring = StagingRing(4, slot_bytes, pinned=False)
    with BoxReader(index, [(fb, dest) for fb, dest, _ in entries], device="cpu", ring=ring, threads=4,
                   direct=False) as r:
        for fb, dest, _ in entries:
            assert r.read(fb) is dest
        assert _within(20, r.finish) is None
        assert r.bytes_read == sum(fb.nbytes for fb, _, _ in entries)
        assert r.bytes_fetched >= r.bytes_read
    assert all_slots_free(ring)
    for i, (fb, dest, want) in enumerate(entries):
        assert torch.equal(_bits(dest), _bits(want)), (i, fb, dest.dtype)


class _Preadv:
    """``os.preadv``, counted; the ``fail``-th call raises EIO, every call first sleeps ``delay`` seconds."""

    def __init__(self, fail: int = 0, delay: float = 0.0) -> None:
        self.real = os.preadv
        self.fail, self.delay = fail, delay
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, fd: int, buffers: object, offset: int, *flags: int) -> int:
        with self.lock:
            self.calls += 1
            n = self.calls
        if self.delay:
            time.sleep(self.delay)
        if n == self.fail:
            raise OSError(errno.EIO, "injected read failure")
        return self.real(fd, buffers, offset, *flags)


def _one_file(folder: Path, numel: int = 40 * 1024) -> tuple[torch.Tensor, str]:
    """One key of ``numel`` float32 in ``model.safetensors``: with 3-page slots, one page a piece."""
    w = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    save_file({"w": w}, str(folder / "model.safetensors"))
    return w, "model.safetensors"


def _row_entries(index, w: torch.Tensor, rows: int) -> list[tuple[FileBox, torch.Tensor]]:
    """``w`` as ``rows`` boxes of one row each, into zero tensors."""
    info = index.keys["w"]
    n = w.numel() // rows
    return [(FileBox(info.file, info.data_offsets[0] + i * n * 4, (n,), (4,), torch.float32), torch.zeros(n))
            for i in range(rows)]


def test_a_failed_read_mid_landing_is_raised_by_finish_naming_the_file(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    w, file = _one_file(tmp_path)
    index = read_checkpoint(tmp_path)
    entries = _row_entries(index, w, 20)
    count = _Preadv()
    monkeypatch.setattr(os, "preadv", count)
    ring = StagingRing(4, 3 * ALIGN, pinned=False)
    with BoxReader(index, entries, device="cpu", ring=ring, threads=4, direct=False) as r:
        assert _within(20, r.finish) is None
    total = count.calls
    assert total >= 20, total  # one read a piece at least

    faulty = _Preadv(fail=total // 2)
    monkeypatch.setattr(os, "preadv", faulty)
    with BoxReader(index, entries, device="cpu", ring=ring, threads=4, direct=False) as r:
        early = None
        try:  # a read copies out every piece read so far: the failed one may come in with the first reads already
            for fb, dest in entries[:3]:
                assert r.read(fb) is dest
        except CheckpointError as failed:
            early = failed
        exc = _within(20, r.finish)
        assert isinstance(exc, CheckpointError), exc
        assert early is None or early is exc  # raised by a read, then by finish: the same failure
        assert file in str(exc) and "injected read failure" in str(exc)
        assert _within(20, r.finish) is exc  # again: the same failure, at once
    assert faulty.calls < total  # the landing stopped: what was not started was not read
    assert all_slots_free(ring)


def test_read_after_a_failure_raises_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w, file = _one_file(tmp_path)
    index = read_checkpoint(tmp_path)
    entries = _row_entries(index, w, 20)
    monkeypatch.setattr(os, "preadv", _Preadv(fail=2))
    ring = StagingRing(2, 3 * ALIGN, pinned=False)
    with BoxReader(index, entries, device="cpu", ring=ring, threads=2, direct=False) as r:
        exc = _within(20, r.finish)
        assert isinstance(exc, CheckpointError) and file in str(exc)
        with pytest.raises(CheckpointError) as raised:
            r.read(entries[0][0])
        assert raised.value is exc
        with pytest.raises(CheckpointError):
            r.read(entries[-1][0])
    assert all_slots_free(ring)


def test_a_truncated_file_is_a_short_read(tmp_path: Path) -> None:
    w, file = _one_file(tmp_path)
    index = read_checkpoint(tmp_path)
    path = tmp_path / file
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)
    entries = _row_entries(index, w, 20)
    ring = StagingRing(4, 3 * ALIGN, pinned=False)
    with pytest.raises(CheckpointError, match="rewritten in place since its header was read"):
        BoxReader(index, entries, device="cpu", ring=ring, threads=4, direct=False)  # seen at open, before any read
    assert all_slots_free(ring)
    unrecorded = dataclasses.replace(index, file_ids={})  # without that record the reads come up short
    with BoxReader(unrecorded, entries, device="cpu", ring=ring, threads=4, direct=False) as r:
        exc = _within(20, r.finish)
        assert isinstance(exc, CheckpointError), exc
        assert re.search(rf"{re.escape(file)}: short read at byte \d+", str(exc)), str(exc)
    assert all_slots_free(ring)


def test_close_while_landing_returns_promptly_and_frees_every_slot(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    w, _ = _one_file(tmp_path, numel=100 * 1024)
    index = read_checkpoint(tmp_path)
    entries = _row_entries(index, w, 100)
    slow = _Preadv(delay=0.02)
    monkeypatch.setattr(os, "preadv", slow)
    ring = StagingRing(4, 3 * ALIGN, pinned=False)
    r = BoxReader(index, entries, device="cpu", ring=ring, threads=4, direct=False)
    deadline = time.monotonic() + 5
    while not slow.calls and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.03)
    assert 0 < slow.calls < 100  # in flight
    t0 = time.monotonic()
    assert _within(5, r.close) is None
    assert time.monotonic() - t0 < 1.0
    after = slow.calls
    time.sleep(0.1)
    assert slow.calls == after  # nothing reads once close returned
    assert after < 100
    assert all_slots_free(ring)


# -- O_DIRECT --------------------------------------------------------------------------------------------------------


disk = box_reads_tests.disk  # the fixture: a directory on a disk that does O_DIRECT reads


def test_large_contiguous_boxes_land_with_o_direct(disk: Path) -> None:
    folder = disk / "direct"
    folder.mkdir()
    g = torch.Generator().manual_seed(5)
    big = torch.randn(300_000, generator=g)
    mid = torch.randn(1000, 777, generator=g).to(torch.bfloat16)
    save_file({"big": big, "mid": mid}, str(folder / "model.safetensors"))
    index = read_checkpoint(folder)
    boxes = [("big", big, (slice(0, 300_000),), torch.float32), ("big", big, (slice(4099, 200_001),), torch.float32),
             ("mid", mid, (slice(100, 900), slice(0, 777)), torch.bfloat16),
             ("mid", mid, (slice(3, 700), slice(0, 777)), torch.float32)]
    entries = []
    for key, t, box, out_dtype in boxes:
        info = index.keys[key]
        fb = _file_box(info.file, info.data_offsets[0], tuple(t.shape), t.dtype, box)
        _, dest = _dest(fb.sizes, out_dtype, list(range(len(box)))[::-1], [1] * len(box), [1] * len(box))
        if out_dtype == t.dtype:
            dest = torch.zeros(fb.sizes, dtype=out_dtype)  # contiguous: one copy from the slot straight in
        entries.append((fb, dest, t[box].to(out_dtype)))
    ring = StagingRing(4, 256 << 10, pinned=False)
    with BoxReader(index, [(fb, dest) for fb, dest, _ in entries], device="cpu", ring=ring, threads=4,
                   direct=True) as r:
        for fb, dest, _ in entries:
            assert r.read(fb) is dest
        assert _within(20, r.finish) is None
        assert r.bytes_direct > 0 and not r.direct_refused
        assert r.bytes_direct >= sum(fb.nbytes for fb, _, _ in entries) // 2
    assert all_slots_free(ring)
    for i, (fb, dest, want) in enumerate(entries):
        assert torch.equal(_bits(dest), _bits(want)), (i, fb)


def test_a_key_at_an_offset_its_elements_do_not_divide_lands_exactly(tmp_path: Path) -> None:
    """Other writers need not align a key's data: 3 bytes of U8, then F32 at byte 3 of the data. The packer does not
    continue the solid range into a place its elements straddle; the F32 part is padded to its own alignment."""
    a = torch.tensor([7, 8, 9], dtype=torch.uint8)
    b = torch.tensor([1.0, 2.0, 3.0, 4.0])
    header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "b": {"dtype": "F32", "shape": [4], "data_offsets": [3, 19]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + a.numpy().tobytes()
                                                 + b.numpy().tobytes())
    index = read_checkpoint(tmp_path)
    entries = []
    for key, want in (("a", a), ("b", b)):
        info = index.keys[key]
        entries.append((FileBox(info.file, info.data_offsets[0], tuple(want.shape), (want.element_size(),),
                                want.dtype), torch.zeros_like(want)))
    pieces = plan_landing([(fb, dest, "runs") for fb, dest in entries], {"model.safetensors": 8 + len(text)},
                          3 * ALIGN)
    assert all(p.at % p.dtype.itemsize == 0 for piece in pieces for p in piece.parts)
    ring = StagingRing(2, 3 * ALIGN, pinned=False)
    with BoxReader(index, entries, device="cpu", ring=ring, threads=2, direct=False) as r:
        for fb, _ in entries:
            r.read(fb)
        r.finish()
    assert torch.equal(entries[0][1], a) and torch.equal(entries[1][1], b)


def test_a_part_off_its_element_size_is_refused_not_read_shifted() -> None:
    """The guard behind the packer: a part whose slot offset its elements do not divide is an error naming it."""
    from workbench.io.files.box_reads import _place
    from workbench.io.files.landing import LandingPart

    typed = torch.zeros(64, dtype=torch.uint8).view(torch.float32)
    part = LandingPart(6, 16, (4,), (1,), torch.float32, torch.zeros(4))
    with pytest.raises(CheckpointError, match=r"landing part of torch.float32 at byte 6 of its slot is not at a "
                                              r"multiple of its element size"):
        _place(typed, part)
    assert _place(typed, LandingPart(8, 16, (4,), (1,), torch.float32, torch.zeros(4))).storage_offset() == 2


def test_a_box_read_without_a_tensor_among_landing_boxes_does_not_wait_forever_for_a_slot(tmp_path: Path) -> None:
    """Landing pieces take every free slot as soon as the reader starts, and give them back only when the loading
    thread copies them out. A box read through the ring into a buffer (no tensor to land in: a key an adapter reads
    whole, a padded parameter) then needs a slot: the reader must copy landing pieces out to free one, not wait
    for a slot only it could give back."""
    w, _ = _one_file(tmp_path)
    index = read_checkpoint(tmp_path)
    entries = _row_entries(index, w, 20)
    info = index.keys["w"]
    n = w.numel() // 20
    staged = FileBox(info.file, info.data_offsets[0] + 3 * n * 4, (2 * n,), (4,), torch.float32)  # rows 3 and 4
    expected = [*entries[:10], staged, *entries[10:]]
    ring = StagingRing(2, 3 * ALIGN, pinned=False)

    def run() -> None:
        with BoxReader(index, expected, device="cpu", ring=ring, threads=4, direct=False) as r:
            got = r.read(staged)  # before any landing box is asked for: every slot holds a landing piece
            assert torch.equal(got, w[3 * n:5 * n])
            for fb, dest in entries:
                assert r.read(fb) is dest
            r.finish()

    assert _within(20, run) is None
    assert all_slots_free(ring)
    for i, (_, dest) in enumerate(entries):
        assert torch.equal(dest, w[i * n:(i + 1) * n]), i


def _land(index, entries: list[tuple[FileBox, torch.Tensor]], ring: StagingRing) -> None:
    with BoxReader(index, entries, device="cpu", ring=ring, threads=4, direct=False) as r:
        assert _within(20, r.finish) is None


def test_a_repeat_landing_plans_nothing_and_lands_in_the_tensors_given_now(tmp_path: Path) -> None:
    """The second load of the same boxes into tensors of the same geometry takes the kept plan (a hit of the memo,
    no ``plan_landing`` call) and lands every box in the new tensors, not in the first ones (which the memo must
    not keep alive either); a tensor of other strides is planned afresh."""
    w = torch.randn(64, 1024, generator=torch.Generator().manual_seed(3))
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    index = read_checkpoint(tmp_path)
    info = index.keys["w"]

    def entries(transposed: bool = False) -> list[tuple[FileBox, torch.Tensor]]:
        out = []
        for i in range(0, 64, 8):  # 8 rows a box, each into a tensor of its own (transposed: column-major)
            fb = FileBox(info.file, info.data_offsets[0] + i * 4096, (8, 1024), (4096, 4), torch.float32)
            dest = torch.zeros(1024, 8).t() if transposed else torch.zeros(8, 1024)
            out.append((fb, dest))
        return out

    ring = StagingRing(4, 16 << 10, pinned=False)
    calls = []
    real = landing.plan_landing

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    landing._KEPT.clear()
    first = entries()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(landing, "plan_landing", counted)
        _land(index, first, ring)
        assert len(calls) == 1
        gone = [weakref.ref(dest) for _, dest in first]
        del first
        second = entries()
        _land(index, second, ring)
        assert len(calls) == 1 and landing._KEPT.hits == 1  # kept: not planned again
        assert all(ref() is None for ref in gone)  # the memo holds no view of the first tensors
        for i, (_, dest) in enumerate(second):
            assert torch.equal(dest, w[8 * i:8 * i + 8]), i
        third = entries(transposed=True)
        _land(index, third, ring)
        assert len(calls) == 2  # other strides: planned afresh
        for i, (_, dest) in enumerate(third):
            assert torch.equal(dest, w[8 * i:8 * i + 8]), i
    assert all_slots_free(ring)


class _Concurrent:
    """``os.preadv`` that sleeps ``delay`` seconds first, counting the most calls in flight at once."""

    def __init__(self, delay: float) -> None:
        self.real, self.delay = os.preadv, delay
        self.now = self.most = 0
        self.lock = threading.Lock()

    def __call__(self, fd: int, buffers: object, offset: int, *flags: int) -> int:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(self.delay)
            return self.real(fd, buffers, offset, *flags)
        finally:
            with self.lock:
                self.now -= 1


def test_a_box_read_into_a_buffer_reads_ahead_while_landed_pieces_wait_for_their_copies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Landing pieces whose reads ended keep their slots until the loading thread copies them out (a load asks for no
    landing box, so nothing else does): a box read into a buffer must copy them out to read its own pieces several
    at a time, not one slot freed per piece and each read waited for before the next starts."""
    w = torch.randn(64 * 2048, generator=torch.Generator().manual_seed(1))
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    index = read_checkpoint(tmp_path)
    info = index.keys["w"]
    n = 2048
    landing_boxes = [(FileBox(info.file, info.data_offsets[0] + i * n * 4, (n,), (4,), torch.float32),
                      torch.zeros(n)) for i in range(32, 64)]
    staged = FileBox(info.file, info.data_offsets[0], (16 * n,), (4,), torch.float32)  # 128 KiB: 11 pieces
    slow = _Concurrent(0.02)
    monkeypatch.setattr(os, "preadv", slow)
    ring = StagingRing(8, 3 * ALIGN, pinned=False)
    with BoxReader(index, [*landing_boxes, staged], device="cpu", ring=ring, threads=8, direct=False) as r:
        deadline = time.monotonic() + 20
        while r._land_ended.qsize() < ring.slots and time.monotonic() < deadline:  # every slot: a landed piece
            time.sleep(0.01)
        slow.most = 0
        assert torch.equal(r.read(staged), w[:16 * n])
        assert slow.most >= 2, slow.most  # read ahead, not one piece at a time
        assert _within(20, r.finish) is None
    assert all_slots_free(ring)
    for i, (_, dest) in enumerate(landing_boxes):
        assert torch.equal(dest, w[(32 + i) * n:(33 + i) * n]), i
