"""Fuzzed headers and indexes: inspect and diff never crash, they report findings (or 'could not read')."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.debug.corpus import model, write
from workbench.debug import KINDS, diff_checkpoints, inspect_checkpoint
from workbench.io.index import INDEX_NAME

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_entry = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "BF16", "I8", "F4", "XX"]) | _json,
    "shape": st.lists(st.integers(-2, 2**40), max_size=3) | _json,
    "data_offsets": st.lists(st.integers(-4, 2**62), min_size=0, max_size=3) | _json,
})
_header = st.dictionaries(st.text(max_size=10), _entry | _json, max_size=4)


def _check(path: Path) -> None:
    ins = inspect_checkpoint(path)
    assert all(f.kind in KINDS for f in ins.findings)
    assert ins.exit_status in (0, 1, 2)
    ins.to_text()
    ins._repr_html_()
    json.dumps(ins.to_dict())


@settings(max_examples=60)
@given(header=_header, claimed=st.none() | st.integers(0, 2**64 - 1), data=st.binary(max_size=64))
def test_fuzzed_safetensors_header(header, claimed, data) -> None:
    raw = json.dumps(header).encode()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.safetensors"
        length = len(raw) if claimed is None else claimed
        path.write_bytes(struct.pack("<Q", length) + raw + data)
        _check(path)
        report = diff_checkpoints(path, path)
        assert report.exit_status in (0, 1, 2)


@settings(max_examples=40)
@given(blob=st.binary(max_size=80))
def test_random_bytes_file(blob) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.safetensors"
        path.write_bytes(blob)
        _check(path)


@settings(max_examples=40)
@given(weight_map=st.dictionaries(st.text(max_size=8), st.text(max_size=12) | _json, max_size=5),
       metadata=_json, drop=st.booleans())
def test_fuzzed_index(weight_map, metadata, drop) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp) / "ck", model())
        good = json.loads((path / INDEX_NAME).read_text())
        body = {"metadata": metadata, "weight_map": {**({} if drop else good["weight_map"]), **weight_map}}
        (path / INDEX_NAME).write_text(json.dumps(body))
        _check(path)
        report = diff_checkpoints(path, path)
        assert report.exit_status in (0, 1, 2)


@settings(max_examples=20)
@given(text=st.text(max_size=40))
def test_index_not_json(text) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp) / "ck", model())
        (path / INDEX_NAME).write_text(text)
        _check(path)
