"""Finding and Report: what a diagnosis found, with the evidence and the fix, as text, HTML and JSON.

A report shows its findings grouped (``FindingGroup``): one group per kind and fix, its keys summarized by layer
pattern (``model.layers.{0..3}.mlp.experts.{0..2}.w1.weight``, as the layout summary groups parameters), the
evidence every member shares once, the first keys' own evidence, and the fix once.
"""

from __future__ import annotations

import html
import json
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KINDS", "VALUES_NOT_COMPARED", "Finding", "FindingGroup", "Report", "key_named_in"]

# DESIGN.md section 6: the diagnosis vocabulary (a contract; order = how reports sort them).
KINDS: tuple[str, ...] = (
    "incomplete_checkpoint",
    "corrupt_header",
    "truncated_file",
    "index_inconsistent",
    "missing_key",
    "unexpected_key",
    "renamed_key",
    "misplaced_tensor",
    "shape_mismatch",
    "dtype_mismatch",
    "permuted",
    "replicated_concat",
    "partial_shard",
    "padding_not_trimmed",
    "precision_lost",
    "value_mismatch",
)
_ORDER = {k: i for i, k in enumerate(KINDS)}
_QUOTED_KEY = re.compile(r"key '((?:[^'\\]|\\.)*)'")  # how the file layer's problems quote a key
_MAX_HTML_ROWS = 200
_FIRST_KEYS = 3  # keys shown with their own evidence in a group
_LIMITS = {"written_from": 480, "held_by": 480, "transform": 320, "detail": 320}  # text kept of long evidence


def key_named_in(detail: str, prefix: str | None = None) -> str | None:
    """The key a problem of the file layer quotes (``key 'K'``): the first anywhere in ``detail``, or, given a
    ``prefix``, the one right after it (None where ``detail`` does not start so)."""
    if prefix is None:
        match = _QUOTED_KEY.search(detail)
    else:
        match = _QUOTED_KEY.match(detail, len(prefix)) if detail.startswith(prefix) else None
    return match.group(1) if match else None


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
        evidence = "; ".join(f"{k}={_short(v, _LIMITS.get(k, 160))}" for k, v in self.evidence.items())
        text = f"{self.kind:<21} {self.key or '(checkpoint)'}"
        if evidence:
            text += f"\n    evidence: {evidence}"
        if self.hint:
            text += f"\n    fix: {self.hint}"
        return text


@dataclass(frozen=True, slots=True)
class FindingGroup:
    """Findings of one kind with one fix, summarized by layer pattern.

    Attributes:
        kind: the findings' kind; hint: their fix (said once); findings: the members, sorted by key.
    """

    kind: str
    hint: str
    findings: tuple[Finding, ...]

    @property
    def count(self) -> int:
        """How many findings."""
        return len(self.findings)

    @property
    def keys(self) -> tuple[str, ...]:
        """The members' keys, in order."""
        return tuple(f.key for f in self.findings)

    @property
    def patterns(self) -> tuple[tuple[str, int], ...]:
        """``(layer pattern, count)`` of the keys, e.g. ``("model.layers.{0..3}.mlp.w1.weight", 4)``."""
        from workbench.name_patterns import group_by_pattern

        return tuple((g.pattern, len(g)) for g in group_by_pattern(k for k in self.keys if k))

    @property
    def shared(self) -> dict[str, Any]:
        """The evidence every member has, with the same value."""
        first = self.findings[0].evidence
        return {k: v for k, v in first.items()
                if all(k in f.evidence and _same_value(f.evidence[k], v) for f in self.findings[1:])}

    def where(self) -> str:
        """The keys as layer patterns with their counts (``'(checkpoint)'`` for a finding about no key)."""
        if not any(self.keys):
            return "(checkpoint)"
        patterns = self.patterns
        if len(patterns) == 1 and patterns[0][1] == 1:
            return patterns[0][0]
        return ", ".join(p if n == 1 else f"{p} ({n})" for p, n in patterns)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: kind, count, patterns, the shared evidence, the first keys and the fix."""
        return {"kind": self.kind, "count": self.count, "patterns": [list(p) for p in self.patterns],
                "evidence": _jsonable(self.shared), "first_keys": list(self.keys[:_FIRST_KEYS]), "hint": self.hint}

    def to_text(self) -> str:
        """One block: kind (x count) and where, the shared evidence, the first keys' own evidence, the fix."""
        if self.count == 1:
            return str(self.findings[0])
        shared = self.shared
        lines = [f"{self.kind + f' x{self.count}':<21} {self.where()}"]
        if shared:
            lines.append("    evidence (all): " + "; ".join(f"{k}={_short(v, _LIMITS.get(k, 160))}"
                                                          for k, v in shared.items()))
        for f in self.findings[:_FIRST_KEYS]:
            own = "; ".join(f"{k}={_short(v, _LIMITS.get(k, 160))}" for k, v in f.evidence.items() if k not in shared)
            lines.append(f"    {f.key or '(checkpoint)'}" + (f": {own}" if own else ""))
        if self.count > _FIRST_KEYS:
            lines.append(f"    ... and {self.count - _FIRST_KEYS} more")
        if self.hint:
            lines.append(f"    fix: {self.hint}")
        return "\n".join(lines)

    __str__ = to_text


def _same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values whose == is not a bool (tensors): not shared
        return False


VALUES_NOT_COMPARED = "not compared (no reference: keys, shapes and dtypes only)"  # a Report's stats["values"]


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

    def groups(self) -> tuple[FindingGroup, ...]:
        """The findings grouped by kind and fix (in kind order, then by first key)."""
        by: dict[tuple[str, str], list[Finding]] = {}
        for f in self.findings:
            by.setdefault((f.kind, f.hint), []).append(f)
        return tuple(FindingGroup(kind, hint, tuple(members)) for (kind, hint), members in by.items())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``--json`` prints): every finding, and the groups the text shows."""
        return {
            "subject": self.subject,
            "reference": self.reference,
            "readable": self.readable,
            "ok": self.ok,
            "kinds": self.kinds(),
            "findings": [f.to_dict() for f in self.findings],
            "groups": [g.to_dict() for g in self.groups()],
            "stats": _jsonable(self.stats),
        }

    def to_json(self) -> str:
        """``to_dict`` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)

    def _verdict(self) -> str:
        if not self.readable:
            return "could not be read"
        if not self.findings:
            if self.stats.get("values") == VALUES_NOT_COMPARED:
                return "no findings in keys, shapes and dtypes (values not compared: pass a reference to compare them)"
            return "healthy: no findings"
        counts = ", ".join(f"{n} {k}" for k, n in self.kinds().items())
        groups = len(self.groups())
        grouped = f" in {groups} group(s)" if groups < len(self.findings) else ""
        return f"{len(self.findings)} finding(s){grouped}: {counts}"

    def to_text(self) -> str:
        """A terminal report: the verdict, the stats, then one block per group of findings."""
        against = f" against {self.reference}" if self.reference else ""
        lines = [f"{self.subject}{against}: {self._verdict()}"]
        if self.stats:
            lines.append("  " + ", ".join(f"{k} {_short(v)}" for k, v in self.stats.items()))
        lines.extend(g.to_text() for g in self.groups())
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


# one colour per block of a reordering, the same block the same colour in the expected and the found order
_PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
            "#bab0ac")
_MAX_BLOCKS_DRAWN = 64


def _strip(order: list[int], label: str) -> str:
    cells = "".join(
        f"<span title='block {b}' style='display:inline-block;min-width:16px;padding:0 2px;margin:0 1px;"
        f"text-align:center;color:white;font-size:10px;background:{_PALETTE[b % len(_PALETTE)]}'>{b}</span>"
        for b in order
    )
    return f"<div style='white-space:nowrap'><span style='display:inline-block;width:64px'>{label}</span>{cells}</div>"


def order_html(finding: Finding) -> str:
    """For a finding whose evidence has a block ``order`` (a reordering found bit for bit): the expected order of
    the blocks beside the order found in the checkpoint, one colour per block; "" otherwise."""
    order = finding.evidence.get("order")
    if not isinstance(order, list | tuple) or not order or len(order) > _MAX_BLOCKS_DRAWN:
        return ""
    if not all(isinstance(b, int) for b in order):
        return ""
    rows, dim = finding.evidence.get("block_rows"), finding.evidence.get("dim", 0)
    unit = "" if not rows else f" ({rows} row(s) each)" if dim == 0 else f" ({rows} slice(s) on dim {dim} each)"
    return (f"<div style='margin-top:4px;font-family:monospace'>"
            f"{_strip(sorted(order), 'right')}{_strip(list(order), 'found')}"
            f"<div style='font-size:10px;color:#555'>blocks in checkpoint order{html.escape(unit)}</div></div>")


def _report_html(report: Report) -> str:
    esc = html.escape
    colour = "#1a7f37" if report.ok else ("#b42318" if not report.readable else "#9a6700")
    head = esc(report.to_text().splitlines()[0])
    rows = []
    groups = report.groups()
    for g in groups[:_MAX_HTML_ROWS]:
        shared = g.shared
        picture = order_html(g.findings[0])
        drawn = ("order", "block_rows", "dim") if picture else ()
        evidence = "<br>".join(f"<b>{esc(str(k))}</b>: {esc(_short(v, 480))}" for k, v in shared.items()
                               if k not in drawn)
        if g.count > 1:
            firsts = "".join(
                f"<li><code>{esc(f.key)}</code>: "
                + esc("; ".join(f"{k}={_short(v)}" for k, v in f.evidence.items() if k not in shared)) + "</li>"
                for f in g.findings[:_FIRST_KEYS])
            more = f"<li>... and {g.count - _FIRST_KEYS} more</li>" if g.count > _FIRST_KEYS else ""
            evidence += f"<ul style='margin:2px 0;padding-left:16px'>{firsts}{more}</ul>"
        kind = esc(g.kind) + (f" &times;{g.count}" if g.count > 1 else "")
        rows.append(
            f"<tr><td><code>{kind}</code></td><td><code>{esc(g.where())}</code></td>"
            f"<td>{evidence}{picture}</td><td>{esc(g.hint)}</td></tr>"
        )
    more = len(groups) - _MAX_HTML_ROWS
    if more > 0:
        rows.append(f"<tr><td colspan=4>... and {more} more group(s)</td></tr>")
    table = (
        "<table style='border-collapse:collapse;font-size:12px'>"
        "<tr style='text-align:left'><th>kind</th><th>keys</th><th>evidence</th><th>fix</th></tr>"
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
