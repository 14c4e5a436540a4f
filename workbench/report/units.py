"""Human units, under the name the report layer has always offered them by: the code is ``workbench.units``, a
base module that every layer (mesh, layout and plan reprs included) may import."""

from workbench.units import (
    byte_tick_step,
    format_bytes,
    format_bytes_in,
    format_count,
    format_ranks,
    format_seconds,
    parse_bytes,
    parse_ranks,
    rank_phrase,
)

__all__ = [
    "byte_tick_step", "format_bytes", "format_bytes_in", "format_count", "format_ranks", "format_seconds",
    "parse_bytes", "parse_ranks", "rank_phrase",
]
