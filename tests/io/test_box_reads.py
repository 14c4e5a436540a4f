"""BoxReader against safetensors' own slicing: every box of every dtype, bit for bit, in and out of order."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from workbench.errors import CheckpointError
from workbench.io.box_reads import BoxReader, box_runs
from workbench.io.index import read_checkpoint

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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_boxes(), dtypes=st.lists(st.sampled_from(DTYPES), min_size=3, max_size=3), order=st.randoms())
def test_boxes_match_safetensors_bit_for_bit(tmp_path: Path, case, dtypes, order) -> None:
    shape, boxes = case
    folder = tmp_path / f"ck{abs(hash((shape, tuple(dtypes)))) % 10**9}"
    folder.mkdir(exist_ok=True)
    tensors = {f"k{i}": _tensor(shape, d, i) for i, d in enumerate(dtypes)}
    save_file(tensors, str(folder / "model.safetensors"))
    expected = [(k, b) for k in tensors for b in boxes]
    asked = list(expected)
    if order.random() < 0.5:  # out of the expected order: still served, by reads of their own
        order.shuffle(asked)
    with BoxReader(read_checkpoint(folder), expected, threads=3, budget_bytes=order.choice([1, 64, 1 << 20])) as r, \
            safe_open(str(folder / "model.safetensors"), "pt") as ref:
        for key, box in asked:
            got = r.read(key, box)
            want = ref.get_tensor(key) if box is None else ref.get_slice(key)[box] if box else ref.get_tensor(key)
            assert got.dtype == want.dtype and got.shape == want.shape, (key, box)
            assert torch.equal(_bytes(got), _bytes(want)), (key, box)


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


def test_a_truncated_file_is_a_checkpoint_error(tmp_path: Path) -> None:
    save_file({"w": torch.ones(1024, 1024)}, str(tmp_path / "model.safetensors"))
    index = read_checkpoint(tmp_path)
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "model.safetensors") - 1000)
    with BoxReader(index, [("w", None)]) as r, pytest.raises(CheckpointError, match="short read"):
        r.read("w")
