"""Aligned plain-text tables for reports (left-aligned text, right-aligned numbers)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def format_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    right: Sequence[int] = (),
    indent: str = "  ",
) -> list[str]:
    """Lines of a table whose columns are as wide as their widest cell; ``right`` lists the columns to
    right-align (numbers, sizes). Trailing spaces are stripped."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
    out = []
    for row in (header, *rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        out.append((indent + "  ".join(cells)).rstrip())
    return out
