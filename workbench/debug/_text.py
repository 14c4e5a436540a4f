"""Private text helpers for debug reports: parameter counts and the split of HF keys into layer patterns.

Byte units and index ranges come from ``workbench.report`` (``format_bytes``, ``compress_indices``).
"""

from __future__ import annotations

import re

__all__ = ["format_count"]

# a key's numeric components (``layers.3``, ``experts.17``): split once, kept as strings (the inspector's hot path)
_SPLIT = re.compile(r"((?<=\.)\d+(?=\.|$)|^\d+(?=\.))")


def format_count(n: int) -> str:
    """``671_000_000_000 -> '671.0B'``, ``7_000 -> '7.0K'`` (parameter counts)."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
