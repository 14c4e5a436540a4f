"""Fold the text that many ranks print into one readable stream.

A line every rank printed identically appears once; lines that differ appear once per distinct text, prefixed
with the ranks that printed it. Lines are matched by their position in each rank's output (the k-th line of
every rank is folded together), which is what SPMD code produces:

==========  ==================  =========================
rank        prints              folded output
==========  ==================  =========================
0, 1, 2, 3  ``loss 0.25``       ``loss 0.25``
0, 2        ``shard (4, 16)``   ``[0,2] shard (4, 16)``
1, 3        ``shard (3, 16)``   ``[1,3] shard (3, 16)``
==========  ==================  =========================

``Folder`` is the streaming form used by the kernel: it emits a line index as soon as every rank still running
has printed it, and lets a line that waited longer than ``stale_after`` seconds through on its own (so one slow
or hung rank does not hold back what the others print).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["Folder", "fold_lines", "format_ranks"]


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``"0-3,5"``; ``[1, 3]`` -> ``"1,3"`` (runs of three or more become ranges)."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ordered[i]}-{ordered[j]}")
        else:
            parts.extend(str(r) for r in ordered[i : j + 1])
        i = j + 1
    return ",".join(parts)


def fold_lines(lines: Mapping[int, str], ranks: Sequence[int]) -> list[str]:
    """Fold one line position: ``{rank: line}`` of the ranks that printed it, out of ``ranks`` taking part.

    Returns the line alone when all of ``ranks`` printed the same text, else one ``[ranks] text`` line per
    distinct text, ordered by the lowest rank that printed it.
    """
    groups: dict[str, list[int]] = {}
    for rank in sorted(lines):
        groups.setdefault(lines[rank], []).append(rank)
    if len(groups) == 1 and set(lines) == set(ranks):
        return [next(iter(groups))]
    return [f"[{format_ranks(owners)}] {text}" for text, owners in sorted(groups.items(), key=lambda g: g[1][0])]


class Folder:
    """Streaming folder for one output stream (stdout or stderr) of one cell over ``ranks``."""

    def __init__(self, ranks: Sequence[int], *, stale_after: float = 1.0) -> None:
        self.ranks = tuple(sorted(ranks))
        self.stale_after = stale_after
        self._partial = dict.fromkeys(self.ranks, "")
        self._pending: dict[int, deque[tuple[float, str]]] = {r: deque() for r in self.ranks}
        self._done: set[int] = set()

    def push(self, rank: int, text: str, now: float | None = None) -> list[str]:
        """Add text a rank printed; return the folded lines now ready (each ending without a newline)."""
        now = time.monotonic() if now is None else now
        buffered = self._partial[rank] + text
        *complete, self._partial[rank] = buffered.split("\n")
        self._pending[rank].extend((now, line) for line in complete)
        return self._ready()

    def finish(self, rank: int) -> list[str]:
        """The rank finished the cell: its unterminated last line counts as a line; return lines now ready."""
        if self._partial[rank]:
            self._pending[rank].append((time.monotonic(), self._partial[rank]))
            self._partial[rank] = ""
        self._done.add(rank)
        return self._ready()

    def flush_stale(self, now: float | None = None) -> list[str]:
        """Let lines through that waited ``stale_after`` seconds for a rank that prints nothing."""
        now = time.monotonic() if now is None else now
        out: list[str] = []
        while True:
            heads = [q[0][0] for q in self._pending.values() if q]
            if not heads or now - min(heads) < self.stale_after:
                return out + self._ready()
            out.extend(self._pop_heads())

    def drain(self) -> list[str]:
        """Everything still buffered (the cell ended or was given up on)."""
        for rank in self.ranks:
            if self._partial[rank]:
                self._pending[rank].append((0.0, self._partial[rank]))
                self._partial[rank] = ""
        out: list[str] = []
        while any(self._pending.values()):
            out.extend(self._pop_heads())
        return out

    def _ready(self) -> list[str]:
        out: list[str] = []
        running = [r for r in self.ranks if r not in self._done]
        while any(self._pending.values()) and all(self._pending[r] for r in running):
            out.extend(self._pop_heads())
        return out

    def _pop_heads(self) -> list[str]:
        heads = {r: q.popleft()[1] for r, q in self._pending.items() if q}
        return fold_lines(heads, self.ranks)
