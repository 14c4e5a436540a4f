"""The plan stage of one rank's save: what it writes, how, into which files (pure, cached per layout).

``plan_rank_save`` checks the call (policy, config files, local shapes), settles which tensors are written in
place by their holders (direct mode) and which are gathered, and plans the gathers (``plan_save_within_writers``)
and the files (``plan_files``). Nothing here touches a file or a process group; ``SaveSession.plan`` runs it,
then prepares the directory and agrees with the other ranks.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.errors import CheckpointError
from workbench.io.files.direct import direct_names
from workbench.io.files.file_plan import FilePlan, plan_files
from workbench.io.files.index import INDEX_NAME
from workbench.io.files.ownership import MARKER_NAME
from workbench.layout.layout_file import LAYOUT_FILE_NAME
from workbench.layout.model_layout import Layout
from workbench.memo import LRU, remember_by_identity
from workbench.plan.policy import SavePolicy
from workbench.plan.save_set import SavePlanSet, key_meta, layout_fingerprint, plan_save_within_writers
from workbench.plan.writers import writer_pool

__all__ = [
    "RankSavePlan", "dtype_problem", "dtype_summary", "files_digest", "files_problem", "files_summary",
    "layout_problem", "layout_rows", "plan_rank_save", "same_model_problem",
]

RESERVED_NAMES = frozenset({INDEX_NAME, MARKER_NAME, LAYOUT_FILE_NAME})  # files of the save that configs may not be
KeyMeta = dict[str, tuple[torch.dtype, tuple[int, ...]]]
DtypeSummary = tuple[str, tuple[str, ...]]  # (digest of the layout without its dtypes, every parameter's dtype)
FilesSummary = tuple[tuple[tuple[str, str], ...], int]  # ((key, save dtype) in order, number of files)


@dataclass(frozen=True, slots=True)
class RankSavePlan:
    """One rank's plan of a save: every key's (save dtype, shape), the tensors written in place, the gathers
    (``plan_set``: this rank's plans and schedule, and every gathered key's writer) and the files."""

    key_meta: KeyMeta
    direct: tuple[str, ...]
    plan_set: SavePlanSet
    file_plan: FilePlan


def plan_rank_save(
    layout: Layout,
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    *,
    policy: SavePolicy | None,
    budget: int | None,
    dtype: torch.dtype | None,
    fp32_keys_pattern: Sequence[str] | str | None,
    max_writers: int | None,
    write_mode: str,
    min_segment_bytes: int,
    queued_bytes: int,
    gather_scratch: bool,
    max_shard_bytes: int,
    config_files: Sequence[Path],
) -> RankSavePlan:
    """Plan ``rank``'s part of a save of ``tensors`` (its local shards) laid out as ``layout``.

    Raises:
        CheckpointError: a policy a HF save cannot follow, a config file that is missing or would overwrite a file
            of the save, or a local tensor whose shape is not the layout's (naming the parameter and both shapes).
    """
    policy = policy or SavePolicy.minimal()
    if policy.mode == "gather_only":
        raise CheckpointError("save_hf writes HF checkpoints; SavePolicy.gather_only keeps runtime layout")
    missing = [c for c in config_files if not c.is_file()]
    if missing:
        raise CheckpointError(f"config file(s) to copy do not exist: {[str(m) for m in missing]}")
    # a cap on the writers: the capped ranks write nothing, so their pieces are gathered to allowed writers, who
    # write whole keys into the files rank 0 made (rank 0 is always allowed: writer_pool starts at the lowest)
    mesh = layout.mesh
    capped = max_writers is not None and len(writer_pool(mesh.all_ranks(), max_writers)) < mesh.size
    direct_mode = write_mode == "direct" and policy.mode in ("full", "minimal") and not capped
    meta, direct = _key_meta_and_direct(layout, dtype, fp32_keys_pattern, min_segment_bytes if direct_mode else None)
    for name, spec in layout.specs.items():
        local, want = tensors[name], spec.local_shape(rank)
        if tuple(local.shape) != tuple(want):
            raise CheckpointError(
                f"parameter {name!r}: local tensor has shape {tuple(local.shape)}, the layout says {tuple(want)}"
            )
    gathered = layout
    if direct:
        skip = set(direct)
        gathered = Layout(layout.mesh, {n: s for n, s in layout.specs.items() if n not in skip},
                          {n: d for n, d in layout.dtypes.items() if n not in skip})
    plan_set = plan_save_within_writers(
        gathered, ranks=[rank], policy=policy, budget_bytes=budget, dtype=dtype, fp32_keys_pattern=fp32_keys_pattern,
        max_writers=max_writers, queued_bytes=queued_bytes, gather_scratch=gather_scratch,
    )
    file_plan = _file_plan(plan_set, meta, layout, max_shard_bytes)
    ours = RESERVED_NAMES | {f.name for f in file_plan.files}
    clash = [str(c) for c in config_files if c.name in ours or c.name.endswith(".safetensors")]
    if clash:
        raise CheckpointError(
            f"config file(s) {clash} would overwrite the index or weight files this save writes; rename them or "
            "leave them out of config_files"
        )
    return RankSavePlan(meta, direct, plan_set, file_plan)


def same_model_problem(models: Sequence[tuple[str, int, str | None]], detail: str | None = None) -> str | None:
    """Why the ranks cannot save together when they hold different layouts (``(fingerprint, parameters, first
    name)`` per rank), else None; ``detail`` (``layout_problem``'s words) says what differs, else each layout's
    size. Ranks that hold different parameters (pipeline stages called as one model) would each leave the others'
    tensors to a writer that does not have them, and publish a checkpoint without them."""
    by_layout: dict[str, list[int]] = {}
    for rank, (fingerprint, _, _) in enumerate(models):
        by_layout.setdefault(fingerprint, []).append(rank)
    if len(by_layout) == 1:
        return None
    groups = detail or "; ".join(
        f"rank(s) {_ranks(ranks)}: {models[ranks[0]][1]} parameters, the first {models[ranks[0]][2]!r}"
        for ranks in by_layout.values()
    )
    return (f"the ranks hold different layouts ({groups}); every rank must save the same model (pipeline "
            "stages save with save_hf_pipeline)")


LayoutRows = tuple[tuple[str, str], ...]  # ("mesh" or a parameter's name, what the save needs alike, as text)


def layout_rows(layout: Layout) -> LayoutRows:
    """The mesh and every parameter of ``layout`` (HF keys, shapes, cuts), as text: what ranks whose layouts differ
    share (one rank per layout) so that ``layout_problem`` can name the first difference."""
    rows = [("mesh", repr(layout.mesh))]
    for name, spec in layout.specs.items():
        text = f"HF key(s) {', '.join(spec.hf_keys)}, shape {tuple(spec.global_shape)}"
        if spec.origin_shape is not None and tuple(spec.origin_shape) != tuple(spec.global_shape):
            text += f" (origin {tuple(spec.origin_shape)})"
        if spec.fused_dim is not None:
            text += f", fused on dim {spec.fused_dim}"
        text += f", cut {' then '.join(str(d) for d in spec.shards) or 'nowhere'}"
        rows.append((name, text))
    return tuple(rows)


def layout_problem(fingerprints: Sequence[str], rows: Sequence[LayoutRows | None]) -> str | None:
    """The first difference between the ranks' layouts (each rank's model fingerprint, and the ``layout_rows`` of
    the first rank of each fingerprint, None from the others): the mesh, or a parameter held by some ranks only or
    cut otherwise, with the ranks of each side; None when the layouts agree or no rank's rows differ."""
    groups: dict[str, list[int]] = {}
    for rank, fingerprint in enumerate(fingerprints):
        groups.setdefault(fingerprint, []).append(rank)
    if len(groups) < 2:
        return None
    (_, ref_ranks), *others = groups.items()
    mine = dict(rows[ref_ranks[0]] or ())
    for _, ranks in others:
        theirs = dict(rows[ranks[0]] or ())
        if not mine or not theirs:
            continue
        a, b = _ranks(ref_ranks), _ranks(ranks)
        for name, text in mine.items():
            if name not in theirs:
                return f"parameter {name!r} is held by rank(s) {a} and not by rank(s) {b}"
            if theirs[name] != text:
                what = "the mesh" if name == "mesh" else f"parameter {name!r}"
                return f"{what} differs: {text} on rank(s) {a}; {theirs[name]} on rank(s) {b}"
        extra = next((name for name in theirs if name not in mine), None)
        if extra is not None:
            return f"parameter {extra!r} is held by rank(s) {b} and not by rank(s) {a}"
    return None


def dtype_summary(layout: Layout) -> DtypeSummary:
    """A digest of ``layout`` without its dtypes (mesh, names, keys, shapes, cuts) and every parameter's dtype name,
    in layout order: what ranks whose fingerprints differ share, to tell one parameter's dtype from another model."""
    digest = hashlib.sha256(repr((layout.mesh.shape, layout.mesh.dim_names)).encode())
    for name, spec in layout.specs.items():
        row = (name, spec.hf_keys, spec.global_shape, spec.origin_shape, spec.fused_dim,
               tuple(str(d) for d in spec.shards))
        digest.update(repr(row).encode())
    dtypes = tuple(_dtype_name(layout.dtypes.get(name)) for name in layout.specs)
    return digest.hexdigest()[:16], dtypes


def dtype_problem(names: Sequence[str], summaries: Sequence[DtypeSummary]) -> str | None:
    """The first parameter of ``names`` whose dtype differs between the ranks (each rank's ``dtype_summary``), with
    each rank's dtype; None when the ranks hold different parameters (their digests differ) or agree on dtypes."""
    if len({digest for digest, _ in summaries}) != 1:
        return None
    differing = [i for i in range(len(names)) if len({dtypes[i] for _, dtypes in summaries}) > 1]
    if not differing:
        return None
    first = differing[0]
    by_dtype: dict[str, list[int]] = {}
    for rank, (_, dtypes) in enumerate(summaries):
        by_dtype.setdefault(dtypes[first], []).append(rank)
    held = " and ".join(f"{dtype} on rank(s) {_ranks(ranks)}" for dtype, ranks in by_dtype.items())
    more = f" ({len(differing) - 1} more parameter(s) differ in dtype)" if len(differing) > 1 else ""
    return (f"parameter {names[first]!r} is {held}: every rank must hold it in one dtype (cast the model, or give "
            f"the layout its dtypes){more}")


_FILES_DIGESTS = LRU(16)
_DEFECT = ("the ranks passed the same arguments, so their planners differ (every rank must run the same workbench; "
           "if they do, this is a planner defect: please report it)")


def files_digest(planned: RankSavePlan) -> str:
    """A digest of what this rank will write where: every file's name, writer and keys, and every key's save dtype
    and shape. Ranks whose gathers agree can still differ here (``max_shard_bytes``, ``dtype=``,
    ``fp32_keys_pattern``; in direct mode nothing is gathered at all); remembered per (cached) plan, so a repeat save
    pays nothing."""

    def digest() -> str:
        files = tuple((f.name, f.writer, f.keys) for f in planned.file_plan.files)
        meta = tuple((k, str(d), shape) for k, (d, shape) in planned.key_meta.items())
        return hashlib.sha256(repr((files, meta)).encode()).hexdigest()[:16]

    return remember_by_identity(_FILES_DIGESTS, (planned.file_plan, planned.key_meta), None, digest)


def files_summary(planned: RankSavePlan) -> FilesSummary:
    """What ranks whose ``files_digest`` differ share to say how: every key's save dtype and the number of files."""
    dtypes = tuple((key, _dtype_name(dtype)) for key, (dtype, _) in planned.key_meta.items())
    return dtypes, len(planned.file_plan.files)


def files_problem(summaries: Sequence[FilesSummary], *, same_writers: bool) -> str | None:
    """Why the ranks' files differ (each rank's ``files_summary``): the first key saved in two dtypes, with each
    rank's dtype; else, when the ranks agree on the writer of every gathered key (``same_writers``), each rank's
    number of files; else None (the writer maps differ: ``check_agreement`` names them).
    ``save_hf`` has proved by then that the ranks passed the same arguments: what differs is how they planned."""
    first = summaries[0][0]
    differing = [i for i, (key, _) in enumerate(first)
                 if any(len(s[0]) != len(first) or s[0][i] != (key, first[i][1]) for s in summaries)]
    if differing:
        index = differing[0]
        key = first[index][0]
        by_dtype: dict[str, list[int]] = {}
        for rank, (dtypes, _) in enumerate(summaries):
            by_dtype.setdefault(dtypes[index][1] if index < len(dtypes) else "absent", []).append(rank)
        held = " and ".join(f"{dtype} on rank(s) {_ranks(ranks)}" for dtype, ranks in by_dtype.items())
        more = f" ({len(differing) - 1} more key(s) differ)" if len(differing) > 1 else ""
        return f"key {key!r} is saved as {held}{more}: {_DEFECT}"
    if not same_writers:
        return None
    by_files: dict[int, list[int]] = {}
    for rank, (_, files) in enumerate(summaries):
        by_files.setdefault(files, []).append(rank)
    plans = "; ".join(f"rank(s) {_ranks(ranks)}: {files} file(s)" for files, ranks in by_files.items())
    return f"the ranks plan different files ({plans}): {_DEFECT}"


def _dtype_name(dtype: torch.dtype | str | None) -> str:
    return "unknown" if dtype is None else str(dtype).removeprefix("torch.")


_META_CACHE = LRU(16)


def _key_meta_and_direct(
    layout: Layout, dtype: torch.dtype | None, patterns: Sequence[str] | str | None, min_segment: int | None
) -> tuple[KeyMeta, tuple[str, ...]]:
    """Every key's (save dtype, shape) and the tensors written directly (none when ``min_segment`` is None);
    cached per layout and options, like the plans, so a repeat save does not redo them."""
    key = (layout_fingerprint(layout), layout.mesh, dtype, patterns if isinstance(patterns, str | None)
           else tuple(patterns), min_segment)
    hit = _META_CACHE.get(key)
    if hit is None:
        runtime = {name: layout.dtype(name) for name in layout}
        meta = key_meta(layout, runtime, dtype, patterns)
        hit = (meta, direct_names(layout, meta, min_segment) if min_segment is not None else ())
        _META_CACHE.put(key, hit)
    return hit


_FILE_PLANS = LRU(16)


def _file_plan(plan_set: SavePlanSet, meta: KeyMeta, layout: Layout, max_shard_bytes: int) -> FilePlan:
    """Which keys go to which file: gathered keys with their writers' files, direct keys spread over the ranks'
    files; remembered for the same (cached) plan set and key metadata, which fix the layout too."""

    def plan() -> FilePlan:
        sizes = {k: math.prod(shape) * d.itemsize for k, (d, shape) in meta.items()}
        writers = dict(plan_set.writers)
        world = layout.mesh.size
        for index, key in enumerate(layout.hf_keys):  # direct keys: any rank-independent spread of files
            writers.setdefault(key, index % world)
        return plan_files(writers, sizes, list(layout.hf_keys), max_shard_bytes=max_shard_bytes)

    return remember_by_identity(_FILE_PLANS, (plan_set, meta), max_shard_bytes, plan)


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f", ... ({len(ranks)} in all)" if len(ranks) > 8 else "")
