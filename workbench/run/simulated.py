"""SimulatedWorld: every rank of a mesh in one process, running the real plans and executor."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workbench.errors import PlanError
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec
from workbench.plan.load_plan import Adapter, expected_key_shape, plan_hf_load
from workbench.plan.policy import SavePolicy
from workbench.plan.save_plan import HFSavePlan, gather_dtype, plan_hf_save, save_dtypes
from workbench.plan.schedule import UnshardSchedule, check_schedules, schedule_unshard
from workbench.plan.writers import assign_writers, key_holders
from workbench.run.executor import GatherRequest, WaveOutput, unshard
from workbench.run.load_ops import execute_load, reader_from_tensors
from workbench.run.unshard_ops import split_keys

__all__ = ["SavePlanSet", "SimulatedWorld", "key_meta", "key_sizes", "plan_save"]


@dataclass(frozen=True, slots=True)
class SavePlanSet:
    """Everything every rank needs for one save: plans, schedules and the writer of each key.

    ``plans`` and ``schedules`` map every planned rank; a rank's plans are built when first asked for (ranks
    of one shape class share a checked schedule, see ``plan_save``).
    """

    policy: SavePolicy
    plans: Mapping[int, tuple[HFSavePlan, ...]]
    schedules: Mapping[int, UnshardSchedule]
    writers: dict[str, int]
    shape_classes: int = 1

    def __str__(self) -> str:
        some = self.schedules[next(iter(self.schedules))]
        writer_ranks = len(set(self.writers.values()))
        return (
            f"SavePlanSet [{self.policy}]: {len(self.plans)} ranks in {self.shape_classes} shape class(es), "
            f"{len(self.writers)} HF keys written by {writer_ranks} ranks\n{some}"
        )


class _PerRank(Mapping[int, Any]):
    """A read-only ``{rank: value}`` whose values are made on first access."""

    def __init__(self, ranks: Sequence[int], make: Callable[[int], Any], known: dict[int, Any]) -> None:
        self._ranks, self._make, self._values = tuple(ranks), make, dict(known)
        self._index = set(self._ranks)

    def __getitem__(self, rank: int) -> Any:
        if rank not in self._index:
            raise KeyError(rank)
        if rank not in self._values:
            self._values[rank] = self._make(rank)
        return self._values[rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ranks)

    def __len__(self) -> int:
        return len(self._ranks)


def plan_save(
    layout: Layout,
    *,
    ranks: Sequence[int] | None = None,
    policy: SavePolicy | None = None,
    budget_bytes: int | None = None,
    dtype: torch.dtype | None = None,
    fp32_keys_pattern: Sequence[str] | str | None = None,
    max_writers: int | None = None,
) -> SavePlanSet:
    """Save plans, unshard schedules and writer assignment of a layout, for ``ranks`` (default: all).

    Work is shared where the math is the same: parameters of one geometry (the layers of a model) share a
    plan, and ranks whose steps have the same shapes (a *shape class*: every rank of an evenly sharded model)
    share one schedule. The first rank packs the waves; each shape class rebuilds its calls on them and is
    checked against the first rank's steps, so a 1,024-rank world plans in seconds.
    """
    policy = policy or SavePolicy.full()
    ranks = tuple(layout.mesh.all_ranks() if ranks is None else ranks)
    runtime = {name: layout.dtype(name) for name in layout}
    groups = _geometry_groups(layout, runtime) if policy.mode not in ("preserve", "minimal") else None

    def templates_of(rank: int) -> dict[tuple, HFSavePlan]:
        return _templates(layout, rank, policy, runtime, dtype, fp32_keys_pattern, groups or {})

    def plans_of(rank: int, templates: dict[tuple, HFSavePlan] | None = None) -> tuple[HFSavePlan, ...]:
        if groups is None:  # preserve, minimal: covered keys depend on each spec's keys, plan each one
            return tuple(plan_hf_save(spec, rank, policy, runtime_dtype=runtime[name], dtype=dtype,
                                      fp32_keys_pattern=fp32_keys_pattern) for name, spec in layout.specs.items())
        return _expand(layout, templates if templates is not None else templates_of(rank), runtime, dtype,
                       fp32_keys_pattern)

    plans: dict[int, tuple[HFSavePlan, ...]] = {}
    schedules: dict[int, UnshardSchedule] = {}
    classes: dict[tuple, UnshardSchedule] = {}
    reference: UnshardSchedule | None = None
    diverged = False
    for r in ranks:
        templates = templates_of(r) if groups is not None else None
        key = _shape_class(templates) if templates is not None else None
        if key is not None and key in classes:
            schedules[r] = dataclasses.replace(classes[key], rank=r)
            continue
        plans[r] = plans_of(r, templates)
        try:
            schedules[r] = schedule_unshard(plans[r], runtime, budget_bytes, reference=reference)
        except PlanError:  # its steps differ from the first rank's (another dtype, say): pack its own waves
            schedules[r] = schedule_unshard(plans[r], runtime, budget_bytes)
            diverged = True
        reference = reference or schedules[r]
        if key is not None:
            classes[key] = schedules[r]
    if diverged:  # ranks batch differently: prove every group still agrees
        check_schedules(schedules, layout.mesh)
    sizes = key_sizes(layout, runtime, dtype, fp32_keys_pattern)
    if policy.mode == "gather_only":
        writers: dict[str, int] = {}
    elif policy.mode == "full":  # every rank ends up holding every key
        everyone = tuple(layout.mesh.all_ranks())
        writers = assign_writers(dict.fromkeys(sizes, everyone), sizes, max_writers=max_writers, world=everyone)
    else:
        # a key's writer must hold it, on whichever rank that is: holders come from every rank's plans
        every_plan = {r: plans[r] if r in plans else plans_of(r) for r in layout.mesh.all_ranks()}
        writers = assign_writers(key_holders(every_plan), sizes, max_writers=max_writers, world=layout.mesh.all_ranks())
    return SavePlanSet(policy, _PerRank(ranks, plans_of, plans), schedules, writers, max(1, len(classes)))


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
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{hf_key: (save dtype, shape)}`` of every key of the layout, as it will be on disk."""
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, spec in layout.specs.items():
        shape = expected_key_shape(spec)
        key_dtypes = save_dtypes(spec.hf_keys, runtime[name], dtype=dtype, fp32_keys_pattern=fp32_keys_pattern)
        out.update({k: (d, shape) for k, d in zip(spec.hf_keys, key_dtypes)})
    return out


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
    fp32_keys_pattern: Sequence[str] | str | None,
    groups: Mapping[tuple, str],
) -> dict[tuple, HFSavePlan]:
    """One rank's save plan of the first parameter of every geometry."""
    return {
        geometry: plan_hf_save(layout[name], rank, policy, runtime_dtype=runtime[name], dtype=dtype,
                               fp32_keys_pattern=fp32_keys_pattern)
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
    fp32_keys_pattern: Sequence[str] | str | None,
) -> tuple[HFSavePlan, ...]:
    """Every parameter's plan from its geometry's template, with its own name, keys and key dtypes."""
    out = []
    for name, spec in layout.specs.items():
        template = templates[_geometry(spec, runtime[name])]
        if template.name == name:
            out.append(template)
            continue
        key_dtypes = save_dtypes(spec.hf_keys, runtime[name], dtype=dtype, fp32_keys_pattern=fp32_keys_pattern)
        out.append(dataclasses.replace(template, name=name, hf_keys=spec.hf_keys, key_dtypes=key_dtypes,
                                       gather_dtype=gather_dtype(key_dtypes, runtime[name])))
    return tuple(out)


class SimulatedWorld:
    """All ranks of ``mesh`` in one process: loads and saves run the real plans, schedule and executor,
    with the collectives done in memory. What it returns is exactly what a real run would produce.

    Example::

        world = SimulatedWorld(layout.mesh)
        locals_ = world.load(layout, hf_tensors)              # {rank: {name: local tensor}}
        written = world.save(layout, locals_, budget_bytes=1 << 20)  # {rank: {hf_key: tensor}}
    """

    def __init__(self, mesh: MeshSpec) -> None:
        self.mesh = mesh

    def __repr__(self) -> str:
        return f"SimulatedWorld({self.mesh!r})"

    def load(
        self,
        layout: Layout,
        hf_tensors: Mapping[str, torch.Tensor],
        *,
        adapters: Mapping[str, Adapter] | None = None,
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Every rank's local tensors, read from full HF tensors through each rank's load plan."""
        self._check(layout)
        shapes = {k: tuple(t.shape) for k, t in hf_tensors.items()}
        missing = [k for k in layout.hf_keys if k not in hf_tensors]
        if missing:
            raise PlanError(f"{len(missing)} HF key(s) of {layout.name!r} are missing, e.g. {missing[:3]}")
        read = reader_from_tensors(hf_tensors)
        out: dict[int, dict[str, torch.Tensor]] = {}
        for rank in self.mesh.all_ranks():
            out[rank] = {}
            for name, spec in layout.specs.items():
                own_shapes = {k: shapes[k] for k in spec.hf_keys if not adapters or k not in adapters}
                plan = plan_hf_load(spec, rank, own_shapes)
                local = torch.empty(plan.target_shape, dtype=layout.dtype(name))
                out[rank][name] = execute_load(plan, read, local, adapters)
        return out

    def save(
        self,
        layout: Layout,
        locals_by_rank: Mapping[int, Mapping[str, torch.Tensor]],
        *,
        policy: SavePolicy | None = None,
        budget_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        fp32_keys_pattern: Sequence[str] | str | None = None,
        max_writers: int | None = None,
    ) -> dict[int, dict[str, torch.Tensor]]:
        """What each rank writes: ``{rank: {hf_key: tensor}}`` (writers only hold their own keys).

        Under ``SavePolicy.gather_only`` the output stays in runtime layout and is keyed by parameter name
        on every rank.
        """
        self._check(layout)
        plan_set = plan_save(layout, policy=policy, budget_bytes=budget_bytes, dtype=dtype,
                             fp32_keys_pattern=fp32_keys_pattern, max_writers=max_writers)
        check_schedules(plan_set.schedules, self.mesh)
        return self.run_save(plan_set, locals_by_rank)

    def run_save(
        self, plan_set: SavePlanSet, locals_by_rank: Mapping[int, Mapping[str, torch.Tensor]]
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Execute a planned save for every rank, answering gathers in memory.

        Each rank's executor runs until it needs an all-gather; a gather completes once every member of its
        group has asked for one over the same mesh dim, as on a real network. If no gather can complete while
        ranks still wait, the schedules would deadlock, and a PlanError names the waiting ranks.
        """
        ranks = sorted(plan_set.plans)
        programs = {r: unshard(plan_set.schedules[r], plan_set.plans[r], locals_by_rank[r]) for r in ranks}
        plans_by_name = {r: {p.name: p for p in plan_set.plans[r]} for r in ranks}
        written: dict[int, dict[str, torch.Tensor]] = {r: {} for r in ranks}
        waiting: dict[int, GatherRequest] = {}

        def advance(rank: int, reply: torch.Tensor | None) -> None:
            while True:
                try:
                    request = programs[rank].send(reply)
                except StopIteration:
                    return
                if isinstance(request, GatherRequest):
                    waiting[rank] = request
                    return
                self._collect(rank, request, plans_by_name[rank], plan_set, written[rank])
                reply = None

        for r in ranks:
            advance(r, None)
        while waiting:
            ready = None
            for r, request in waiting.items():
                group = self.mesh.group_ranks(r, request.mesh_dim)
                if all(m in waiting and waiting[m].mesh_dim == request.mesh_dim for m in group):
                    ready = group
                    break
            if ready is None:
                stuck = "; ".join(f"rank {r} on {waiting[r].call}" for r in sorted(waiting)[:4])
                raise PlanError(
                    f"the save would deadlock: {len(waiting)} rank(s) wait on gathers no group completes ({stuck})"
                )
            sends = [waiting[m].send for m in ready]
            if len({s.numel() for s in sends}) != 1:
                raise PlanError(
                    f"all-gather over ranks {list(ready)} got send buffers of sizes {[s.numel() for s in sends]}"
                )
            gathered = torch.cat(sends)
            for m in ready:
                del waiting[m]
            for m in ready:
                advance(m, gathered)
        return written

    @staticmethod
    def _collect(rank: int, wave: WaveOutput, plans: Mapping[str, HFSavePlan], plan_set: SavePlanSet,
                 out: dict[str, torch.Tensor]) -> None:
        for name, tensor in wave.tensors.items():
            plan = plans[name]
            if plan_set.policy.mode == "gather_only":
                out[name] = tensor
                continue
            for key, value in split_keys(tensor, plan).items():
                if plan_set.writers.get(key) == rank:
                    out[key] = value

    def _check(self, layout: Layout) -> None:
        if layout.mesh != self.mesh:
            raise PlanError(f"layout {layout.name!r} is on {layout.mesh!r}, this world is {self.mesh!r}")
