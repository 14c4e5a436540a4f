"""diff_checkpoints: compare a checkpoint with a reference, key by key, and explain every difference.

Equal tensors cost one streamed hash of each side (content fingerprints); only tensors that differ are
analyzed (``analyze.analyze_pair``). The same fingerprints find keys holding another key's bytes anywhere in
the checkpoint (swapped experts, gate and up in the wrong slot), looked up by value, never compared pair by
pair; the dim-0 halves of differing keys are hashed to find fused halves in the wrong slot. A numbered component
shifted as a whole (``layers.N`` saved as ``layers.N+1``, experts numbered from 1) is one finding, its keys paired
with the keys they stand for; a rename found by names is not claimed where the bytes are another key's. With a
``Layout``, fused parameters are analyzed as one tensor (a gather bug moves rows across HF keys) and the layout's
cuts (W, F) are tried first. Keys of missing, truncated or unparsable files are findings; the rest is compared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from itertools import combinations, permutations
from pathlib import Path
from typing import Any

from workbench.debug.analyze import analyze_pair
from workbench.debug.damage import damaged_keys, unread_files_hint
from workbench.debug.findings import Finding, Report
from workbench.debug.integrity import scan_for_findings
from workbench.debug.provenance import held_by, same_shape, written_from
from workbench.debug.renames import (
    IndexShift,
    Rename,
    find_renames,
    index_shifts,
    rename_hint,
    shift_pattern,
    shift_words,
    shifted_back,
)
from workbench.debug.source import DEFAULT_BLOCK_BYTES, CheckpointSource, KeyMeta, Source
from workbench.debug.stacked import (
    MissingByContent,
    find_joined,
    find_joined_on_dim,
    in_fused_order,
    joined_finding,
)
from workbench.debug.ties import broken_tie
from workbench.debug.transforms import Hint, gate_up_groups, gate_up_hints
from workbench.debug.views import TensorView
from workbench.errors import LayoutError
from workbench.layout.layout_file import LAYOUT_FILE_NAME, read_checkpoint_layout
from workbench.layout.model_layout import Layout
from workbench.layout.pipeline import PipelineLayout, read_checkpoint_pipeline_layout
from workbench.mesh import format_mesh_dim

__all__ = ["MAX_FUSED_PARTS", "MAX_FUSED_POOL", "check_block_bytes", "compare_sources", "diff_checkpoints",
           "fused_by_shape", "in_name_order", "layout_hints", "listing", "name_stem", "open_checkpoint"]


def check_block_bytes(block_bytes: int) -> int:
    """``block_bytes`` when it is a whole number of bytes >= 1; else an error naming it (a block of 0 or fewer
    bytes would read nothing, and two keys that hash nothing are equal)."""
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int):
        raise TypeError(f"block_bytes must be an int (bytes), got {type(block_bytes).__name__} {block_bytes!r}")
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be at least 1 byte (the largest read at once), got {block_bytes}")
    return block_bytes


def open_checkpoint(path: Path | str, block_bytes: int = DEFAULT_BLOCK_BYTES) -> tuple[
    CheckpointSource | None, tuple[Finding, ...], str
]:
    """``(source, integrity findings, error)`` for a checkpoint path; ``source`` is None when unreadable.

    Raises:
        ValueError: ``block_bytes`` is below 1.
    """
    check_block_bytes(block_bytes)
    scan = scan_for_findings(path)
    if scan.index is None or scan.error:
        return None, scan.findings, scan.error or f"{path}: not a checkpoint"
    return CheckpointSource(scan.index, block_bytes=block_bytes, label=str(path)), scan.findings, ""


def layout_hints(layout: Layout | None) -> dict[str, tuple[tuple[Hint, ...], str]]:
    """``{hf_key: (cuts of its parameter, parameter name)}`` from a layout."""
    if layout is None:
        return {}
    out = {}
    for name, spec in layout.specs.items():
        hints = tuple(
            Hint(d.dim, layout.mesh.group_size(d.mesh_dim), d.interleave_factor, format_mesh_dim(d.mesh_dim))
            for d in spec.shards
        )
        for key in spec.hf_keys:
            out[key] = (hints, name)
    return out


_MAX_BLAMED = 256  # differing keys whose ranks are named from the checkpoint's layout (each costs one more read)


class _Fingerprints:
    """Content fingerprints of a source's keys, whole and by dim-0 half, indexed for lookups by value.

    One streamed read of a key hashes each of its two dim-0 halves (when dim 0 is even; a key within one block is
    read once) and the whole key's fingerprint is the two digests: equal keys are found at the cost of the read the
    equality pass makes anyway, and the halves (fused gate/up) come for free. Fingerprints are only compared between
    keys of one (shape, dtype); a lookup by meta indexes the keys of that meta once.
    """

    def __init__(self, source: Source, metas: Mapping[str, KeyMeta], block_bytes: int) -> None:
        self.source = source
        self.metas = metas
        self.block_bytes = block_bytes
        self._by_meta: dict[KeyMeta, list[str]] = {}
        for key, meta in metas.items():
            self._by_meta.setdefault(meta, []).append(key)
        self._whole: dict[str, bytes] = {}
        self._index: dict[KeyMeta, tuple[dict[bytes, str], dict[bytes, list[str]]]] = {}
        self._half_index: dict[KeyMeta, dict[bytes, tuple[str, int]]] = {}

    def of(self, key: str) -> bytes:
        """The fingerprint of the whole key (the digests of its two halves, or of all of it)."""
        found = self._whole.get(key)
        if found is None:
            meta = self.metas[key]
            n = meta.nbytes
            split = n // 2 if len(meta.shape) >= 1 and meta.rows >= 2 and meta.rows % 2 == 0 else 0
            if n <= self.block_bytes:  # one read, hashed in two
                raw = memoryview(self.source.read_raw(key, 0, n))
                parts = [raw[:split], raw[split:]] if split else [raw]
                found = b"".join(hashlib.blake2b(p, digest_size=16).digest() for p in parts)
            else:
                found = b"".join(_digest(self.source, key, a, b, self.block_bytes)
                                 for a, b in (((0, split), (split, n)) if split else ((0, n),)))
            self._whole[key] = found
        return found

    def halves(self, key: str) -> tuple[bytes, bytes] | None:
        """The fingerprints of the two dim-0 halves (None unless dim 0 is even and > 1)."""
        found = self.of(key)
        return (found[:16], found[16:]) if len(found) == 32 else None

    def keys_with(self, meta: KeyMeta, fingerprint: bytes) -> list[str]:
        """The keys of ``meta`` whose bytes have ``fingerprint``."""
        index = self._index.get(meta)
        if index is None:
            first: dict[bytes, str] = {}
            more: dict[bytes, list[str]] = {}
            for key in self._by_meta.get(meta, ()):
                fp = self.of(key)
                if first.setdefault(fp, key) is not key:
                    more.setdefault(fp, []).append(key)
            index = self._index[meta] = (first, more)
        hit = index[0].get(fingerprint)
        return [] if hit is None else [hit, *index[1].get(fingerprint, ())]

    def half_with(self, meta: KeyMeta, fingerprint: bytes) -> tuple[str, int] | None:
        """``(key, half)``: a key of ``meta`` whose dim-0 half ``half`` has ``fingerprint``."""
        index = self._half_index.get(meta)
        if index is None:
            index = self._half_index[meta] = {}
            for key in self._by_meta.get(meta, ()):
                for h, fp in enumerate(self.halves(key) or ()):
                    index.setdefault(fp, (key, h))
        return index.get(fingerprint)


def _digest(source: Source, key: str, start: int, stop: int, block: int) -> bytes:
    """The digest of bytes ``start:stop`` of ``key``, read ``block`` bytes at a time."""
    if block < 1:  # range() would read nothing (or fail): every key would hash alike
        raise ValueError(f"_digest of {key!r}: block {block} must be at least 1 byte")
    digest = hashlib.blake2b(digest_size=16)
    for a in range(start, stop, block):
        digest.update(source.read_raw(key, a, min(stop, a + block)))
    return digest.digest()


def _fused(missing: set[str], unexpected: list[str], ref_metas: Mapping[str, KeyMeta],
           act_metas: Mapping[str, KeyMeta], ref_fp: _Fingerprints, act_fp: _Fingerprints
           ) -> list[tuple[str, tuple[str, str]]]:
    """Unexpected keys whose dim-0 halves are two missing reference keys, whole: ``(key, (first, second))``. Only
    missing keys of a half's shape and dtype are read, each once (one digest of all its bytes)."""
    by_meta: dict[tuple[tuple[int, ...], str], list[str]] = {}
    for m in sorted(missing):
        by_meta.setdefault((ref_metas[m].shape, ref_metas[m].dtype), []).append(m)
    by_digest: dict[tuple[tuple[int, ...], str], dict[bytes, list[str]]] = {}  # made per (shape, dtype) on first use
    found, taken = [], set()
    for u in unexpected:
        meta = act_metas[u]
        if not meta.shape or meta.shape[0] % 2:
            continue
        group = ((meta.shape[0] // 2, *meta.shape[1:]), meta.dtype)
        if group not in by_meta or (halves := act_fp.halves(u)) is None:
            continue
        if group not in by_digest:
            index: dict[bytes, list[str]] = {}
            for m in by_meta[group]:
                index.setdefault(_digest(ref_fp.source, m, 0, ref_metas[m].nbytes, ref_fp.block_bytes), []).append(m)
            by_digest[group] = index
        first, second = (next((m for m in by_digest[group].get(h, ()) if m not in taken), None) for h in halves)
        if first is not None and second is not None and first != second:
            found.append((u, (first, second)))
            taken.update((first, second))
    return found


MAX_FUSED_POOL = 8  # missing keys of one module tried as the parts of a fused key
MAX_FUSED_PARTS = 4  # parts of one fused key (q, k, v; gate, up)


def name_stem(key: str) -> str:
    """A key's own module name without ``_proj``: ``q`` for ``...self_attn.q_proj.weight``."""
    parts = key.rsplit(".", 2)
    return parts[-2].removesuffix("_proj") if len(parts) == 3 else key


def in_name_order(fused: str, parts: Sequence[str]) -> tuple[str, ...]:
    """``parts`` in the order the fused key's name lists them (``qkv``: q, k, v), the others after, by name."""
    name = name_stem(fused)
    return tuple(sorted(parts, key=lambda m: (name.find(name_stem(m)) if name_stem(m) in name else len(name), m)))


def fused_by_shape(unexpected: Mapping[str, Sequence[int]], missing: Mapping[str, Sequence[int]]
                   ) -> dict[str, list[tuple[str, ...]]]:
    """For each unexpected key, the sets of 2 to 4 missing keys of its module whose dim-0 lengths add up to its own,
    trailing dims equal (``qkv_proj`` where ``q_proj``, ``k_proj``, ``v_proj`` are expected), by names and shapes
    only: the sets its name lists most parts of first, each in the name's order."""
    by_module: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for m in sorted(missing):
        if missing[m]:
            by_module.setdefault((m.rsplit(".", 2)[0], tuple(missing[m][1:])), []).append(m)
    out = {}
    for u, shape in unexpected.items():
        pool = by_module.get((u.rsplit(".", 2)[0], tuple(shape[1:])), [])[:MAX_FUSED_POOL] if shape else []
        sets = [in_name_order(u, c) for r in range(2, min(len(pool), MAX_FUSED_PARTS) + 1)
                for c in combinations(pool, r) if sum(missing[m][0] for m in c) == shape[0]]
        if sets:
            out[u] = sorted(sets, key=lambda c: (-sum(name_stem(m) in name_stem(u) for m in c), len(c)))
    return out


def listing(keys: Sequence[str]) -> str:
    """``a, b and c``."""
    return keys[0] if len(keys) == 1 else f"{', '.join(keys[:-1])} and {keys[-1]}"


def _fused_order(u: str, sets: list[tuple[str, ...]], ref_fp: _Fingerprints, act_fp: _Fingerprints
                 ) -> tuple[str, ...] | None:
    """The parts (one of ``sets``, in the order found) whose bytes ``act[u]`` holds cut at their row counts, the
    name's order tried first; each piece and each part is hashed once."""
    meta, block = act_fp.metas[u], act_fp.block_bytes
    pieces: dict[tuple[int, int], bytes] = {}
    wholes: dict[str, bytes] = {}
    for parts in sets:
        if any(ref_fp.metas[m].dtype != meta.dtype for m in parts):
            continue
        for order in (parts, *(p for p in permutations(parts) if p != parts)):
            start = 0
            for m in order:
                stop = start + ref_fp.metas[m].nbytes
                if (start, stop) not in pieces:
                    pieces[start, stop] = _digest(act_fp.source, u, start, stop, block)
                if m not in wholes:
                    wholes[m] = _digest(ref_fp.source, m, 0, ref_fp.metas[m].nbytes, block)
                if pieces[start, stop] != wholes[m]:
                    break
                start = stop
            else:
                return order
    return None


def _fused_finding(u: str, parts: Sequence[str]) -> Finding:
    count = {2: "two", 3: "three", 4: "four"}[len(parts)]
    return Finding("renamed_key", u, {"expected_keys": list(parts),
                                      "transform": f"{listing(parts)} fused on dim 0, in that order",
                                      "verified": "by content hash"},
                   f"the checkpoint holds {count} expected keys concatenated on dim 0 under one key (a fused "
                   "gate_up_proj or qkv_proj, say): split it into its keys in the key map or the conversion, or "
                   "save them unfused; the weights are all there")


def _all_zero(source: Source, key: str, nbytes: int, block: int = DEFAULT_BLOCK_BYTES) -> bool:
    for a in range(0, nbytes, block):
        raw = source.read_raw(key, a, min(nbytes, a + block))
        if raw.count(0) != len(raw):
            return False
    return True


def _is_gate_up(a: str, b: str) -> bool:
    words = {w for k in (a, b) for w in k.replace("_", ".").split(".")}
    return {"gate", "up"} <= words or {"w1", "w3"} <= words


def _misplaced(rk: str, ak: str, ref_fp: _Fingerprints, act_fp: _Fingerprints,
               act_of: Mapping[str, str]) -> Finding | None:
    """``act[ak]`` holds the bytes of another reference key (anywhere in the checkpoint): swapped or copied."""
    meta = act_fp.metas[ak]
    holders = [k for k in ref_fp.keys_with(meta, act_fp.of(ak)) if k != rk]
    if not holders:
        return None

    def partner_holds(other: str, whose: str) -> bool:
        """Whether the checkpoint's key for reference key ``other`` holds ``whose``'s reference tensor."""
        partner = act_of.get(other)
        return partner is not None and act_fp.metas[partner] == ref_fp.metas[whose] and \
            act_fp.of(partner) == ref_fp.of(whose)

    swapped = [k for k in holders if partner_holds(k, rk)]
    other = (swapped or holders)[0]
    if not swapped and _all_zero(ref_fp.source, other, meta.nbytes):
        return None  # an all-zero tensor matches any zero buffer: the value analysis says "all zeros"
    what = "gate/up " if _is_gate_up(rk, other) else ""
    if swapped:
        transform = f"{what}swapped with {act_of[other]} (each holds the other's tensor)"
        hint = ("two keys were swapped (the fused order, the key map, or an expert or layer index off by one): swap "
                "them back (the transform names the partner)")
    elif partner_holds(other, other):
        transform = f"holds a copy of {other}'s tensor (which {act_of[other]} holds too)"
        hint = ("this key was written with another key's tensor (a wrong index in the key map or the conversion "
                "loop): write each key from its own parameter")
    elif act_of.get(other) is None:
        transform = f"holds {other}'s tensor ({other} itself is not in the checkpoint)"
        hint = ("the tensor was saved under another key's name (a wrong index or name in the key map): write it under "
                "its own key")
    else:
        transform = f"holds {other}'s tensor, while {act_of[other]} holds yet another one"
        hint = ("the keys are shifted: each holds another key's tensor (an expert or layer index off by one in the key "
                "map or the conversion loop): map each key from its own parameter")
    evidence = {"transform": transform, "expected_shape": list(ref_fp.metas[rk].shape), "verified": "by content hash"}
    if meta.shape != ref_fp.metas[rk].shape:
        evidence["actual_shape"] = list(meta.shape)
    if len(holders) > 1:
        evidence["same_bytes_as"] = holders[:5]
    return Finding("misplaced_tensor", ak, evidence, hint)


def _misplaced_halves(rk: str, ak: str, ref_fp: _Fingerprints, act_fp: _Fingerprints) -> Finding | None:
    """The dim-0 halves of ``act[ak]`` hold halves of (other) reference keys: fused gate/up in the wrong slot."""
    mine = act_fp.halves(ak)
    if mine is None:
        return None
    meta = act_fp.metas[ak]
    found = [ref_fp.half_with(meta, fp) for fp in mine]
    moved = [h for h, hit in enumerate(found) if hit is not None and hit != (rk, h)]
    if not moved or found == [(rk, 1), (rk, 0)]:
        return None  # each half is its own or unknown; or the key's own halves swapped (the value analysis names it)
    n = meta.rows // 2
    parts = []
    for h, hit in enumerate(found):
        rows = f"rows {h * n}:{(h + 1) * n}"
        parts.append(f"{rows} hold rows {hit[1] * n}:{(hit[1] + 1) * n} of {hit[0]}" if hit
                     else f"{rows} match no half of a reference key")
    keys = sorted({hit[0] for hit in found if hit})
    hint = ("the halves of this fused key come from the wrong keys (gate and up, or two experts, written into each "
            "other's slot): build each fused key from its own parameter's halves, in the model's order")
    return Finding("misplaced_tensor", ak, {"transform": "; ".join(parts), "expected_shape": list(meta.shape),
                                            "source_keys": keys, "verified": "by content hash of each half"}, hint)


def _contradicted(rename: Rename, ref_fp: _Fingerprints, act_fp: _Fingerprints) -> bool:
    """Whether the bytes of a rename found by names and shapes are another reference key's, not the expected one's
    (``layers.48`` "is ``layers.0`` renamed" but holds layer 47's tensor): then no rename is claimed. Bytes that match
    no reference key (a cast, another step's values) leave the names to decide."""
    meta, mine = act_fp.metas[rename.actual], act_fp.of(rename.actual)
    if ref_fp.metas[rename.expected] == meta and ref_fp.of(rename.expected) == mine:
        return False
    return _holds_other(rename.actual, ref_fp, act_fp) is not None


def _holds_other(actual: str, ref_fp: _Fingerprints, act_fp: _Fingerprints) -> str | None:
    """The reference key whose bytes ``actual`` holds (not all zeros, which match any zero buffer), or None."""
    meta = act_fp.metas[actual]
    found = ref_fp.keys_with(meta, act_fp.of(actual))
    return found[0] if found and not _all_zero(ref_fp.source, found[0], meta.nbytes) else None


def _index_shifts(ref_fp: _Fingerprints, act_fp: _Fingerprints) -> tuple[dict[str, str], list[Finding]]:
    """The numbered components whose every index moved by a constant (``layers.N`` saved as ``layers.N+1``, experts
    numbered from 1), found by names (``index_shifts``) and kept where most keys of the component hold the tensor of
    the shifted index: ``({stored key: reference key}, one finding per shift)``. The stored keys of a kept shift are
    paired with the keys they stand for; those whose bytes differ are compared with them as any pair is."""
    ref_metas, act_metas = ref_fp.metas, act_fp.metas
    if all(k in act_metas for k in ref_metas) or all(k in ref_metas for k in act_metas):
        return {}, []  # an index moved as a whole leaves keys on both sides without a namesake
    live = index_shifts(ref_metas, act_metas)
    while live:
        mapped = {a: e for a in act_metas if (e := shifted_back(live, a)) in ref_metas}
        held = {a for a, e in mapped.items() if ref_metas[e] == act_metas[a] and ref_fp.of(e) == act_fp.of(a)}
        applies_to = {s: [a for a in act_metas if s.applies(a.split("."))] for s in live}
        kept = [s for s in live if 2 * sum(a in held for a in applies_to[s]) > len(applies_to[s])]
        if kept == live:
            return mapped, [_shift_finding(s, applies_to[s], held, mapped) for s in live]
        live = kept
    return {}, []


def _pairs_by_name(ref_metas: Mapping[str, KeyMeta], act_metas: Mapping[str, KeyMeta], shifted: Mapping[str, str]
                   ) -> list[tuple[str, str]]:
    """``(reference key, stored key)``: the shifted keys with the keys they stand for, then the namesakes neither
    side of a shifted pair took."""
    taken = set(shifted.values())
    return [(e, a) for a, e in shifted.items()] + [
        (k, k) for k in ref_metas if k in act_metas and k not in shifted and k not in taken]


def _shift_finding(shift: IndexShift, keys: Sequence[str], held: set[str], mapped: Mapping[str, str]) -> Finding:
    """One finding for a whole index shift: ``keys`` are the stored keys it applies to."""
    same_bytes = [a for a in keys if a in held]
    example = (same_bytes[0], mapped[same_bytes[0]])
    lowest = (min(int(a.split(".")[shift.at]) for a in keys),
              min(int(mapped[a].split(".")[shift.at]) for a in keys if a in mapped))
    transform, hint = shift_words(shift, example, lowest)
    return Finding("renamed_key", shift_pattern(shift, keys),
                   {"transform": transform, "offset": shift.offset, "keys": len(keys), "same_bytes": len(same_bytes),
                    "example": f"{example[0]} holds {example[1]}'s tensor", "verified": "by content hash"}, hint)


def _checkpoint_layout(source: Source) -> tuple[Layout | PipelineLayout | None, str]:
    """The layout a checkpoint was saved with (``LAYOUT_FILE_NAME`` in its folder: a pipeline's for a pipeline
    checkpoint, whose stages say which ranks held what), and a note about it."""
    index = getattr(source, "index", None)
    if index is None:
        return None, ""
    try:
        layout = read_checkpoint_pipeline_layout(index.directory) or read_checkpoint_layout(index.directory)
    except (LayoutError, OSError, ValueError) as exc:
        return None, f"{LAYOUT_FILE_NAME} cannot be used: {exc}"
    return layout, "" if layout is None else f"{LAYOUT_FILE_NAME} ({layout.name}, {layout.mesh!r})"


def compare_sources(
    ref: Source,
    act: Source,
    *,
    layout: Layout | PipelineLayout | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    findings: tuple[Finding, ...] = (),
    subject: str = "",
    reference: str = "",
) -> Report:
    """Compare every key of ``act`` with ``ref``: missing, unexpected, renamed and misplaced keys, then values.

    Healthy pairs give no finding. ``findings`` (integrity problems found while opening) are included. Keys whose
    bytes cannot be read (a missing, truncated or unparsable file) are findings and the rest is compared. When
    ``act`` is a checkpoint that carries the layout it was saved with (``LAYOUT_FILE_NAME``), or else with
    ``layout``, or else with the layout the reference ``ref`` carries, each differing key names the ranks whose shards
    differ and each missing key the ranks that held it.

    Raises:
        ValueError: ``block_bytes`` is below 1.
    """
    check_block_bytes(block_bytes)
    saved_layout, layout_note = _checkpoint_layout(act)
    if saved_layout is None and layout is None and not layout_note:  # the checkpoint carries none: the reference's
        saved_layout, layout_note = _checkpoint_layout(ref)
        if layout_note:
            layout_note = (f"the reference's {layout_note} (the checkpoint carries none)" if saved_layout is not None
                           else f"the reference's {layout_note}")
    provenance = saved_layout or layout
    one_mesh = layout or saved_layout  # its cuts and fused keys; a pipeline's as one mesh (its ranks: provenance)
    if isinstance(one_mesh, PipelineLayout):
        one_mesh = one_mesh.flat_layout()
    out = list(findings)
    ref_damage, act_damage = damaged_keys(ref), damaged_keys(act)
    out += [f for f in act_damage.values() if f is not None]
    out += [Finding(f.kind, f.key, {**f.evidence, "side": "reference"}, f.hint) for f in ref_damage.values() if f]
    ref_metas = {k: m for k, m in ref.metas().items() if k not in ref_damage}
    act_metas = {k: m for k, m in act.metas().items() if k not in act_damage}
    stats: dict[str, Any] = {"keys": len(act_metas), "expected_keys": len(ref_metas)}
    for side, source, metas, damage in (("reference", ref, ref_metas, ref_damage), ("", act, act_metas, act_damage)):
        if not metas and damage:
            where = f"{side}: " if side else ""
            stats["error"] = f"{where}none of the {len(damage)} key(s) of {source.label} can be read"
            return Report(subject=subject or act.label, reference=reference or ref.label, findings=tuple(out),
                          stats=stats, readable=False)
    if layout_note:
        stats["layout_file"] = layout_note
    ref_fp, act_fp = _Fingerprints(ref, ref_metas, block_bytes), _Fingerprints(act, act_metas, block_bytes)
    shifted, shift_findings = _index_shifts(ref_fp, act_fp)  # {stored key: the reference key it stands for}
    out += shift_findings
    pairs = _pairs_by_name(ref_metas, act_metas, shifted)
    paired_ref, paired_act = {e for e, _ in pairs}, {a for _, a in pairs}
    missing = [k for k in ref_metas if k not in paired_ref and k not in act_damage]
    unexpected = [k for k in act_metas if k not in paired_act and k not in ref_damage]

    def same(expected: str, actual: str) -> bool:  # by shape: a renamed key may be cast too (a dtype finding follows)
        return ref_metas[expected].shape == act_metas[actual].shape

    renames = [r for r in find_renames(missing, unexpected, same) if not _contradicted(r, ref_fp, act_fp)]
    renamed = {r.expected for r in renames}
    for r in renames:
        evidence = {"expected_key": r.expected, "transform": f"rename {r.rule}"}
        out.append(Finding("renamed_key", r.actual, evidence, rename_hint([r])))
        pairs.append((r.expected, r.actual))
    swapped_into = {r.actual for r in renames}
    rest_unexpected = [k for k in unexpected if k not in swapped_into]
    # keys renamed with no common rule but the same bytes (any missing key of the same shape and dtype)
    left_missing = {m for m in missing if m not in renamed}
    for u in list(rest_unexpected):
        hits = [m for m in ref_fp.keys_with(act_metas[u], act_fp.of(u)) if m in left_missing and m not in renamed]
        if hits:
            renamed.add(hits[0])
            rest_unexpected.remove(u)
            out.append(Finding("renamed_key", u, {"expected_key": hits[0], "transform": "same bytes under another "
                                                  "name"}, rename_hint([])))
            pairs.append((hits[0], u))
    for u, parts in _fused(left_missing - renamed, rest_unexpected, ref_metas, act_metas, ref_fp, act_fp):
        renamed.update(parts)
        rest_unexpected.remove(u)
        out.append(in_fused_order(_fused_finding(u, parts), one_mesh))
    for u in list(rest_unexpected):
        sets = fused_by_shape({u: act_metas[u].shape}, {m: ref_metas[m].shape for m in left_missing - renamed})
        parts = _fused_order(u, sets.get(u, []), ref_fp, act_fp)
        if parts is not None:
            renamed.update(parts)
            rest_unexpected.remove(u)
            out.append(in_fused_order(_fused_finding(u, parts), one_mesh))
    stacked = MissingByContent(ref_metas, sorted(left_missing - renamed),
                               lambda m: _digest(ref, m, 0, ref_metas[m].nbytes, block_bytes))
    for u in list(rest_unexpected):  # a stale key map: several missing keys stacked or fused under one key
        found = find_joined(u, act_metas[u], stacked, renamed,
                            lambda a, b, u=u: _digest(act, u, a, b, block_bytes))
        if found is None:  # joined on another dim: each part a box of the key, hashed as a key's bytes
            view = TensorView(act, (u,), u)
            found = find_joined_on_dim(u, act_metas[u], stacked, renamed, view.read_rows,
                                       view.rows_per_block(block_bytes, 2))
        if found is not None:
            renamed.update(found.parts)
            rest_unexpected.remove(u)
            out.append(in_fused_order(joined_finding(found, act_metas[u], ref_metas), one_mesh))
    maybe = fused_by_shape({u: act_metas[u].shape for u in rest_unexpected},
                           {m: ref_metas[m].shape for m in missing if m not in renamed})
    inside = {part: u for u, sets in maybe.items() for part in sets[0]}
    unread = unread_files_hint(act, findings)
    for m in missing:
        if m not in renamed:
            meta = ref_metas[m]
            evidence = {"expected_shape": list(meta.shape), "expected_dtype": meta.dtype}
            if provenance is not None:
                evidence.update(held_by(provenance, m))
            hint = ("the checkpoint lacks this key: was it filtered out by the key map, dropped while consolidating "
                    "(keys of other EP or PP ranks), or did its writer rank fail? Re-save with it")
            if unread:
                hint = unread
            elif m in inside and act_metas[inside[m]].dtype != meta.dtype:
                hint = (f"by shape it may be part of {inside[m]} (fused on dim 0 with sibling keys), stored there as "
                        f"{act_metas[inside[m]].dtype} where {meta.dtype} is expected, so the bytes were not "
                        "compared: split that key, cast the pieces and compare them")
            elif m in inside:
                hint = (f"by shape it may be part of {inside[m]} (fused on dim 0 with sibling keys), whose pieces do "
                        "not hold this key's bytes: split that key and compare the pieces")
            out.append(Finding("missing_key", m, evidence, hint))
    for u in rest_unexpected:
        meta = act_metas[u]
        hint = ("the reference has no such key: an extra buffer, a key from another model, or a rename the key map "
                "misses; drop it or map it")
        expected = sorted({ref_metas[m].dtype for m in maybe[u][0]}) if u in maybe else []
        if u in maybe and expected != [meta.dtype]:
            hint = (f"by shape it may be {listing(maybe[u][0])} fused on dim 0, stored as {meta.dtype} where "
                    f"{' and '.join(expected)} is expected (a cast as well as a fusion?), so the bytes were not "
                    "compared: split it in the key map, cast the pieces and compare them; do not drop it, it may "
                    "hold their weights")
        elif u in maybe:
            hint = (f"by shape it may be {listing(maybe[u][0])} fused on dim 0, but its pieces hold other bytes (in "
                    "every order): split it in the key map and compare the pieces; do not drop it, it may hold "
                    "their weights")
        evidence = {"shape": list(meta.shape), "dtype": meta.dtype}
        holds = _holds_other(u, ref_fp, act_fp) if u not in maybe else None
        if holds is not None:  # what a rename the bytes contradict leaves: say whose tensor it is
            evidence.update(holds=holds, verified="by content hash")
            hint = ("the reference has no such key, but this one holds the tensor of the key named in holds: a wrong "
                    "index or name in the key map or the conversion loop; map it to that key, do not drop it")
        out.append(Finding("unexpected_key", u, evidence, hint))

    hints = layout_hints(one_mesh)
    mismatched: list[tuple[str, str]] = []
    equal = 0
    unreadable: dict[str, Finding] = {}
    for rk, ak in pairs:
        try:
            if ref_metas[rk] == act_metas[ak] and ref_fp.of(rk) == act_fp.of(ak):
                equal += 1
                continue
        except OSError as exc:  # the file changed or shrank after it was scanned
            unreadable[ak] = _read_error(ak, exc)
            continue
        mismatched.append((rk, ak))
    out += unreadable.values()
    act_of = {rk: ak for rk, ak in pairs}
    data_findings: list[tuple[Finding, list[tuple[str, str]]]] = []
    handled: set[str] = set()
    if one_mesh is not None:
        fused_layout = one_mesh
        pair_of = dict(mismatched)
        for name, spec in fused_layout.specs.items():
            keys = spec.hf_keys
            if len(keys) < 2 or spec.fused_dim != 0 or not any(k in pair_of for k in keys):
                continue
            if not all(k in act_of for k in keys):
                continue
            rv = TensorView(ref, keys, name)
            av = TensorView(act, tuple(act_of[k] for k in keys), name)
            if rv.dtype is None or av.dtype is None or rv.shape != av.shape or rv.dtype != av.dtype:
                continue
            groups = gate_up_groups(keys)  # the layout's word on where gate and up are: its fused keys' order
            fused_hints = (Hint(spec.fused_dim, 1, gate_up=groups),) if groups else ()
            finding = analyze_pair(rv, av, (*hints[keys[0]][0], *fused_hints), block_bytes)
            if finding.transform is not None:
                data_findings.append((finding, [(k, act_of[k]) for k in keys]))
                handled.update(keys)
    for rk, ak in mismatched:
        if rk in handled:
            continue
        try:
            finding = _misplaced(rk, ak, ref_fp, act_fp, act_of)
            if finding is None:
                key_hints = (*hints.get(rk, ((), ""))[0], *gate_up_hints(rk, ref_metas[rk].shape))
                finding = analyze_pair(TensorView(ref, (rk,), rk), TensorView(act, (ak,), ak), key_hints, block_bytes)
                if finding.transform is None and ref_metas[rk] == act_metas[ak]:
                    finding = _misplaced_halves(rk, ak, ref_fp, act_fp) or finding
        except OSError as exc:
            out.append(_read_error(ak, exc))
            continue
        data_findings.append((finding, [(rk, ak)]))
    stale = _stale_file(act, [ak for _, ak in mismatched], [ak for _, ak in pairs],
                        all(f.kind == "value_mismatch" for f, _ in data_findings))
    for i, (finding, keys) in enumerate(data_findings):
        if provenance is not None and i < _MAX_BLAMED:
            finding = _with_ranks(finding, keys, ref, act, ref_metas, act_metas, provenance, block_bytes)
        if stale is not None:
            finding = Finding(finding.kind, finding.key, {**finding.evidence, "file": stale[0],
                                                          "file_keys": stale[1]}, _stale_file_hint(*stale))
        if len(keys) == 1:
            finding = broken_tie(finding, *keys[0], ref_fp, act_fp, act_of,
                                 lambda k: _all_zero(ref, k, ref_metas[k].nbytes, block_bytes))
        out.append(finding)
    stats.update(equal=equal, differing=len(mismatched))
    read = sum(getattr(s, "bytes_read", 0) for s in (ref, act))
    if read:
        stats["bytes_read"] = read
    return Report(subject=subject or act.label, reference=reference or ref.label, findings=tuple(out), stats=stats)


def _stale_file(act: Source, differing: Sequence[str], compared: Sequence[str], values_only: bool
                ) -> tuple[str, int, int] | None:
    """``(file, its compared keys, how many differ)``: the one data file that holds all the ``differing`` keys (two
    or more, no transform explaining any: ``values_only``) while every key of every other file is equal."""
    index = getattr(act, "index", None)
    if index is None or len(differing) < 2 or not values_only:
        return None
    files = {index.weight_map.get(k) for k in differing}
    file = files.pop() if len(files) == 1 else None
    if file is None:
        return None
    in_file = {k for k in compared if index.weight_map.get(k) == file}
    if len(in_file) == len(set(compared)):
        return None  # no other file to tell a stale file from a bad save
    return file, len(in_file), len(set(differing))


def _stale_file_hint(file: str, keys: int, differing: int) -> str:
    if differing == keys:
        return (f"every key of {file} differs from the reference and the keys of every other file are equal: {file} "
                "is likely a stale copy from another save (an earlier step or another run, left in place or copied "
                f"in), not a bug of this save: copy this save's {file} again, or re-save")
    return (f"the differing keys are all in {file} ({differing} of its {keys}; its other keys and those of every other "
            f"file are equal): {file} may be a stale copy from another save whose other keys did not change (frozen, "
            f"or rounded to the same values); compare it with this save's {file} and copy that again, or re-save")


def _read_error(key: str, exc: OSError) -> Finding:
    if "short read" not in str(exc):
        raise exc
    return Finding("truncated_file", key, {"detail": str(exc)},
                   "the file ended before this key's data while it was read (it shrank after the scan, or is being "
                   "written): re-run on a finished checkpoint")


def _with_ranks(finding: Finding, keys: list[tuple[str, str]], ref: Source, act: Source,
                ref_metas: Mapping[str, KeyMeta], act_metas: Mapping[str, KeyMeta], layout: Layout,
                block_bytes: int) -> Finding:
    """``finding`` with the ranks whose shards of its keys differ (``written_from``, ``differing_ranks``)."""
    texts, ranks, some_right = [], set(), False
    for rk, ak in keys:
        meta = act_metas[ak]
        if ref_metas[rk] != meta or meta.torch_dtype is None or not same_shape(layout, rk, meta.shape):
            continue
        found = written_from(layout, rk, TensorView(ref, (rk,), rk), TensorView(act, (ak,), ak), block_bytes)
        if found:
            texts.append(found["written_from"])
            ranks.update(found["differing_ranks"])
            some_right = some_right or found["some_right"]
    if not texts:
        return finding
    hint = finding.hint
    if some_right and finding.kind == "value_mismatch":  # not another run's weights: some ranks' shards are right
        named = ", ".join(map(str, sorted(ranks)))
        hint = (f"only the shards written from rank(s) {named} differ and the others are right: the save of those "
                "ranks went wrong (a shard never written, zeros, another rank's shard or a stale one), not the run; "
                "check what those ranks held and wrote, then re-save")
    return Finding(finding.kind, finding.key, {**finding.evidence, "written_from": " | ".join(texts),
                                               "differing_ranks": sorted(ranks)}, hint)


def diff_checkpoints(
    a: Path | str,
    b: Path | str,
    *,
    layout: Layout | PipelineLayout | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> Report:
    """Compare checkpoint ``b`` with the reference ``a``; a ``Report`` whose findings explain each difference.

    Both are read in blocks of at most ``block_bytes`` (memory stays bounded whatever their size); equal
    tensors are recognized by a streamed hash of their bytes. For each tensor that differs, the transforms
    real sharding bugs produce are tried (see ``workbench.debug.transforms``) and the one that reproduces
    the data bit for bit is reported; pass the training ``layout`` to try its cuts first and to analyze
    fused parameters across their HF keys.

    Example::

        >>> report = wb.diff_checkpoints("exp/good", "exp/suspect")      # doctest: +SKIP
        >>> [(f.kind, f.key, f.transform) for f in report.findings]      # doctest: +SKIP
        [('permuted', 'model.layers.0.mlp.experts.fused_w1w3',
          'interleaved shard gathered as contiguous (IS(0,2)@tp over 2 ranks)')]

    Raises:
        ValueError: ``block_bytes`` is below 1 (a block of no bytes would compare nothing).
    """
    check_block_bytes(block_bytes)
    ref, ref_findings, ref_error = open_checkpoint(a, block_bytes)
    act, act_findings, act_error = open_checkpoint(b, block_bytes)
    tagged = [Finding(f.kind, f.key, {**f.evidence, "side": "reference"}, f.hint) for f in ref_findings]
    findings = tuple(tagged) + tuple(act_findings)
    if ref is None or act is None:
        error = "; ".join(e for e in (ref_error and f"reference: {ref_error}", act_error) if e)
        return Report(subject=str(b), reference=str(a), findings=findings, stats={"error": error}, readable=False)
    try:
        return compare_sources(ref, act, layout=layout, block_bytes=block_bytes, findings=findings,
                               subject=str(b), reference=str(a))
    finally:
        ref.close()
        act.close()
