"""Bounded JSON parsing: the C-speed depth count against a character-by-character scan, and what is refused."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.io.files.limits import MAX_HEADER_BYTES, MAX_JSON_DEPTH, json_depth, parse_json, read_capped


def scanned_depth(text: str) -> int:
    """Depth by walking the text one character at a time, tracking strings and escapes."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


_tricky = st.text(alphabet='[]{}"\\/ab\n\u00e9', max_size=8)  # strings full of brackets, quotes, escapes
_json = st.recursive(
    st.none() | st.integers() | _tricky,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_tricky, inner, max_size=3),
    max_leaves=30,
)


@settings(max_examples=300)
@given(value=_json, ascii_only=st.booleans())
def test_depth_matches_a_character_scan(value, ascii_only) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert json_depth(text.encode(), stop_above=10**6) == scanned_depth(text)


def test_depth_examples() -> None:
    assert json_depth(b"3") == 0
    assert json_depth(b'{"a[[": [1, {"b": "\\\\"}], "c\\"[": 2}') == 3
    assert json_depth(b'["\\\\\\"]]]", [[]]]') == 3  # an escaped backslash, then an escaped quote, in one string
    assert json_depth(b"[" * 5000 + b"]" * 5000, stop_above=10**6) == 5000


def test_depth_is_counted_across_chunks() -> None:
    """Nesting that rises in one 4 Mi-bracket chunk and peaks in the next is still counted."""
    flat = b"[]" * (3 << 20)  # 6 Mi brackets at depth 1
    assert json_depth(b"[" + flat + b"[[[]]]" + b"]", stop_above=100) == 4


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b'{"a": NaN}', "NaN"),
        (b"[Infinity]", "Infinity"),
        (b"[-Infinity]", "-Infinity"),
        (b"[1e400]", "overflows to infinity"),
        (b"[-1e999]", "overflows to infinity"),
        (b"[1" + b"0" * 5000 + b"]", "thousands of digits"),
        (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), f"deeper than {MAX_JSON_DEPTH} levels"),
        (b"[" * 100_000, f"deeper than {MAX_JSON_DEPTH} levels"),  # no closing brackets: refused before parsing
        (b'{"a": "\xff"}', "not UTF-8"),
        (b"{not json", "Expecting property name"),
    ],
)
def test_refused(raw, words) -> None:
    with pytest.raises(ValueError, match=words):
        parse_json(raw)


def test_accepted() -> None:
    nested = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert parse_json(nested) == json.loads(nested)
    assert parse_json(b'{"total_size": 18446744073709551615, "x": 1.5e300}') == {
        "total_size": 2**64 - 1, "x": 1.5e300
    }


def test_read_capped(tmp_path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    assert read_capped(path, 10, "CAP") == b"x" * 10
    with pytest.raises(ValueError, match=r"10 bytes, over the 9-byte limit \(CAP\)"):
        read_capped(path, 9, "CAP")
    assert MAX_HEADER_BYTES == 100_000_000  # safetensors' MAX_HEADER_SIZE
