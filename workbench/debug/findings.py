"""Finding and Report: what a diagnosis found, with the evidence and the fix, as text, HTML and JSON."""

from __future__ import annotations

import html
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KINDS", "Finding", "Report"]

# DESIGN.md section 6: the diagnosis vocabulary (a contract; order = how reports sort them).
KINDS: tuple[str, ...] = (
    "incomplete_checkpoint",
    "corrupt_header",
    "truncated_file",
    "index_inconsistent",
    "missing_key",
    "unexpected_key",
    "renamed_key",
    "shape_mismatch",
    "dtype_mismatch",
    "permuted",
    "replicated_concat",
    "partial_shard",
    "padding_not_trimmed",
    "value_mismatch",
)
_ORDER = {k: i for i, k in enumerate(KINDS)}
_MAX_HTML_ROWS = 200


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing wrong with a checkpoint, said so a person can act on it.

    Args:
        kind: one of ``KINDS`` (DESIGN.md section 6).
        key: the HF key (or file, for file-level problems) it is about; ``""`` for the checkpoint itself.
        evidence: what was measured: shapes, dtypes, max abs diff, and ``transform`` when a layout
            transform reproduces the data exactly.
        hint: what to do about it.
    """

    kind: str
    key: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    hint: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _ORDER:
            raise ValueError(f"Finding kind {self.kind!r} is not one of {list(KINDS)}")
        object.__setattr__(self, "evidence", dict(self.evidence))

    def __hash__(self) -> int:
        return hash((self.kind, self.key, json.dumps(_jsonable(self.evidence), sort_keys=True), self.hint))

    @property
    def transform(self) -> str | None:
        """The transform that reproduces the data exactly, when one was found."""
        value = self.evidence.get("transform")
        return None if value is None else str(value)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"kind": self.kind, "key": self.key, "evidence": _jsonable(self.evidence), "hint": self.hint}

    def __str__(self) -> str:
        evidence = "; ".join(f"{k}={_short(v)}" for k, v in self.evidence.items())
        text = f"{self.kind:<21} {self.key or '(checkpoint)'}"
        if evidence:
            text += f"\n    evidence: {evidence}"
        if self.hint:
            text += f"\n    fix: {self.hint}"
        return text


@dataclass(frozen=True, slots=True)
class Report:
    """The findings of ``diff_checkpoints`` or ``diagnose``; empty findings means healthy.

    Args:
        subject: what was examined (a path).
        reference: what it was compared with (a path, a layout, a model), or "".
        findings: sorted by kind (most basic first), then key.
        stats: counts of what was compared (keys, equal by fingerprint, bytes read).
        readable: False when the subject (or the reference) could not be read at all (exit status 2).
    """

    subject: str
    reference: str = ""
    findings: tuple[Finding, ...] = ()
    stats: Mapping[str, Any] = field(default_factory=dict)
    readable: bool = True

    def __post_init__(self) -> None:
        ordered = sorted(set(self.findings), key=lambda f: (_ORDER[f.kind], f.key))
        object.__setattr__(self, "findings", tuple(ordered))
        object.__setattr__(self, "stats", dict(self.stats))

    @property
    def ok(self) -> bool:
        """True when there is nothing to report."""
        return self.readable and not self.findings

    @property
    def exit_status(self) -> int:
        """0 healthy, 1 findings, 2 could not read (the CLI's exit status)."""
        return 2 if not self.readable else (1 if self.findings else 0)

    def kinds(self) -> dict[str, int]:
        """``{kind: count}`` of the findings."""
        out: dict[str, int] = {}
        for f in self.findings:
            out[f.kind] = out.get(f.kind, 0) + 1
        return out

    def by_key(self, key: str) -> tuple[Finding, ...]:
        """The findings about one key."""
        return tuple(f for f in self.findings if f.key == key)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``--json`` prints)."""
        return {
            "subject": self.subject,
            "reference": self.reference,
            "readable": self.readable,
            "ok": self.ok,
            "kinds": self.kinds(),
            "findings": [f.to_dict() for f in self.findings],
            "stats": _jsonable(self.stats),
        }

    def to_json(self) -> str:
        """``to_dict`` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self) -> str:
        """A terminal report: the verdict, then one block per finding."""
        against = f" against {self.reference}" if self.reference else ""
        if not self.readable:
            verdict = "could not be read"
        elif not self.findings:
            verdict = "healthy: no findings"
        else:
            counts = ", ".join(f"{n} {k}" for k, n in self.kinds().items())
            verdict = f"{len(self.findings)} finding(s): {counts}"
        lines = [f"{self.subject}{against}: {verdict}"]
        if self.stats:
            lines.append("  " + ", ".join(f"{k} {_short(v)}" for k, v in self.stats.items()))
        lines.extend(str(f) for f in self.findings)
        return "\n".join(lines)

    __str__ = to_text

    def __repr__(self) -> str:
        return f"Report(subject={self.subject!r}, findings={len(self.findings)}, kinds={self.kinds()})"

    def _repr_html_(self) -> str:
        try:
            return _report_html(self)
        except Exception as exc:  # the HTML repr never raises
            warnings.warn(f"Report HTML rendering failed ({exc!r}); showing the text form", stacklevel=2)
            return f"<pre>{html.escape(repr(self))}</pre>"


def _report_html(report: Report) -> str:
    esc = html.escape
    colour = "#1a7f37" if report.ok else ("#b42318" if not report.readable else "#9a6700")
    head = esc(report.to_text().splitlines()[0])
    rows = []
    for f in report.findings[:_MAX_HTML_ROWS]:
        evidence = "<br>".join(f"<b>{esc(str(k))}</b>: {esc(_short(v))}" for k, v in f.evidence.items())
        rows.append(
            f"<tr><td><code>{esc(f.kind)}</code></td><td><code>{esc(f.key)}</code></td>"
            f"<td>{evidence}</td><td>{esc(f.hint)}</td></tr>"
        )
    more = len(report.findings) - _MAX_HTML_ROWS
    if more > 0:
        rows.append(f"<tr><td colspan=4>... and {more} more</td></tr>")
    table = (
        "<table style='border-collapse:collapse;font-size:12px'>"
        "<tr style='text-align:left'><th>kind</th><th>key</th><th>evidence</th><th>fix</th></tr>"
        + "".join(rows)
        + "</table>"
        if rows
        else ""
    )
    return f"<div><p style='color:{colour};font-weight:bold'>{head}</p>{table}</div>"


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return str(value)


def _short(value: Any, limit: int = 160) -> str:
    text = str(list(value)) if isinstance(value, tuple) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
