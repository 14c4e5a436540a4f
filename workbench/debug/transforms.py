"""The transforms real checkpoint bugs produce, as maps between slices, tested on signatures then exactly.

A candidate says: "actual slice ``i`` along ``dim`` is reference slice ``src[i]``" (``-1``: padding that
the reference does not have). Candidates come from the layout's cuts (group size W, interleave factor F)
when known, and otherwise from small factors:

==========================  =========================  ==========================================
bug                         finding kind               map (reference blocks of N / (W*F) rows)
==========================  =========================  ==========================================
interleaved gathered as     ``permuted``               block ``r*F + j`` holds block ``j*W + r``
contiguous (W, F)
contiguous treated as       ``permuted``               the inverse
interleaved (W, F)
wrong rank order            ``permuted``               reversed, the two mesh dims of W swapped, or
                                                       string-sorted (rank 10 before rank 2)
layout's cuts gathered in   ``permuted``               the ranks of two or more cuts on one dim ordered
another mesh-dim order                                 by another mesh dim first (fsdp-major, not ep-major)
interleave applied twice    ``permuted``               the interleave's map composed with itself
one shard in every slot     ``partial_shard``          every block holds reference block ``k``
gate/up halves swapped      ``permuted``               halves swapped (in each of k groups), only where gate
                                                       and up are two halves on that dim (the layout's
                                                       fused keys, or the key's name and shape); a map that
                                                       is also two shards reversed names both readings
two halves swapped          ``permuted``               the same map anywhere else (no gate/up claimed)
gate/up rows interleaved    ``permuted``               row ``2i + h`` holds row ``h*N/2 + i`` (or the inverse)
q/k/v in another order      ``permuted``               three parts of N*m/(m+2), N/(m+2), N/(m+2) reordered
transposed                  ``permuted``               ``actual = reference.T``
replicated x W              ``replicated_concat``      ``i -> i % N``
one shard only              ``partial_shard``          rank r's rows (contiguous or interleaved), only
                                                       where torch's chunk rule gives that piece
a piece no split gives      ``shape_mismatch``         slices ``a:b`` of the reference
padding not trimmed         ``padding_not_trimmed``    ``i -> i`` for ``i < N``, then padding
==========================  =========================  ==========================================

A candidate is reported only when the data matches it exactly (bit for bit, streamed in blocks). With a layout's
cuts, an interleaved shard is claimed only on a dim the layout cuts with one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import chain, permutations, product

import torch

from workbench.debug.signatures import Signatures
from workbench.debug.views import TensorView, bits

__all__ = ["Candidate", "Hint", "chunk_shard", "gate_up_groups", "gate_up_hints", "on_dim", "resized_candidates",
           "same_length_candidates", "verify_map", "verify_transpose"]

SMALL_W = (2, 3, 4, 6, 8, 16, 32, 64)
SMALL_F = (2, 3, 4, 8)


@dataclass(frozen=True, slots=True)
class Hint:
    """What is known of one dim of a parameter: a cut of the layout (``dim``, group size ``world``, interleave
    ``factor``, mesh dim); or, with ``gate_up`` > 0 and ``world`` 1, that gate and up lie on ``dim`` as two halves in
    each of ``gate_up`` groups (the layout's fused [gate; up] keys, or ``gate_up_hints``)."""

    dim: int
    world: int
    factor: int = 1
    mesh_dim: str = ""
    gate_up: int = 0


@dataclass(frozen=True, slots=True)
class Candidate:
    """One transform hypothesis: a slice map along ``dim`` and how to word it if it holds."""

    kind: str
    dim: int
    src: torch.Tensor
    transform: str
    hint: str
    details: tuple[tuple[str, object], ...] = ()


def _blocks(n: int, nb: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64).reshape(nb, n // nb)


def _block_map(n: int, order: Sequence[int], groups: int = 1) -> torch.Tensor:
    """In each of ``groups`` equal pieces, actual block q holds reference block ``order[q]``."""
    blocks = _blocks(n, groups * len(order))
    index = torch.tensor([g * len(order) + o for g in range(groups) for o in order], dtype=torch.int64)
    return blocks[index].reshape(-1)


def _pairs(n: int, hints: Sequence[Hint], dim: int) -> Iterator[tuple[int, int, str, int]]:
    """``(W, F, mesh dim, G)``: the layout's cuts on ``dim`` first, then small factors."""
    seen: set[tuple[int, int, int]] = set()
    yield from _layout_pairs(n, hints, dim, seen)
    yield from _small_pairs(n, dim, seen, _may_interleave(hints, dim))


def _layout_pairs(n: int, hints: Sequence[Hint], dim: int, seen: set[tuple[int, int, int]]
                  ) -> Iterator[tuple[int, int, str, int]]:
    """The layout's cuts on ``dim`` as ``(W, F, mesh dim, G)``, G = 1 and G = the product of the cuts made before it
    on that dim (inside whose pieces it applies); each ``(W, F, G)`` yielded is added to ``seen``. After an
    interleaved cut on ``dim`` the pieces a later cut splits are stripes, not G contiguous blocks: that nested map is
    not one this layout makes, so only G = 1 is yielded."""
    outer, interleaved = 1, False
    for h in hints:
        if h.dim != dim or h.world < 2:
            continue
        for g in (1,) if interleaved else dict.fromkeys((outer, 1)):
            if (h.world, h.factor, g) not in seen and n % (g * h.world * h.factor) == 0:
                seen.add((h.world, h.factor, g))
                yield h.world, h.factor, h.mesh_dim, g
        outer *= h.world
        interleaved = interleaved or h.factor > 1


def _small_pairs(n: int, dim: int, seen: set[tuple[int, int, int]], interleave: bool
                 ) -> Iterator[tuple[int, int, str, int]]:
    """Small factors W (and F, only where ``interleave``) with G in 1, 2, 4, 8, those not in ``seen``."""
    for g in (1, 2, 4, 8):
        for w in SMALL_W:
            for f in (1, *SMALL_F) if interleave else (1,):
                if (w, f, g) not in seen and g * w * f <= n and n % (g * w * f) == 0:
                    seen.add((w, f, g))
                    yield w, f, "", g


def _may_interleave(hints: Sequence[Hint], dim: int) -> bool:
    """Whether an interleaved shard may be named on ``dim``: without the layout's cuts, yes; with them, only where one
    of its cuts on ``dim`` is interleaved (a cut the layout does not make is not how the tensor was sharded)."""
    cuts = [h for h in hints if h.world > 1]
    return not cuts or any(h.dim == dim and h.factor > 1 for h in cuts)


_GATE_UP_KEY = re.compile(r"gate_up|w13|w1w3|w1_w3")
_GATE_UP_PARTS = ({"gate_proj", "up_proj"}, {"w1", "w3"}, {"gate", "up"})


def gate_up_hints(key: str, shape: Sequence[int]) -> tuple[Hint, ...]:
    """Where a key's name says gate and up are fused in it (``gate_up_proj``, ``w13``): the dims on which they may be
    two halves, either dim of a 2-d key, a trailing dim of a stacked one ([E, 2I, H] or [E, H, 2I]), never the expert
    dim 0 of a stacked one (its halves are experts). A bare ``gate_proj`` holds no up half."""
    if not _GATE_UP_KEY.search(key) or len(shape) < 2:
        return ()
    dims = range(2) if len(shape) == 2 else range(1, len(shape))
    return tuple(Hint(d, 1, gate_up=1) for d in dims if shape[d] % 2 == 0)


def gate_up_groups(keys: Sequence[str]) -> int:
    """How many (gate, up) pairs a fused parameter's HF ``keys`` are, in order: each two neighbours the gate and the
    up key of one module (``experts.3.gate_proj.weight``, ``experts.3.up_proj.weight``); 0 when they are not."""
    if len(keys) < 2 or len(keys) % 2:
        return 0
    for a, b in zip(keys[::2], keys[1::2], strict=True):
        x, y = a.split("."), b.split(".")
        differ = [{p, q} for p, q in zip(x, y, strict=False) if p != q]
        if len(x) != len(y) or len(differ) != 1 or differ[0] not in _GATE_UP_PARTS:
            return 0
    return len(keys) // 2


_ROTARY_KEY = re.compile(r"(^|\.)(q_proj|k_proj|wq|wk)\.weight$")


def _rotary_candidates(n: int) -> Iterator[Candidate]:
    """The rotary permute of HF's LLaMA conversion (each head's rows as interleaved pairs against two halves),
    applied where it was not due or not applied where it was, for every even head size that divides ``n``."""
    for head in range(4, min(n, 512) + 1, 2):
        if n % head or n // head > 256:
            continue
        halves = [*range(0, head, 2), *range(1, head, 2)]  # a permuted head's row q holds the original row halves[q]
        inverse = [0] * head
        for q, src in enumerate(halves):
            inverse[src] = q
        for order, how in ((halves, "applied"), (inverse, "undone")):
            yield Candidate("permuted", 0, _block_map(n, order, n // head),
                            f"rotary permute of HF's LLaMA conversion {how} once too often (heads of {head} rows)",
                            f"each head's rows are in the other rotary layout (pairs interleaved, or two halves): the "
                            f"conversion's permute of q_proj/k_proj was {how} where it should not have been; apply "
                            "it exactly once, for the attention code that reads this checkpoint",
                            (("head_rows", head),))


def _at(mesh_dim: str) -> str:
    return f"@{mesh_dim}" if mesh_dim else ""


def joined_on(want: Sequence[int], got: Sequence[int], dim: int, world: int) -> int | None:
    """The dim along which the ``world`` shards of a cut on ``dim`` of a ``want``-shaped tensor were concatenated to
    give a ``got``-shaped one (that dim's length multiplied, ``dim``'s divided), or None."""
    if world < 2 or len(got) != len(want) or want[dim] % world:
        return None
    for e in range(len(want)):
        if e != dim and tuple(got) == tuple(want[i] // world if i == dim else want[i] * world if i == e else want[i]
                                            for i in range(len(want))):
            return e
    return None


def joined_words(world: int, cut: str, dim: int, other: int) -> tuple[str, str]:
    """``(transform, hint)`` of shards of ``cut`` (on ``dim``) concatenated on ``other``."""
    return (f"its {world} shards under {cut} joined on dim {other}, not dim {dim}",
            f"the shards of a tensor cut on dim {dim} were concatenated on dim {other}: gather them on dim {dim} "
            "(full_tensor() or wb.save_hf); do not transpose it")


def same_length_candidates(n: int, dim: int, hints: Sequence[Hint], key: str,
                           sig_ref: torch.Tensor | None = None, sig_act: torch.Tensor | None = None
                           ) -> Iterator[Candidate]:
    """Permutations of ``n`` slices along ``dim`` that real gathers produce: the layout's cuts first (each one, then
    all of them on ``dim`` gathered in another mesh-dim order), then gate/up swaps (only where ``hints`` say gate and
    up are two halves on ``dim``), q/k/v and rotary orders, then small factors; with the slice signatures, also "one
    rank's shard written into every rank's slot"."""
    seen: set[tuple[int, int, int]] = set()
    groups = sorted({h.gate_up for h in hints if h.dim == dim and h.gate_up and n % (2 * h.gate_up) == 0})
    gate_up = [_halves(n, dim, g, gate_up=True) for g in groups]
    whole = 1 in groups  # gate and up are the two halves of the whole dim
    layout = (c for w, f, mesh_dim, g in _layout_pairs(n, hints, dim, seen)
              for c in _cut_candidates(n, dim, w, f, mesh_dim, g, whole, sig_ref, sig_act))
    named = chain(gate_up, _rows_interleaved(n, dim) if whole else (),
                  _qkv_orders(n, dim) if _QKV_KEY.search(key) else (),
                  # before small factors: the rotary map is also an interleaved shard's, by coincidence
                  _rotary_candidates(n) if dim == 0 and _ROTARY_KEY.search(key) else ())
    small = (c for w, f, mesh_dim, g in _small_pairs(n, dim, seen, _may_interleave(hints, dim))
             for c in _cut_candidates(n, dim, w, f, mesh_dim, g, whole, sig_ref, sig_act))
    neutral = (_halves(n, dim, k) for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n % (2 * k) == 0)
    candidates = chain(layout, _cut_orders(n, dim, hints), named, _assembled_as_interleaved_layout(n, dim, hints),
                       small, neutral)
    yield from _gate_up_readings(candidates, gate_up, any(h.world > 1 for h in hints))


def _gate_up_readings(candidates: Iterable[Candidate], gate_up: Sequence[Candidate], layout: bool
                      ) -> Iterator[Candidate]:
    """``candidates``, each gate/up swap said once and with both readings where two apply: halves swapped in each of
    G groups is also two shards reversed inside each of G outer shards. A layout cut with that map names both; with no
    layout cut on the parameter, the plain 2-way reversal is the other reading; later candidates with the map are
    dropped."""
    if not gate_up:
        yield from candidates
        return
    said: set[int] = set()
    for c in candidates:
        i = next((i for i, h in enumerate(gate_up) if h is c or torch.equal(h.src, c.src)), None)
        if i is None:
            yield c
        elif i not in said:
            said.add(i)
            halves = gate_up[i]
            if c is not halves:
                yield _both_readings(halves, c)
            elif layout:
                yield halves
            else:
                yield _both_readings(halves, _reversed(n=len(c.src), dim=c.dim, w=2, mesh_dim="",
                                                       g=dict(c.details)["groups"]))


def _both_readings(halves: Candidate, cut: Candidate) -> Candidate:
    """One map, two causes the data cannot tell apart: gate/up halves swapped, or a cut's shards reversed."""
    return Candidate("permuted", cut.dim, cut.src, f"{halves.transform} or {cut.transform}: one map, two readings",
                     f"two causes give this map and the data cannot tell them apart: {halves.hint}; or {cut.hint}. "
                     "Check which of the two the conversion does", (*cut.details, *halves.details))


def _reversed(n: int, dim: int, w: int, mesh_dim: str, g: int) -> Candidate:
    """The ``w`` shards of a contiguous cut (in each of ``g`` outer pieces) concatenated in reverse rank order."""
    inside = f" inside each of {g} outer shards" if g > 1 else ""
    return Candidate("permuted", dim, _block_map(n, list(range(w))[::-1], g),
                     f"rank order reversed (S({dim}){_at(mesh_dim)} over {w} ranks{inside})",
                     f"the {w} shards were concatenated in reverse rank order: gather in group-rank order",
                     (("world", w), ("factor", 1), ("outer_shards", g)))


def _cut_candidates(n: int, dim: int, w: int, f: int, mesh_dim: str, g: int, whole_gate_up: bool,
                    sig_ref: torch.Tensor | None, sig_act: torch.Tensor | None) -> Iterator[Candidate]:
    """The gather bugs of one cut: ``w`` ranks, interleave ``f``, in each of ``g`` outer pieces."""
    if f > 1:
        return _interleaved_cut(n, dim, w, f, mesh_dim, g, whole_gate_up)
    return _contiguous_cut(n, dim, w, mesh_dim, g, sig_ref, sig_act)


def _interleaved_cut(n: int, dim: int, w: int, f: int, mesh_dim: str, g: int, whole_gate_up: bool
                     ) -> Iterator[Candidate]:
    inside = f" inside each of {g} outer shards" if g > 1 else ""
    details = (("world", w), ("factor", f), ("outer_shards", g))
    order = [j * w + r for r in range(w) for j in range(f)]
    cut = f"IS({dim},{f}){_at(mesh_dim)} over {w} ranks"
    yield _gathered_as_contiguous(n, dim, w, f, mesh_dim, g)
    inverse = [0] * (w * f)
    for q, src in enumerate(order):
        inverse[src] = q
    if whole_gate_up and w == 2 and f > 2 and not mesh_dim:
        # the same map as f ranks' [gate_r; up_r] gathered as rows: for a fused gate/up that is the bug
        yield _gathered_as_contiguous(n, dim, f, 2, mesh_dim, g)
    else:
        yield _assembled_as_interleaved(n, dim, w, f, mesh_dim, g)
    for twice, how in (([order[o] for o in order], "gathered as contiguous"),
                       ([inverse[o] for o in inverse], "undone")):
        if twice not in (list(range(w * f)), order, inverse):
            yield Candidate("permuted", dim, _block_map(n, twice, g),
                            f"interleave {how} twice ({cut}{inside})",
                            f"the interleave of {cut} was {how} twice (a conversion applied on top of a save "
                            "that already did it, or a loop that converts every time): apply it once",
                            details)


def _assembled_as_interleaved(n: int, dim: int, w: int, f: int, mesh_dim: str, g: int) -> Candidate:
    """A contiguous cut of ``w`` ranks reassembled as if it were ``IS(dim, f)``, in each of ``g`` outer pieces."""
    inside = f" inside each of {g} outer shards" if g > 1 else ""
    cut = f"IS({dim},{f}){_at(mesh_dim)} over {w} ranks"
    inverse = [0] * (w * f)
    for q, src in enumerate(j * w + r for r in range(w) for j in range(f)):
        inverse[src] = q
    return Candidate("permuted", dim, _block_map(n, inverse, g),
                     f"contiguous shards assembled as interleaved ({cut}{inside})",
                     f"the tensor was cut contiguously but reassembled as if interleaved ({cut}): gather "
                     "a plain Shard with plain concatenation",
                     (("world", w), ("factor", f), ("outer_shards", g)))


def _assembled_as_interleaved_layout(n: int, dim: int, hints: Sequence[Hint]) -> Iterator[Candidate]:
    """The layout's contiguous cuts on ``dim`` reassembled as if interleaved: a gather bug, not an interleaved
    layout, so it is named even where the layout interleaves nothing on ``dim`` (small factors of it are not)."""
    if _may_interleave(hints, dim):
        return  # the small factors name it
    for h in hints:
        if h.dim == dim and h.world > 1 and h.factor == 1:
            for f in SMALL_F:
                if n % (h.world * f) == 0:
                    yield _assembled_as_interleaved(n, dim, h.world, f, h.mesh_dim, 1)


def _contiguous_cut(n: int, dim: int, w: int, mesh_dim: str, g: int, sig_ref: torch.Tensor | None,
                    sig_act: torch.Tensor | None) -> Iterator[Candidate]:
    inside = f" inside each of {g} outer shards" if g > 1 else ""
    details = (("world", w), ("factor", 1), ("outer_shards", g))
    yield _reversed(n, dim, w, mesh_dim, g)
    if w > 10:
        yield Candidate("permuted", dim, _block_map(n, sorted(range(w), key=str), g),
                        f"shards in string-sorted rank order (S({dim}){_at(mesh_dim)} over {w} ranks"
                        f"{inside}: rank 10 before rank 2)",
                        "the shard files or keys were sorted as strings ('rank_10' < 'rank_2'): sort them "
                        "by rank number before concatenating",
                        (*details, ("order", "string-sorted")))
    repeated = _one_shard_everywhere(n, w, g, sig_ref, sig_act)
    if repeated is not None:
        yield Candidate("partial_shard", dim, _block_map(n, [repeated] * w, g),
                        f"rank {repeated}'s shard written in every rank's slot (S({dim}){_at(mesh_dim)} over "
                        f"{w} ranks{inside})",
                        f"every rank wrote the piece of group rank {repeated} (the same local shard, or the "
                        "same offset) instead of its own: each rank must write its own shard at its own "
                        "offset",
                        (*details, ("rank", repeated)))
    for w1 in range(2, w):
        if w % w1 == 0:
            w2 = w // w1
            order = [b * w1 + a for a in range(w1) for b in range(w2)]
            yield Candidate("permuted", dim, _block_map(n, order, g),
                            f"rank order of a {w1}x{w2} mesh read column-major (S({dim}) over {w} ranks"
                            f"{inside})",
                            f"the shards were ordered by the wrong mesh dim first ({w1}x{w2} read as "
                            f"{w2}x{w1}): order the gather by the mesh's row-major rank order",
                            (*details, ("mesh", f"{w1}x{w2}")))


def _cut_orders(n: int, dim: int, hints: Sequence[Hint]) -> Iterator[Candidate]:
    """The layout's contiguous cuts on ``dim`` (two or more, outer first) gathered with the ranks ordered by another
    mesh dim first: fsdp-major where the layout cuts by ep first and by fsdp inside each ep piece."""
    cuts = [h for h in hints if h.dim == dim and h.world > 1]
    total = math.prod(h.world for h in cuts)
    if len(cuts) < 2 or any(h.factor > 1 for h in cuts) or n % total:
        return
    names = [h.mesh_dim or f"cut {i + 1}" for i, h in enumerate(cuts)]
    strides = [math.prod(h.world for h in cuts[i + 1 :]) for i in range(len(cuts))]  # block = sum(coord * stride)
    for order in permutations(range(len(cuts))):
        if list(order) == sorted(order):
            continue
        blocks = [sum(c * strides[i] for c, i in zip(coords, order, strict=True))
                  for coords in product(*(range(cuts[i].world) for i in order))]  # the first of order slowest
        wrong = [names[i] for i in order]
        said = (f"{wrong[0]}-major instead of {names[0]}-major" if len(cuts) == 2
                else f"in the mesh-dim order {', '.join(wrong)} instead of {', '.join(names)}")
        yield Candidate("permuted", dim, _block_map(n, blocks),
                        f"shards gathered {said} (dim {dim} cut by {', '.join(names)}, outer first, over {total} "
                        "ranks)",
                        f"the {total} shards of dim {dim} were concatenated with the ranks ordered by {wrong[0]} "
                        f"first, but the layout cuts dim {dim} by {names[0]} first and by {', '.join(names[1:])} "
                        f"inside each piece: gather in that order ({names[0]}-major), as full_tensor() and "
                        "wb.save_hf do",
                        (("world", total), ("gathered", ", ".join(wrong)), ("layout_order", ", ".join(names))))


def _gathered_as_contiguous(n: int, dim: int, w: int, f: int, mesh_dim: str, g: int) -> Candidate:
    """An interleaved shard IS(dim, f) over ``w`` ranks (in each of ``g`` outer pieces) concatenated as rows."""
    order = [j * w + r for r in range(w) for j in range(f)]
    cut = f"IS({dim},{f}){_at(mesh_dim)} over {w} ranks"
    inside = f" inside each of {g} outer shards" if g > 1 else ""
    return Candidate("permuted", dim, _block_map(n, order, g),
                     f"interleaved shard gathered as contiguous ({cut}{inside})",
                     f"the tensor is cut by an interleaved shard ({cut}) but its shards were concatenated "
                     "as if the cut were contiguous: undo the interleave when gathering (workbench's save "
                     "plan does), then re-save",
                     (("world", w), ("factor", f), ("outer_shards", g)))


_QKV_KEY = re.compile(r"(qkv|query_key_value|W_pack|c_attn|in_proj)")


def _rows_interleaved(n: int, dim: int) -> Iterator[Candidate]:
    """A fused gate/up whose gate and up slices alternate (slice ``2i``: gate ``i``, ``2i+1``: up ``i``) where two
    blocks are expected, and the inverse."""
    half = n // 2
    idx = torch.arange(n, dtype=torch.int64)
    interleaved = (idx % 2) * half + idx // 2
    yield Candidate("permuted", dim, interleaved,
                    f"gate and up rows interleaved (slice 2i gate i, 2i+1 up i) on dim {dim}, where the gate block "
                    "then the up block is expected",
                    f"the fused gate/up was written with its gate and up slices alternating (as some frameworks fuse "
                    f"it): de-interleave it on dim {dim} (unflatten it into ({half}, 2), swap those two dims, flatten "
                    "them) in the conversion, or fuse it as [gate; up]",
                    (("layout", "interleaved"),))
    yield Candidate("permuted", dim, 2 * (idx % half) + idx // half,
                    f"gate and up as two blocks on dim {dim}, where their rows interleaved (slice 2i gate i, 2i+1 "
                    "up i) are expected",
                    f"the model reads its fused gate/up with gate and up slices alternating, but this checkpoint "
                    f"holds the gate block then the up block: interleave them on dim {dim} when converting",
                    (("layout", "blocks"),))


def _qkv_orders(n: int, dim: int) -> Iterator[Candidate]:
    """A fused attention projection whose q, k and v parts (q ``m`` times as long as k and v: grouped-query
    attention) are in another order than q, k, v."""
    names = ("q", "k", "v")
    for m in range(1, 65):
        if n % (m + 2):
            continue
        b = n // (m + 2)
        unit = "rows" if dim == 0 else "slices"
        starts, sizes = (0, m * b, (m + 1) * b), (m * b, b, b)
        for order in ((0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)):
            src = torch.cat([torch.arange(starts[i], starts[i] + sizes[i], dtype=torch.int64) for i in order])
            said = ", ".join(names[i] for i in order)
            yield Candidate("permuted", dim, src,
                            f"q/k/v fused in the order {said} (q of {m * b} {unit}, k and v of {b} each) on dim {dim}, "
                            "where q, k, v is expected",
                            f"the fused projection holds its parts as {said}: fuse them as q, k, v, the order the "
                            "model splits them in (check the key map's order or the conversion's concatenation)",
                            (("order", said), ("q_slices", m * b), ("kv_slices", b)))


def _one_shard_everywhere(n: int, w: int, g: int, sig_ref: torch.Tensor | None,
                          sig_act: torch.Tensor | None) -> int | None:
    """The group rank ``k`` whose block every block of ``sig_act`` holds (in each of ``g`` outer pieces), if any."""
    if sig_ref is None or sig_act is None or len(sig_act) != n or g * w > n or n % (g * w):
        return None
    act = sig_act.reshape(g, w, -1)
    if not bool((act == act[:, :1]).all()):
        return None
    ref = sig_ref.reshape(g, w, -1)
    for k in range(w):
        if torch.equal(ref[:, k], act[:, 0]) and not bool((ref == ref[:, k : k + 1]).all()):
            return k
    return None


def _halves(n: int, dim: int, groups: int, gate_up: bool = False) -> Candidate:
    """The two halves of each of ``groups`` blocks along ``dim`` swapped; named gate/up only where ``gate_up``."""
    order = [g * 2 + (1 - h) for g in range(groups) for h in range(2)]
    if gate_up:
        where = "" if groups == 1 else f" in each of {groups} groups (experts)"
        return Candidate("permuted", dim, _block_map(n, order), f"gate/up halves swapped{where} (dim {dim})",
                         "the two halves of each fused block are in the other order (e.g. [up, gate] where the model "
                         "expects [gate, up]): fix the fused order in the key map or the adapter",
                         (("groups", groups),))
    where = "" if groups == 1 else f" in each of {groups} blocks"
    return Candidate("permuted", dim, _block_map(n, order), f"two halves swapped{where} (dim {dim})",
                     f"each of the {groups} equal block(s) along dim {dim} (an expert, or an outer cut's piece) has "
                     "its two halves in the other order: its two shards concatenated in reverse rank order, or two "
                     "fused parts in the other order; gather in group-rank order, or fix the fused order",
                     (("groups", groups),))


def resized_candidates(n_ref: int, n_act: int, dim: int, hints: Sequence[Hint],
                       sig_ref: torch.Tensor, sig_act: torch.Tensor) -> Iterator[Candidate]:
    """Maps from ``n_ref`` reference slices to ``n_act`` actual ones: replication, one shard, padding."""
    idx = torch.arange(n_act, dtype=torch.int64)
    if n_act > n_ref > 0 and n_act % n_ref == 0:
        k = n_act // n_ref
        yield Candidate("replicated_concat", dim, idx % n_ref,
                        f"replicated tensor concatenated {k} times on dim {dim}",
                        f"a Replicate tensor was gathered as if it were sharded over {k} ranks, so each rank's "
                        "full copy was concatenated: treat it as replicated and save one copy",
                        (("copies", k),))
    if n_act > n_ref:
        src = torch.where(idx < n_ref, idx, torch.full_like(idx, -1))
        yield Candidate("padding_not_trimmed", dim, src,
                        f"{n_act - n_ref} padding slices kept on dim {dim} ({n_act} instead of {n_ref})",
                        f"the runtime tensor carries tail padding (global_shape {n_act} vs origin_shape {n_ref} on "
                        f"dim {dim}, e.g. for FP8 blocks or even chunks) and it was saved untrimmed: trim to the "
                        "origin shape before saving (set origin_shape in the layout)",
                        (("padding", n_act - n_ref),))
    if 0 < n_act < n_ref:
        for w, f, mesh_dim, g in _pairs(n_ref, hints, dim):
            if f > 1 and g == 1 and n_act * w == n_ref:
                run = n_ref // (w * f)
                for r in range(w):
                    src = torch.cat([torch.arange((j * w + r) * run, (j * w + r + 1) * run) for j in range(f)])
                    if torch.equal(sig_act, sig_ref[src]):
                        yield _partial(dim, src, f"rank {r}'s interleaved shard (IS({dim},{f}){_at(mesh_dim)} "
                                       f"over {w} ranks)", r, w)
        starts = torch.nonzero(sig_ref[: n_ref - n_act + 1] == sig_act[0]).flatten().tolist()
        worlds = {h.world: h.mesh_dim for h in hints if h.dim == dim and h.factor == 1 and h.world > 1}
        for start in starts[:64]:
            src = torch.arange(start, start + n_act, dtype=torch.int64)
            shard = chunk_shard(n_ref, start, n_act, worlds)
            if shard is None:
                what = ("rows", "columns")[dim] if dim < 2 else f"slices on dim {dim}"
                yield Candidate("shape_mismatch", dim, src,
                                f"equals {what} {start}:{start + n_act} of the expected (of {n_ref}; no even or "
                                "chunked split into shards gives this piece)",
                                f"the tensor holds {n_act} of the expected {n_ref} {what}, a count that no rank's "
                                "shard has under torch's chunk rule: the write stopped early, or it was cut by hand; "
                                "save the whole tensor",
                                ((what.split()[0], f"{start}:{start + n_act}"),))
                continue
            rank, world = shard
            where = f"{_at(worlds[world])} " if worlds.get(world) else ""
            yield _partial(dim, src, f"rank {rank}'s contiguous shard of {world} {where}(slices {start}:"
                           f"{start + n_act} of {n_ref} on dim {dim})", rank, world)


def chunk_shard(n: int, start: int, length: int, preferred: Sequence[int] = ()) -> tuple[int, int] | None:
    """``(rank, world)`` when slices ``start:start + length`` of ``n`` are one rank's piece under torch's chunk
    rule (chunk ``ceil(n / world)``, trailing ranks short or empty) for some world size, the ``preferred`` world
    sizes first, else the smallest; None when no world size cuts that piece."""
    if not 0 < length < n or start < 0 or start + length > n:
        return None
    for world in preferred:
        chunk = -(-n // world)
        if start % chunk == 0 and start // chunk < world and min(chunk, n - start) == length:
            return start // chunk, world
    chunks = [length] if start + length < n else []
    if start + length == n:  # the last piece may be shorter than the chunk: any chunk >= length dividing start
        chunks = sorted({length} | {c for d in range(1, math.isqrt(start) + 1) if start % d == 0
                                    for c in (d, start // d) if c >= length}, reverse=True)  # fewest ranks first
    for chunk in chunks:
        world = -(-n // chunk)
        if -(-n // world) == chunk and start % chunk == 0:
            return start // chunk, world
    return None


def _partial(dim: int, src: torch.Tensor, what: str, rank: int | None, world: int) -> Candidate:
    return Candidate("partial_shard", dim, src, f"only {what}",
                     "only one rank's local shard was saved, not the full tensor: save full tensors "
                     "(DTensor.full_tensor() or workbench's save_hf), not to_local()",
                     (("rank", rank), ("world", world)))


def on_dim(c: Candidate, shape: Sequence[int], details: tuple[tuple[str, object], ...] = ()) -> Candidate:
    """``c``, a map along its dim (>= 1) of ``shape``, the same in every slice: a map along the trailing dims
    flattened (dim 1, as the signatures count them), with ``details`` added."""
    n, outer, inner = shape[c.dim], math.prod(shape[1 : c.dim]), math.prod(shape[c.dim + 1 :])
    src = (torch.arange(outer, dtype=torch.int64)[:, None, None] * (n * inner) + c.src[None, :, None] * inner
           + torch.arange(inner, dtype=torch.int64)[None, None, :])
    return replace(c, dim=1, src=src.reshape(-1), details=(*c.details, *details))


def signature_holds(c: Candidate, ref: Signatures, act: Signatures) -> bool:
    """Whether ``c``'s map agrees with both signatures (a necessary condition)."""
    sig_ref = ref.s0 if c.dim == 0 else ref.s1
    sig_act = act.s0 if c.dim == 0 else act.s1
    if sig_ref is None or sig_act is None or len(c.src) != len(sig_act):
        return False
    valid = c.src >= 0
    return bool(torch.equal(sig_act[valid], sig_ref[c.src[valid]]))


def _runs(src: torch.Tensor) -> Iterator[tuple[int, int, int]]:
    """``(position, start, length)`` of consecutive increasing stretches of ``src``."""
    values = src.tolist()
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        yield i, values[i], j - i + 1
        i = j + 1


def verify_map(ref: TensorView, act: TensorView, c: Candidate, block_bytes: int) -> tuple[bool, int]:
    """Compare ``act`` with ``ref`` mapped by ``c``, bit for bit, in blocks: ``(exact, nonzero padding)``."""
    nonzero = 0
    step = act.rows_per_block(block_bytes, 2)
    n0 = act.shape[0]
    for a in range(0, n0, step):
        b = min(n0, a + step)
        got = bits(act.read_rows(a, b))
        if c.dim == 0:
            src = c.src[a:b]
            valid = src >= 0
            if bool(valid.any()):
                parts = [bits(ref.read_rows(s, s + n)) for _, s, n in _runs(src[valid])]
                if not torch.equal(got[valid], torch.cat(parts)):
                    return False, 0
            nonzero += int(torch.count_nonzero(got[~valid]))
        else:  # dim 1 is the trailing dims flattened, as the signatures count it
            got, want = got.reshape(b - a, -1), bits(ref.read_rows(a, b)).reshape(b - a, -1)
            valid = c.src >= 0
            if not torch.equal(got[:, valid], want[:, c.src[valid]]):
                return False, 0
            nonzero += int(torch.count_nonzero(got[:, ~valid]))
    return True, nonzero


def verify_transpose(ref: TensorView, act: TensorView, block_bytes: int) -> bool:
    """``act == ref.T`` bit for bit (2-d), reading ``act`` in row blocks and ``ref`` in column boxes."""
    n = act.shape[0]
    step = act.rows_per_block(block_bytes, 2)
    for a in range(0, n, step):
        b = min(n, a + step)
        got = bits(act.read_rows(a, b))
        want = bits(ref.read_box((0, ref.shape[0]), (a, b), block_bytes)).T
        if not torch.equal(got, want):
            return False
    return True
