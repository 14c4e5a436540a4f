"""The kernel's own magics, read off the top of a cell before the rest runs on the ranks.

============================  ==================================================================================
``%%ranks 0,2``               run this cell on ranks 0 and 2 only (``0-3``, ``1,4-7``; other ranks are untouched)
``%rank_output MODE``         from now on show ``folded`` text (default), rank ``0``'s output only, or ``all``
                              ranks' lines, each prefixed with its rank
``%hang_timeout S [MODE]``    report every rank's stack when a cell runs longer than S seconds (``off``: never);
                              MODE ``report`` (default) keeps waiting, ``interrupt`` then interrupts every rank
``%join_timeout S``           a cell waits up to S seconds for every rank of the job to join (cluster kernels)
``%dead_after S``             a rank silent for S seconds whose connection is gone is lost: the cell ends naming it
``%live on|off``              show (default) or not, while a cell runs longer than a second, what each rank is doing
``%flight_recorder on|off``   hang reports add each rank's last collectives from torch's flight recorder (or not)
============================  ==================================================================================

They are handled by the kernel, not by IPython on the ranks, so they may stand on lines of their own at the top
of any cell; the lines after them run as usual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workbench.kernel.fold import format_ranks

__all__ = ["OUTPUT_MODES", "CellDirectives", "MagicError", "check_ranks", "parse_cell", "parse_ranks"]

OUTPUT_MODES = ("folded", "0", "all")


class MagicError(ValueError):
    """A kernel magic was given arguments it cannot use."""


@dataclass(frozen=True, slots=True)
class CellDirectives:
    """What the kernel magics at the top of a cell asked for, and the code left to run."""

    code: str
    ranks: tuple[int, ...] | None = None
    output: str | None = None
    hang_timeout: float | None = None
    hang_action: str | None = None
    timeout_given: bool = False
    join_timeout: float | None = None
    dead_after: float | None = None
    live: bool | None = None
    flight_recorder: bool | None = None


MAX_RANKS = 1 << 20  # a %%ranks range is checked before it is expanded: a typo must not build a list of millions


def parse_ranks(text: str, world_size: int | None) -> tuple[int, ...]:
    """``"0,2"`` / ``"0-3"`` / ``"1,4-7"`` -> sorted ranks, each checked against ``world_size`` (``None``: not known
    yet, before a cluster kernel's ranks joined; only negative ranks are refused, see ``check_ranks``). Ranges are
    checked before they are expanded."""
    spans: list[tuple[int, int]] = []
    for part in (p.strip() for p in text.replace(" ", ",").split(",")):
        if not part:
            continue
        try:
            lo, hi = (int(x) for x in part.split("-", 1)) if "-" in part else (int(part),) * 2
        except ValueError:
            raise MagicError(f"%%ranks: {part!r} is not a rank or a range like 0-3") from None
        if hi < lo:
            raise MagicError(f"%%ranks: range {part!r} ends before it starts; write it as {hi}-{lo}")
        spans.append((lo, hi))
    if not spans:
        raise MagicError("%%ranks needs ranks, e.g. %%ranks 0,2 or %%ranks 0-3")
    limit = MAX_RANKS if world_size is None else world_size
    outside = [(max(lo, limit), hi) for lo, hi in spans if hi >= limit]
    if outside:
        _out_of_range(",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in outside[:4]), world_size)
    return check_ranks(tuple(sorted({r for lo, hi in spans for r in range(lo, hi + 1)})), world_size)


def check_ranks(ranks: tuple[int, ...], world_size: int | None) -> tuple[int, ...]:
    """``ranks`` if each is in ``range(world_size)``, else a MagicError naming those that are not (with
    ``world_size`` None, not known yet, only negative ranks are refused)."""
    bad = [r for r in ranks if r < 0 or (world_size is not None and r >= world_size)]
    if bad:
        _out_of_range(format_ranks(bad), world_size)
    return ranks


def _out_of_range(bad: str, world_size: int | None) -> None:
    size = "not known yet" if world_size is None else f"{world_size} (ranks 0-{world_size - 1})"
    raise MagicError(f"%%ranks: rank(s) [{bad}] out of range; this kernel has world_size {size}")


def parse_cell(code: str, world_size: int | None) -> CellDirectives:
    """Strip the kernel magics off the top of ``code`` and say what they asked for (``world_size`` None: not known
    yet; ``%%ranks`` are then checked once it is, see ``check_ranks``)."""
    lines = code.split("\n")
    ranks = output = action = None
    timeout: float | None = None
    seconds: dict[str, float] = {}
    switches: dict[str, bool] = {}
    timeout_given = False
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped:
            i += 1
            continue
        word, _, rest = stripped.partition(" ")
        rest = rest.strip()
        if word == "%%ranks":
            ranks = parse_ranks(rest, world_size)
        elif word == "%rank_output":
            if rest not in OUTPUT_MODES:
                raise MagicError(f"%rank_output {rest!r}: use one of {', '.join(OUTPUT_MODES)}")
            output = rest
        elif word == "%hang_timeout":
            args = rest.split()
            if not args or len(args) > 2:
                raise MagicError("%hang_timeout needs seconds (or off) and optionally report|interrupt, "
                                 "e.g. %hang_timeout 30 interrupt")
            timeout_given = True
            if args[0] == "off":
                timeout = None
            else:
                try:
                    timeout = float(args[0])
                except ValueError:
                    raise MagicError(f"%hang_timeout {args[0]!r}: give seconds, e.g. %hang_timeout 30") from None
                if not 0 < timeout < math.inf:  # NaN too: a report that never comes
                    raise MagicError(f"%hang_timeout {args[0]}: seconds must be > 0 and finite (or off)")
            if len(args) == 2:
                if args[1] not in ("report", "interrupt"):
                    raise MagicError(f"%hang_timeout: action {args[1]!r} must be report or interrupt")
                action = args[1]
        elif word in ("%join_timeout", "%dead_after"):
            seconds[word] = _seconds(word, rest, minimum=1.0 if word == "%dead_after" else 0.0)
        elif word in ("%live", "%flight_recorder"):
            if rest not in ("on", "off"):
                raise MagicError(f"{word} {rest!r}: use {word} on or {word} off")
            switches[word] = rest == "on"
        else:
            break
        i += 1
    return CellDirectives(code="\n".join(lines[i:]), ranks=ranks, output=output, hang_timeout=timeout,
                          hang_action=action, timeout_given=timeout_given,
                          join_timeout=seconds.get("%join_timeout"), dead_after=seconds.get("%dead_after"),
                          live=switches.get("%live"), flight_recorder=switches.get("%flight_recorder"))


def _seconds(magic: str, text: str, minimum: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise MagicError(f"{magic} {text!r}: give seconds, e.g. {magic} 60") from None
    if not value > minimum:
        raise MagicError(f"{magic} {text}: seconds must be > {minimum:g}")
    return value
