"""plan_transfers against a read-by-read copy: random keys laid out in a random file order with random gaps, random
boxes of them fused into one local tensor; moving every transfer's strided box must leave the very bytes that
copying each read's slice does (numpy on a byte array stands in for the file), and never span more than a piece."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.io.files.index import CheckpointIndex, KeyInfo
from workbench.io.files.transfers import plan_transfers
from workbench.plan.load_plan import KeyRead

DTYPES = {1: "U8", 2: "BF16", 4: "F32"}


@st.composite
def _case(draw: st.DrawFn):
    itemsize = draw(st.sampled_from(sorted(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    keys = draw(st.integers(1, 8))
    fused = draw(st.integers(0, len(shape) - 1))  # the keys are fused on this dim of the local tensor
    order = draw(st.permutations(range(keys)))  # the file's order of the keys
    gaps = draw(st.lists(st.sampled_from([0, 0, 0, 1, itemsize, 64]), min_size=keys, max_size=keys))
    reads = []
    for k in range(keys):
        if not draw(st.booleans()) and k:
            continue
        box = []
        for n in shape:
            a = draw(st.integers(0, n - 1))
            box.append((a, draw(st.integers(a + 1, n))))
        cut = box[0][0] + 1 < box[0][1] and draw(st.booleans())  # the key read as two boxes of its rows
        if cut:
            middle = draw(st.integers(box[0][0] + 1, box[0][1] - 1))
            reads += [(k, ((box[0][0], middle), *box[1:])), (k, ((middle, box[0][1]), *box[1:]))]
        else:
            reads.append((k, tuple(box)))
    if draw(st.booleans()):
        reads = draw(st.permutations(reads))
    return itemsize, shape, keys, fused, order, gaps, reads, draw(st.sampled_from([1, 7, 64, 1 << 20]))


@settings(max_examples=300, deadline=None)
@given(case=_case())
def test_transfers_move_exactly_the_bytes_of_the_reads(case) -> None:
    itemsize, shape, nkeys, fused, order, gaps, reads, piece_bytes = case
    key_bytes = math.prod(shape) * itemsize
    rng = np.random.default_rng(len(reads))
    infos, at = {}, 0
    for k, gap in zip(order, gaps):
        at += gap
        infos[f"k{k}"] = KeyInfo(f"k{k}", "f.safetensors", DTYPES[itemsize], shape, (at, at + key_bytes))
        at += key_bytes
    data = rng.integers(0, 256, at, dtype=np.uint8)
    index = CheckpointIndex(Path("/nowhere"), {k: "f.safetensors" for k in infos}, at, ("f.safetensors",), infos)
    local_shape = tuple(n * nkeys if d == fused else n for d, n in enumerate(shape))
    local_strides = tuple(math.prod(local_shape[d + 1:]) for d in range(len(shape)))
    plan = [KeyRead(f"k{k}", tuple(a for a, _ in box), tuple(b - a for a, b in box),
                    tuple(a + (k * shape[d] if d == fused else 0) for d, (a, _) in enumerate(box)))
            for k, box in reads]

    want = np.zeros(math.prod(local_shape) * itemsize, dtype=np.uint8)  # read by read
    view = want.reshape(*local_shape, itemsize)
    for r in plan:
        start = infos[r.hf_key].data_offsets[0]
        key = data[start:start + key_bytes].reshape(*shape, itemsize)
        src = key[tuple(slice(o, o + n) for o, n in zip(r.key_offset, r.sizes))]
        view[tuple(slice(o, o + n) for o, n in zip(r.local_offset, r.sizes))] = src

    transfers = plan_transfers(index, plan, local_strides, piece_bytes=piece_bytes)
    got = np.zeros_like(want)
    for t in transfers:
        fb = t.source
        assert fb.dtype.itemsize == itemsize
        src = np.lib.stride_tricks.as_strided(data[fb.offset:], (*fb.sizes, itemsize), (*fb.strides, 1))
        dst = np.lib.stride_tricks.as_strided(got[t.offset * itemsize:], (*fb.sizes, itemsize),
                                              (*(s * itemsize for s in t.strides), 1))
        assert not dst.any(), "a transfer wrote over another's bytes"
        dst[...] = src
        row = fb.span - (fb.sizes[0] - 1) * fb.strides[0]  # the bytes of one index of the leading dim
        assert fb.span <= max(piece_bytes, row), (fb, piece_bytes)
        for d in range(len(fb.sizes) - 1):  # nested: each dim steps past all of the dims inside it, both sides
            inner = list(zip(fb.sizes[d + 1:], fb.strides[d + 1:], t.strides[d + 1:]))
            assert fb.strides[d] >= sum((n - 1) * a for n, a, _ in inner) + itemsize, (fb, d)
            assert t.strides[d] >= sum((n - 1) * b for n, _, b in inner) + 1, (t, d)
    assert np.array_equal(got, want)
    if piece_bytes >= want.size:  # nothing to cut: stacking never makes more transfers than reads
        assert len(transfers) <= len(plan)


def test_fused_keys_one_step_apart_are_one_transfer() -> None:
    # 16 keys of [8, 4] float32 in fused order, back to back: a rank owning rows 2:6 of each reads 16 boxes that
    # are one box of 16 x 4 rows x 4 columns, 128 bytes apart in the file, 64 bytes apart in the local tensor
    infos = {f"k{k}": KeyInfo(f"k{k}", "f", "F32", (8, 4), (128 * k, 128 * (k + 1))) for k in range(16)}
    index = CheckpointIndex(Path("/nowhere"), {k: "f" for k in infos}, 2048, ("f",), infos)
    plan = [KeyRead(f"k{k}", (2, 0), (4, 4), (4 * k, 0)) for k in range(16)]
    (t,) = plan_transfers(index, plan, (4, 1))
    assert (t.source.offset, t.source.sizes, t.source.strides) == (32, (16, 16), (128, 4))
    assert (t.offset, t.strides, t.key, t.keys) == (0, (16, 1), "k0", 16)
