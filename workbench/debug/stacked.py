"""An unexpected key that holds several missing keys back to back: a stale key map saved the runtime's tensor.

A runtime that stacks experts (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``) or fuses them (``fused_w1w3``
``[E * 2I, H]``) and a key map that no longer splits it leave one key where the reference has many. Such a key's
bytes are the missing keys' bytes in some order: it is cut at their sizes and each piece looked up by content hash
among the missing keys whose shape fits (one digest of each missing key, made once, a group of one shape and dtype
at a time), so the cost is one read of each key involved.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from workbench.debug.findings import Finding
from workbench.debug.source import KeyMeta
from workbench.debug.transforms import gate_up_groups
from workbench.debug.views import bits
from workbench.layout.model_layout import Layout
from workbench.name_patterns import compress_indices, split_template

__all__ = ["Joined", "MissingByContent", "find_joined", "find_joined_on_dim", "in_fused_order", "joined_finding"]

MAX_PARTS = 4096  # pieces of one key looked up (a stacked MoE layer: 2 per expert)
_MAX_SIZES = 4  # part sizes tried at each offset
_SHOWN = 4  # parts named in the words of an order with no pattern

Group = tuple[tuple[int, ...], str]  # (shape, dtype)


class MissingByContent:
    """Missing reference keys indexed by (shape, dtype), each group digested whole on first use."""

    def __init__(self, metas: Mapping[str, KeyMeta], keys: Sequence[str], digest: Callable[[str], bytes]) -> None:
        self.metas = metas
        self.digest = digest
        self.groups: dict[Group, list[str]] = {}
        for k in sorted(keys):
            self.groups.setdefault((metas[k].shape, metas[k].dtype), []).append(k)
        self._index: dict[Group, dict[bytes, list[str]]] = {}
        self.digests: dict[str, bytes] = {}

    def keys_with(self, group: Group, fingerprint: bytes) -> list[str]:
        """The keys of ``group`` whose bytes digest to ``fingerprint``."""
        index = self._index.get(group)
        if index is None:
            index = self._index[group] = {}
            for k in self.groups[group]:
                self.digests[k] = self.digest(k)
                index.setdefault(self.digests[k], []).append(k)
        return index.get(fingerprint, [])


@dataclass(frozen=True, slots=True)
class Joined:
    """What an unexpected key holds: ``parts`` in order; ``slices``: the parts of each dim-0 slice when stacked on a
    new dim 0 (None when concatenated); ``dim``: the dim of the parts (or of each slice's parts) they are
    concatenated on; ``new_dim``: the new dim (>= 1) they are stacked on instead, one part per index."""

    key: str
    parts: tuple[str, ...]
    slices: tuple[tuple[str, ...], ...] | None
    dim: int = 0
    new_dim: int | None = None


def _fits(part: tuple[int, ...], whole: tuple[int, ...]) -> bool:
    """Whether a part of shape ``part`` can be a piece of ``whole`` concatenated on dim 0, stacked on a new dim 0, or
    concatenated on dim 0 within each stacked slice."""
    return (len(part) == len(whole) and part[1:] == whole[1:]) or \
        (len(part) == len(whole) - 1 and len(part) >= 1 and part[1:] == whole[2:])


def find_joined(key: str, meta: KeyMeta, missing: MissingByContent, taken: set[str],
                piece: Callable[[int, int], bytes]) -> Joined | None:
    """The missing keys (not in ``taken``) whose bytes ``key`` holds back to back, all of it, in a shape that stacks
    or concatenates them; ``piece(start, stop)`` digests bytes of ``key``. None at the first piece no key matches."""
    if len(meta.shape) < 1 or meta.nbytes == 0:
        return None
    groups = [g for g in missing.groups if g[1] == meta.dtype and _fits(g[0], meta.shape)]
    sizes: dict[int, list[Group]] = {}
    for g in groups:
        size = missing.metas[missing.groups[g][0]].nbytes
        if 0 < size < meta.nbytes:
            sizes.setdefault(size, []).append(g)
    if not sizes or meta.nbytes // min(sizes) > MAX_PARTS:
        return None
    order = sorted(sizes, reverse=True)[:_MAX_SIZES]
    parts: list[str] = []
    used = set(taken)
    at = 0
    while at < meta.nbytes:
        hit = None
        for size in order:
            if at + size > meta.nbytes:
                continue
            fingerprint = piece(at, at + size)
            hit = next((k for g in sizes[size] for k in missing.keys_with(g, fingerprint) if k not in used), None)
            if hit is not None:
                at += size
                break
        if hit is None:
            return None
        parts.append(hit)
        used.add(hit)
    if len(parts) < 2 or len({missing.digests[p] for p in parts}) == 1:
        return None  # one part, or copies of one tensor (zeros fill any zero buffer): nothing tells them apart
    return _shaped(key, meta, tuple(parts), missing.metas)


_MAX_ARRANGEMENTS = 8  # joins on dims other than 0 tried for one key (each costs one read of it)
Box = tuple[slice, ...]


def _arrangements(whole: tuple[int, ...], part: tuple[int, ...]) -> Iterator[tuple[list[Box], int, int | None, int]]:
    """``(boxes, dim, new_dim, per_slice)``: the ways equal parts of shape ``part`` make ``whole`` joined on a dim
    other than 0 (dim 0 is ``find_joined``'s): concatenated on dim d; stacked on a new dim d; or stacked on a new
    dim 0, each slice's parts concatenated on its dim d (``per_slice`` parts a slice, 0 otherwise). Each box is a
    part's slices of ``whole``, in the parts' order."""
    def box(at: dict[int, slice]) -> Box:
        return tuple(at.get(i, slice(None)) for i in range(len(whole)))

    if len(part) == len(whole):
        for d in range(1, len(whole)):
            k = whole[d] // part[d] if part[d] else 0
            if k >= 2 and whole[d] == k * part[d] and all(whole[i] == part[i] for i in range(len(whole)) if i != d):
                yield [box({d: slice(j * part[d], (j + 1) * part[d])}) for j in range(k)], d, None, 0
    if len(part) == len(whole) - 1 and part:
        for d in range(1, len(whole)):
            if whole[d] >= 2 and whole[:d] + whole[d + 1:] == part:
                yield [box({d: slice(j, j + 1)}) for j in range(whole[d])], 0, d, 0
        for d in range(1, len(part)):  # each dim-0 slice the parts concatenated on the slice's dim d
            k = whole[d + 1] // part[d] if part[d] else 0
            if k >= 2 and whole[d + 1] == k * part[d] and all(whole[i + 1] == part[i]
                                                               for i in range(len(part)) if i != d):
                yield [box({0: slice(e, e + 1), d + 1: slice(j * part[d], (j + 1) * part[d])})
                       for e in range(whole[0]) for j in range(k)], d, None, k


def _box_digests(rows: Callable[[int, int], torch.Tensor], n_rows: int, step: int, boxes: list[Box]) -> list[bytes]:
    """The blake2b-16 digest of each box's elements in row-major order (the bytes a key of that shape holds), the
    whole tensor read once in blocks of ``step`` dim-0 rows."""
    hashes = [hashlib.blake2b(digest_size=16) for _ in boxes]
    for a in range(0, n_rows, step):
        b = min(n_rows, a + step)
        block = rows(a, b)
        for h, box in zip(hashes, boxes):
            lo, hi = max(a, box[0].start or 0), min(b, n_rows if box[0].stop is None else box[0].stop)
            if lo < hi:
                h.update(bits(block[(slice(lo - a, hi - a), *box[1:])]).numpy().tobytes())
    return [h.digest() for h in hashes]


def find_joined_on_dim(key: str, meta: KeyMeta, missing: MissingByContent, taken: set[str],
                       rows: Callable[[int, int], torch.Tensor], step: int) -> Joined | None:
    """The missing keys (not in ``taken``, all of one shape) that ``key`` holds joined on a dim other than 0 (gate and
    up concatenated on dim 1, experts stacked on dim 1, each stacked slice's parts concatenated on its dim 1), every
    element of it, in order; ``rows(a, b)`` reads its dim-0 rows ``a:b`` (``step`` at a time). ``missing`` must
    digest keys with blake2b-16 of their bytes. None when no arrangement holds."""
    if len(meta.shape) < 2 or meta.torch_dtype is None or meta.nbytes == 0:
        return None
    tried = 0
    for group in missing.groups:
        if group[1] != meta.dtype:
            continue
        for boxes, dim, new_dim, per_slice in _arrangements(tuple(meta.shape), group[0]):
            if tried == _MAX_ARRANGEMENTS or len(boxes) > MAX_PARTS:
                return None
            tried += 1
            parts, used = [], set(taken)
            for fingerprint in _box_digests(rows, meta.shape[0], step, boxes):
                hit = next((k for k in missing.keys_with(group, fingerprint) if k not in used), None)
                if hit is None:
                    break
                parts.append(hit)
                used.add(hit)
            if len(parts) == len(boxes) and len({missing.digests[p] for p in parts}) > 1:
                slices = tuple(tuple(parts[i:i + per_slice]) for i in range(0, len(parts), per_slice)) \
                    if per_slice else None
                return Joined(key, tuple(parts), slices, dim, new_dim)
    return None


def _shaped(key: str, meta: KeyMeta, parts: tuple[str, ...], metas: Mapping[str, KeyMeta]) -> Joined | None:
    shapes = [metas[p].shape for p in parts]
    if all(len(s) == len(meta.shape) for s in shapes):
        return Joined(key, parts, None)
    if not all(len(s) == len(meta.shape) - 1 for s in shapes):
        return None
    slices, current, rows = [], [], 0
    for p, s in zip(parts, shapes):
        current.append(p)
        rows += s[0]
        if rows > meta.shape[1]:
            return None  # a part crosses a slice's end: not a stack of whole keys
        if rows == meta.shape[1]:
            slices.append(tuple(current))
            current, rows = [], 0
    return Joined(key, parts, tuple(slices)) if len(slices) == meta.shape[0] and not current else None


def _pattern(chunks: Sequence[Sequence[str]]) -> tuple[str, str] | None:
    """``("a.{i}.gate + a.{i}.up", "i = 0..3")`` when every chunk is the first one's keys with one index moving (the
    same index in all of a chunk's keys); None otherwise."""
    split = [[split_template(k) for k in c] for c in chunks]
    templates = [t for t, _ in split[0]]
    numbers = []
    for c in split:
        if [t for t, _ in c] != templates or len({n for _, n in c}) != 1:
            return None
        numbers.append(c[0][1])
    moving = [i for i in range(len(numbers[0])) if len({n[i] for n in numbers}) > 1]
    if len(moving) != 1 or len(set(numbers)) != len(numbers):
        return None
    at = moving[0]

    def filled(template: str, n: tuple[int, ...]) -> str:
        values = ["{i}" if j == at else str(v) for j, v in enumerate(n)]
        pieces = template.split("{}")
        return pieces[0] + "".join(v + rest for v, rest in zip(values, pieces[1:]))

    words = " + ".join(filled(t, numbers[0]) for t in templates)
    index = [n[at] for n in numbers]
    span = f"i = {compress_indices(index)}" if index == sorted(index) else f"i in the order {index}"
    return words, span


def _listed(parts: Sequence[str]) -> str:
    shown = list(parts[:_SHOWN]) + (["...", parts[-1]] if len(parts) > _SHOWN + 1 else list(parts[_SHOWN:]))
    return ", ".join(shown)


def _period(parts: Sequence[str]) -> list[tuple[str, ...]] | None:
    """``parts`` cut into chunks of the shortest length that repeats the same keys with one index moving."""
    for p in range(1, len(parts) // 2 + 1):
        if len(parts) % p == 0:
            chunks = [tuple(parts[i:i + p]) for i in range(0, len(parts), p)]
            if _pattern(chunks) is not None:
                return chunks
    return None


def joined_words(found: Joined, meta: KeyMeta, metas: Mapping[str, KeyMeta]) -> str:
    """How ``found.key`` holds its parts, in their order."""
    n = len(found.parts)
    if found.new_dim is not None:
        chunks = [(p,) for p in found.parts]
        order = _pattern(chunks)
        words = f"{order[0]}, for {order[1]}" if order is not None else _listed(found.parts)
        return f"{n} expected keys stacked on a new dim {found.new_dim}, in the order {words}"
    if found.slices is not None:
        pattern = _pattern(found.slices)
        per = {len(s) for s in found.slices}
        inner = f" concatenated on dim {found.dim}" if per != {1} else ""
        if pattern is not None:
            return (f"{n} expected keys stacked on a new dim 0 ({meta.shape[0]} slices): slice i = {pattern[0]}"
                    f"{inner}, for {pattern[1]}")
        return (f"{n} expected keys stacked on a new dim 0 ({meta.shape[0]} slices{', each ' if inner else ''}"
                f"{inner.strip()}), in the order {_listed(found.parts)}")
    rows = {metas[p].shape[found.dim] for p in found.parts}
    unit = "rows" if found.dim == 0 else f"slices on dim {found.dim}"
    size = f" of {rows.pop()} {unit} each" if len(rows) == 1 else ""
    chunks = _period(found.parts)
    order = _pattern(chunks) if chunks is not None else None
    words = f"{order[0]}, for {order[1]}" if order is not None else _listed(found.parts)
    return f"{n} expected keys{size} concatenated on dim {found.dim}, in the order {words}"


def joined_finding(found: Joined, meta: KeyMeta, metas: Mapping[str, KeyMeta]) -> Finding:
    """A ``renamed_key`` finding: the key holds these expected keys, the key map that wrote it is stale."""
    how = "stacked" if found.slices is not None else "fused"
    evidence = {"transform": joined_words(found, meta, metas), "parts": len(found.parts), "shape": list(meta.shape),
                "expected_keys": list(found.parts), "verified": "by content hash of each part"}
    return Finding("renamed_key", found.key, evidence,
                   f"the key map that wrote this checkpoint is stale: it saved the runtime's {how} tensor under its "
                   "own name where the reference has the keys in expected_keys; the weights are all there, so do not "
                   "drop it: split it into those keys in that order (fix the key map, or have the loader split it)")


def _order_words(found: Sequence[str], order: Sequence[str]) -> tuple[str, str]:
    """``(evidence, hint words)``: how ``found`` departs from ``order`` (the same keys): gate/up swapped in each
    pair, or the positions."""
    pairs = gate_up_groups(order)
    if pairs and list(found) == [k for a, b in zip(order[::2], order[1::2]) for k in (b, a)]:
        each = f" in each of {pairs} pairs" if pairs > 1 else ""
        return f"gate/up swapped{each}: {found[0]} before {found[1]}", f"gate and up swapped{each} (up before gate)"
    at = {k: i for i, k in enumerate(order)}
    positions = [at[k] for k in found]
    shown = positions if len(positions) <= 16 else [*positions[:16], "..."]
    return f"the parts in the layout's positions {shown}", "in another order (order_vs_layout)"


def in_fused_order(finding: Finding, layout: Layout | None) -> Finding:
    """``finding`` (a key found to hold several expected keys, ``expected_keys`` in the order found) checked against
    the order in which ``layout`` fuses them (its parameter's ``hf_keys``): where they differ, the evidence says how
    (``parameter``, ``layout_order``, ``order_vs_layout``) and the hint says that the fused order is wrong."""
    parts = finding.evidence.get("expected_keys")
    if layout is None or finding.kind != "renamed_key" or not isinstance(parts, list) or len(parts) < 2:
        return finding
    owner = {k: name for name, spec in layout.specs.items() for k in spec.hf_keys}
    names = {owner.get(p) for p in parts}
    name = names.pop() if len(names) == 1 else None
    if name is None or layout.specs[name].fused_dim is None:
        return finding
    wanted = set(parts)
    order = [k for k in layout.specs[name].hf_keys if k in wanted]
    if order == parts:
        return finding
    said, words = _order_words(parts, order)
    hint = (f"{finding.hint}. Its parts are not in the order the layout's fused parameter has them (layout_order): "
            f"{words}; whatever fused this key wrote them in the wrong order: split it in the order found "
            "(expected_keys) to get each key right, and fix the fused order where it was written (read as that "
            "parameter, the parts land in each other's place)")
    return Finding(finding.kind, finding.key, {**finding.evidence, "parameter": name, "layout_order": order,
                                               "order_vs_layout": said}, hint)
