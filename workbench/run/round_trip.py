"""A simulated round trip: random HF tensors -> load into a layout -> save -> compare bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.layout.model_layout import Layout
from workbench.plan.load_plan import expected_key_shape
from workbench.plan.policy import SavePolicy
from workbench.run.simulated import SimulatedWorld, plan_save

__all__ = ["HF_KEYED_MODES", "RoundTripReport", "check_round_trip_policy", "random_hf_tensors",
           "simulate_round_trip"]

# policy modes whose saves are HF checkpoints (keyed by HF key, each key whole): the ones a round trip can compare
HF_KEYED_MODES = ("minimal", "full", "preserve")


@dataclass(frozen=True, slots=True)
class RoundTripReport:
    """What a simulated save of a layout produced, compared with the tensors it was loaded from."""

    layout: str
    ranks: int
    keys: int
    bytes: int
    exact: bool
    mismatched: tuple[str, ...]
    writers: int
    calls: int
    peak_bytes: int

    def __str__(self) -> str:
        verdict = "bit-exact" if self.exact else f"MISMATCH in {len(self.mismatched)} keys: {list(self.mismatched[:5])}"
        return (
            f"round trip {self.layout}: {self.keys} HF keys ({self.bytes} bytes) loaded into {self.ranks} ranks, "
            f"saved back by {self.writers} writer ranks in {self.calls} gather calls "
            f"(predicted peak {self.peak_bytes} bytes per rank): {verdict}"
        )


def random_hf_tensors(layout: Layout, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random checkpoint tensors for every HF key of ``layout``, in each parameter's dtype."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, spec in layout.specs.items():
        dtype = layout.dtype(name)
        shape = expected_key_shape(spec)
        for key in spec.hf_keys:
            if dtype.is_floating_point:
                out[key] = torch.randn(shape, generator=generator).to(dtype)
            else:
                out[key] = torch.randint(-(2**30), 2**30, shape, generator=generator).to(dtype)
    return out


def check_round_trip_policy(policy: SavePolicy) -> SavePolicy:
    """``policy`` when its saves are HF-keyed (``HF_KEYED_MODES``); else a ``ValueError`` naming it."""
    if policy.mode not in HF_KEYED_MODES:
        raise ValueError(f"policy {policy}: a round trip compares the saved HF keys with the loaded ones, but "
                         f"{policy.mode} saves in runtime layout, keyed by parameter name; use minimal (save_hf's "
                         "default), full or preserve:DIM[,DIM]")
    return policy


def simulate_round_trip(
    layout: Layout,
    *,
    budget_bytes: int | None = None,
    policy: SavePolicy | None = None,
    max_writers: int | None = None,
    seed: int = 0,
) -> RoundTripReport:
    """Load random HF tensors into every rank of ``layout``, save them back, and compare bit for bit.

    Raises:
        ValueError: ``policy`` does not save an HF checkpoint (``gather_only``: see ``check_round_trip_policy``).
    """
    if policy is not None:
        check_round_trip_policy(policy)
    hf = random_hf_tensors(layout, seed=seed)
    world = SimulatedWorld(layout.mesh)
    locals_by_rank = world.load(layout, hf)
    plan_set = plan_save(layout, policy=policy, budget_bytes=budget_bytes, max_writers=max_writers)
    written = world.run_save(plan_set, locals_by_rank)
    merged: dict[str, torch.Tensor] = {}
    duplicated: list[str] = []
    for per_rank in written.values():
        for key, tensor in per_rank.items():
            if key in merged:
                duplicated.append(key)
            merged[key] = tensor
    bad = sorted(
        set(duplicated)
        | {k for k in hf if k not in merged}
        | {k for k in hf if k in merged and (merged[k].dtype != hf[k].dtype or not torch.equal(merged[k], hf[k]))}
    )
    first = plan_set.schedules[min(plan_set.schedules)]
    return RoundTripReport(
        layout.name, layout.mesh.size, len(hf), sum(t.numel() * t.element_size() for t in hf.values()), not bad,
        tuple(bad), len(set(plan_set.writers.values())), first.num_calls, first.peak_bytes,
    )
