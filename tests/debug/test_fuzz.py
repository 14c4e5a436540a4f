"""Fuzzed and hostile headers and indexes: inspect and diff report findings (or 'could not read'), and the
loader's reader, ``validate_final`` and ``latest_checkpoint`` raise ``CheckpointError`` or list the problem;
no other exception escapes any of them."""

from __future__ import annotations

import json
import math
import re
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.debug.corpus import model, write
from workbench import latest_checkpoint
from workbench.debug import KINDS, diff_checkpoints, inspect_checkpoint
from workbench.errors import CheckpointError
from workbench.io.files import limits
from workbench.io.files.index import INDEX_NAME, read_checkpoint
from workbench.io.files.publish import validate_final
from workbench.io.files.read import CheckpointReader

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
# numbers that broke the parsers: json.dumps writes inf/nan as Infinity/NaN; ints past u64; whole floats; booleans
_hostile = st.sampled_from([math.inf, -math.inf, math.nan, 1e300, 2**64, 2**64 - 1, 10**400, -1, 4.0, 2.5, True])
_entry = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "BF16", "I8", "F4", "XX"]) | _json,
    "shape": st.lists(st.integers(-2, 2**40) | _hostile, max_size=3) | _json,
    "data_offsets": st.lists(st.integers(-4, 2**62) | _hostile, min_size=0, max_size=3) | _json,
})
_header = st.dictionaries(st.text(max_size=10), _entry | _json, max_size=4)


def _check(path: Path) -> None:
    ins = inspect_checkpoint(path)
    assert all(f.kind in KINDS for f in ins.findings)
    assert ins.exit_status in (0, 1, 2)
    ins.to_text()
    ins._repr_html_()
    json.dumps(ins.to_dict())
    try:  # the loader's parser: a readable checkpoint or a CheckpointError, nothing else
        CheckpointReader(path).close()
    except CheckpointError:
        pass
    problems = validate_final(path)
    assert all(isinstance(p, str) for p in problems)
    if path.is_dir():
        assert latest_checkpoint(path.parent).path in (None, path)


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
       metadata=st.fixed_dictionaries({"total_size": _hostile | _json}) | _json, drop=st.booleans())
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


# Hostile files: each names the entry point's expected words. Every case is built by editing the raw bytes of
# a healthy checkpoint (Infinity and NaN are what Python's json.dumps writes for inf and nan).


def _edit_index_text(path: Path, edit: Callable[[str], str]) -> None:
    index = path / INDEX_NAME
    index.write_text(edit(index.read_text()))


def _total_size(literal: str) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        _edit_index_text(path, lambda t: t.replace('"total_size": ', f'"total_size": {literal}, "was": ', 1))
    return edit


def _nest(depth: int) -> str:
    return "[" * depth + "]" * depth


def _first_file(path: Path) -> Path:
    return sorted(path.glob("*.safetensors"))[0]


def _set_header_text(path: Path, edit: Callable[[str], str]) -> None:
    """Rewrite the first file's header text through ``edit``, keeping its data bytes."""
    file = _first_file(path)
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = edit(raw[8 : 8 + n].decode()).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _offsets(literal: str) -> Callable[[Path], None]:
    """Write ``literal`` as the first header entry's data_offsets, verbatim."""
    def apply(path: Path) -> None:
        first = re.compile(r'"data_offsets":\[[0-9]+,[0-9]+\]')
        _set_header_text(path, lambda t: first.sub(f'"data_offsets":{literal}', t, count=1))
    return apply


def _index_field(text: str) -> Callable[[Path], None]:
    """Put ``text`` (a ``"name": value`` pair) first in the index's metadata."""
    return lambda path: _edit_index_text(path, lambda t: t.replace('"total_size"', f'{text}, "total_size"', 1))


def _header_field(text: str) -> Callable[[Path], None]:
    """Put ``text`` (a ``"name": value`` pair) first in the first file's header."""
    return lambda path: _set_header_text(path, lambda t: t.replace("{", "{" + text + ",", 1))


def _set_length(file: Path, claimed: int) -> None:
    file.write_bytes(struct.pack("<Q", claimed) + file.read_bytes()[8:])


def _entry(key: str, edit: Callable[[dict], None]) -> Callable[[Path], None]:
    """Edit one key's header entry (dtype, shape, data_offsets) as a dict, written back with json.dumps."""
    def apply(path: Path) -> None:
        def rewrite(text: str) -> str:
            header = json.loads(text)
            edit(header[key])
            return json.dumps(header)
        _set_header_text(path, rewrite)
    return apply


EMBED = "model.embed_tokens.weight"  # BF16 [16, 8]: 256 bytes, the first key of the only file

HOSTILE: list[tuple[str, Callable[[Path], None], str, str]] = [
    # (case, edit of the checkpoint folder, Finding kind, words of the problem)
    ("total_size Infinity", _total_size("Infinity"), "index_inconsistent", "Infinity"),
    ("total_size -Infinity", _total_size("-Infinity"), "index_inconsistent", "Infinity"),
    ("total_size NaN", _total_size("NaN"), "index_inconsistent", "NaN"),
    ("total_size 1e400", _total_size("1e400"), "index_inconsistent", "overflows to infinity"),
    ("total_size 5000 digits", _total_size("1" + "0" * 5000), "index_inconsistent", "thousands of digits"),
    ("total_size 2**64", _total_size(str(2**64)), "index_inconsistent", "not an integer byte count"),
    ("total_size negative", _total_size("-1"), "index_inconsistent", "not an integer byte count"),
    ("total_size fraction", _total_size("1.5"), "index_inconsistent", "not an integer byte count"),
    ("total_size string", _total_size('"400"'), "index_inconsistent", "not an integer byte count"),
    ("total_size true", _total_size("true"), "index_inconsistent", "not an integer byte count"),
    ("index nested 100k deep", _index_field(f'"x": {_nest(100_000)}'), "index_inconsistent", "MAX_JSON_DEPTH"),
    ("index nested 65 deep", _index_field(f'"x": {_nest(63)}'), "index_inconsistent", "deeper than 64 levels"),
    ("metadata not an object",
     lambda p: _edit_index_text(p, lambda t: t.replace('"metadata": {', '"metadata": 3, "m": {')),
     "index_inconsistent", "'metadata' is 3, not an object"),
    ("offsets Infinity", _offsets("[0,Infinity]"), "corrupt_header", "Infinity"),
    ("offsets NaN", _offsets("[NaN,32]"), "corrupt_header", "NaN"),
    ("offsets 1e400", _offsets("[0,1e400]"), "corrupt_header", "overflows to infinity"),
    ("offsets 5000 digits", _offsets("[0,1" + "0" * 5000 + "]"), "corrupt_header", "thousands of digits"),
    ("offsets beyond u64", _entry(EMBED, lambda e: e.update(shape=[2**66, 0], data_offsets=[2**65, 2**65])),
     "corrupt_header", "expected a list of integer sizes"),
    ("offset end beyond u64", _entry(EMBED, lambda e: e.update(data_offsets=[2**64 - 16, 2**64 + 240])),
     "corrupt_header", "expected [begin, end] of integers"),
    ("negative offsets", _entry(EMBED, lambda e: e.update(data_offsets=[-256, 0])),
     "corrupt_header", "expected [begin, end] of integers"),
    ("offsets reversed", _entry(EMBED, lambda e: e.update(data_offsets=[256, 0])),
     "corrupt_header", "end before they begin"),
    ("float offsets", _entry(EMBED, lambda e: e.update(data_offsets=[0.0, 256.0])),
     "corrupt_header", "expected [begin, end] of integers"),
    ("boolean in shape", _entry(EMBED, lambda e: e.update(shape=[True, 128])),
     "corrupt_header", "expected a list of integer sizes"),
    ("header nested 100k deep", _header_field(f'"x": {_nest(100_000)}'), "corrupt_header", "MAX_JSON_DEPTH"),
    ("header metadata nested 500 deep", _header_field(f'"__metadata__": {{"a": {_nest(500)}}}'),
     "corrupt_header", "deeper than 64 levels"),
    ("header length claims 2**63", lambda p: _set_length(_first_file(p), 2**63), "corrupt_header", "MAX_HEADER_BYTES"),
]


@pytest.mark.parametrize(("edit", "kind", "words"), [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_file_is_named_everywhere(tmp_path, edit, kind, words) -> None:
    path = write(tmp_path / "ck", model())
    edit(path)
    named = INDEX_NAME if kind == "index_inconsistent" else _first_file(path).name

    ins = inspect_checkpoint(path)  # debug: a finding of the right kind, naming the file and the problem
    assert not ins.error
    hits = [f for f in ins.findings if f.kind == kind and words in str(f.evidence.get("detail"))]
    assert hits and hits[0].evidence["file"] == named, ins.findings

    with pytest.raises(CheckpointError) as info:  # load: the reader load_hf opens
        CheckpointReader(path)
    assert words in str(info.value) and str(path / named) in str(info.value)

    problems = validate_final(path)  # publish's check: the problem listed, so the folder is not complete
    assert any(words in p and str(path / named) in p for p in problems), problems
    assert latest_checkpoint(tmp_path).path is None


def test_nesting_at_the_cap_is_accepted(tmp_path) -> None:
    """Free-form index metadata nested exactly ``MAX_JSON_DEPTH`` deep (index object + metadata + 62) reads."""
    path = write(tmp_path / "ck", model())
    _index_field(f'"x": {_nest(limits.MAX_JSON_DEPTH - 2)}')(path)
    assert limits.MAX_JSON_DEPTH == 64 and inspect_checkpoint(path).ok
    assert read_checkpoint(path).keys.keys() == model().keys()
    assert latest_checkpoint(tmp_path).path == path


def test_index_larger_than_the_cap_is_not_read(tmp_path, monkeypatch) -> None:
    path = write(tmp_path / "ck", model())
    size = (path / INDEX_NAME).stat().st_size
    monkeypatch.setattr(limits, "MAX_INDEX_BYTES", size - 1)
    words = f"{size} bytes, over the {size - 1}-byte limit (MAX_INDEX_BYTES)"
    with pytest.raises(CheckpointError, match=r"index\.json: corrupt index: .*MAX_INDEX_BYTES"):
        CheckpointReader(path)
    assert any(words in p for p in validate_final(path))
    finding = inspect_checkpoint(path).findings[0]
    assert finding.kind == "index_inconsistent" and words in finding.evidence["detail"]
    monkeypatch.setattr(limits, "MAX_INDEX_BYTES", size)
    assert inspect_checkpoint(path).ok


def test_sparse_index_over_the_real_cap_is_refused_unread(tmp_path, monkeypatch) -> None:
    """A 128 MiB + 1 index (sparse: no bytes written) is refused from its size, before any read."""
    path = write(tmp_path / "ck", model())
    with open(path / INDEX_NAME, "r+b") as f:
        f.truncate(limits.MAX_INDEX_BYTES + 1)
    reads: list[int] = []
    real_open = open

    def counting_open(file, mode="r", *args, **kwargs):  # record reads of the index: there must be none
        handle = real_open(file, mode, *args, **kwargs)
        if str(file).endswith(INDEX_NAME):
            read = handle.read
            handle = _Spy(handle, lambda n=-1: reads.append(n) or read(n))
        return handle

    monkeypatch.setattr("builtins.open", counting_open)
    with pytest.raises(CheckpointError, match=f"{128 * 2**20 + 1} bytes, over the {128 * 2**20}-byte limit"):
        read_checkpoint(path)
    assert reads == []


class _Spy:
    def __init__(self, handle, read) -> None:
        self._handle, self.read = handle, read

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._handle.close()


def test_header_larger_than_the_cap_is_not_read(tmp_path, monkeypatch) -> None:
    path = write(tmp_path / "ck", model())
    file = _first_file(path)
    (n,) = struct.unpack("<Q", file.read_bytes()[:8])
    monkeypatch.setattr(limits, "MAX_HEADER_BYTES", n - 1)
    with pytest.raises(CheckpointError, match=f"header length {n} bytes is beyond the {n - 1}-byte limit"):
        CheckpointReader(path)
    assert inspect_checkpoint(path).findings[0].kind == "corrupt_header"
    assert latest_checkpoint(tmp_path).path is None
    monkeypatch.setattr(limits, "MAX_HEADER_BYTES", n)
    assert inspect_checkpoint(path).ok and latest_checkpoint(tmp_path).path == path
