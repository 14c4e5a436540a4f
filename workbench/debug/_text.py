"""Private text helpers for debug reports: human byte units and HF keys grouped by layer pattern.

(A teammate's ``workbench/report`` package will own these; until it lands they live here, private.)
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["compress_ints", "format_bytes", "format_count", "key_pattern"]

_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")
_SPLIT = re.compile(r"((?<=\.)\d+(?=\.|$)|^\d+(?=\.))")


def format_bytes(n: int) -> str:
    """``1536 -> '1.5 KiB'``, ``3 * 2**30 -> '3.0 GiB'`` (binary units, one decimal)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(n: int) -> str:
    """``671_000_000_000 -> '671.0B'``, ``7_000 -> '7.0K'`` (parameter counts)."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def key_pattern(key: str) -> tuple[str, tuple[int, ...]]:
    """``'model.layers.3.mlp.experts.7.w1'`` -> ``('model.layers.{}.mlp.experts.{}.w1', (3, 7))``."""
    parts = _SPLIT.split(key)
    return "{}".join(parts[::2]), tuple(map(int, parts[1::2]))


def compress_ints(values: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5, 7, 8]`` -> ``'0..3,5,7..8'``; a lone value stays as it is."""
    ordered = sorted(set(values))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}..{ordered[j]}")
        i = j + 1
    return ",".join(parts)
