"""Human units: bytes (``14.2 GiB``), counts (``46,183``), rank sets (``0-7, 12``) and their parsers.

A base module: it imports nothing from workbench, so every layer (mesh, layout and plan reprs, io, debug, viz) may
use it. ``workbench.report.units`` offers the same names.

=====================================  ===========================
call                                   result
=====================================  ===========================
``format_bytes(512)``                  ``'512 B'``
``format_bytes(15267266560)``          ``'14.2 GiB'``
``format_bytes(1369188535968)``        ``'1.25 TiB'``
``format_bytes(3 << 30, exact=True)``  ``'3 GiB (3,221,225,472 B)'``
``parse_bytes("4GiB")``                ``4294967296``
``format_ranks([0, 1, 2, 3, 7])``      ``'0-3, 7'``
``parse_ranks("0,5,8-11")``            ``(0, 5, 8, 9, 10, 11)``
``byte_tick_step(5 << 20, 6)``         ``(1048576.0, 2)``: 1 MiB steps
``format_bytes_in(3 << 19, 2, 1)``     ``'1.5 MiB'``
=====================================  ===========================
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = [
    "byte_tick_step", "format_bytes", "format_bytes_in", "format_count", "format_ranks", "format_seconds",
    "head_and_tail", "parse_bytes", "parse_ranks", "rank_phrase",
]

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
_PARSE_UNITS = {
    "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
    "p": 1 << 50, "pib": 1 << 50, "pb": 10**15,
}


def format_bytes(n: float, *, exact: bool = False) -> str:
    """A byte count in binary units with three significant digits: ``'512 B'``, ``'868 KiB'``, ``'14.2 GiB'``,
    ``'1.25 TiB'``; trailing zeros are dropped (``'2 GiB'``, ``'1.5 MiB'``).

    Args:
        n: bytes (may be negative, e.g. a difference).
        exact: append the exact count, ``'14.2 GiB (15,267,266,560 B)'`` (not for counts under 1 KiB).
    """
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    unit = 0
    while unit < len(_BINARY) - 1 and round(value, _decimals(value)) >= 1024:
        value /= 1024
        unit += 1
    text = f"{value:.{_decimals(value) if unit else 0}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    out = f"{sign}{text} {_BINARY[unit]}"
    if exact and unit:
        out += f" ({format_count(int(n))} B)"
    return out


def _decimals(value: float) -> int:
    return 2 if value < 9.995 else 1 if value < 99.95 else 0


# round steps of a byte axis, as (mantissa, decimals) of a binary unit: 0.1 .. 50 units, then the next unit
_STEP_MANTISSAS = ((0.1, 1), (0.2, 1), (0.4, 1), (0.5, 1), (1, 0), (2, 0), (4, 0), (5, 0), (10, 0), (20, 0), (40, 0),
                   (50, 0))


def byte_tick_step(span: float, max_intervals: int) -> tuple[float, int]:
    """The step of round ticks on a byte axis and the binary unit to label them in.

    The step is the smallest ``m x unit`` (m in 0.1, 0.2, 0.4, 0.5, 1, 2, 4, 5, 10, 20, 40, 50; unit B, KiB,
    MiB, ...; no fractional bytes) that cuts ``span`` bytes into at most ``max_intervals`` intervals.

    Returns:
        ``(step_bytes, unit)`` where ``unit`` indexes B, KiB, MiB, ... (``1024 ** unit`` bytes).
    """
    if max_intervals < 1:
        raise ValueError(f"byte_tick_step: max_intervals must be >= 1, got {max_intervals}")
    need = max(float(span), 1.0) / max_intervals
    for unit in range(len(_BINARY)):
        for mantissa, decimals in _STEP_MANTISSAS:
            if unit == 0 and decimals:
                continue
            step = mantissa * 1024.0**unit
            if step >= need:
                return step, unit
    return 50 * 1024.0 ** (len(_BINARY) - 1), len(_BINARY) - 1


def format_bytes_in(n: float, unit: int, decimals: int = 0) -> str:
    """``n`` bytes in one binary unit (an axis's labels share it): ``format_bytes_in(3 << 19, 2, 1) == '1.5 MiB'``.

    Zero is ``'0'``; ``decimals`` digits after the point.
    """
    if not 0 <= unit < len(_BINARY):
        raise ValueError(f"format_bytes_in: unit must index {_BINARY}, got {unit}")
    if n == 0:
        return "0"
    return f"{n / 1024.0**unit:.{decimals}f} {_BINARY[unit]}"


def format_count(n: int) -> str:
    """An integer with thousands separators: ``46183 -> '46,183'``."""
    return f"{n:,}"


def format_seconds(seconds: float) -> str:
    """A duration: ``'850 us'``, ``'12.5 ms'``, ``'3.21 s'``, ``'2 min 5 s'``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


def parse_bytes(text: str) -> int:
    """Bytes from ``'4GiB'``, ``'4 GiB'``, ``'4G'`` (binary), ``'1.5GB'`` (decimal), ``'200B'`` or ``'1024'``.

    Raises:
        ValueError: the text is not a non-negative number with a known unit (the message lists them).
    """
    lowered = text.strip().lower().replace("_", "").replace(",", "")
    number, unit = lowered, "b"
    for suffix in sorted(_PARSE_UNITS, key=len, reverse=True):
        if lowered.endswith(suffix):
            number, unit = lowered[: -len(suffix)].strip(), suffix
            break
    try:
        value = float(number)
    except ValueError:
        raise ValueError(
            f"cannot read {text!r} as a byte count; write e.g. 4GiB, 256MiB, 1.5GB, 200B or 1024 "
            "(K, M, G, T are binary, KB, MB, GB, TB decimal)"
        ) from None
    if value < 0:
        raise ValueError(f"byte count {text!r} is negative")
    return int(value * _PARSE_UNITS[unit])


def parse_ranks(text: str, world: int | None = None) -> tuple[int, ...]:
    """Ranks from ``'5'``, ``'0,5'``, ``'0-7'`` or a mix (``'0,8-11'``), sorted, without repeats.

    Args:
        text: the rank list.
        world: when given, every rank must be in ``range(world)``.

    Raises:
        ValueError: a part is not a rank or range, a range runs backwards, or a rank is outside the world.
    """
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"rank list {text!r}: {part!r} is not a rank or a range like 0-7") from None
        if first < 0 or last < first:
            raise ValueError(f"rank list {text!r}: range {part!r} is empty or negative; write LOW-HIGH, e.g. 0-7")
        out.update(range(first, last + 1))
    if not out:
        raise ValueError(f"rank list {text!r} names no rank; write e.g. 5, 0,5 or 0-7")
    if world is not None and max(out) >= world:
        bad = sorted(r for r in out if r >= world)
        raise ValueError(
            f"rank(s) {format_ranks(bad)} of {text!r} are outside the world of {world} ranks (0-{world - 1})"
        )
    return tuple(sorted(out))


def format_ranks(ranks: Iterable[int], *, limit: int | None = None) -> str:
    """Ranks as compact ranges: ``[0, 1, 2, 3, 7] -> '0-3, 7'``; ``limit`` caps the ranges shown (``', ...'``)."""
    runs: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    if limit is not None and len(parts) > limit:
        parts = [*parts[:limit], "..."]
    return ", ".join(parts)


def rank_phrase(ranks: Iterable[int], *, limit: int | None = 4) -> str:
    """``'rank 5'`` or ``'ranks 0-3, 7'`` (``limit`` caps the ranges shown)."""
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks, limit=limit)}"


def head_and_tail(items: Sequence[object], noun: str, *, keep: int = 12) -> list[str]:
    """One indented line per item, or, past ``2 * keep`` items, the first and last ``keep`` around a line saying how
    many ``noun`` are left out (a text summary of a long list)."""
    if len(items) <= 2 * keep:
        return [f"  {item}" for item in items]
    return ([f"  {item}" for item in items[:keep]] + [f"  ... {len(items) - 2 * keep} more {noun}"]
            + [f"  {item}" for item in items[-keep:]])
