"""Findings: what needs attention, most severe first, each one line in human units plus optional details.

Reports (layout, save, and the checkpoint inspector built on this layer) lead with their findings.
``severity`` orders them: ``"error"`` (the result will be wrong or the run will fail: a coverage hole, a
budget the save cannot keep), ``"warning"`` (it works but costs: empty ranks, a writer carrying far more
bytes than the mean, uneven shards that waste memory), ``"info"`` (worth knowing).

Example::

    f = Finding("over_budget", "error", "predicted peak 14.2 GiB is over the 4 GiB budget",
                subject="rank 0", details=("model.layers.{3..61}.mlp.experts.fused_w1w3: 14 GiB each",))
    print("\\n".join(format_findings([f])))
    # ! predicted peak 14.2 GiB is over the 4 GiB budget
    #     model.layers.{3..61}.mlp.experts.fused_w1w3: 14 GiB each
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["SEVERITIES", "Finding", "format_findings", "sort_findings"]

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[str, ...] = ("error", "warning", "info")
_MARK = {"error": "!!", "warning": "! ", "info": "- "}


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing a report wants a person to look at.

    Attributes:
        kind: a short stable tag, e.g. ``"over_budget"``, ``"coverage"``, ``"empty_ranks"``,
            ``"heavy_writer"``, ``"uneven_shards"``, ``"imbalance"``.
        severity: ``"error"``, ``"warning"`` or ``"info"``.
        message: one line, human units, saying what is wrong and where.
        subject: what it is about (a parameter pattern, a rank list), for filtering and HTML.
        details: further lines (the oversized tensors with their sizes, the holes), shown indented.
    """

    kind: str
    severity: Severity
    message: str
    subject: str = ""
    details: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"Finding {self.kind!r}: severity {self.severity!r} is not one of {SEVERITIES}")

    def __str__(self) -> str:
        return "\n".join(format_findings([self]))

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return {"kind": self.kind, "severity": self.severity, "message": self.message, "subject": self.subject,
                "details": list(self.details)}


def sort_findings(findings: Iterable[Finding]) -> tuple[Finding, ...]:
    """Errors, then warnings, then info; the given order within a severity."""
    return tuple(sorted(findings, key=lambda f: SEVERITIES.index(f.severity)))


def format_findings(findings: Iterable[Finding], *, max_details: int = 6, indent: str = "") -> list[str]:
    """Lines of the findings, most severe first: ``'!! message'`` for errors, ``'!  message'`` for warnings,
    ``'-  message'`` for info, then up to ``max_details`` indented detail lines each."""
    lines: list[str] = []
    for f in sort_findings(findings):
        lines.append(f"{indent}{_MARK[f.severity]} {f.message}")
        shown = f.details[:max_details]
        lines += [f"{indent}     {d}" for d in shown]
        if len(f.details) > len(shown):
            lines.append(f"{indent}     ... {len(f.details) - len(shown)} more")
    return lines
