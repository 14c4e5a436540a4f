"""Bounds on what a checkpoint's metadata may ask of a reader: JSON size, nesting depth, number sizes.

An index or a safetensors header comes from disk, perhaps from someone else. Before parsing, its size is
checked against a stated cap and its bracket nesting against ``MAX_JSON_DEPTH`` (a cheap pass over the
bytes, so the recursive JSON decoder never sees a deep document); while parsing, ``NaN``/``Infinity``
and number literals that overflow to infinity (``1e400``) are refused. Every refusal is a
``ValueError`` whose message says what is wrong; the callers add the file and turn it into a
``CheckpointError`` or a problem line.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MAX_HEADER_BYTES",
    "MAX_INDEX_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_STORED_INT",
    "json_depth",
    "parse_json",
    "read_capped",
]

MAX_INDEX_BYTES = 128 << 20
"""Largest ``model.safetensors.index.json`` read (128 MiB). A weight-map line is ~100 bytes, so a 100k-key
index is ~10 MB; ten times the largest known index still fits."""

MAX_HEADER_BYTES = 100_000_000
"""Largest safetensors JSON header read: safetensors' own limit (``MAX_HEADER_SIZE``), so any file it opens
we open too."""

MAX_JSON_DEPTH = 64
"""Deepest nesting of ``[``/``{`` accepted in an index or header. Real ones nest 3 deep (header object,
tensor entry, shape list); 64 leaves room for free-form index metadata and stays far below the
recursion limit of Python's JSON decoder and of ``repr``."""

MAX_STORED_INT = 2**64 - 1
"""Largest size or offset a safetensors file can hold (u64); a larger number is refused as out of range."""

_KEEP_OUTSIDE = bytes(b for b in range(256) if b not in b'[]{}"')  # the bytes deleted: all but brackets and quotes
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # opening +1, closing -1 (as int8)
_CHUNK = 1 << 22


def json_depth(raw: bytes, stop_above: int = MAX_JSON_DEPTH) -> int:
    """The deepest ``[``/``{`` nesting of the JSON text ``raw``, brackets inside strings not counted.

    Runs at C speed: escapes are dropped, then everything but brackets and quotes, then the string
    contents; the depth is the largest running sum of +1/-1 steps, taken in chunks of 4 Mi brackets. It stops
    after the first chunk that goes above ``stop_above`` (a larger answer means only "too deep"), so a
    hostile 100 MB header costs well under a second. Malformed text gives some depth; the JSON decoder then
    names the syntax error.
    """
    marks = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _KEEP_OUTSIDE)
    marks = marks.replace(b'""', b"")  # an empty string, or the gap between two strings: no bracket in either
    if b'"' in marks:
        marks = b"".join(marks.split(b'"')[::2])  # keep what lies between strings
    steps = marks.translate(_STEPS)
    deepest = level = 0
    for begin in range(0, len(steps), _CHUNK):
        chunk = torch.frombuffer(bytearray(steps[begin : begin + _CHUNK]), dtype=torch.int8)
        levels = chunk.to(torch.int32).cumsum(0) + level
        deepest, level = max(deepest, int(levels.max())), int(levels[-1])
        if deepest > stop_above:
            break
    return deepest


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a checkpoint may hold (NaN and Infinity are refused)")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows to infinity; refused")
    return value


def parse_json(raw: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse UTF-8 JSON strictly: nesting at most ``max_depth``, no NaN/Infinity (literal or by overflow).

    Integers are Python ints (a literal over Python's 4,300-digit limit is a ``ValueError`` too): callers
    check the range of the sizes and offsets they use against ``MAX_STORED_INT``.

    Raises:
        ValueError: the reason, worded for a message (a ``json.JSONDecodeError`` for bad syntax).
    """
    if json_depth(raw, max_depth) > max_depth:
        raise ValueError(f"JSON nests deeper than {max_depth} levels (MAX_JSON_DEPTH), refused before parsing")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc})") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_parse_float)
    except json.JSONDecodeError:
        raise
    except ValueError as exc:
        if "integer string conversion" in str(exc):  # Python's own cap on int literals (4,300 digits)
            raise ValueError("an integer literal has thousands of digits; refused") from None
        raise
    except RecursionError:  # unreachable after the depth check; kept so no parse ever escapes as another type
        raise ValueError("JSON nests too deep to parse") from None


def read_capped(path: Path | str, max_bytes: int, cap_name: str) -> bytes:
    """The bytes of ``path``, refused before reading when it holds more than ``max_bytes``.

    Raises:
        ValueError: the file is larger than the cap (``cap_name`` names the constant in the message).
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise ValueError(f"{size} bytes, over the {max_bytes}-byte limit ({cap_name}); not read")
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:  # grew while opened
        raise ValueError(f"more than {max_bytes} bytes, over the limit ({cap_name}); not read")
    return raw
