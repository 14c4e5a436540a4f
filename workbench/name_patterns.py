"""Group names that differ only in their numbers: ``model.layers.{0..60}.input_layernorm.weight``.

A name's *template* replaces each dot-separated component that is a whole number by ``{}``
(``model.layers.{}.mlp.experts.{}.up_proj.weight``); digits inside a word (``q_a_proj``, ``fp8``, ``w1w3``)
are kept. ``group_by_pattern`` returns one ``PatternGroup`` per template, in order of first appearance, so
every distinct layer pattern is named once. With a ``key`` function (e.g. a rank's local shape), the members
that share the most common value form the group and the others are listed as its ``exceptions``: the dense
first layers of a MoE model, its MTP layer, a layer whose shard is empty.

====================================================  =====================================================
names                                                 pattern
====================================================  =====================================================
``model.layers.0.x`` ... ``model.layers.60.x``        ``model.layers.{0..60}.x``
layers 3..61, experts 0..255                          ``model.layers.{3..61}.mlp.experts.{0..255}.up_proj``
layers 0, 1, 2 and 61                                 ``model.layers.{0..2,61}.x``
one name                                              the name itself
====================================================  =====================================================

Example::

    groups = group_by_pattern(layout.specs, key=lambda name: layout[name].local_shape(0))
    for g in groups:
        print(g.pattern, len(g), g.value, [e.pattern for e in g.exceptions])
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "IndexSpan",
    "PatternGroup",
    "compress_indices",
    "group_by_pattern",
    "index_spans",
    "render_pattern",
    "split_template",
]


def split_template(name: str) -> tuple[str, tuple[int, ...]]:
    """``'model.layers.3.mlp.experts.17.w' -> ('model.layers.{}.mlp.experts.{}.w', (3, 17))``."""
    parts = name.split(".")
    numbers = tuple(int(p) for p in parts if p.isdigit())
    if not numbers:
        return name, ()
    return ".".join("{}" if p.isdigit() else p for p in parts), numbers


def compress_indices(values: Iterable[int]) -> str:
    """``[0, 1, 2, 61] -> '0..2,61'``; a single value stays a number (``'7'``)."""
    runs: list[list[int]] = []
    for v in sorted(set(values)):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}..{b}" if b > a + 1 else f"{a},{b}" for a, b in runs)


def render_pattern(template: str, indices: Sequence[tuple[int, ...]]) -> str:
    """The pattern of a template's members, e.g. ``model.layers.{0..60}.x``.

    Each ``{}`` gets its set of values (a single value is written bare). When the index tuples are not a
    product of per-position sets (layers 3..60 hold experts 0..255, layer 61 only 0..7), the leading
    positions are split into product blocks joined by ``' + '``.
    """
    if not indices:
        return template
    if not indices[0]:
        return template
    width = len(indices[0])
    columns = [sorted({t[i] for t in indices}) for i in range(width)]
    if len(set(indices)) == _product_size(columns):
        return _fill(template, columns)
    # not a product: group leading values by the set of tails they have, render each block
    tails: dict[int, set[tuple[int, ...]]] = {}
    for t in indices:
        tails.setdefault(t[0], set()).add(t[1:])
    blocks: dict[frozenset, list[int]] = {}
    for head in sorted(tails):
        blocks.setdefault(frozenset(tails[head]), []).append(head)
    head_template, _, tail_template = template.partition("{}")
    out = []
    for tail_set, heads in blocks.items():
        tail = render_pattern(tail_template, sorted(tail_set)) if width > 1 else tail_template
        out.append(head_template + _brace([*heads]) + tail)
    return " + ".join(out)


def _product_size(columns: Sequence[Sequence[int]]) -> int:
    size = 1
    for c in columns:
        size *= len(c)
    return size


def _brace(values: Sequence[int]) -> str:
    return str(values[0]) if len(values) == 1 else "{" + compress_indices(values) + "}"


def _fill(template: str, columns: Sequence[Sequence[int]]) -> str:
    pieces = template.split("{}")
    return "".join(itertools.chain.from_iterable(zip(pieces, [_brace(c) for c in columns] + [""])))


@dataclass(frozen=True, slots=True)
class PatternGroup:
    """Names of one template that share one value, plus the template's members that do not (``exceptions``).

    Attributes:
        template: the names with each numeric component replaced by ``{}``.
        names: the members sharing ``value``, in input order.
        value: what those members share (the ``key`` function's result; None without a key).
        exceptions: members of the same template with another value, one group per value (each has no
            exceptions of its own), largest first.
    """

    template: str
    names: tuple[str, ...]
    value: Hashable = None
    exceptions: tuple[PatternGroup, ...] = ()

    @property
    def indices(self) -> tuple[tuple[int, ...], ...]:
        """The numbers of each member of ``names``, in order."""
        return tuple(split_template(n)[1] for n in self.names)

    @property
    def pattern(self) -> str:
        """``names`` as one pattern, e.g. ``model.layers.{3..61}.mlp.gate.weight``."""
        return render_pattern(self.template, self.indices)

    @property
    def all_names(self) -> tuple[str, ...]:
        """Every member of the template: ``names`` then each exception's names."""
        return self.names + tuple(n for e in self.exceptions for n in e.names)

    @property
    def full_pattern(self) -> str:
        """Every member of the template (exceptions included) as one pattern."""
        return render_pattern(self.template, tuple(split_template(n)[1] for n in self.all_names))

    def __len__(self) -> int:
        return len(self.names)

    def __str__(self) -> str:
        return self.pattern


def group_by_pattern(
    names: Iterable[str],
    key: Callable[[str], Hashable] | None = None,
) -> tuple[PatternGroup, ...]:
    """One ``PatternGroup`` per template of ``names``, in order of first appearance.

    Args:
        names: the names (parameter names, HF keys); repeats are ignored. A mapping's keys work too.
        key: a value per name. Members sharing the most common value (ties: the first seen) make the group;
            the rest become its ``exceptions``, grouped by value.

    Returns:
        The groups; ``sum(len(g.all_names) for g in groups)`` is the number of distinct names.
    """
    by_template: dict[str, list[str]] = {}
    for name in dict.fromkeys(names):
        by_template.setdefault(split_template(name)[0], []).append(name)
    out = []
    for template, members in by_template.items():
        if key is None:
            out.append(PatternGroup(template, tuple(members)))
            continue
        by_value: dict[Hashable, list[str]] = {}
        for name in members:
            by_value.setdefault(key(name), []).append(name)
        counts = Counter({v: len(m) for v, m in by_value.items()})
        ranked = sorted(by_value, key=lambda v: -counts[v])  # stable: ties keep first-seen order
        main, rest = ranked[0], ranked[1:]
        exceptions = tuple(PatternGroup(template, tuple(by_value[v]), v) for v in rest)
        out.append(PatternGroup(template, tuple(by_value[main]), main, exceptions))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class IndexSpan:
    """The numbered blocks under one prefix (``model.layers``) and the names not present in every block.

    Attributes:
        prefix: the components before the first number, e.g. ``model.layers``.
        indices: every block number seen (``0..61``).
        partial: ``(indices, suffixes)`` for the suffixes present only in some blocks, grouped by the blocks
            they are in: ``((0, 1, 2), ('mlp.gate_proj.weight', ...))`` for the dense first layers of a MoE
            model, ``((61,), ('enorm.weight', ...))`` for its MTP layer. Ordered by first appearance.
    """

    prefix: str
    indices: tuple[int, ...]
    partial: tuple[tuple[tuple[int, ...], tuple[str, ...]], ...]

    def __str__(self) -> str:
        head = f"{self.prefix}.{{{compress_indices(self.indices)}}}: {len(self.indices)} blocks"
        parts = []
        for indices, suffixes in self.partial:
            where = _brace(sorted(indices))
            listed = ", ".join(suffixes[:4]) + (f", +{len(suffixes) - 4} more" if len(suffixes) > 4 else "")
            parts.append(f"only {where}: {listed}")
        return head + ("; " + "; ".join(parts) if parts else ", every name in every block")


def index_spans(names: Iterable[str]) -> tuple[IndexSpan, ...]:
    """The numbered blocks of ``names`` (layers) and the exceptions: names only some blocks have.

    Only prefixes with more than one block are returned. Example: DeepSeek-V3's parameters give one span,
    ``model.layers.{0..61}: 62 blocks; only {0..2}: mlp.gate_proj.weight, ...; only {3..61}:
    mlp.gate.weight, ...; only 61: embed_tokens.weight, enorm.weight, ...``.
    """
    blocks: dict[str, dict[str, set[int]]] = {}
    for name in dict.fromkeys(names):
        parts = name.split(".")
        first = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if first is None or first == len(parts) - 1:
            continue
        prefix = ".".join(parts[:first])
        suffix = split_template(".".join(parts[first + 1:]))[0]
        blocks.setdefault(prefix, {}).setdefault(suffix, set()).add(int(parts[first]))
    out = []
    for prefix, suffixes in blocks.items():
        every = set().union(*suffixes.values())
        if len(every) < 2:
            continue
        partial: dict[tuple[int, ...], list[str]] = {}
        for suffix, indices in suffixes.items():
            if indices != every:
                partial.setdefault(tuple(sorted(indices)), []).append(suffix)
        out.append(IndexSpan(prefix, tuple(sorted(every)), tuple((k, tuple(v)) for k, v in partial.items())))
    return tuple(out)
