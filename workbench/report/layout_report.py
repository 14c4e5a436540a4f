"""LayoutReport: what ranks hold, summarized by layer pattern with totals and problems first.

``str(report)`` is the summary (one rank of DeepSeek-V3 on 1,024 ranks fits in about 50 lines);
``report.full()`` lists every parameter's key regions and every coverage verdict; ``report.to_dict()`` is the
same data for JSON, with exact byte counts.

Example::

    report = summarize_layout(layout, ranks=[0])
    print(report)                 # summary: problems, coverage count, outlier ranks, rank 0 by pattern
    print(report.full())          # every key region of every parameter on rank 0, every coverage line
    report.totals[0].bytes_held   # exact bytes rank 0 holds
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from workbench.layout.coverage import CoverageReport
from workbench.layout.model_layout import Layout
from workbench.name_patterns import PatternGroup, compress_indices, group_by_pattern, index_spans
from workbench.report.findings import Finding, format_findings
from workbench.report.table import format_table
from workbench.report.totals import (
    RankOutliers,
    RankTotals,
    UnevenShard,
    outlier_ranks,
    rank_totals,
    uneven_shards,
)
from workbench.units import format_bytes, format_count, format_ranks, rank_phrase

__all__ = ["LayoutReport", "describe_mesh", "layout_findings", "select_layout", "summarize_layout"]

_REGION_LINES = 40  # a rank's summary lists its key regions (grouped) when they fit in this many lines


def describe_mesh(layout: Layout) -> str:
    """``'1024 ranks (dp=16, ep=64)'``."""
    dims = ", ".join(f"{n}={s}" for n, s in zip(layout.mesh.dim_names, layout.mesh.shape))
    return f"{layout.mesh.size} ranks ({dims})"


def select_layout(layout: Layout, params: str | None) -> Layout:
    """The layout restricted to parameters matching the glob ``params`` (the layout itself when None).

    Raises:
        ValueError: no parameter matches (the message shows a few names).
    """
    if params is None:
        return layout
    names = [n for n in layout if fnmatch.fnmatchcase(n, params)]
    if not names:
        some = ", ".join(list(layout)[:3])
        raise ValueError(f"no parameter of {layout.name!r} matches {params!r} (names look like {some}, ...)")
    if len(names) == len(layout):
        return layout
    return Layout(layout.mesh, {n: layout[n] for n in names},
                  {n: layout.dtypes[n] for n in names if n in layout.dtypes}, name=layout.name)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutReport:
    """A layout's summary for some ranks: findings first, coverage, outlier ranks, each rank by pattern.

    Attributes:
        layout: the layout described (restricted to the selected parameters).
        ranks: the ranks described in detail.
        params: the glob that selected the parameters (None: all).
        totals: ``RankTotals`` of every rank of the mesh.
        outliers: the ranks that hold the most and least bytes, and empty ranks.
        coverage: the coverage verdict of every parameter.
        uneven: parameters whose shards differ in size, largest waste first.
        findings: what needs attention, most severe first.
        max_keys: in ``full()``, key regions listed per rank and parameter before eliding.
        hint: how to get the full listing, shown when the summary leaves key regions out.
    """

    layout: Layout
    ranks: tuple[int, ...]
    params: str | None
    totals: Mapping[int, RankTotals]
    outliers: RankOutliers
    coverage: Mapping[str, CoverageReport]
    uneven: tuple[UnevenShard, ...]
    findings: tuple[Finding, ...]
    max_keys: int = 12
    hint: str = "report.full() lists every key region"

    @property
    def total_bytes(self) -> int:
        """Bytes of every parameter at its runtime dtype (checkpoint-visible shape)."""
        return sum(math.prod(s.visible_shape) * self.layout.dtype(n).itemsize for n, s in self.layout.specs.items())

    @property
    def ok(self) -> bool:
        """True when no finding is an error (coverage exact)."""
        return not any(f.severity == "error" for f in self.findings)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        errors = sum(f.severity == "error" for f in self.findings)
        return (f"LayoutReport({self.layout.name!r}, ranks=[{format_ranks(self.ranks, limit=4)}], "
                f"params={len(self.layout)}, total={format_bytes(self.total_bytes)}, findings={len(self.findings)}, "
                f"errors={errors})")

    # -- text -------------------------------------------------------------------------------------------
    def _header(self) -> list[str]:
        layout = self.layout
        patterns = len(group_by_pattern(layout.specs))
        lines = [
            f"layout {layout.name}: {format_count(len(layout))} parameters ({patterns} patterns), "
            f"{format_count(len(layout.hf_keys))} HF keys, {format_bytes(self.total_bytes)} on {describe_mesh(layout)}"
        ]
        if self.params is not None:
            lines.append(f"parameters matching {self.params!r} only")
        return lines

    def _problems(self) -> list[str]:
        if not self.findings:
            return ["attention: nothing (coverage exact, no empty rank, shards even)"]
        return ["attention:", *format_findings(self.findings, indent="  ")]

    def _coverage_line(self) -> list[str]:
        bad = [n for n, r in self.coverage.items() if not r.ok]
        checked = len(self.coverage)
        if not bad:
            return [f"coverage: all {format_count(checked)} parameters exact "
                    "(every element held once per replica group)"]
        lines = [f"coverage: {format_count(checked - len(bad))} of {format_count(checked)} parameters exact; "
                 f"NOT exact ({len(bad)}):"]
        for group in group_by_pattern(bad):
            lines.append(f"  {group.pattern}  {self.layout[group.names[0]].global_shape}  "
                         f"{self.layout[group.names[0]].describe_shards()}")
        return lines

    def _ranks_line(self) -> str:
        o = self.outliers
        if not o.ranks:
            return "ranks: none"
        empty = f"{len(o.empty)} empty (ranks {format_ranks(o.empty, limit=4)})" if o.empty else "no empty rank"
        return (f"ranks: {format_bytes(o.mean)} held on average; most {format_bytes(o.most_value)} "
                f"({rank_phrase(o.most, limit=3)}), least {format_bytes(o.least_value)} "
                f"({rank_phrase(o.least, limit=3)}); {empty}")

    def _rank_title(self, rank: int) -> str:
        t = self.totals[rank] if rank in self.totals else rank_totals(self.layout, [rank])[rank]
        coord = ", ".join(f"{d}={c}" for d, c in zip(self.layout.mesh.dim_names, t.coordinate))
        empty = f", {t.empty_tensors} empty" if t.empty_tensors else ""
        return (f"rank {rank}  ({coord}): holds {format_bytes(t.bytes_held)} in {format_count(t.tensors)} "
                f"tensors{empty}; reads {format_bytes(t.bytes_read)} of {format_count(t.hf_keys)} HF keys on load")

    def rank_summary(self, rank: int) -> list[str]:
        """Lines of one rank's summary: its totals, then one row per parameter pattern (exceptions below it)."""
        layout = self.layout

        def row_of(name: str) -> tuple:
            return (layout[name].local_shape(rank), layout.dtypes.get(name, "float32"))

        groups = group_by_pattern(layout.specs, key=row_of)
        rows = []
        for group in groups:
            rows.append(self._row(group, rank, ""))
            rows += [self._row(e, rank, "  except ") for e in group.exceptions]
        lines = [self._rank_title(rank)]
        lines += format_table(("parameters", "n", "local shape", "dtype", "bytes"), rows, right=(1, 4))
        regions = self._region_lines(groups, rank)
        if len(lines) + len(regions) <= _REGION_LINES:
            lines += ["  key regions:", *regions]
        else:
            lines.append(f"  ({format_count(sum(len(layout[n].key_regions(rank)) for n in layout))} key regions "
                         f"left out; {self.hint})")
        return lines

    def _row(self, group: PatternGroup, rank: int, lead: str) -> tuple[str, ...]:
        local, dtype = group.value
        nbytes = sum(math.prod(local) * self.layout.dtype(n).itemsize for n in group.names)
        note = "" if math.prod(local) else " (holds nothing)"
        return (f"{lead}{group.pattern}{note}", str(len(group)), str(local), dtype, format_bytes(nbytes))

    def _region_lines(self, groups: Sequence[PatternGroup], rank: int) -> list[str]:
        # A rank may read several regions of one key (an InterleavedShard's stripes): keys group by the whole
        # tuple of their regions, and each group gets one line per region.
        regions: dict[str, list[str]] = {}
        for group in groups:
            for name in group.all_names:
                for r in self.layout[name].key_regions(rank):
                    regions.setdefault(r.hf_key, []).append(_region_text(r))
        lines = []
        for g in group_by_pattern(regions, key=lambda k: tuple(regions[k])):
            for sub in (g, *g.exceptions):
                lines += [f"    {sub.pattern}{text}" for text in sub.value]
        return lines

    def summary(self) -> str:
        """Problems first, then coverage, outlier ranks, layer structure and each rank by pattern."""
        lines = self._header()
        lines += self._problems()
        lines += self._coverage_line()
        lines.append(self._ranks_line())
        lines += _span_lines(self.layout)
        for rank in self.ranks:
            lines += ["", *self.rank_summary(rank)]
        return "\n".join(lines)

    def full(self) -> str:
        """Every parameter's key regions on each described rank (``max_keys`` per parameter), then every
        parameter's coverage verdict, after the summary's header and problems."""
        layout = self.layout
        mesh = layout.mesh
        lines = self._header() + self._problems()
        width = max((len(n) for n in layout), default=0)
        for rank in self.ranks:
            coord = ", ".join(f"{d}={c}" for d, c in zip(mesh.dim_names, mesh.coordinate(rank)))
            lines += ["", f"rank {rank}  ({coord})"]
            for name in layout:
                spec = layout[name]
                local = spec.local_shape(rank)
                regions = spec.key_regions(rank)
                note = "" if regions else "   holds nothing" if 0 in local else "   holds only padding"
                nbytes = format_bytes(math.prod(local) * layout.dtype(name).itemsize)
                lines.append(f"  {name:<{width}}  local {local}  {layout.dtypes.get(name, 'float32')}  {nbytes}{note}")
                lines += [f"      {region}" for region in regions[: self.max_keys]]
                if len(regions) > self.max_keys:
                    lines.append(f"      ... {len(regions) - self.max_keys} more key regions")
        lines += ["", "coverage (every element held exactly once per replica group):"]
        failed = 0
        for name in layout:
            spec, report = layout[name], self.coverage[name]
            failed += not report.ok
            verdict = "exact" if report.ok else "NOT EXACT"
            lines.append(f"  {verdict:<9} {name:<{width}}  {spec.global_shape}  {spec.describe_shards()}  "
                         f"({report.replica_groups} replica group(s))")
            if not report.ok:
                lines += [f"      {line}" for line in str(report).splitlines()[1:]]
        lines.append(f"verdict: {'all exact' if not failed else f'{failed} parameter(s) NOT exact'} "
                     f"({len(layout)} parameters checked on {mesh.size} ranks)")
        return "\n".join(lines)

    # -- data -------------------------------------------------------------------------------------------
    def to_dict(self, *, full: bool = False) -> dict[str, Any]:
        """The report as plain data (exact byte counts): totals of every rank, findings, coverage, and per
        described rank its patterns (``full=True``: also every parameter's key regions)."""
        layout = self.layout
        ranks = []
        for rank in self.ranks:
            entry: dict[str, Any] = dict(self.totals[rank].to_dict())

            def row_of(name: str, rank: int = rank) -> tuple:
                return (layout[name].local_shape(rank), layout.dtypes.get(name, "float32"))

            entry["patterns"] = [
                _group_dict(sub, layout)
                for g in group_by_pattern(layout.specs, key=row_of) for sub in (g, *g.exceptions)
            ]
            if full:
                entry["parameters"] = [
                    {"name": n, "local_shape": list(layout[n].local_shape(rank)),
                     "dtype": layout.dtypes.get(n, "float32"),
                     "key_regions": [{"hf_key": r.hf_key, "key_offset": list(r.key_offset), "sizes": list(r.sizes),
                                      "local_offset": list(r.local_offset)} for r in layout[n].key_regions(rank)]}
                    for n in layout
                ]
            ranks.append(entry)
        bad = [n for n, r in self.coverage.items() if not r.ok]
        return {
            "kind": "layout",
            "layout": layout.name,
            "mesh": {"shape": list(layout.mesh.shape), "dim_names": list(layout.mesh.dim_names),
                     "ranks": layout.mesh.size},
            "params": self.params,
            "parameters": len(layout),
            "hf_keys": len(layout.hf_keys),
            "total_bytes": self.total_bytes,
            "findings": [f.to_dict() for f in self.findings],
            "coverage": {"checked": len(self.coverage), "exact": len(self.coverage) - len(bad), "not_exact": bad},
            "outliers": self.outliers.to_dict(),
            "uneven_waste_bytes": sum(u.waste_bytes for u in self.uneven),
            "ranks": ranks,
        }


def _span_lines(layout: Layout) -> list[str]:
    lines = []
    for span in index_spans(layout.specs):
        lines.append(f"layers: {span.prefix}.{{{compress_indices(span.indices)}}} ({len(span.indices)} blocks)"
                     + ("" if span.partial else ", every name in every block"))
        for indices, suffixes in span.partial:
            where = compress_indices(indices)
            listed = ", ".join(suffixes[:5]) + (f", +{len(suffixes) - 5} more" if len(suffixes) > 5 else "")
            lines.append(f"  only in {{{where}}}: {listed}")
    return lines


def _region_text(region: Any) -> str:
    key = ", ".join(f"{o}:{o + s}" for o, s in zip(region.key_offset, region.sizes))
    local = ", ".join(f"{o}:{o + s}" for o, s in zip(region.local_offset, region.sizes))
    return f"[{key}] -> local[{local}]"


def _group_dict(group: PatternGroup, layout: Layout) -> dict[str, Any]:
    local, dtype = group.value
    return {"pattern": group.pattern, "count": len(group), "local_shape": list(local), "dtype": dtype,
            "bytes": sum(math.prod(local) * layout.dtype(n).itemsize for n in group.names)}


def layout_findings(
    layout: Layout,
    coverage: Mapping[str, CoverageReport],
    outliers: RankOutliers,
    uneven: Sequence[UnevenShard],
    total_bytes: int,
) -> tuple[Finding, ...]:
    """What needs attention in a layout: coverage holes and overlaps (error), empty ranks and imbalance
    (warning), uneven shards (warning when they waste >= 1% of the model's bytes, else info)."""
    findings = []
    bad = [n for n, r in coverage.items() if not r.ok]
    for group in group_by_pattern(bad):
        report = coverage[group.names[0]]
        spec = layout[group.names[0]]
        findings.append(Finding(
            "coverage", "error",
            f"coverage NOT exact for {group.pattern} {spec.global_shape} ({spec.describe_shards()}): "
            f"{format_count(report.hole_elements)} elements held by no rank, "
            f"{format_count(report.overlap_elements)} held twice",
            subject=group.pattern, details=tuple(str(report).splitlines()[1:]),
        ))
    if outliers.empty:
        findings.append(Finding(
            "empty_ranks", "warning",
            f"{len(outliers.empty)} of {outliers.ranks} ranks hold nothing: {rank_phrase(outliers.empty, limit=6)}",
            subject=format_ranks(outliers.empty),
        ))
    if outliers.heavy:
        findings.append(Finding(
            "imbalance", "warning",
            f"{len(outliers.heavy)} rank(s) hold over {outliers.heavy_factor:g}x the mean "
            f"{format_bytes(outliers.mean)}: most {format_bytes(outliers.most_value)} on ranks "
            f"{format_ranks(outliers.most, limit=4)}",
            subject=format_ranks(outliers.heavy),
        ))
    if uneven:
        waste = sum(u.waste_bytes for u in uneven)
        share = waste / max(1, total_bytes)
        first = {u.name: u for u in uneven}
        by_pattern = sorted(group_by_pattern(first), key=lambda g: -sum(first[n].waste_bytes for n in g.names))
        details = []
        for g in by_pattern[:6]:
            u = first[g.names[0]]
            empty = f", {u.empty_ranks} of {u.ranks} ranks hold none" if u.empty_ranks else ""
            details.append(f"{g.pattern} {u.global_shape}: largest shard {format_bytes(u.max_bytes)}{empty}; "
                           f"{format_bytes(sum(first[n].waste_bytes for n in g.names))} padding")
        findings.append(Finding(
            "uneven_shards", "warning" if share >= 0.01 else "info",
            f"{len(uneven)} parameters ({len(by_pattern)} patterns) are cut unevenly: sizing every rank for the "
            f"largest shard costs {format_bytes(waste)} over {layout.mesh.size} ranks ({share:.2%} of the model)",
            subject=", ".join(g.pattern for g in by_pattern[:3]), details=tuple(details),
        ))
    return tuple(findings)


def summarize_layout(
    layout: Layout,
    *,
    ranks: Sequence[int] | None = None,
    params: str | None = None,
    max_keys: int = 12,
    hint: str = "report.full() lists every key region",
) -> LayoutReport:
    """Summarize ``layout`` for ``ranks``: per-rank totals of every rank, outliers, coverage, findings.

    Args:
        layout: the layout.
        ranks: ranks to describe in detail (default: every rank of a mesh of <= 16 ranks, else its first).
        params: a glob on parameter names (``"*experts*"``) to narrow everything to.
        max_keys: in ``full()``, key regions listed per rank and parameter.
        hint: the sentence telling how to get the full listing (the CLI says ``--full``).

    Raises:
        ValueError: a rank outside the mesh, or a glob matching no parameter.
    """
    selected = select_layout(layout, params)
    shown = _shown_ranks(layout, ranks)
    totals = rank_totals(selected)
    outliers = outlier_ranks(totals, heavy_factor=1.5)
    coverage = selected.coverage()
    uneven = uneven_shards(selected)
    total = sum(math.prod(s.visible_shape) * selected.dtype(n).itemsize for n, s in selected.specs.items())
    findings = layout_findings(selected, coverage, outliers, uneven, total)
    return LayoutReport(layout=selected, ranks=shown, params=params, totals=totals, outliers=outliers,
                        coverage=coverage, uneven=uneven, findings=findings, max_keys=max_keys, hint=hint)


def _shown_ranks(layout: Layout, ranks: Sequence[int] | None) -> tuple[int, ...]:
    """The ranks to describe: ``ranks`` (checked against the mesh's rank array), else every rank of a mesh of
    <= 16 ranks, else the mesh's first rank (a sub-mesh's ranks need not start at 0)."""
    every = layout.mesh.all_ranks()
    if ranks is None or not len(ranks):
        return tuple(every) if len(every) <= 16 else every[:1]
    shown = tuple(ranks)
    known = set(every)
    bad = [r for r in shown if r not in known]
    if bad:
        raise ValueError(f"rank(s) {format_ranks(bad)} outside {layout.name!r}'s {len(every)} ranks "
                         f"({format_ranks(every, limit=8)})")
    return shown
