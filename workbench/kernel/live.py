"""The live view of a running cell: what each rank is doing, ranks in the same state on one line.

While a cell runs longer than a second the kernel shows one display (``display_data`` with a ``display_id``, then
``update_display_data`` at most twice a second) built here from each rank's ``RankState``::

    cell running 3.1 s on 8 ranks
      ranks 0-5   all_reduce #12 on group default (ranks 0-7)   3.1 s
      rank 6      In [7] line 3: time.sleep(600)                3.0 s
      rank 7      done

Ranks that wait in the same collective (same op, group and call number) share a line, as do ranks at the same line
of user code, so the view stays a few lines long at 64 ranks and more; the line that has waited longest comes
first among the collectives, ranks in user code first of all (the others wait for them). ``summary`` is the one
line that replaces the view when the cell ends. Text and HTML come in one bundle. Nothing here talks to ranks.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping
from dataclasses import dataclass

from workbench.kernel.fold import format_ranks

__all__ = ["KINDS", "RankState", "Row", "bundle", "group_states", "summary", "where_label"]

# what a rank can be doing, in the order the view lists them (ranks the others may wait for first)
KINDS = ("code", "gpu", "silent", "collective", "starting", "failed", "done")
_LABELS = {"code": "running", "gpu": "GPU busy", "silent": "no answer", "collective": "waiting in",
           "starting": "no report yet", "failed": "failed", "done": "done"}
_MAX_ROWS = 12  # more distinct states than this: the rest are counted on one line
_WHERE = re.compile(r'^File "(?P<file>.*)", line (?P<line>\d+), in (?P<func>[^:]*)(?:: (?P<code>.*))?$')
_CELL_FILE = re.compile(r"^<ipython-input-(\d+)-[0-9a-f]+>$")


@dataclass(frozen=True, slots=True)
class RankState:
    """What one rank is doing: ``kind`` (one of ``KINDS``), ``what`` (the collective or the line, in words) and
    ``since`` (wall-clock seconds when it began, ``None`` when not known)."""

    kind: str
    what: str = ""
    since: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"RankState.kind {self.kind!r}: use one of {', '.join(KINDS)}")


@dataclass(frozen=True, slots=True)
class Row:
    """Ranks in one state: the state and the longest any of them has been in it (seconds, ``None``: not known)."""

    ranks: tuple[int, ...]
    kind: str
    what: str
    seconds: float | None

    @property
    def who(self) -> str:
        return f"rank{'s' if len(self.ranks) > 1 else ''} {format_ranks(self.ranks)}"


def where_label(where: str) -> str:
    """A stack report's line as the view shows it: ``File "<ipython-input-7-ab>", line 3, in <module>: x()`` ->
    ``In [7] line 3: x()``; a file's frame -> ``dir/file.py:42 in step: x()``."""
    match = _WHERE.match(where.strip())
    if match is None:
        return where.strip() or "outside user code"
    cell = _CELL_FILE.match(match["file"])
    place = (f"In [{cell.group(1)}] line {match['line']}" if cell
             else f"{'/'.join(match['file'].split('/')[-2:])}:{match['line']} in {match['func']}")
    return f"{place}: {match['code']}" if match["code"] else place


def group_states(states: Mapping[int, RankState], now: float) -> list[Row]:
    """Ranks with the same kind and ``what`` on one row; rows ordered by ``KINDS``, then longest first."""
    groups: dict[tuple[str, str], list[int]] = {}
    for rank in sorted(states):
        state = states[rank]
        groups.setdefault((state.kind, state.what), []).append(rank)
    rows = []
    for (kind, what), ranks in groups.items():
        since = [states[r].since for r in ranks if states[r].since is not None]
        rows.append(Row(tuple(ranks), kind, what, max(0.0, now - min(since)) if since else None))
    return sorted(rows, key=lambda r: (KINDS.index(r.kind), -(r.seconds or 0.0), r.ranks[0]))


def _trim(rows: list[Row]) -> tuple[list[Row], str]:
    if len(rows) <= _MAX_ROWS:
        return rows, ""
    rest = rows[_MAX_ROWS - 1:]
    count = sum(len(r.ranks) for r in rest)
    return rows[: _MAX_ROWS - 1], f"... {len(rest)} more states of {count} ranks"


def _seconds(row: Row) -> str:
    return "" if row.seconds is None or row.kind in ("done", "failed") else f"{row.seconds:.1f} s"


def _text(rows: list[Row], head: str) -> str:
    shown, more = _trim(rows)
    who_width = max((len(r.who) for r in shown), default=0)
    lines = [head]
    for row in shown:
        state = f"{_LABELS[row.kind]} {row.what}".strip() if row.kind != "done" else "done"
        took = _seconds(row)
        lines.append(f"  {row.who:<{who_width}}  {state}" + (f", {took}" if took else ""))
    if more:
        lines.append(f"  {more}")
    return "\n".join(lines)


def _html(rows: list[Row], head: str) -> str:
    shown, more = _trim(rows)
    colors = {"code": "#b35c00", "gpu": "#b35c00", "silent": "#b00020", "collective": "#1f5fa8",
              "starting": "#666", "failed": "#b00020", "done": "#2e7d32"}
    cells = []
    for row in shown:
        cells.append(
            "<tr>"
            f'<td style="text-align:left;padding:0 0.8em 0 0;white-space:nowrap">{html.escape(row.who)}</td>'
            f'<td style="text-align:left;padding:0 0.8em 0 0;color:{colors[row.kind]}">{_LABELS[row.kind]}</td>'
            f'<td style="text-align:left;padding:0 0.8em 0 0;font-family:monospace">{html.escape(row.what)}</td>'
            f'<td style="text-align:right;white-space:nowrap">{_seconds(row)}</td>'
            "</tr>")
    if more:
        cells.append(f'<tr><td colspan="4" style="text-align:left">{html.escape(more)}</td></tr>')
    return (f'<div class="workbench-live"><div style="font-weight:bold">{html.escape(head)}</div>'
            f'<table style="border-collapse:collapse;margin:0.2em 0 0 0.5em;font-size:90%">{"".join(cells)}</table>'
            "</div>")


def bundle(states: Mapping[int, RankState], elapsed: float, now: float) -> dict[str, str]:
    """The view as a mime bundle (``text/plain`` and ``text/html``) for a cell running ``elapsed`` seconds."""
    rows = group_states(states, now)
    head = f"cell running {elapsed:.1f} s on {len(states)} rank{'s' if len(states) != 1 else ''}"
    return {"text/plain": _text(rows, head), "text/html": _html(rows, head)}


def summary(finished: Mapping[int, float], failed: Mapping[int, str], elapsed: float) -> dict[str, str]:
    """The one line left when the cell ends: how long it ran and which rank finished last, by how much.

    ``finished``: rank -> seconds from the cell's start to its end on that rank; ``failed``: rank -> error name.
    """
    parts = [f"cell ran {elapsed:.1f} s on {len(finished)} rank{'s' if len(finished) != 1 else ''}"]
    if len(finished) > 1:
        order = sorted(finished, key=lambda r: (finished[r], r))
        first, last = order[0], order[-1]
        parts.append(f"last to finish: rank {last}, {finished[last] - finished[first]:.1f} s after rank {first}")
    if failed:
        by_error: dict[str, list[int]] = {}
        for rank, ename in sorted(failed.items()):
            by_error.setdefault(ename, []).append(rank)
        parts.append("; ".join(f"rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)} failed ({e})"
                               for e, rs in by_error.items()))
    text = "; ".join(parts)
    return {"text/plain": text,
            "text/html": f'<div class="workbench-live" style="color:#666">{html.escape(text)}</div>'}
