"""diff_checkpoints: compare a checkpoint with a reference, key by key, and explain every difference.

Equal tensors cost one streamed hash of each side (content fingerprints); only tensors that differ are
analyzed (``analyze.analyze_pair``). With a ``Layout``, fused parameters are analyzed as one tensor (a
gather bug moves rows across HF keys) and the layout's cuts (W, F) are tried first.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workbench.debug.analyze import analyze_pair
from workbench.debug.findings import Finding, Report
from workbench.debug.integrity import scan_for_findings
from workbench.debug.renames import find_renames, rename_hint
from workbench.debug.source import DEFAULT_BLOCK_BYTES, CheckpointSource, KeyMeta, Source
from workbench.debug.transforms import Hint
from workbench.debug.views import TensorView
from workbench.layout.model_layout import Layout
from workbench.mesh import format_mesh_dim

__all__ = ["compare_sources", "diff_checkpoints", "layout_hints", "open_checkpoint"]


def open_checkpoint(path: Path | str, block_bytes: int = DEFAULT_BLOCK_BYTES) -> tuple[
    CheckpointSource | None, tuple[Finding, ...], str
]:
    """``(source, integrity findings, error)`` for a checkpoint path; ``source`` is None when unreadable."""
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


def _swap_partner(key: str, ref: Source, act: Source, metas: Mapping[str, KeyMeta]) -> str | None:
    """Another reference key (same parent, same meta) whose bytes ``act[key]`` holds."""
    parent = key.rsplit(".", 2)[0]
    fp = act.fingerprint(key)
    for other, meta in metas.items():
        if other != key and other.rsplit(".", 2)[0] == parent and meta == metas[key] and ref.fingerprint(other) == fp:
            return other
    return None


def compare_sources(
    ref: Source,
    act: Source,
    *,
    layout: Layout | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    findings: tuple[Finding, ...] = (),
    subject: str = "",
    reference: str = "",
) -> Report:
    """Compare every key of ``act`` with ``ref``: missing, unexpected and renamed keys, then values.

    Healthy pairs give no finding. ``findings`` (integrity problems found while opening) are included.
    """
    ref_metas, act_metas = ref.metas(), act.metas()
    out = list(findings)
    missing = [k for k in ref_metas if k not in act_metas]
    unexpected = [k for k in act_metas if k not in ref_metas]

    def same(expected: str, actual: str) -> bool:
        a, b = ref_metas[expected], act_metas[actual]
        return a.shape == b.shape and a.dtype == b.dtype

    renames = find_renames(missing, unexpected, same)
    pairs = [(k, k) for k in ref_metas if k in act_metas]
    renamed = {r.expected for r in renames}
    for r in renames:
        evidence = {"expected_key": r.expected, "transform": f"rename {r.rule}"}
        out.append(Finding("renamed_key", r.actual, evidence, rename_hint([r])))
        pairs.append((r.expected, r.actual))
    swapped_into = {r.actual for r in renames}
    rest_unexpected = [k for k in unexpected if k not in swapped_into]
    # keys renamed with no common rule but the same bytes
    by_fp: dict[tuple[KeyMeta, str], str] = {}
    wanted = {act_metas[u] for u in rest_unexpected}
    for m in missing:
        if m not in renamed and ref_metas[m] in wanted:
            by_fp[(ref_metas[m], ref.fingerprint(m))] = m
    for u in list(rest_unexpected):
        m = by_fp.pop((act_metas[u], act.fingerprint(u)), None) if by_fp else None
        if m is not None:
            renamed.add(m)
            rest_unexpected.remove(u)
            out.append(Finding("renamed_key", u, {"expected_key": m, "transform": "same bytes under another name"},
                               rename_hint([])))
    for m in missing:
        if m not in renamed:
            meta = ref_metas[m]
            out.append(Finding("missing_key", m, {"expected_shape": list(meta.shape), "expected_dtype": meta.dtype},
                               "the checkpoint lacks this key: was it filtered out by the key map, or did its "
                               "writer rank fail? Re-save with it"))
    for u in rest_unexpected:
        meta = act_metas[u]
        out.append(Finding("unexpected_key", u, {"shape": list(meta.shape), "dtype": meta.dtype},
                           "the reference has no such key: an extra buffer, a key from another model, or a "
                           "rename the key map misses; drop it or map it"))

    hints = layout_hints(layout)
    mismatched: list[tuple[str, str]] = []
    equal = 0
    for rk, ak in pairs:
        if ref_metas[rk] == act_metas[ak] and ref.fingerprint(rk) == act.fingerprint(ak):
            equal += 1
        else:
            mismatched.append((rk, ak))
    handled: set[str] = set()
    if layout is not None:
        pair_of = dict(mismatched)
        everywhere = {rk: ak for rk, ak in pairs}
        for name, spec in layout.specs.items():
            keys = spec.hf_keys
            if len(keys) < 2 or spec.fused_dim != 0 or not any(k in pair_of for k in keys):
                continue
            if not all(k in everywhere for k in keys):
                continue
            rv = TensorView(ref, keys, name)
            av = TensorView(act, tuple(everywhere[k] for k in keys), name)
            if rv.dtype is None or av.dtype is None or rv.shape != av.shape or rv.dtype != av.dtype:
                continue
            finding = analyze_pair(rv, av, hints[keys[0]][0], block_bytes)
            if finding.transform is not None:
                out.append(finding)
                handled.update(keys)
    for rk, ak in mismatched:
        if rk in handled:
            continue
        partner = None
        if ref_metas[rk] == act_metas[ak] and rk == ak:
            partner = _swap_partner(rk, ref, act, ref_metas)
        if partner is not None:
            what = "gate/up swapped: " if {"gate", "up"} & set(partner.replace("_", ".").split(".")) else ""
            out.append(Finding("permuted", ak, {"transform": f"{what}holds the data of {partner}",
                                                "expected_shape": list(ref_metas[rk].shape), "verified": "bit for bit"},
                               f"this key holds {partner}'s tensor: the two keys were swapped (fused order or key "
                               "map); swap them back"))
            continue
        key_hints = hints.get(rk, ((), ""))[0]
        out.append(analyze_pair(TensorView(ref, (rk,), rk), TensorView(act, (ak,), ak), key_hints, block_bytes))
    stats: dict[str, Any] = {"keys": len(act_metas), "expected_keys": len(ref_metas), "equal": equal,
                             "differing": len(mismatched)}
    read = sum(getattr(s, "bytes_read", 0) for s in (ref, act))
    if read:
        stats["bytes_read"] = read
    return Report(subject=subject or act.label, reference=reference or ref.label, findings=tuple(out), stats=stats)


def diff_checkpoints(
    a: Path | str,
    b: Path | str,
    *,
    layout: Layout | None = None,
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
    """
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
