"""diagnose: what is wrong with a checkpoint, judged against a reference checkpoint, a Layout or a model."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import replace
from itertools import combinations
from pathlib import Path
from typing import Any

import torch

from workbench.debug.damage import damaged_keys, unread_files_hint
from workbench.debug.diff import (
    MAX_FUSED_PARTS,
    MAX_FUSED_POOL,
    compare_sources,
    diff_checkpoints,
    fused_by_shape,
    in_name_order,
    listing,
    name_stem,
    open_checkpoint,
)
from workbench.debug.findings import VALUES_NOT_COMPARED, Finding, Report
from workbench.debug.inspect import pipeline_of_stages
from workbench.debug.provenance import held_by
from workbench.debug.renames import find_renames, rename_hint
from workbench.debug.source import DEFAULT_BLOCK_BYTES, MemorySource
from workbench.debug.transforms import chunk_shard, joined_on, joined_words
from workbench.io.files.index import INDEX_NAME, read_index, safetensors_dtype
from workbench.layout.chunking import local_sizes
from workbench.layout.descriptors import ShardDescriptor
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout

__all__ = ["diagnose"]

_SHAPES_ONLY = "shapes only: a layout has no values; diagnose against a reference checkpoint to check the data"


def diagnose(
    path: Path | str,
    expected: Any,
    *,
    layout: Layout | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> Report:
    """Explain what is wrong with the checkpoint at ``path``; a ``Report`` with no findings when healthy.

    Args:
        path: the checkpoint to judge (HF folder or ``.safetensors`` file).
        expected: what it should be: a reference checkpoint path; a layout file (``.toml``) or a
            ``Layout`` (keys, shapes and dtypes are checked, and shape bugs named from the layout's cuts:
            values cannot be checked without a reference); or an ``nn.Module`` / state dict keyed by HF
            keys (values are compared, DTensors gathered with ``full_tensor()``).
        layout: with a reference checkpoint or model, the training layout: its cuts are tried first and
            fused parameters are analyzed across their HF keys. A checkpoint that carries the layout it was
            saved with (``workbench_layout.toml``, written by ``save_hf``) needs none: that layout's cuts are
            used, each differing key names the ranks (with mesh coordinates) whose shards differ
            (``written_from``), and each missing key the ranks that held it (``held_by``).
        block_bytes: the largest block read at once (memory stays bounded by a few blocks).

    Damaged or missing files are findings, never exceptions: their keys are reported by what happened to
    their file and every other key is compared; ``Report.readable`` is False only when nothing can be read.

    Example::

        >>> report = wb.diagnose("exp/hf-100", expected="exp/hf-100-reference")   # doctest: +SKIP
        >>> print(report)                                                          # doctest: +SKIP
    """
    return _one_file_of_a_folder(Path(path), _diagnose(path, expected, layout=layout, block_bytes=block_bytes))


def _diagnose(path: Path | str, expected: Any, *, layout: Layout | None, block_bytes: int) -> Report:
    if isinstance(expected, Layout):
        return _against_layout(path, expected)
    if isinstance(expected, str | Path):
        if str(expected).endswith(".toml"):
            from workbench.layout.layout_file import load_layout

            return _against_layout(path, load_layout(expected))
        return diff_checkpoints(expected, path, layout=layout, block_bytes=block_bytes)
    if isinstance(expected, torch.nn.Module):
        state: Mapping[str, Any] = expected.state_dict()
        label = type(expected).__name__
    elif isinstance(expected, Mapping):
        state, label = expected, "state dict"
    else:
        raise TypeError(
            f"diagnose: expected must be a checkpoint path, a layout (.toml or Layout), an nn.Module or a state "
            f"dict, got {type(expected).__name__}"
        )
    act, findings, error = open_checkpoint(path, block_bytes)
    if act is None:
        return Report(subject=str(path), reference=label, findings=findings, stats={"error": error}, readable=False)
    try:
        return compare_sources(MemorySource(state, label=label), act, layout=layout, block_bytes=block_bytes,
                               findings=findings, subject=str(path), reference=label)
    finally:
        act.close()


def _one_file_of_a_folder(path: Path, report: Report) -> Report:
    """``report`` of one ``.safetensors`` file of an indexed checkpoint: its missing keys that the folder's index
    places in another of its files are said to be there (diagnose the folder), not to be re-saved."""
    index = path.parent / INDEX_NAME
    if path.suffix != ".safetensors" or not path.is_file() or not index.is_file():
        return report
    weight_map, _, _ = read_index(index)
    if path.name not in weight_map.values():
        return report
    findings = []
    for f in report.findings:
        elsewhere = weight_map.get(f.key) if f.kind == "missing_key" else None
        if elsewhere is not None and elsewhere != path.name:
            f = replace(f, evidence={**f.evidence, "in_file": elsewhere}, hint=(
                f"{path.parent / INDEX_NAME} places it in {elsewhere}, another file of this checkpoint: diagnose "
                f"the folder {path.parent}, not one of its files"))
        findings.append(f)
    return replace(report, findings=tuple(findings))


def _expected_keys(layout: Layout) -> dict[str, tuple[tuple[int, ...], str | None, str]]:
    """``{hf_key: (checkpoint shape, safetensors dtype or None when the layout gives none, parameter)}``."""
    out = {}
    for name, spec in layout.specs.items():
        shape = list(spec.visible_shape)
        if spec.fused_dim is not None:
            shape[spec.fused_dim] //= len(spec.hf_keys)
        given = layout.given_dtype(name)
        dtype = None if given is None else safetensors_dtype(given)
        for key in spec.hf_keys:
            out[key] = (tuple(shape), dtype, name)
    return out


_MAX_NEAR = 16384  # missing keys under one module tried as the parts of one stacked key


def _under_each_module(keys: Iterable[str]) -> dict[str, list[str]]:
    """Each module (every dotted prefix of a key but the top one) -> the keys under it, in sorted order."""
    out: dict[str, list[str]] = {}
    for key in sorted(keys):
        parent = key.rsplit(".", 1)[0]
        while "." in parent:
            out.setdefault(parent, []).append(key)
            parent = parent.rsplit(".", 1)[0]
    return out


def _stacked_by_shape(unexpected: Mapping[str, Any], missing: Mapping[str, tuple[tuple[int, ...], str | None, str]]
                      ) -> dict[str, list[str]]:
    """Unexpected keys whose elements are exactly those of the two or more missing keys under their own module that
    fit their shape (stacked on a new dim 0, or joined on dim 0: ``experts.gate_up_proj`` ``[E, 2I, H]`` for each
    expert's gate and up), by shapes and dtypes only."""
    by_module = _under_each_module(missing)
    out = {}
    for u, meta in unexpected.items():
        shape = tuple(meta.shape)
        near = by_module.get(u.rsplit(".", 1)[0], ())
        if len(near) > _MAX_NEAR:
            continue  # a whole model's keys under one module (a prefix dropped): not one stale key map's stack
        pool = [m for m in near if missing[m][1] in (None, meta.dtype) and _fits(missing[m][0], shape)]
        if len(pool) >= 2 and sum(math.prod(missing[m][0]) for m in pool) == math.prod(shape):
            out[u] = sorted(pool)
    return out


def _fits(part: tuple[int, ...], whole: tuple[int, ...]) -> bool:
    """Whether ``part`` can be a piece of ``whole`` joined on dim 0, or of one of its slices stacked on a new dim 0
    (no longer than a slice: ``[H, I]`` parts are not slices of ``[H, E, I]`` with E < H)."""
    return bool(whole) and ((len(part) == len(whole) and part[1:] == whole[1:])
                            or (len(part) == len(whole) - 1 and len(part) >= 1 and part[0] <= whole[1]
                                and part[1:] == whole[2:]))


def _joined_on_other_dim(unexpected: Mapping[str, Any], missing: Mapping[str, tuple[tuple[int, ...], str | None, str]]
                         ) -> dict[str, tuple[list[str], str]]:
    """``{key: (parts, how)}``: unexpected keys whose elements are exactly those of 2 or more missing keys of their
    own module joined on a dim d >= 1 (the parts' shapes the key's but on d, their lengths on d adding up to its
    own: a Conv1D ``c_attn`` ``[H, Hq+2Hk]`` for q, k, v) or stacked on a new dim d >= 1 (``[H, E, I]`` for E experts'
    ``[H, I]``), by shapes and dtypes only; ``how`` is "joined on dim d" or "stacked on a new dim d". All of a
    module's missing keys of one fitting shape are tried as parts; a subset only of 2 to ``MAX_FUSED_PARTS`` of the
    first ``MAX_FUSED_POOL``, the sets the key's name lists most parts of first (dim-0 joins: ``fused_by_shape``)."""
    by_module = _under_each_module(missing)
    out: dict[str, tuple[list[str], str]] = {}
    for u, meta in unexpected.items():
        whole = tuple(meta.shape)
        for module in dict.fromkeys(u.rsplit(".", n)[0] for n in (1, 2)):  # a stacked key's, a fused weight's
            near = by_module.get(module, [])
            if len(near) > _MAX_NEAR:
                break  # a whole model's keys under one module (a prefix dropped): not one stale key map's join
            near = [m for m in near if missing[m][1] in (None, meta.dtype)]
            for d in range(1, len(whole)):
                rest = whole[:d] + whole[d + 1:]
                stack = [m for m in near if missing[m][0] == rest]
                if whole[d] >= 2 and len(stack) == whole[d]:
                    out[u] = (stack, f"stacked on a new dim {d}")
                    break
                pool = [m for m in near if len(missing[m][0]) == len(whole) and 0 < missing[m][0][d] < whole[d]
                        and missing[m][0][:d] + missing[m][0][d + 1:] == rest]
                size = {m: missing[m][0][d] for m in pool}
                subsets = (c for r in range(2, min(len(pool), MAX_FUSED_PARTS) + 1)
                           for c in combinations(pool[:MAX_FUSED_POOL], r))
                sets = [tuple(pool)] if len(pool) >= 2 and sum(size.values()) == whole[d] else [
                    c for c in subsets if sum(size[m] for m in c) == whole[d]]
                if sets:
                    best = max(sets, key=lambda c: (sum(name_stem(m) in name_stem(u) for m in c), -len(c)))
                    out[u] = (list(in_name_order(u, best)), f"joined on dim {d}")
                    break
            if u in out:
                break
    return out


def _patterns(keys: list[str]) -> str:
    from workbench.name_patterns import group_by_pattern

    return ", ".join(g.pattern for g in group_by_pattern(keys))


def _key_extent(spec: LoadSpec, rank: int, key: str, dim: int) -> tuple[tuple[int, int], ...]:
    """The spans of ``key`` on ``dim`` that ``rank`` holds (empty when it holds none of the key)."""
    return tuple(sorted((r.key_offset[dim], r.key_offset[dim] + r.sizes[dim])
                        for r in spec.key_regions(rank) if r.hf_key == key))


def _cuts_of_key(layout: Layout, name: str, key: str) -> list[ShardDescriptor]:
    """The cuts of parameter ``name`` that split ``key`` itself: on a fused parameter, a cut on the fused dim whose
    ranks hold whole keys (EP over experts) falls between keys, and no shape bug of the key comes from it."""
    spec = layout.specs[name]
    out = []
    for shard in spec.shards:
        if spec.fused_dim is None or shard.dim != spec.fused_dim:
            out.append(shard)
            continue
        holder = next((r for r in layout.mesh.all_ranks() if _key_extent(spec, r, key, shard.dim)), None)
        if holder is None:
            out.append(shard)
            continue
        held = {_key_extent(spec, r, key, shard.dim) for r in layout.mesh.group_ranks(holder, shard.mesh_dim)}
        if len(held - {()}) > 1:
            out.append(shard)
    return out


def _explain_shape(layout: Layout, name: str, want: tuple[int, ...], got: tuple[int, ...],
                   key: str | None = None) -> tuple[str, str, str]:
    """``(kind, transform, hint)`` naming the layout cut that a wrong shape of ``key`` (of parameter ``name``) comes
    from; only cuts that split the key itself are considered."""
    spec = layout.specs[name]
    shards = spec.shards if key is None else _cuts_of_key(layout, name, key)
    transposed = len(want) == 2 and got == want[::-1] and want != got
    for shard in shards:  # a cut's shards joined along another dim: its length divided, another's multiplied
        w = layout.mesh.group_size(shard.mesh_dim)
        e = joined_on(want, got, shard.dim, w)
        if e is not None:
            transform, hint = joined_words(w, str(shard), shard.dim, e)
            also = (" If it was never sharded, it may instead be stored transposed: the shapes alone cannot tell, "
                    "a reference's values can") if transposed else ""
            return "shape_mismatch", transform, f"{hint}.{also}"
    if transposed:
        return "permuted", "transposed", "the tensor is stored transposed: transpose it when saving"
    diff = [d for d in range(len(want)) if len(got) == len(want) and want[d] != got[d]]
    if len(diff) == 1:
        d = diff[0]
        n, m = want[d], got[d]
        if spec.origin_shape is not None and spec.fused_dim is None and m == spec.global_shape[d]:
            return ("padding_not_trimmed", f"{m - n} padding rows kept on dim {d} (global_shape {m}, origin {n})",
                    "trim the tail padding to origin_shape before saving")
        for shard in shards:
            w = layout.mesh.group_size(shard.mesh_dim)
            if shard.dim == d and w > 1 and 0 < m < n and m in local_sizes(n, w, shard.interleave_factor):
                return ("partial_shard", f"the shape of one rank's shard under {shard} ({w} ranks)",
                        "only a local shard was saved: save full tensors (full_tensor() or wb.save_hf)")
        cut = math.prod(layout.mesh.group_size(s.mesh_dim) for s in spec.shards)
        if m > n and m % n == 0 and m // n <= layout.mesh.size // max(1, cut):
            return ("replicated_concat", f"{m // n} copies concatenated on dim {d}",
                    "a replicated tensor was gathered as if sharded: save one copy")
        if 0 < m < n and chunk_shard(n, 0, m) is None:
            return ("shape_mismatch", f"{m} of the {n} expected slices on dim {d}: no rank's shard under torch's "
                    "chunk rule has that length",
                    "the tensor is shorter than the layout's and no shard split gives its length: the write stopped "
                    "early, or it was cut by hand; save the whole tensor")
    return "shape_mismatch", "", "the checkpoint's shape is not the layout's: saved from another model config?"


def _saved_by_stages_of(path: Path | str, fingerprints: set[str], mine: str) -> bool:
    """Whether the files were written by the stages of the pipeline the folder carries, and the layout is that
    pipeline's whole model."""
    pipeline = pipeline_of_stages(path, fingerprints)
    return pipeline is not None and pipeline.flat_layout().fingerprint() == mine


def _against_layout(path: Path | str, layout: Layout) -> Report:
    act, findings, error = open_checkpoint(path)
    subject, reference = str(path), f"layout {layout.name}"
    if act is None:
        return Report(subject=subject, reference=reference, findings=findings, stats={"error": error}, readable=False)
    try:
        metas = act.metas()
        damaged = damaged_keys(act)
        expected = _expected_keys(layout)
        out = list(findings) + [f for f in damaged.values() if f is not None]
        missing = [k for k in expected if k not in metas and k not in damaged]
        unexpected = [k for k in metas if k not in expected]
        renames = find_renames(missing, unexpected, lambda e, a: expected[e][0] == metas[a].shape)
        renamed = {r.expected: r.actual for r in renames}
        for r in renames:
            out.append(Finding("renamed_key", r.actual, {"expected_key": r.expected, "transform": f"rename {r.rule}"},
                               rename_hint([r])))
        done = set(renamed.values())
        fused = {k: sets[0] for k, sets in fused_by_shape({k: metas[k].shape for k in unexpected if k not in done},
                                                          {k: expected[k][0] for k in missing if k not in renamed}
                                                          ).items()}
        stacked = _stacked_by_shape({k: metas[k] for k in unexpected if k not in done and k not in fused},
                                    {k: expected[k] for k in missing if k not in renamed})
        fused.update(stacked)
        other_dim = _joined_on_other_dim({k: metas[k] for k in unexpected if k not in done and k not in fused},
                                         {k: expected[k] for k in missing if k not in renamed})
        fused.update((k, parts) for k, (parts, _) in other_dim.items())
        inside = {part: k for k, parts in fused.items() for part in parts}
        unread = unread_files_hint(act, findings)
        for k in missing:
            if k not in renamed:
                hint = unread or ("the layout has this key but the checkpoint does not: re-save with it (keys of other "
                                  "EP or PP ranks dropped while consolidating?)")
                if k in inside and not unread:
                    share = "half" if len(fused[inside[k]]) == 2 else "part"
                    how = other_dim[inside[k]][1] if inside[k] in other_dim else "fused or stacked on dim 0"
                    hint = (f"by shape it may be {share} of {inside[k]} ({how} with sibling keys): "
                            "split that key in the key map, or save unfused")
                out.append(Finding("missing_key", k, {"expected_shape": list(expected[k][0]),
                                                      "parameter": expected[k][2], **held_by(layout, k)}, hint))
        for k in unexpected:
            if k not in done:
                hint = "the layout has no such key: add it to the key map, or drop it once you know it is not needed"
                if k in stacked:
                    hint = (f"by shape it may be the {len(fused[k])} keys {_patterns(fused[k])} stacked or fused on "
                            "dim 0, all of them (the layout expects them apart): the key map that wrote it is stale; "
                            "split it in the key map or the loader; do not drop it, it may hold their weights")
                elif k in other_dim:
                    parts, how = other_dim[k]
                    few = how.startswith("joined") and len(parts) <= MAX_FUSED_PARTS  # q, k and v; or experts.{0..7}
                    named = listing(parts) if few else f"the {len(parts)} keys {_patterns(parts)}"
                    hint = (f"by shape it may be {named} {how}, all of them (the layout expects them apart): the key "
                            "map that wrote it is stale; split it in the key map or the loader; do not drop it, it may "
                            "hold their weights")
                elif k in fused:
                    hint = (f"by shape it may be {listing(fused[k])} fused on dim 0 (the layout expects them apart): "
                            "split it in the key map, or save unfused; do not drop it, it may hold their weights")
                out.append(Finding("unexpected_key", k, {"shape": list(metas[k].shape), "dtype": metas[k].dtype},
                                   hint))
        for key, (shape, dtype, name) in expected.items():
            stored = renamed.get(key, key)
            if stored not in metas:
                continue
            meta = metas[stored]
            evidence = {"expected_shape": list(shape), "actual_shape": list(meta.shape), "parameter": name}
            if meta.shape != shape:
                kind, transform, hint = _explain_shape(layout, name, shape, meta.shape, key)
                if transform:
                    evidence.update(transform=transform, verified=_SHAPES_ONLY)
                out.append(Finding(kind, stored, evidence, hint))
            elif dtype is not None and meta.dtype != dtype:
                out.append(Finding("dtype_mismatch", stored, {**evidence, "expected_dtype": dtype,
                                                              "actual_dtype": meta.dtype},
                                   "stored in another dtype than the layout's: check the save dtype and "
                                   "fp32_keys_pattern"))
        stats: dict[str, Any] = {"keys": len(metas), "expected_keys": len(expected),
                                 "values": VALUES_NOT_COMPARED}
        unknown = sum(1 for n in layout.specs if layout.given_dtype(n) is None)
        if unknown:
            stats["dtypes_not_checked"] = f"{unknown} parameter(s) whose layout gives no dtype"
        fps = {m.get("layout") for m in act.index.file_metadata.values() if m.get("layout")}
        if fps:
            mine = layout.fingerprint()
            if fps == {mine}:
                stats["layout_fingerprint"] = "same as the layout"
            elif _saved_by_stages_of(path, fps, mine):
                stats["layout_fingerprint"] = "same as the layout (saved stage by stage: one per pipeline stage)"
            else:
                stats["layout_fingerprint"] = f"saved from layout {sorted(fps)}, this layout is {mine}"
        return Report(subject=subject, reference=reference, findings=tuple(out), stats=stats)
    finally:
        act.close()

