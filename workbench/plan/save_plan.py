"""HFSavePlan: the steps one rank undoes to turn its local tensor into the output a save writes."""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workbench.display import html_of
from workbench.errors import PlanError
from workbench.layout.chunking import gather_chunk
from workbench.layout.descriptors import ShardDescriptor
from workbench.layout.load_spec import LoadSpec
from workbench.layout.runs import Segment, dim_segments
from workbench.plan.policy import SavePolicy

__all__ = ["HFSavePlan", "SaveShardStep", "gather_dtype", "gather_dtype_bounds", "plan_hf_save", "save_dtypes",
           "splits_keys"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveShardStep:
    """One shard as the save sees it: the cut, the tensor's shape when it is undone, and whether it stays.

    ``shape_before`` is the shape of the tensor right after this cut is undone during a save: every cut
    applied before it in forward order, and every kept cut, still applied. ``bound_before`` is the same shape
    on the rank with group rank 0 on every cut: the largest any rank sees, which sizes the schedule
    identically everywhere. ``chunk`` is the per-rank length along ``descriptor.dim`` every member of the
    group contributes to the all-gather (``ceil(N / W)`` padded for contiguous cuts, ``N / W`` for
    interleaves); it is the same on every rank of the group.
    """

    descriptor: ShardDescriptor
    shape_before: tuple[int, ...]
    world: int
    group_rank: int
    preserved: bool
    bound_before: tuple[int, ...] = ()

    @property
    def chunk(self) -> int:
        """Per-rank contribution along the cut dim (collective padding included)."""
        return self.chunk_of(self.shape_before)

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """Shape every rank of the group sends for this step."""
        shape = list(self.shape_before)
        shape[self.descriptor.dim] = self.chunk
        return tuple(shape)

    @property
    def gathered_shape(self) -> tuple[int, ...]:
        """Shape of the all-gather's output for this tensor (padding included)."""
        return self.gathered_of(self.shape_before)

    def chunk_of(self, merged_shape: Sequence[int]) -> int:
        """Per-rank contribution along the cut dim when the undone tensor has ``merged_shape``
        (``layout.chunking.gather_chunk``)."""
        d = self.descriptor
        return gather_chunk(merged_shape[d.dim], self.world, d.interleave_factor)

    def gathered_of(self, merged_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of the all-gather's output (collective padding included) when the undone tensor has
        ``merged_shape`` (e.g. ``bound_before``, the largest any rank sees)."""
        shape = list(merged_shape)
        shape[self.descriptor.dim] = self.chunk_of(merged_shape) * self.world
        return tuple(shape)

    def __str__(self) -> str:
        state = "keep" if self.preserved else "gather"
        return f"{state} {self.descriptor} (shape before {self.shape_before}, W={self.world})"


@dataclass(frozen=True, slots=True, kw_only=True)
class HFSavePlan:
    """One rank's save program for one parameter under a policy.

    Attributes:
        name: runtime parameter name.
        rank: global rank the plan is for.
        policy: the save policy.
        steps: every shard in forward order, each marked preserved or not.
        local_shape: the rank's local tensor shape (input).
        runtime_output_shape: shape after the pending gathers (tail padding included).
        output_shape: checkpoint-visible output shape (after the tail trim).
        hf_keys: the keys the output covers (all keys unless a preserved cut selects a key range).
        fused_dim: dim the keys are concatenated on (None for one key).
        gather_dtype: dtype the tensor is cast to before gathering.
        key_dtypes: dtype each covered key is written in.
        bound_local_shape: the local shape with every cut at group rank 0: the largest any rank holds, which sizes
            the schedule identically everywhere.
        trim_bound_numel: elements of the largest copy any rank makes to trim FP8 tails off its output (0: no rank
            copies; a trim that is a contiguous view copies nothing).
        gather_dtype_bounds: every gather dtype a rank of the parameter may have, the widest first (rank-independent:
            a kept cut on the fused dim leaves each rank some keys, whose save dtypes may differ from another
            rank's); empty means ``(gather_dtype,)``. Sizes the schedule identically everywhere.
    """

    name: str
    rank: int
    policy: SavePolicy
    steps: tuple[SaveShardStep, ...]
    local_shape: tuple[int, ...]
    runtime_output_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    hf_keys: tuple[str, ...]
    fused_dim: int | None
    gather_dtype: torch.dtype
    key_dtypes: tuple[torch.dtype, ...]
    bound_local_shape: tuple[int, ...]
    trim_bound_numel: int
    gather_dtype_bounds: tuple[torch.dtype, ...] = ()

    @property
    def widest_gather_dtype(self) -> torch.dtype:
        """The widest gather dtype any rank of the parameter may have (rank-independent)."""
        return self.gather_dtype_bounds[0] if self.gather_dtype_bounds else self.gather_dtype

    @property
    def pending(self) -> tuple[SaveShardStep, ...]:
        """Steps to undo, in execution order (reverse forward order; preserved ones and cuts over a group of
        one rank, which are the identity, skipped)."""
        return tuple(s for s in reversed(self.steps) if not s.preserved and s.world > 1)

    @property
    def preserves_shards(self) -> bool:
        """True when some cut stays applied in the output."""
        return any(s.preserved for s in self.steps)

    @property
    def output_bytes(self) -> int:
        """Bytes of the runtime output at the gather dtype."""
        return math.prod(self.runtime_output_shape) * self.gather_dtype.itemsize

    def _repr_html_(self) -> str | None:
        """HTML for notebooks, from the renderer ``workbench.viz`` registers (``workbench.display``)."""
        return html_of(self)

    def __str__(self) -> str:
        from workbench.units import format_bytes

        keys = self.hf_keys[0] if len(self.hf_keys) == 1 else f"{len(self.hf_keys)} keys"
        dtype = str(self.gather_dtype).removeprefix("torch.")
        lines = [
            f"HFSavePlan {self.name!r} rank {self.rank} [{self.policy}]: local {self.local_shape} -> "
            f"{self.runtime_output_shape} -> output {self.output_shape} ({keys}, {dtype}, "
            f"{format_bytes(self.output_bytes)})"
        ]
        lines += [f"  {i}. {s}" for i, s in enumerate(self.pending, 1)]
        lines += [f"  -  {s}" for s in self.steps if s.preserved]
        return "\n".join(lines)


def save_dtypes(
    hf_keys: Sequence[str],
    runtime_dtype: torch.dtype,
    *,
    dtype: torch.dtype | None = None,
    fp32_keys_pattern: Sequence[str] | str | None = None,
) -> tuple[torch.dtype, ...]:
    """Dtype each key is saved in: float32 when any pattern ``re.search``-matches it, else ``dtype``
    (default: the runtime dtype). Non-floating tensors always keep their runtime dtype.

    Raises:
        PlanError: ``dtype`` is not a floating dtype of 16 bits or more (a cast into an integer, bool, complex or
            float8 dtype would write other numbers, or float8 ones without their scales); or a cast would change a
            float8 tensor (its raw values are meaningless without their block scales: dequantize it first); or a
            pattern is empty (it would match every key).
    """
    patterns = (fp32_keys_pattern,) if isinstance(fp32_keys_pattern, str) else tuple(fp32_keys_pattern or ())
    return _save_dtypes(tuple(hf_keys), runtime_dtype, dtype, patterns)


@functools.lru_cache(maxsize=8192)
def _save_dtypes(
    hf_keys: tuple[str, ...], runtime_dtype: torch.dtype, dtype: torch.dtype | None, patterns: tuple[str, ...]
) -> tuple[torch.dtype, ...]:
    if dtype is not None and (not dtype.is_floating_point or dtype.itemsize < 2):
        raise PlanError(f"dtype={dtype}: a save casts floating keys into a floating dtype of 16 bits or more "
                        "(bfloat16, float16, float32, float64); leave dtype=None to write each tensor in its own")
    if not runtime_dtype.is_floating_point:
        return tuple(runtime_dtype for _ in hf_keys)
    default = dtype or runtime_dtype
    compiled = []
    for pattern in patterns:
        if not pattern:  # an empty regex matches every key: every floating key would be saved in float32
            raise PlanError("fp32_keys_pattern holds an empty pattern, which matches every key (all would be saved in "
                            "float32); pass None, or leave the empty string out of the list, to match none")
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise PlanError(f"fp32_keys_pattern {pattern!r} is not a valid regular expression: {exc}") from None
    out = tuple(torch.float32 if any(c.search(k) for c in compiled) else default for k in hf_keys)
    changed = [k for k, d in zip(hf_keys, out) if d != runtime_dtype]
    if runtime_dtype.itemsize == 1 and changed:  # float8: raw values, scaled by blocks
        how = f"dtype={dtype}" if default != runtime_dtype else "fp32_keys_pattern, which matches it,"
        raise PlanError(
            f"HF key {changed[0]!r} is {str(runtime_dtype).removeprefix('torch.')}: {how} would write its raw "
            "float8 values without their block scales. Save the dequantized state "
            "(workbench.io.hf.fp8.dequantized_state(model, layout), then save_hf(state, path, layout=...)), or keep "
            "it float8 (no dtype=, and a fp32_keys_pattern that leaves it out)")
    return out


def plan_hf_save(
    spec: LoadSpec,
    rank: int,
    policy: SavePolicy | None = None,
    *,
    runtime_dtype: torch.dtype = torch.float32,
    dtype: torch.dtype | None = None,
    fp32_keys_pattern: Sequence[str] | str | None = None,
) -> HFSavePlan:
    """Compile the save plan of ``spec`` for ``rank`` under ``policy`` (default: full).

    Raises:
        PlanError: a preserved cut does not fall on HF key boundaries, or a kept cut was applied after one
            the policy undoes on the same dim (the output would not be a tensor of the global one).
    """
    policy = policy or SavePolicy.full()
    mesh = spec.mesh
    cuts = [(d, mesh.group_size(d.mesh_dim), mesh.group_rank(rank, d.mesh_dim)) for d in spec.shards]
    if policy.mode == "minimal":
        keep = list(_key_aligned_prefix(spec))
    else:
        keep = [policy.keeps(d, spec.fused_dim) for d, _, _ in cuts]
    steps = []
    for i, (d, world, index) in enumerate(cuts):
        # applied when cut i is undone: every earlier cut, and (for a gathered cut) every kept one
        applied = [j < i or (keep[j] and not keep[i]) for j in range(len(cuts))]
        steps.append(SaveShardStep(
            descriptor=d, shape_before=_shape(spec.global_shape, cuts, applied), world=world, group_rank=index,
            preserved=keep[i], bound_before=_shape(spec.global_shape, [(c, w, 0) for c, w, _ in cuts], applied),
        ))
    cur = list(_shape(spec.global_shape, cuts, [True] * len(cuts)))
    bound_local = _shape(spec.global_shape, [(c, w, 0) for c, w, _ in cuts], [True] * len(cuts))
    _check_order(spec, steps, policy)
    kept = [s for s in steps if s.preserved]
    segments = _segments(spec, kept)
    runtime_out = tuple(sum(n for _, n in segs) for segs in segments)
    visible = spec.visible_shape
    output = tuple(sum(max(0, min(g + n, v) - g) for g, n in segs) for segs, v in zip(segments, visible))
    by_key = kept and policy.mode in ("preserve", "minimal")
    keys = _covered_keys(spec, segments, kept, rank) if by_key else spec.hf_keys
    key_dtypes = save_dtypes(keys, runtime_dtype, dtype=dtype, fp32_keys_pattern=fp32_keys_pattern)
    return HFSavePlan(
        name=spec.name, rank=rank, policy=policy, steps=tuple(steps), local_shape=tuple(cur),
        runtime_output_shape=runtime_out, output_shape=output, hf_keys=tuple(keys), fused_dim=spec.fused_dim,
        gather_dtype=gather_dtype(key_dtypes, runtime_dtype), key_dtypes=key_dtypes, bound_local_shape=bound_local,
        trim_bound_numel=_trim_bound(spec, kept),
        gather_dtype_bounds=gather_dtype_bounds(
            save_dtypes(spec.hf_keys, runtime_dtype, dtype=dtype, fp32_keys_pattern=fp32_keys_pattern),
            runtime_dtype, splits_keys(policy, steps, spec.fused_dim),
        ),
    )


def splits_keys(policy: SavePolicy, steps: Sequence[SaveShardStep], fused_dim: int | None) -> bool:
    """Whether ``policy`` leaves each rank some of the keys only: it follows the keys (``preserve``, ``minimal``)
    and keeps a cut of more than one rank on the fused dim."""
    return policy.mode in ("preserve", "minimal") and any(
        s.preserved and s.world > 1 and s.descriptor.dim == fused_dim for s in steps
    )


def gather_dtype_bounds(
    all_key_dtypes: Sequence[torch.dtype], runtime_dtype: torch.dtype, partial: bool
) -> tuple[torch.dtype, ...]:
    """Every gather dtype a rank of a parameter may have, the widest first: the gather dtype of all its keys
    (``all_key_dtypes``) and, when a kept cut leaves each rank some of the keys only (``partial``), each key's own
    dtype too (a rank whose keys share one dtype gathers in it). The first sizes every rank's gathers."""
    whole = gather_dtype(all_key_dtypes, runtime_dtype)
    possible = {whole, *all_key_dtypes} if partial else {whole}
    return tuple(sorted(possible, key=lambda d: (-d.itemsize, d != whole, str(d))))


def gather_dtype(key_dtypes: Sequence[torch.dtype], runtime_dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor is gathered in, so that every key, cast from it, equals the key cast from the runtime
    tensor: the keys' dtype when they share one; when they differ (a fused tensor with a key in float32),
    float32 if it holds every runtime value (a runtime of 32 bits or fewer), else the runtime dtype (float64:
    a float32 gather would round the other keys). Non-floating tensors keep their runtime dtype."""
    if not runtime_dtype.is_floating_point or not key_dtypes:
        return runtime_dtype
    if len(set(key_dtypes)) == 1:
        return key_dtypes[0]
    return torch.float32 if runtime_dtype.itemsize <= 4 else runtime_dtype


def _shape(global_shape: Sequence[int], cuts: Sequence[tuple[ShardDescriptor, int, int]],
           applied: Sequence[bool]) -> tuple[int, ...]:
    """Shape after the ``applied`` cuts (forward order per dim; cuts on different dims commute)."""
    shape = list(global_shape)
    for (d, world, index), on in zip(cuts, applied):
        if on:
            shape[d.dim] = sum(b - a for a, b in d.local_intervals(shape[d.dim], world, index))
    return tuple(shape)


def _trim_bound(spec: LoadSpec, kept: Sequence[SaveShardStep]) -> int:
    """Elements of the largest trimmed copy any rank makes: the largest over every rank's (runtime output,
    output) extents, which the kept cuts of each dim set independently."""
    if spec.visible_shape == spec.global_shape:
        return 0
    per_dim = [
        _dim_extents(length, visible, tuple((s.descriptor, s.world) for s in kept if s.descriptor.dim == dim))
        for dim, (length, visible) in enumerate(zip(spec.global_shape, spec.visible_shape))
    ]
    return max(_trim_numel(tuple(r for r, _ in cells), tuple(o for _, o in cells))
               for cells in itertools.product(*per_dim))


@functools.lru_cache(maxsize=4096)
def _dim_extents(
    length: int, visible: int, cuts: tuple[tuple[ShardDescriptor, int], ...]
) -> frozenset[tuple[int, int]]:
    """Every (runtime length, visible length) a rank's output has on one dim, over the kept cuts' group ranks."""
    out = set()
    for index in itertools.product(*(range(world) for _, world in cuts)):
        segments = dim_segments(length, [(d, world, i) for (d, world), i in zip(cuts, index)])
        out.add((sum(n for _, n in segments), sum(max(0, min(g + n, visible) - g) for g, n in segments)))
    return frozenset(out)


@functools.lru_cache(maxsize=4096)
def _trim_numel(runtime_shape: tuple[int, ...], output_shape: tuple[int, ...]) -> int:
    """Elements of the copy that trims a ``runtime_shape`` tensor to ``output_shape`` (0: none, or the trimmed
    view is contiguous)."""
    if output_shape == runtime_shape:
        return 0
    view = torch.empty(runtime_shape, device="meta")[tuple(slice(0, s) for s in output_shape)]
    return 0 if view.is_contiguous() else math.prod(output_shape)


def _key_aligned_prefix(spec: LoadSpec) -> tuple[bool, ...]:
    """Which cuts ``SavePolicy.minimal`` keeps: the longest forward prefix of the fused dim's cuts (over groups of
    more than one rank) after which every rank holds whole HF keys."""
    fd = spec.fused_dim
    if fd is None or not spec.key_size:
        return (False,) * len(spec.shards)
    mesh = spec.mesh
    chain = [(i, d, mesh.group_size(d.mesh_dim)) for i, d in enumerate(spec.shards) if d.dim == fd]
    while chain and chain[-1][2] == 1:
        chain.pop()
    for k in range(len(chain), 0, -1):
        prefix = tuple((d, world) for _, d, world in chain[:k])
        if _aligned(spec.global_shape[fd], spec.visible_shape[fd], spec.key_size, prefix):
            kept = {i for i, _, _ in chain[:k]}
            return tuple(i in kept for i in range(len(spec.shards)))
    return (False,) * len(spec.shards)


@functools.lru_cache(maxsize=4096)
def _aligned(length: int, visible: int, key_size: int, prefix: tuple[tuple[ShardDescriptor, int], ...]) -> bool:
    """True when, for every combination of group ranks, the cuts leave only whole keys (padding aside)."""
    for index in itertools.product(*(range(world) for _, world in prefix)):
        for g, n in dim_segments(length, [(d, world, i) for (d, world), i in zip(prefix, index)]):
            lo, hi = g, min(g + n, visible)
            if hi > lo and (lo % key_size or (hi % key_size and hi != visible)):
                return False
    return True


def _check_order(spec: LoadSpec, steps: list[SaveShardStep], policy: SavePolicy) -> None:
    undone_dims: dict[int, SaveShardStep] = {}
    for step in steps:
        if step.world == 1:  # a cut over one rank is the identity: keeping or undoing it changes nothing
            continue
        d = step.descriptor
        if not step.preserved:
            undone_dims.setdefault(d.dim, step)
        elif d.dim in undone_dims:
            raise PlanError(
                f"parameter {spec.name!r}: policy {policy} keeps {d} but undoes "
                f"{undone_dims[d.dim].descriptor}, which was applied before it on the same dim; the output "
                "would interleave pieces of different ranks. Keep the outer cut too, or gather both."
            )


def _segments(spec: LoadSpec, kept: list[SaveShardStep]) -> tuple[tuple[Segment, ...], ...]:
    out = []
    for dim, length in enumerate(spec.global_shape):
        cuts = [(s.descriptor, s.world, s.group_rank) for s in kept if s.descriptor.dim == dim]
        out.append(dim_segments(length, cuts, what=f"parameter {spec.name!r} dim {dim}"))
    return tuple(out)


def _covered_keys(
    spec: LoadSpec, segments: tuple[tuple[Segment, ...], ...], kept: list[SaveShardStep], rank: int
) -> tuple[str, ...]:
    fd, ks = spec.fused_dim, spec.key_size
    if fd is None or not ks:
        return spec.hf_keys
    visible = spec.visible_shape[fd]
    keys: list[str] = []
    for g, n in segments[fd]:
        lo, hi = g, min(g + n, visible)
        if hi <= lo:
            continue
        if lo % ks or (hi % ks and hi != visible):
            padding = (
                f" The tensor's {spec.global_shape[fd]} rows include tail padding past the {visible} visible ones, "
                "which moves the cuts off the key boundaries." if spec.global_shape[fd] != visible else ""
            )
            kept_desc = ", ".join(f"{s.descriptor}" for s in kept)
            raise PlanError(
                f"parameter {spec.name!r}, rank {rank}: keeping {kept_desc} leaves fused-dim rows [{lo}, {hi}) "
                f"on this rank, which do not fall on HF key boundaries (each of the {len(spec.hf_keys)} keys "
                f"has {ks} rows on dim {fd}).{padding} Preserve a mesh dim whose cuts fall on key boundaries "
                f"(its size dividing the key count {len(spec.hf_keys)}), or gather it (SavePolicy.full())."
            )
        keys.extend(spec.hf_keys[lo // ks : -(-hi // ks)])
    return tuple(keys)
