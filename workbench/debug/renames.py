"""Find the renaming (prefix, suffix or infix substitution) that maps unexpected keys onto missing ones, and the
numbered components (``layers.N``, ``experts.E``) whose every index moved by a constant."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from workbench.name_patterns import compress_indices

__all__ = ["IndexShift", "Rename", "find_renames", "index_shifts", "shift_pattern", "shift_words", "shifted_back"]

_SAMPLE = 32  # unexpected keys used to propose rules
_PER_KEY = 256  # missing keys each sample is compared with


@dataclass(frozen=True, slots=True)
class Rename:
    """``expected`` (a reference key) is stored as ``actual``, by the substitution ``old -> new``."""

    actual: str
    expected: str
    rule: str


def _rule(expected: str, actual: str) -> tuple[str, str, str, int]:
    """``(where, old, new, at)``: the differing dot-separated components of two keys, with their dots, and the
    position of the first of them (an infix is substituted there only: ``.0.`` -> ``.8.`` learned on the expert
    index must not rewrite ``layers.8``).

    ``("prefix", "", "model.", 0)`` adds a prefix; ``("suffix", ".weight", ".kernel", 0)``; ``("infix", ".a.", ".b.",
    2)``.
    """
    e, a = expected.split("."), actual.split(".")
    p = 0
    while p < min(len(e), len(a)) and e[p] == a[p]:
        p += 1
    s = 0
    while s < min(len(e), len(a)) - p and e[-1 - s] == a[-1 - s]:
        s += 1
    old, new = e[p : len(e) - s], a[p : len(a) - s]
    if p == 0:
        return "prefix", "".join(c + "." for c in old), "".join(c + "." for c in new), 0
    if s == 0:
        return "suffix", "".join("." + c for c in old), "".join("." + c for c in new), 0
    return "infix", "." + "".join(c + "." for c in old), "." + "".join(c + "." for c in new), p


def _apply(where: str, old: str, new: str, at: int) -> Callable[[str], str | None]:
    """The inverse map actual -> expected of one rule (None where the rule does not apply)."""
    old_parts, new_parts = (text.strip(".").split(".") if text.strip(".") else [] for text in (old, new))

    def back(actual: str) -> str | None:
        if where == "prefix":
            return old + actual[len(new) :] if actual.startswith(new) else None
        if where == "suffix":
            return actual[: len(actual) - len(new)] + old if actual.endswith(new) else None
        parts = actual.split(".")
        end = at + len(new_parts)
        if end >= len(parts) or parts[at:end] != new_parts:  # an infix keeps a component after it
            return None
        return ".".join([*parts[:at], *old_parts, *parts[end:]])

    return back


def find_renames(
    missing: Sequence[str], unexpected: Sequence[str], same: Callable[[str, str], bool]
) -> list[Rename]:
    """Pairs (unexpected -> missing) explained by a consistent renaming; ``same(expected, actual)`` says
    whether the two keys hold compatible tensors (equal shape and dtype).

    Rules are proposed from a sample of pairs and tried most-voted first; each key is used once.
    """
    if not missing or not unexpected:
        return []
    by_tail: dict[str, list[str]] = {}
    for m in missing:
        by_tail.setdefault(m.rsplit(".", 1)[-1], []).append(m)
    votes: Counter[tuple[str, str, str, int]] = Counter()
    for u in list(unexpected)[:_SAMPLE]:
        pool = by_tail.get(u.rsplit(".", 1)[-1]) or list(missing)
        for m in pool[:_PER_KEY]:
            if same(m, u):
                votes[_rule(m, u)] += 1
    left_missing = set(missing)
    left = list(unexpected)
    found: list[Rename] = []
    for (where, old, new, at), _ in votes.most_common(8):
        if old == new:
            continue
        back = _apply(where, old, new, at)
        text = f"{where} {old!r} -> {new!r}"
        rest = []
        for u in left:
            m = back(u)
            if m is not None and m in left_missing and same(m, u):
                found.append(Rename(u, m, text))
                left_missing.discard(m)
            else:
                rest.append(u)
        left = rest
    return found


def rename_hint(renames: Sequence[Rename], total: Mapping[str, int] | None = None) -> str:
    """One fix sentence for a rule."""
    del total
    rule = renames[0].rule if renames else ""
    return (f"the keys were renamed ({rule}): map them back in the key map (or rename the checkpoint's keys) so "
            "that the loader finds them")


@dataclass(frozen=True, slots=True)
class IndexShift:
    """The index at dot component ``at`` of the keys under ``stem`` (``*`` there: any index) is the reference's plus
    ``offset``: ``model.layers.{i + 1}...`` holds what the reference calls ``model.layers.{i}...``."""

    stem: str
    at: int
    offset: int

    def applies(self, parts: Sequence[str]) -> bool:
        """Whether a key (its dot components) has an index at ``at`` under ``stem``."""
        stem = self.stem.split(".") if self.at else []
        return len(parts) > self.at and _is_index(parts[self.at]) and all(
            s == p or (s == "*" and _is_index(p)) for s, p in zip(stem, parts[: self.at], strict=True))

    @property
    def name(self) -> str:
        """What the index counts, from the component before it (``layer`` for ``layers``), or ""."""
        last = self.stem.rsplit(".", 1)[-1]
        return "" if last in ("", "*") or _is_index(last) else last.removesuffix("s")


def _is_index(part: str) -> bool:
    return part.isascii() and part.isdigit() and (part == "0" or part[0] != "0")


def _general(stem: str) -> str:
    """``stem`` with every index as ``*``: ``model.layers.*.mlp.experts``."""
    return ".".join("*" if _is_index(p) else p for p in stem.split("."))


def _index_sets(keys: Iterable[str]) -> dict[tuple[str, int], set[int]]:
    """``{(stem, at): indices}`` of every numbered component, under its literal stem (``model.layers.3.mlp.experts``)
    and under its stem with every index as ``*`` (``model.layers.*.mlp.experts``)."""
    sets: dict[tuple[str, int], set[int]] = {}
    for key in keys:
        parts = key.split(".")
        for at, part in enumerate(parts):
            if _is_index(part):
                literal = ".".join(parts[:at])
                for stem in {literal, _general(literal)}:
                    sets.setdefault((stem, at), set()).add(int(part))
    return sets


def index_shifts(expected: Iterable[str], actual: Iterable[str]) -> list[IndexShift]:
    """By names alone, the numbered components whose indices in ``actual`` are those in ``expected`` moved by a
    constant (layers 1..48 where 0..47 are expected; two indices or more, else it is a rename); one layer's experts only
    where the experts of every layer are not shifted alike. The content has to confirm each."""
    want, got = _index_sets(expected), _index_sets(actual)
    found = []
    for (stem, at), indices in got.items():
        ref = want.get((stem, at))
        if ref is None or len(ref) < 2 or len(ref) != len(indices) or ref == indices:
            continue
        offset = min(indices) - min(ref)
        if {i + offset for i in ref} == indices:
            found.append(IndexShift(stem, at, offset))
    shifted = {(s.stem, s.at) for s in found}
    return [s for s in found if _general(s.stem) == s.stem or (_general(s.stem), s.at) not in shifted]


def shifted_back(shifts: Sequence[IndexShift], actual: str) -> str | None:
    """The reference key ``actual`` stands for under ``shifts`` (each one that applies, undone); None where none
    applies or an index would go below 0."""
    parts = actual.split(".")
    applying = [s for s in shifts if s.applies(parts)]
    for s in applying:
        index = int(parts[s.at]) - s.offset
        if index < 0:
            return None
        parts[s.at] = str(index)
    return ".".join(parts) if applying else None


def shift_pattern(shift: IndexShift, keys: Iterable[str]) -> str:
    """The stored keys' numbered component as a pattern: ``model.layers.{1..48}``, ``model.layers.{0..47}.mlp.experts.
    {1..8}``."""
    values: dict[int, set[int]] = {}
    parts: list[str] = []
    for key in keys:
        parts = key.split(".")[: shift.at + 1]
        for i, p in enumerate(parts):
            if _is_index(p):
                values.setdefault(i, set()).add(int(p))
    for i, found in values.items():
        text = compress_indices(found)
        parts[i] = text if len(found) == 1 else "{" + text + "}"
    return ".".join(parts)


def shift_words(shift: IndexShift, example: tuple[str, str], lowest: tuple[int, int]) -> tuple[str, str]:
    """``(transform, hint)`` of an index shift; ``example`` is (stored key, the key whose tensor it holds), ``lowest``
    the smallest index stored and expected."""
    k, what = shift.offset, f"{shift.name} " if shift.name else ""
    steps = "" if abs(k) == 1 else f"{abs(k)} "
    side = "before" if k > 0 else "after"
    transform = f"every {what}index is shifted by {k:+d}: each key holds the tensor of the index {steps}{side} it"
    hint = (f"the {what}index in these keys' names is off by {k:+d} (numbered from {lowest[0]} where the reference "
            f"counts from {lowest[1]}, or an offset in the conversion loop or the key map): renumber them "
            f"({example[0]} -> {example[1]}); the tensors are right, only their names moved")
    return transform, hint
