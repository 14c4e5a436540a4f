"""SaveReport: a planned save summarized, problems first (over budget and why, heavy writers), in human units.

``summarize_save(layout, plan_set)`` takes the ``SavePlanSet`` that ``workbench.run.simulated.plan_save``
returns (or anything with ``policy``, ``plans``, ``schedules`` and ``writers``). ``str(report)`` is the summary:
findings, writers, then for each rank its totals and its all-gather calls grouped by (mesh dim, dtype) and
tensor pattern; ``report.full()`` adds every plan and every call; ``report.to_dict()`` is plain data.

Example::

    plan_set = plan_save(layout, ranks=[0], policy=SavePolicy.minimal(), budget_bytes=4 << 30)
    report = summarize_save(layout, plan_set)
    print(report)                      # '!! rank 0: predicted peak 14.2 GiB is over the 4 GiB budget ...'
    report.totals[0].bytes_received    # exact bytes rank 0 gathers from others
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from workbench.layout.model_layout import Layout
from workbench.mesh import format_mesh_dim
from workbench.name_patterns import group_by_pattern
from workbench.report import totals as _totals
from workbench.report.findings import Finding, format_findings
from workbench.report.layout_report import describe_mesh
from workbench.report.table import format_table
from workbench.report.totals import RankOutliers, RankTotals, outlier_ranks, rank_totals
from workbench.units import format_bytes, format_count, format_ranks, rank_phrase

__all__ = ["SaveReport", "oversized_tensors", "save_findings", "summarize_save"]


def oversized_tensors(plan_set: Any, rank: int) -> dict[str, int]:
    """``{name: output bytes}`` of the tensors ``rank``'s schedule gathers alone because each exceeds the budget."""
    names = dict.fromkeys(i.name for c in plan_set.schedules[rank].calls if c.oversized for i in c.items)
    if not names:
        return {}
    plans = {p.name: p for p in plan_set.plans[rank]}
    return {n: plans[n].output_bytes for n in names}


def _budget_finding(plan_set: Any, ranks: Sequence[int]) -> list[Finding]:
    """One finding per set of ranks with the same overrun (same peak, same oversized tensors)."""
    by_case: dict[tuple, list[int]] = {}
    for rank in ranks:
        s = plan_set.schedules[rank]
        if s.budget_bytes is not None and s.peak_bytes > s.budget_bytes:
            oversized = oversized_tensors(plan_set, rank)
            by_case.setdefault((s.peak_bytes, s.budget_bytes, tuple(sorted(oversized.items()))), []).append(rank)
    out = []
    for (peak, budget, oversized), members in by_case.items():
        sizes = dict(oversized)
        who = rank_phrase(members)
        message = (f"{who}: predicted peak {format_bytes(peak)} is over the {format_bytes(budget)} budget "
                   f"({peak / budget:.1f}x)")
        details: list[str] = []
        if sizes:
            message += f": {len(sizes)} tensor(s) larger than the budget are each gathered alone"
            groups = group_by_pattern(sizes, key=lambda n: sizes[n])
            rows = sorted((sub for g in groups for sub in (g, *g.exceptions)), key=lambda g: -g.value)
            details = [f"{g.pattern}: {len(g)} x {format_bytes(g.value)}" for g in rows]
            details.append(f"a budget of {format_bytes(peak)} or more avoids the overrun; a smaller one "
                           "cannot (these tensors are gathered whole)")
        else:
            details = ["no single tensor exceeds the budget; the model's wave packing did not keep it"]
        out.append(Finding("over_budget", "error", message, subject=who, details=tuple(details)))
    return out


def save_findings(plan_set: Any, ranks: Sequence[int], writers: RankOutliers,
                  totals: Mapping[int, RankTotals]) -> tuple[Finding, ...]:
    """What needs attention in a planned save: predicted peak over budget on ``ranks`` (error, naming the
    oversized tensors and their sizes), writers carrying far more bytes than the mean (warning)."""
    findings = _budget_finding(plan_set, ranks)
    if writers.heavy:
        top = sorted(writers.heavy, key=lambda r: -(totals[r].bytes_written or 0))
        details = tuple(f"rank {r}: {format_bytes(totals[r].bytes_written or 0)} in "
                        f"{format_count(totals[r].keys_written or 0)} HF keys" for r in top[:5])
        findings.append(Finding(
            "heavy_writer", "warning",
            f"{len(writers.heavy)} writer rank(s) write over {writers.heavy_factor:g}x the mean "
            f"{format_bytes(writers.mean)} of the {writers.ranks} writers; the slowest writer sets the save's time",
            subject=format_ranks(writers.heavy), details=details,
        ))
    return tuple(findings)


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveReport:
    """A planned save's summary for some ranks.

    Attributes:
        layout: the layout saved.
        plan_set: the planned save (``SavePlanSet``).
        ranks: the ranks described (those with a schedule).
        params: a glob on parameter names whose plans are listed (None: plans are not listed).
        totals: ``RankTotals`` of every rank (save fields filled where planned; ``bytes_written`` everywhere).
        writers: outliers of ``bytes_written`` among the ranks that write.
        findings: what needs attention, most severe first.
        hint: how to get the full listing.
    """

    layout: Layout
    plan_set: Any
    ranks: tuple[int, ...]
    params: str | None
    totals: Mapping[int, RankTotals]
    writers: RankOutliers
    findings: tuple[Finding, ...]
    hint: str = "report.full() lists every call"

    @property
    def policy(self) -> Any:
        """The save policy."""
        return self.plan_set.policy

    @property
    def budget_bytes(self) -> int | None:
        """The schedules' memory budget (None: unbounded)."""
        return self.plan_set.schedules[self.ranks[0]].budget_bytes if self.ranks else None

    @property
    def ok(self) -> bool:
        """True when no finding is an error."""
        return not any(f.severity == "error" for f in self.findings)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        budget = "unbounded" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        return (f"SaveReport({self.layout.name!r}, policy={self.policy}, ranks=[{format_ranks(self.ranks, limit=4)}], "
                f"budget={budget}, findings={len(self.findings)})")

    # -- text -------------------------------------------------------------------------------------------
    def _header(self) -> list[str]:
        budget = "no budget" if self.budget_bytes is None else f"budget {format_bytes(self.budget_bytes)}"
        lines = [f"save of {self.layout.name} [{self.policy}] on {describe_mesh(self.layout)}; {budget}"]
        lines += ["attention:", *format_findings(self.findings, indent="  ")] if self.findings else \
            ["attention: nothing (within budget, writers balanced)"]
        return lines

    def _writers_line(self) -> str:
        writers = self.plan_set.writers
        if not writers:
            return "writers: none (this policy keeps the runtime layout; nothing is written as HF keys)"
        w = self.writers
        total = sum(t.bytes_written or 0 for t in self.totals.values())
        return (f"writers: {format_count(len(writers))} HF keys ({format_bytes(total)}) written by {w.ranks} ranks; "
                f"mean {format_bytes(w.mean)}, most {format_bytes(w.most_value)} ({rank_phrase(w.most, limit=3)}), "
                f"least {format_bytes(w.least_value)} ({rank_phrase(w.least, limit=3)})")

    def _rank_title(self, rank: int) -> str:
        t, s = self.totals[rank], self.plan_set.schedules[rank]
        coord = ", ".join(f"{d}={c}" for d, c in zip(self.layout.mesh.dim_names, t.coordinate))
        keys = f"{format_count(t.keys_written or 0)} HF key{'s' if t.keys_written != 1 else ''}"
        return (f"rank {rank}  ({coord}): receives {format_bytes(t.bytes_received or 0)} in {s.num_calls} calls "
                f"({len(s.waves)} waves); predicted peak {format_bytes(t.peak_bytes or 0)}; writes {keys} "
                f"({format_bytes(t.bytes_written or 0)}); holds {format_bytes(t.bytes_held)}")

    def call_groups(self, rank: int) -> list[dict[str, Any]]:
        """``rank``'s calls grouped by (mesh dim, group size, dtype, oversized): counts, bytes, tensor patterns."""
        groups: dict[tuple, dict[str, Any]] = {}
        for c in self.plan_set.schedules[rank].calls:
            key = (format_mesh_dim(c.mesh_dim), c.world, str(c.dtype).removeprefix("torch."), c.oversized)
            g = groups.setdefault(key, {"mesh_dim": key[0], "world": key[1], "dtype": key[2], "oversized": key[3],
                                        "calls": 0, "tensors": 0, "bytes_received": 0, "names": {}})
            g["calls"] += 1
            g["tensors"] += len(c.items)
            g["bytes_received"] += c.bytes_out - c.bytes_in
            g["names"].update(dict.fromkeys(i.name for i in c.items))
        out = []
        for g in groups.values():
            names = g.pop("names")
            g["patterns"] = [p.pattern for p in group_by_pattern(names)]
            out.append(g)
        return out

    def rank_summary(self, rank: int) -> list[str]:
        """One rank's totals and its calls grouped."""
        rows = []
        for g in self.call_groups(rank):
            patterns = g["patterns"]
            more = len(patterns) - 2
            shown = ", ".join(patterns[:2]) + (f", +{more} pattern{'s' if more > 1 else ''}" if more > 0 else "")
            rows.append((g["mesh_dim"], str(g["world"]), g["dtype"], str(g["calls"]), format_count(g["tensors"]),
                         format_bytes(g["bytes_received"]), "OVERSIZED" if g["oversized"] else "", shown))
        lines = [self._rank_title(rank)]
        if rows:
            lines += format_table(("mesh dim", "W", "dtype", "calls", "tensors", "receives", "", "tensors gathered"),
                                  rows, right=(1, 3, 4, 5))
        else:
            lines.append("  no gathers: every tensor is saved as it is held")
        return lines

    def _plan_lines(self, rank: int, *, full: bool) -> list[str]:
        if self.params is None:
            return []
        plans = [p for p in self.plan_set.plans[rank] if fnmatch.fnmatchcase(p.name, self.params)]
        lines = [f"  save plans of {len(plans)} parameter(s) matching {self.params!r}:"]
        if full:
            return lines + [f"  {line}" for p in plans for line in str(p).splitlines()]
        by_name = {p.name: p for p in plans}

        def body(name: str) -> str:
            return "\n".join(str(by_name[name]).splitlines()[1:]) + f"|{by_name[name].runtime_output_shape}"

        for g in group_by_pattern(by_name, key=body):
            for sub in (g, *g.exceptions):
                text = str(by_name[sub.names[0]]).splitlines()
                lines.append(f"    {sub.pattern} ({len(sub)}): " + text[0].split(": ", 1)[1])
                lines += [f"    {line}" for line in text[1:]]
        return lines

    def summary(self) -> str:
        """Problems first, then writers, then each rank's totals and grouped calls."""
        lines = [*self._header(), self._writers_line()]
        for rank in self.ranks:
            lines += ["", *self.rank_summary(rank), *self._plan_lines(rank, full=False)]
        return "\n".join(lines)

    def full(self) -> str:
        """The summary, then per rank every listed plan and every call of its schedule."""
        lines = [self.summary()]
        for rank in self.ranks:
            schedule = self.plan_set.schedules[rank]
            lines += ["", f"rank {rank}: every call", *[f"  {c}" for c in schedule.calls],
                      *self._plan_lines(rank, full=True)]
        return "\n".join(lines)

    # -- data -------------------------------------------------------------------------------------------
    def to_dict(self, *, full: bool = False) -> dict[str, Any]:
        """Plain data (exact bytes): findings, writers, and per described rank its totals, schedule figures,
        grouped calls and oversized tensors (``full=True``: every call)."""
        ranks = []
        for rank in self.ranks:
            s = self.plan_set.schedules[rank]
            entry: dict[str, Any] = dict(self.totals[rank].to_dict())
            entry.update({"calls": s.num_calls, "waves": len(s.waves), "rounds": len(s.rounds),
                          "budget_bytes": s.budget_bytes, "call_groups": self.call_groups(rank),
                          "oversized": [{"name": n, "bytes": b}
                                        for n, b in oversized_tensors(self.plan_set, rank).items()]})
            if full:
                entry["every_call"] = [
                    {"wave": c.wave, "round": c.round, "mesh_dim": format_mesh_dim(c.mesh_dim), "world": c.world,
                     "dtype": str(c.dtype).removeprefix("torch."), "bytes_in": c.bytes_in, "bytes_out": c.bytes_out,
                     "oversized": c.oversized, "tensors": [i.name for i in c.items]}
                    for c in s.calls
                ]
            ranks.append(entry)
        return {
            "kind": "save",
            "layout": self.layout.name,
            "policy": str(self.policy),
            "mesh": {"shape": list(self.layout.mesh.shape), "dim_names": list(self.layout.mesh.dim_names),
                     "ranks": self.layout.mesh.size},
            "budget_bytes": self.budget_bytes,
            "findings": [f.to_dict() for f in self.findings],
            "writers": {"keys": len(self.plan_set.writers),
                        "bytes": sum(t.bytes_written or 0 for t in self.totals.values()), **self.writers.to_dict()},
            "ranks": ranks,
        }


def summarize_save(
    layout: Layout,
    plan_set: Any,
    *,
    ranks: Sequence[int] | None = None,
    params: str | None = None,
    key_bytes: Mapping[str, int] | None = None,
    hint: str = "report.full() lists every call",
) -> SaveReport:
    """Summarize a planned save for ``ranks`` (default: every planned rank, at most the first 4).

    Args:
        layout: the layout the save was planned for.
        plan_set: ``plan_save``'s result.
        ranks: ranks to describe; each must have been planned.
        params: a glob on parameter names whose save plans to list.
        key_bytes: ``{hf_key: bytes on disk}`` (``workbench.run.simulated.key_sizes`` gives the save's own;
            default: every key at its runtime dtype).
        hint: how to get the full listing (the CLI says ``--full``).

    Raises:
        ValueError: a rank was not planned.
    """
    planned = tuple(plan_set.schedules)
    shown = tuple(ranks) if ranks else planned[:4]
    missing = [r for r in shown if r not in plan_set.schedules]
    if missing:
        raise ValueError(f"rank(s) {format_ranks(missing)} were not planned "
                         f"(planned: {format_ranks(planned, limit=4)})")
    sizes = key_bytes if key_bytes is not None else _totals.key_bytes(layout)
    totals = rank_totals(layout, save=plan_set, key_bytes=sizes)
    writers = outlier_ranks(totals, "bytes_written", nonzero_only=True)
    findings = save_findings(plan_set, shown, writers, totals)
    return SaveReport(layout=layout, plan_set=plan_set, ranks=shown, params=params, totals=totals, writers=writers,
                      findings=findings, hint=hint)
