"""SimulatedWorld: every rank of a mesh in one process, running the real plans and executor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from workbench.errors import PlanError
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec
from workbench.plan.load_plan import Adapter, plan_hf_load
from workbench.plan.policy import SavePolicy
from workbench.plan.save_plan import HFSavePlan
from workbench.plan.save_set import SavePlanSet, key_meta, key_sizes, plan_save, plan_save_within_writers
from workbench.plan.schedule import check_schedules
from workbench.run.executor import GatherRequest, WaveOutput, unshard
from workbench.run.load_ops import execute_load, reader_from_tensors
from workbench.run.unshard_ops import split_keys

# plan_save, SavePlanSet, key_meta and key_sizes live in workbench.plan.save_set (planning is pure); they are
# re-exported here so existing imports keep working.
__all__ = ["SavePlanSet", "SimulatedWorld", "key_meta", "key_sizes", "plan_save"]


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
        # a parameter whose dtype the layout was not given takes its checkpoint's (its first HF key's), as a model
        # built from that checkpoint holds it: no dtype is assumed
        dtypes = {name: layout.given_dtype(name) or hf_tensors[spec.hf_keys[0]].dtype
                  for name, spec in layout.specs.items()}
        out: dict[int, dict[str, torch.Tensor]] = {}
        for rank in self.mesh.all_ranks():
            out[rank] = {}
            for name, spec in layout.specs.items():
                own_shapes = {k: shapes[k] for k in spec.hf_keys if not adapters or k not in adapters}
                plan = plan_hf_load(spec, rank, own_shapes)
                local = torch.empty(plan.target_shape, dtype=dtypes[name])
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

        As ``save_hf``: each tensor is saved in its own dtype (a parameter the layout gives no dtype takes its
        tensors'), and under ``max_writers`` every key goes to an allowed writer (``plan_save_within_writers``).
        Under ``SavePolicy.gather_only`` the output stays in runtime layout and is keyed by parameter name
        on every rank.

        Raises:
            PlanError: a rank of the mesh has no tensors, or two ranks hold a parameter in different dtypes.
            LayoutError: a rank misses a parameter, or its tensor's dtype is not the one the layout gives.
        """
        self._check(layout)
        layout = self._with_tensor_dtypes(layout, locals_by_rank)
        plan_set = plan_save_within_writers(layout, policy=policy, budget_bytes=budget_bytes, dtype=dtype,
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

    def _with_tensor_dtypes(self, layout: Layout, locals_by_rank: Mapping[int, Mapping[str, torch.Tensor]]) -> Layout:
        """``layout`` with every parameter's dtype taken from the ranks' tensors, which must agree."""
        filled: Layout | None = None
        first = None
        for rank in self.mesh.all_ranks():
            if rank not in locals_by_rank:
                raise PlanError(f"no local tensors for rank {rank} of {self.mesh!r}")
            mine = layout.with_tensor_dtypes(locals_by_rank[rank])
            if filled is None:
                filled, first = mine, rank
                continue
            if mine.dtypes != filled.dtypes:
                name = next(n for n in layout.specs if mine.dtypes[n] != filled.dtypes[n])
                raise PlanError(f"parameter {name!r} is {filled.dtypes[name]} on rank {first} but "
                                f"{mine.dtypes[name]} on rank {rank}: every rank must hold it in one dtype")
        assert filled is not None
        return filled

    def _check(self, layout: Layout) -> None:
        if layout.mesh != self.mesh:
            raise PlanError(f"layout {layout.name!r} is on {layout.mesh!r}, this world is {self.mesh!r}")
