"""Plain-text reports of a Layout: what every rank holds of every HF key, and the coverage verdict."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from workbench.layout.model_layout import Layout

__all__ = ["layout_report", "select_ranks"]


def select_ranks(layout: Layout, ranks: Sequence[int] | None, *, limit: int = 16) -> list[int]:
    """Ranks to show: the given ones, every rank of a small mesh, else the first and last few."""
    every = list(layout.mesh.all_ranks())
    if ranks:
        return list(ranks)
    if len(every) <= limit:
        return every
    return every[:2] + every[-2:]


def layout_report(
    layout: Layout,
    *,
    ranks: Sequence[int] | None = None,
    params: str | None = None,
    max_keys: int = 12,
) -> str:
    """Per rank, the region of every HF key it holds; then the coverage verdict of each parameter.

    Args:
        layout: the layout to describe.
        ranks: ranks to list (default: all of a mesh of <= 16 ranks, else the first and last two).
        params: a glob on parameter names (``"*experts*"``) to narrow the report.
        max_keys: per rank and parameter, key regions shown before eliding the rest.
    """
    names = [n for n in layout if params is None or fnmatch.fnmatchcase(n, params)]
    shown = select_ranks(layout, ranks)
    mesh = layout.mesh
    lines = [
        f"layout {layout.name}: {mesh!r}, {mesh.size} ranks, {len(layout)} parameters, "
        f"{len(layout.hf_keys)} HF keys",
    ]
    if len(names) != len(layout):
        lines.append(f"showing {len(names)} parameters matching {params!r}")
    if len(shown) < mesh.size:
        lines.append(f"showing ranks {shown} of {mesh.size} (pass --rank to pick others)")
    width = max((len(n) for n in names), default=0)
    for rank in shown:
        coord = ", ".join(f"{d}={c}" for d, c in zip(mesh.dim_names, mesh.coordinate(rank)))
        lines += ["", f"rank {rank}  ({coord})"]
        for name in names:
            spec = layout[name]
            local = spec.local_shape(rank)
            regions = spec.key_regions(rank)
            note = "" if regions else "   holds nothing" if 0 in local else "   holds only padding"
            lines.append(f"  {name:<{width}}  local {local}  {layout.dtypes.get(name, 'float32')}{note}")
            for region in regions[:max_keys]:
                lines.append(f"      {region}")
            if len(regions) > max_keys:
                lines.append(f"      ... {len(regions) - max_keys} more key regions")
    lines += ["", "coverage (every element held exactly once per replica group):"]
    reports = layout.coverage()
    failed = 0
    for name in names:
        spec, report = layout[name], reports[name]
        failed += not report.ok
        verdict = "exact" if report.ok else "NOT EXACT"
        lines.append(
            f"  {verdict:<9} {name:<{width}}  {spec.global_shape}  {spec.describe_shards()}  "
            f"({report.replica_groups} replica group(s))"
        )
        if not report.ok:
            lines += [f"      {line}" for line in str(report).splitlines()[1:]]
    lines.append(
        f"verdict: {'all exact' if not failed else f'{failed} parameter(s) NOT exact'} "
        f"({len(names)} parameters checked on {mesh.size} ranks)"
    )
    return "\n".join(lines)
