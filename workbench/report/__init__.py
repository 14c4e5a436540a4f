"""The summarizing layer: every report of workbench (CLI, text reprs, HTML reprs, the checkpoint inspector)
says things the same way, in human units, problems first.

Stable API (other packages build on these names; they are not renamed):

Units (``workbench.units``, imports nothing from workbench; any layer may use it)
    ``format_bytes(n, *, exact=False)`` -> ``'14.2 GiB'`` (``exact=True``: ``'14.2 GiB (15,267,266,560 B)'``),
    ``format_count(46183)`` -> ``'46,183'``, ``format_seconds(0.0125)`` -> ``'12.5 ms'``,
    ``format_ranks([0, 1, 2, 7])`` -> ``'0-2, 7'``, ``parse_bytes('4GiB')``, ``parse_ranks('0,5,8-11', world=None)``.

Patterns (``workbench.name_patterns``)
    ``group_by_pattern(names, key=None) -> tuple[PatternGroup, ...]``: one group per template
    (``model.layers.{0..60}.input_layernorm.weight``), members with another ``key`` value listed as the group's
    ``exceptions``. ``PatternGroup``: ``template``, ``names``, ``value``, ``exceptions``, ``pattern``,
    ``all_names``, ``full_pattern``. ``index_spans(names) -> tuple[IndexSpan, ...]``: numbered blocks (layers)
    and the names only some blocks have (dense first layers, an MTP layer). Helpers: ``split_template``,
    ``render_pattern``, ``compress_indices``.

Findings (``workbench.report.findings``)
    ``Finding(kind, severity, message, subject="", details=())`` with severity ``"error" | "warning" | "info"``;
    ``sort_findings`` (most severe first), ``format_findings(findings) -> list[str]``.

Totals (``workbench.report.totals``)
    ``rank_totals(layout, ranks=None, *, save=None, key_bytes=None) -> {rank: RankTotals}``: bytes held,
    bytes read on load, and with a planned save bytes received, predicted peak, bytes and keys written.
    ``outlier_ranks(totals, measure="bytes_held", *, heavy_factor=2.0, nonzero_only=False) -> RankOutliers``
    (most, least, empty, heavy ranks), ``uneven_shards(layout) -> tuple[UnevenShard, ...]``,
    ``key_bytes(layout) -> {hf_key: bytes}``.

Reports (objects: ``str(report)`` is the summary, ``report.full()`` every line, ``report.to_dict()`` plain
data for JSON with exact bytes, ``report.findings`` what needs attention)
    ``summarize_layout(layout, *, ranks=None, params=None) -> LayoutReport``
    ``summarize_save(layout, plan_set, *, ranks=None, params=None, key_bytes=None) -> SaveReport``
    ``format_table(header, rows, right=())`` aligns columns.

Python reports never print CLI flags; the CLI passes its own ``hint`` (``--full``) to the report.
"""

from workbench.name_patterns import (
    IndexSpan,
    PatternGroup,
    compress_indices,
    group_by_pattern,
    index_spans,
    render_pattern,
    split_template,
)
from workbench.report.findings import SEVERITIES, Finding, format_findings, sort_findings
from workbench.report.layout_report import LayoutReport, describe_mesh, layout_findings, summarize_layout
from workbench.report.save_report import SaveReport, save_findings, summarize_save
from workbench.report.table import format_table
from workbench.report.totals import (
    RankOutliers,
    RankTotals,
    UnevenShard,
    key_bytes,
    outlier_ranks,
    rank_totals,
    uneven_shards,
)
from workbench.units import (
    format_bytes,
    format_count,
    format_ranks,
    format_seconds,
    parse_bytes,
    parse_ranks,
    rank_phrase,
)

__all__ = [
    "SEVERITIES",
    "Finding",
    "IndexSpan",
    "LayoutReport",
    "PatternGroup",
    "RankOutliers",
    "RankTotals",
    "SaveReport",
    "UnevenShard",
    "compress_indices",
    "describe_mesh",
    "format_bytes",
    "format_count",
    "format_findings",
    "format_ranks",
    "format_seconds",
    "format_table",
    "group_by_pattern",
    "index_spans",
    "key_bytes",
    "layout_findings",
    "outlier_ranks",
    "parse_bytes",
    "parse_ranks",
    "rank_phrase",
    "rank_totals",
    "render_pattern",
    "save_findings",
    "sort_findings",
    "split_template",
    "summarize_layout",
    "summarize_save",
    "uneven_shards",
]
