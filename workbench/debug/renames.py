"""Find the renaming (prefix, suffix or infix substitution) that maps unexpected keys onto missing ones."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Rename", "find_renames"]

_SAMPLE = 32  # unexpected keys used to propose rules
_PER_KEY = 256  # missing keys each sample is compared with


@dataclass(frozen=True, slots=True)
class Rename:
    """``expected`` (a reference key) is stored as ``actual``, by the substitution ``old -> new``."""

    actual: str
    expected: str
    rule: str


def _rule(expected: str, actual: str) -> tuple[str, str, str]:
    """``(where, old, new)``: the differing dot-separated components of two keys, with their dots.

    ``("prefix", "", "model.")`` adds a prefix; ``("suffix", ".weight", ".kernel")``; ``("infix", ".a.", ".b.")``.
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
        return "prefix", "".join(c + "." for c in old), "".join(c + "." for c in new)
    if s == 0:
        return "suffix", "".join("." + c for c in old), "".join("." + c for c in new)
    return "infix", "." + "".join(c + "." for c in old), "." + "".join(c + "." for c in new)


def _apply(where: str, old: str, new: str) -> Callable[[str], str | None]:
    """The inverse map actual -> expected of one rule (None where the rule does not apply)."""

    def back(actual: str) -> str | None:
        if where == "prefix":
            return old + actual[len(new) :] if actual.startswith(new) else None
        if where == "suffix":
            return actual[: len(actual) - len(new)] + old if actual.endswith(new) else None
        return actual.replace(new, old, 1) if new in actual else None

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
    votes: Counter[tuple[str, str, str]] = Counter()
    for u in list(unexpected)[:_SAMPLE]:
        pool = by_tail.get(u.rsplit(".", 1)[-1]) or list(missing)
        for m in pool[:_PER_KEY]:
            if same(m, u):
                votes[_rule(m, u)] += 1
    left_missing = set(missing)
    left = list(unexpected)
    found: list[Rename] = []
    for (where, old, new), _ in votes.most_common(8):
        if old == new:
            continue
        back = _apply(where, old, new)
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
