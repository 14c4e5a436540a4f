"""The executor over real gloo process groups writes exactly what the simulated world writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workbench import load_layout
from workbench.run import launch
from workbench.run.simulated import SimulatedWorld

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "sample_meshes" / "toy_expert_tp.toml"


def _save_on_every_rank(path: str, budget: int | None) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    from workbench import load_layout
    from workbench.plan.load_plan import plan_hf_load
    from workbench.run.communicator import drive
    from workbench.run.executor import unshard
    from workbench.run.load_ops import execute_load, reader_from_tensors
    from workbench.run.round_trip import random_hf_tensors
    from workbench.run.simulated import plan_save
    from workbench.run.torch_comm import TorchCommunicator
    from workbench.run.unshard_ops import split_keys

    rank = dist.get_rank()
    layout = load_layout(path)
    hf = random_hf_tensors(layout, seed=3)
    read = reader_from_tensors(hf)
    locals_ = {}
    for name, spec in layout.specs.items():
        plan = plan_hf_load(spec, rank)
        locals_[name] = execute_load(plan, read, torch.empty(plan.target_shape, dtype=layout.dtype(name)))
    plan_set = plan_save(layout, ranks=[rank], budget_bytes=budget)
    plans = {p.name: p for p in plan_set.plans[rank]}
    comm = TorchCommunicator(layout.mesh, {c.mesh_dim for c in plan_set.schedules[rank].calls})
    written: dict[str, torch.Tensor] = {}

    def on_wave(wave):
        for name, tensor in wave.tensors.items():
            for key, value in split_keys(tensor, plans[name]).items():
                if plan_set.writers[key] == rank:
                    written[key] = value.clone()

    drive(unshard(plan_set.schedules[rank], plan_set.plans[rank], locals_), comm, on_wave)
    return written


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 200])
def test_gloo_executor_matches_the_simulated_world(budget: int | None) -> None:
    results = launch(_save_on_every_rank, nprocs=8, args=(str(TOY), budget), timeout=120)
    layout = load_layout(TOY)
    from workbench.run.round_trip import random_hf_tensors

    hf = random_hf_tensors(layout, seed=3)
    world = SimulatedWorld(layout.mesh)
    simulated = world.save(layout, world.load(layout, hf), budget_bytes=budget)
    assert set(results) == set(range(8))
    for rank in range(8):
        assert sorted(results[rank]) == sorted(simulated[rank]), rank
        for key, tensor in simulated[rank].items():
            got = results[rank][key]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), (rank, key)
            assert torch.equal(got, hf[key]), (rank, key)
