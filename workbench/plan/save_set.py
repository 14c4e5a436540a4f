"""A whole save planned at once: every rank's save plans, unshard schedules and the writer of each HF key.

``plan_save`` is what every rank of ``save_hf`` runs (for itself) and what ``SimulatedWorld`` runs (for every
rank). Work is shared wherever the math is the same:

* parameters of one *geometry* (same shape, cuts, fused dim and key count: the layers of a model) share one
  template plan per rank; each parameter's plan is the template with its own name and keys;
* ranks whose steps have the same shapes (a *shape class*) share one schedule;
* who holds which key (for the writer map under ``minimal`` and ``preserve``) is answered once per geometry
  and per combination of group ranks on the kept cuts, never by planning every rank: DeepSeek-V3 on 1,024
  ranks needs 18 geometries x 64 EP ranks, not 1,024 ranks x 989 parameters;
* a repeated call with the same layout (``Layout.fingerprint()``) and options returns the cached result
  (``plan_cache_info``, ``clear_plan_cache``).

The writer map depends only on the layout and options, so every rank computes the same map.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.errors import PlanError
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.memo import LRU, remember_while_same
from workbench.mesh import MeshDimRef
from workbench.plan.load_plan import expected_key_shape
from workbench.plan.policy import SavePolicy
from workbench.plan.save_plan import (
    HFSavePlan,
    gather_dtype,
    gather_dtype_bounds,
    plan_hf_save,
    save_dtypes,
    splits_keys,
)
from workbench.plan.schedule import UnshardSchedule, check_schedules, schedule_unshard
from workbench.plan.writers import assign_writers, writer_pool

__all__ = [
    "PlanCacheInfo",
    "SavePlanSet",
    "clear_plan_cache",
    "key_meta",
    "key_sizes",
    "layout_as_held",
    "layout_fingerprint",
    "plan_cache_info",
    "plan_save",
    "plan_save_within_writers",
    "save_key_holders",
    "saved_layout",
]

KeyMeta = dict[str, tuple[torch.dtype, tuple[int, ...]]]


@dataclass(frozen=True, slots=True, kw_only=True)
class SavePlanSet:
    """Everything every rank needs for one save: plans, schedules, the writer of each key and the keys' on-disk
    dtype and shape (what the file plan is built from).

    ``plans`` and ``schedules`` map every planned rank; a rank's plans are built when first asked for (ranks
    of one shape class share a checked schedule, see ``plan_save``). A plan set may come from the plan cache
    and be shared by later calls: treat it, and its ``writers`` and ``key_meta``, as read-only.

    Attributes:
        policy: the save policy.
        plans: ``{rank: that rank's HFSavePlans, in model order}``.
        schedules: ``{rank: that rank's UnshardSchedule}``.
        writers: ``{hf_key: rank that writes it}`` (empty under ``gather_only``).
        shape_classes: how many distinct schedules the planned ranks needed.
        key_meta: ``{hf_key: (save dtype, shape on disk)}`` of every key of the layout.
        key_bytes: ``{hf_key: bytes on disk}``.
    """

    policy: SavePolicy
    plans: Mapping[int, tuple[HFSavePlan, ...]]
    schedules: Mapping[int, UnshardSchedule]
    writers: dict[str, int]
    shape_classes: int = 1
    key_meta: KeyMeta = field(default_factory=dict, repr=False)
    key_bytes: dict[str, int] = field(default_factory=dict, repr=False)

    def __str__(self) -> str:
        some = self.schedules[next(iter(self.schedules))]
        writer_ranks = len(set(self.writers.values()))
        return (
            f"SavePlanSet [{self.policy}]: {len(self.plans)} ranks in {self.shape_classes} shape class(es), "
            f"{len(self.writers)} HF keys written by {writer_ranks} ranks\n{some}"
        )


class _PerRank(Mapping[int, Any]):
    """A read-only ``{rank: value}`` whose values are made on first access (thread-safe)."""

    def __init__(self, ranks: Sequence[int], make: Callable[[int], Any], known: dict[int, Any]) -> None:
        self._ranks, self._make, self._values = tuple(ranks), make, dict(known)
        self._index = set(self._ranks)
        self._lock = threading.Lock()

    def __getitem__(self, rank: int) -> Any:
        if rank not in self._index:
            raise KeyError(rank)
        value = self._values.get(rank)
        if value is None:
            with self._lock:
                value = self._values.get(rank)
                if value is None:
                    value = self._values[rank] = self._make(rank)
        return value

    def __iter__(self) -> Iterator[int]:
        return iter(self._ranks)

    def __len__(self) -> int:
        return len(self._ranks)


# -- the cache ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class PlanCacheInfo:
    """Counters of the plan cache: ``hits``, ``misses``, entries held (``size``) and the bound (``maxsize``)."""

    hits: int
    misses: int
    size: int
    maxsize: int


_PLANS = LRU(16)  # a few models x policies x budgets; each entry holds one rank's plans (or a world's)
_SAVED_LAYOUTS = LRU(8)  # id(layout) -> (layout, (specs, dtypes, key meta), layout with the dtypes written)
_FINGERPRINTS = LRU(8)  # id(layout) -> (layout, (specs, dtypes), fingerprint): skips re-hashing a known layout


def plan_cache_info() -> PlanCacheInfo:
    """Hits, misses and size of the cache ``plan_save`` keeps (per process)."""
    return PlanCacheInfo(hits=_PLANS.hits, misses=_PLANS.misses, size=len(_PLANS), maxsize=_PLANS.maxsize)


def clear_plan_cache() -> None:
    """Drop every cached plan set (and the remembered layout fingerprints)."""
    _PLANS.clear()
    _FINGERPRINTS.clear()
    _SAVED_LAYOUTS.clear()


def layout_fingerprint(layout: Layout) -> str:
    """``layout.fingerprint()``, remembered for a layout object whose specs and dtypes are unchanged (a dict
    compare of the same spec objects costs microseconds; hashing DeepSeek-V3's 989 specs about 10 ms)."""
    return remember_while_same(_FINGERPRINTS, layout, (layout.specs, layout.dtypes), layout.fingerprint)


def _patterns(fp32_keys_pattern: Sequence[str] | str | None) -> tuple[str, ...]:
    return (fp32_keys_pattern,) if isinstance(fp32_keys_pattern, str) else tuple(fp32_keys_pattern or ())


# -- planning -------------------------------------------------------------------------------------------
def plan_save(
    layout: Layout,
    *,
    ranks: Sequence[int] | None = None,
    policy: SavePolicy | None = None,
    budget_bytes: int | None = None,
    dtype: torch.dtype | None = None,
    fp32_keys_pattern: Sequence[str] | str | None = None,
    max_writers: int | None = None,
    queued_bytes: int = 0,
    gather_scratch: bool = False,
    cache: bool = True,
) -> SavePlanSet:
    """Save plans, unshard schedules and writer assignment of a layout, for ``ranks`` (default: all).

    Work is shared where the math is the same (see the module docstring), so one rank of DeepSeek-V3 on 1,024
    ranks plans in a fraction of a second and the whole world in seconds. With ``cache`` (the default) the
    result is kept in a bounded LRU keyed on ``layout.fingerprint()``, the mesh and every option, so a repeated
    save of the same model costs no planning.

    ``queued_bytes`` is the writer-queue bound the schedules' predicted peak counts, and ``gather_scratch`` says
    the backend receives each gather into a scratch buffer first (gloo); see ``schedule_unshard``.

    .. note:: every rank of a save must call it with the same layout and options (not the same ``ranks``):
       the writer map and the schedules' structure depend only on those, which ``save_hf`` checks at run time.

    Raises:
        PlanError: the policy cannot be applied (a kept cut off HF key boundaries, names the parameter and
            the lowest rank it fails on), or two ranks of one group would issue different collectives.
    """
    policy = policy or SavePolicy.full()
    ranks = tuple(layout.mesh.all_ranks() if ranks is None else ranks)
    patterns = _patterns(fp32_keys_pattern)
    key = None
    if cache:
        key = (layout_fingerprint(layout), layout.mesh, ranks, policy, budget_bytes, dtype, patterns, max_writers,
               queued_bytes, gather_scratch)
        hit = _PLANS.get(key)
        if hit is not None:
            return hit
    result = _plan_save(layout, ranks, policy, budget_bytes, dtype, patterns, max_writers, queued_bytes,
                        gather_scratch)
    if key is not None:
        _PLANS.put(key, result)
    return result


def plan_save_within_writers(layout: Layout, *, policy: SavePolicy | None = None, max_writers: int | None = None,
                             **options: Any) -> SavePlanSet:
    """``plan_save`` whose every writer is one of the ``max_writers`` ranks ``writer_pool`` allows: what ``save_hf``
    runs. (``plan_save`` alone gives a key none of whose holders is in the pool to one of its holders.)

    Under ``minimal``, a kept cut can leave a key on ranks none of which may write (experts of an EP rank outside
    the pool): the save is then planned as ``full`` (the same checkpoint, every cut gathered), so a rank of the pool
    holds every key. ``options`` go to ``plan_save``.

    Raises:
        PlanError: under ``preserve``, a key the policy keeps on ranks none of which may write (naming the key,
            its holders and the allowed writers), besides what ``plan_save`` raises.
    """
    policy = policy or SavePolicy.full()
    plan_set = plan_save(layout, policy=policy, max_writers=max_writers, **options)
    everyone = layout.mesh.all_ranks()
    pool = set(writer_pool(everyone, max_writers))
    if len(pool) == len(everyone) or all(rank in pool for rank in plan_set.writers.values()):
        return plan_set
    if policy.mode == "minimal":
        return plan_save(layout, policy=SavePolicy.full(), max_writers=max_writers, **options)
    outside = next(key for key, rank in plan_set.writers.items() if rank not in pool)
    holders = save_key_holders(layout, policy, dtype=options.get("dtype"),
                               fp32_keys_pattern=options.get("fp32_keys_pattern"))[outside]
    raise PlanError(
        f"max_writers={max_writers} lets ranks {sorted(pool)} write, but SavePolicy {policy} keeps HF key "
        f"{outside!r} on ranks {list(holders)} only, none of which may write: raise max_writers, or save under "
        "SavePolicy.minimal() or full() (which gather every key to an allowed writer)"
    )


def _plan_save(
    layout: Layout,
    ranks: tuple[int, ...],
    policy: SavePolicy,
    budget_bytes: int | None,
    dtype: torch.dtype | None,
    patterns: tuple[str, ...],
    max_writers: int | None,
    queued_bytes: int = 0,
    gather_scratch: bool = False,
) -> SavePlanSet:
    runtime = {name: layout.dtype(name) for name in layout}
    groups = _geometry_groups(layout, runtime)
    by_key = policy.mode in ("preserve", "minimal")  # a rank's keys depend on its group ranks
    key_index: dict[tuple, dict[tuple[str, ...], tuple[int, ...]]] = {}

    def templates_of(rank: int) -> dict[tuple, HFSavePlan]:
        return _templates(layout, rank, policy, runtime, dtype, patterns, groups)

    def plans_of(rank: int, templates: dict[tuple, HFSavePlan] | None = None) -> tuple[HFSavePlan, ...]:
        return _expand(layout, templates if templates is not None else templates_of(rank), runtime, dtype, patterns,
                       key_index)

    plans: dict[int, tuple[HFSavePlan, ...]] = {}
    schedules: dict[int, UnshardSchedule] = {}
    classes: dict[tuple, UnshardSchedule] = {}
    reference: UnshardSchedule | None = None
    diverged = False
    for r in ranks:
        templates = templates_of(r)
        if by_key:  # ranks of one shape class may still hold keys of other save dtypes: expand first
            plans[r] = plans_of(r, templates)
            key = (_shape_class(templates), tuple(p.gather_dtype for p in plans[r]))
        else:
            key = _shape_class(templates)
        if key in classes:
            schedules[r] = dataclasses.replace(classes[key], rank=r)
            continue
        if r not in plans:
            plans[r] = plans_of(r, templates)
        try:
            schedules[r] = schedule_unshard(plans[r], runtime, budget_bytes, reference=reference,
                                            queued_bytes=queued_bytes,
                                            gather_scratch=gather_scratch)
        except PlanError:  # its steps differ from the first rank's (another dtype, say): pack its own waves
            schedules[r] = schedule_unshard(plans[r], runtime, budget_bytes, queued_bytes=queued_bytes,
                                            gather_scratch=gather_scratch)
            diverged = True
        reference = reference or schedules[r]
        classes[key] = schedules[r]
    if diverged:  # ranks batch differently: prove every group still agrees
        check_schedules(schedules, layout.mesh)
    meta = key_meta(layout, runtime, dtype, patterns)
    sizes = {k: math.prod(shape) * d.itemsize for k, (d, shape) in meta.items()}
    everyone = tuple(layout.mesh.all_ranks())
    if policy.mode == "gather_only":
        writers: dict[str, int] = {}
    elif policy.mode == "full":  # every rank ends up holding every key
        writers = assign_writers(dict.fromkeys(sizes, everyone), sizes, max_writers=max_writers, world=everyone)
    else:  # a key's writer must hold it, on whichever rank that is
        holders = save_key_holders(layout, policy, dtype=dtype, fp32_keys_pattern=patterns)
        writers = assign_writers(holders, sizes, max_writers=max_writers, world=everyone)
    return SavePlanSet(
        policy=policy, plans=_PerRank(ranks, plans_of, plans), schedules=schedules, writers=writers,
        shape_classes=max(1, len(classes)), key_meta=meta, key_bytes=sizes,
    )


def save_key_holders(
    layout: Layout,
    policy: SavePolicy,
    *,
    dtype: torch.dtype | None = None,
    fp32_keys_pattern: Sequence[str] | str | None = None,
) -> dict[str, tuple[int, ...]]:
    """``{hf_key: ranks whose save output covers it}`` under ``policy``, ranks ascending, in the order
    ``writers.key_holders`` gives for every rank's plans (keys first held by rank 0 first, then model order).

    A rank's covered keys depend only on its group ranks on the cuts the policy keeps on the fused dim, so
    each geometry is planned once per combination of those group ranks (its lowest rank stands for all),
    never once per rank. Keys with the same holders share one tuple (``assign_writers`` shares work on it).

    Raises:
        PlanError: the policy leaves some rank off HF key boundaries; the error names the first such rank in
            mesh order (``mesh.all_ranks()``) and the first such parameter, as planning every rank would.
    """
    mesh = layout.mesh
    runtime = {name: layout.dtype(name) for name in layout}
    patterns = _patterns(fp32_keys_pattern)
    everyone = mesh.all_ranks()
    position = {r: i for i, r in enumerate(everyone)}
    group_ranks: dict[MeshDimRef, tuple[int, ...]] = {}
    interned: dict[tuple[int, ...], tuple[int, ...]] = {}
    failures: list[tuple[int, int, PlanError]] = []
    per_geometry: dict[tuple, tuple[dict[int, list[int]], list[tuple[int, ...]]]] = {}
    for order, (geometry, name) in enumerate(_geometry_groups(layout, runtime).items()):
        spec = layout[name]
        plan = plan_hf_save(spec, everyone[0], policy, runtime_dtype=runtime[name], dtype=dtype,
                            fp32_keys_pattern=patterns)
        refs = _kept_fused_refs(spec, plan)
        if refs is None:  # every rank covers every key
            combos: dict[tuple[int, ...], list[int]] = {(): list(everyone)}
        else:
            for ref in refs:
                if ref not in group_ranks:
                    group_ranks[ref] = tuple(mesh.group_rank(r, ref) for r in everyone)
            columns = [group_ranks[ref] for ref in refs]
            combos = {}
            for i, r in enumerate(everyone):
                combos.setdefault(tuple(c[i] for c in columns), []).append(r)
        key_position = {k: i for i, k in enumerate(spec.hf_keys)}
        holders: list[list[int]] = [[] for _ in spec.hf_keys]
        first: dict[int, list[int]] = {}  # lowest holder -> key indices it holds first, in its plan's order
        for members in sorted(combos.values(), key=min):  # members[0]: the combination's first rank in mesh order
            try:
                covered = plan.hf_keys if refs is None else plan_hf_save(
                    spec, members[0], policy, runtime_dtype=runtime[name], dtype=dtype, fp32_keys_pattern=patterns
                ).hf_keys
            except PlanError as exc:
                failures.append((position[members[0]], order, exc))
                continue
            for key in covered:
                index = key_position[key]
                if not holders[index]:
                    first.setdefault(min(members), []).append(index)
                holders[index].extend(members)
        per_geometry[geometry] = (first, [interned.setdefault(t, t) for t in (tuple(sorted(h)) for h in holders)])
    if failures:
        raise min(failures, key=lambda f: (f[0], f[1]))[2]
    by_first: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for name, spec in layout.specs.items():  # model order within each lowest holder, as every rank's plans give
        first, shared = per_geometry[_geometry(spec, runtime[name])]
        for rank, indices in first.items():
            by_first.setdefault(rank, []).extend((spec.hf_keys[i], shared[i]) for i in indices)
    out: dict[str, tuple[int, ...]] = {}
    for rank in sorted(by_first):
        out.update(by_first[rank])
    return out


def _kept_fused_refs(spec: LoadSpec, plan: HFSavePlan) -> tuple[MeshDimRef, ...] | None:
    """Mesh dims of the kept cuts that decide which keys a rank covers (None: every rank covers every key)."""
    kept = [s for s in plan.steps if s.preserved]
    if not kept or plan.policy.mode not in ("preserve", "minimal") or spec.fused_dim is None or not spec.key_size:
        return None
    return tuple(s.descriptor.mesh_dim for s in kept if s.descriptor.dim == spec.fused_dim)


def key_sizes(
    layout: Layout,
    runtime: Mapping[str, torch.dtype],
    dtype: torch.dtype | None,
    fp32_keys_pattern: Sequence[str] | str | None,
) -> dict[str, int]:
    """Bytes every HF key of the layout occupies on disk, in its save dtype."""
    return {k: math.prod(shape) * d.itemsize for k, (d, shape) in key_meta(layout, runtime, dtype,
                                                                           fp32_keys_pattern).items()}


def key_meta(
    layout: Layout,
    runtime: Mapping[str, torch.dtype],
    dtype: torch.dtype | None,
    fp32_keys_pattern: Sequence[str] | str | None,
) -> KeyMeta:
    """``{hf_key: (save dtype, shape)}`` of every key of the layout, as it will be on disk."""
    out: KeyMeta = {}
    for name, spec in layout.specs.items():
        shape = expected_key_shape(spec)
        key_dtypes = save_dtypes(spec.hf_keys, runtime[name], dtype=dtype, fp32_keys_pattern=fp32_keys_pattern)
        out.update({k: (d, shape) for k, d in zip(spec.hf_keys, key_dtypes)})
    return out


def saved_layout(layout: Layout, meta: KeyMeta) -> Layout:
    """``layout`` with the dtypes its keys are written in (``meta``: ``key_meta``'s answer), as a checkpoint's
    layout file records it: a parameter whose keys are saved in different dtypes (``fp32_keys_pattern`` naming some
    keys of a fused one) gives none. ``layout`` itself when the save writes every parameter in its dtype; the same
    object again for a repeat save of an unchanged layout (its fingerprint is then remembered too)."""
    return remember_while_same(_SAVED_LAYOUTS, layout, (layout.specs, layout.dtypes, meta),
                               lambda: _saved_layout(layout, meta))


def layout_as_held(
    layout: Layout,
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype | None,
    fp32_keys_pattern: Sequence[str] | str | None,
) -> Layout:
    """A given layout whose dtypes are those a save wrote (a checkpoint's own layout file, read back: the inverse of
    ``saved_layout``) with the dtypes ``tensors`` hold: a parameter whose given dtype is not its tensor's, but is the
    one dtype this save writes all its keys in (``dtype``, ``fp32_keys_pattern``), takes its tensor's. Any other
    given dtype stays, for ``Layout.with_tensor_dtypes`` to refuse when it disagrees."""
    held = {}
    for name, given in layout.dtypes.items():
        tensor = tensors.get(name)
        own = None if tensor is None else str(tensor.dtype).removeprefix("torch.")
        if own is None or own == given:
            continue
        written = set(save_dtypes(layout.specs[name].hf_keys, tensor.dtype, dtype=dtype,
                                  fp32_keys_pattern=fp32_keys_pattern))
        if len(written) == 1 and str(written.pop()).removeprefix("torch.") == given:
            held[name] = own
    if not held:
        return layout
    return dataclasses.replace(layout, dtypes={**layout.dtypes, **held})


def _saved_layout(layout: Layout, meta: KeyMeta) -> Layout:
    dtypes = {}
    for name, spec in layout.specs.items():
        written = {meta[key][0] for key in spec.hf_keys}
        if len(written) == 1:
            dtypes[name] = str(written.pop()).removeprefix("torch.")
    if dtypes == layout.dtypes:
        return layout
    return dataclasses.replace(layout, dtypes=dtypes)


# -- sharing work between parameters of one geometry ---------------------------------------------------------
def _geometry_groups(layout: Layout, runtime: Mapping[str, torch.dtype]) -> dict[tuple, str]:
    """``{geometry: first parameter with it}``: parameters that differ only in names and keys."""
    groups: dict[tuple, str] = {}
    for name, spec in layout.specs.items():
        groups.setdefault(_geometry(spec, runtime[name]), name)
    return groups


def _geometry(spec: LoadSpec, runtime_dtype: torch.dtype) -> tuple:
    return (spec.global_shape, spec.shards, spec.fused_dim, spec.origin_shape, len(spec.hf_keys), runtime_dtype)


def _templates(
    layout: Layout,
    rank: int,
    policy: SavePolicy,
    runtime: Mapping[str, torch.dtype],
    dtype: torch.dtype | None,
    patterns: tuple[str, ...],
    groups: Mapping[tuple, str],
) -> dict[tuple, HFSavePlan]:
    """One rank's save plan of the first parameter of every geometry."""
    return {
        geometry: plan_hf_save(layout[name], rank, policy, runtime_dtype=runtime[name], dtype=dtype,
                               fp32_keys_pattern=patterns)
        for geometry, name in groups.items()
    }


def _shape_class(templates: Mapping[tuple, HFSavePlan]) -> tuple:
    """Every shape a rank's schedule depends on, one entry per geometry (ranks with equal keys share calls)."""
    return tuple(
        (p.local_shape, p.runtime_output_shape, tuple(s.shape_before for s in p.steps)) for p in templates.values()
    )


def _expand(
    layout: Layout,
    templates: Mapping[tuple, HFSavePlan],
    runtime: Mapping[str, torch.dtype],
    dtype: torch.dtype | None,
    patterns: tuple[str, ...],
    key_index: dict[tuple, dict[tuple[str, ...], tuple[int, ...]]],
) -> tuple[HFSavePlan, ...]:
    """Every parameter's plan from its geometry's template, with its own name, keys and key dtypes. A
    template covering some keys only (a kept key-aligned cut) gives every parameter the keys at the same
    positions."""
    out = []
    for name, spec in layout.specs.items():
        geometry = _geometry(spec, runtime[name])
        template = templates[geometry]
        if template.name == name:
            out.append(template)
            continue
        source = layout[template.name].hf_keys
        if template.hf_keys == source:
            keys = spec.hf_keys
        else:
            memo = key_index.setdefault(geometry, {})
            indices = memo.get(template.hf_keys)
            if indices is None:
                position = {k: i for i, k in enumerate(source)}
                indices = memo[template.hf_keys] = tuple(position[k] for k in template.hf_keys)
            keys = tuple(spec.hf_keys[i] for i in indices)
        key_dtypes = save_dtypes(keys, runtime[name], dtype=dtype, fp32_keys_pattern=patterns)
        bounds = gather_dtype_bounds(save_dtypes(spec.hf_keys, runtime[name], dtype=dtype, fp32_keys_pattern=patterns),
                                     runtime[name], splits_keys(template.policy, template.steps, template.fused_dim))
        out.append(dataclasses.replace(template, name=name, hf_keys=keys, key_dtypes=key_dtypes,
                                       gather_dtype=gather_dtype(key_dtypes, runtime[name]),
                                       gather_dtype_bounds=bounds))
    return tuple(out)
