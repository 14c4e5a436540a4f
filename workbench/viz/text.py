"""Plain-text reports of a Layout, built on the summarizing layer (``workbench.report``).

``layout_report(layout)`` returns a ``LayoutReport``: ``print(report)`` shows the summary (problems first,
parameters grouped by layer pattern, human units), ``report.full()`` every key region of every parameter.
"""

from __future__ import annotations

from collections.abc import Sequence

from workbench.layout.model_layout import Layout
from workbench.report.layout_report import LayoutReport, summarize_layout

__all__ = ["layout_report", "select_ranks"]


def select_ranks(layout: Layout, ranks: Sequence[int] | None, *, limit: int = 16) -> list[int]:
    """Ranks to describe: the given ones, every rank of a mesh of <= ``limit`` ranks, else its first rank."""
    if ranks:
        return list(ranks)
    every = list(layout.mesh.all_ranks())
    return every if len(every) <= limit else every[:1]


def layout_report(
    layout: Layout,
    *,
    ranks: Sequence[int] | None = None,
    params: str | None = None,
    max_keys: int = 12,
) -> LayoutReport:
    """What ranks hold of every HF key, and the coverage verdict, as a report object.

    Args:
        layout: the layout to describe.
        ranks: ranks to describe (default: all of a mesh of <= 16 ranks, else its first rank).
        params: a glob on parameter names (``"*experts*"``) to narrow the report.
        max_keys: in ``full()``, key regions shown per rank and parameter before eliding the rest.

    Returns:
        A ``LayoutReport``: ``str()`` is the summary, ``.full()`` every line, ``.to_dict()`` plain data.
    """
    return summarize_layout(layout, ranks=select_ranks(layout, ranks), params=params, max_keys=max_keys)
