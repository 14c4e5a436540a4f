"""The fault-injection harness: ranks that save and load a small sharded model while one rank fails on purpose.

Used by ``tests/faults/`` (a fast subset) and ``bench/faults.py`` (the full tally). Everything that runs inside a
rank is a module-level function here, so spawned ranks import it by name.

The model: a few parameters on a mesh of 2 ranks (``fsdp``) or 4 (``ep`` x ``fsdp``), gathered over FSDP and,
under ``SavePolicy.full()``, over EP too; a replicated fp32 norm (never gathered) and fused expert keys. The old
checkpoint is written by the parent from global tensors (``old_values``); ranks load it, add 1 (the new values)
and save it back to the same path with a fault armed on one rank. A verdict then checks, from the parent:

* every rank ended (no hang) within ``deadline`` seconds with an error naming the failing rank, or succeeded when
  the point lies after the publish (``cleanup``);
* the path holds, bit for bit, the old checkpoint (or the new one when the save succeeded or was killed after its
  rename), and it is complete;
* no directory without the ``.incomplete`` name holds partial data.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

AFTER_PUBLISH = ("cleanup",)  # the save has succeeded when these fire
RANK0_POINTS = ("index", "rename", "cleanup")
BUDGET = 256  # bytes: several gather waves
SHARD_BYTES = 256  # bytes: several files


@dataclass(frozen=True, slots=True)
class Scenario:
    """One injected failure: ``point`` on ``rank`` with ``action``, in a sync or async save (or a load)."""

    point: str
    rank: int
    action: str = "raise"
    async_save: bool = False
    policy: str = "minimal"
    detail: str | None = None
    write_mode: str = "direct"

    @property
    def name(self) -> str:
        where = self.point.replace(".", "_") + (f"{self.detail}" if self.detail is not None else "")
        mode = "async" if self.async_save else "sync"
        return f"{where}-r{self.rank}-{self.action}-{mode}-{self.policy}-{self.write_mode}"

    @property
    def rule(self) -> str:
        detail = f":{self.detail}" if self.detail is not None else ""
        return f"{self.point}{detail}@{self.rank}:{self.action}"


def mesh_of(world: int):
    import workbench as wb

    return wb.MeshSpec((world,), ("fsdp",)) if world == 2 else wb.MeshSpec((2, 2), ("ep", "fsdp"))


def layout_of(world: int):
    """The harness model's layout on 2 or 4 ranks (pure: the parent uses it too)."""
    from torch.distributed.tensor import Replicate, Shard

    import workbench as wb

    mesh = mesh_of(world)
    rep, dp = ([], [Shard(0)]) if world == 2 else ([Replicate()], [Shard(0)])
    cols = [Shard(1)] if world == 2 else [Replicate(), Shard(1)]
    experts = [Shard(0)] if world == 2 else [Shard(0), Shard(0)]
    expert_keys = [f"model.experts.{e}.weight" for e in range(4)]
    specs = {
        "embed": wb.LoadSpec.from_placements("embed", "model.embed.weight", (16, 8), mesh, rep + dp),
        "experts": wb.LoadSpec.from_placements("experts", expert_keys, (16, 8), mesh, experts, fused_dim=0),
        "proj": wb.LoadSpec.from_placements("proj", "model.proj.weight", (8, 12), mesh, cols),
        "norm": wb.LoadSpec.from_placements("norm", "model.norm.weight", (8,), mesh, [Replicate()] * mesh.ndim),
    }
    dtypes = {"embed": "bfloat16", "experts": "bfloat16", "proj": "float32", "norm": "float32"}
    return wb.Layout(mesh, specs, dtypes)


def old_values() -> dict[str, torch.Tensor]:
    """The old checkpoint, by HF key (global tensors; distinct values everywhere)."""
    out = {"model.embed.weight": torch.arange(128.0).reshape(16, 8).to(torch.bfloat16)}
    for e in range(4):
        out[f"model.experts.{e}.weight"] = (torch.arange(32.0).reshape(4, 8) + 1000 * e).to(torch.bfloat16)
    out["model.proj.weight"] = torch.linspace(-1, 1, 96).reshape(8, 12)
    out["model.norm.weight"] = torch.arange(8.0) / 7
    return out


def new_values() -> dict[str, torch.Tensor]:
    """What a successful save writes: every old value plus one (in its own dtype)."""
    return {k: v + 1 for k, v in old_values().items()}


def write_old_checkpoint(path: Path) -> None:
    """The parent's save of the old checkpoint (one process, plain tensors, the same HF keys)."""
    import workbench as wb

    wb.save_hf(old_values(), path, max_shard_bytes=SHARD_BYTES)


# -- inside every rank ---------------------------------------------------------------------------------------------


def _local_state(layout, rank: int) -> dict[str, torch.Tensor]:
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    return {n: torch.zeros(s.local_shape(rank), dtype=dtypes[layout.dtypes[n]]) for n, s in layout.specs.items()}


def run_scenarios(root: str, records: str, scenarios: Sequence[Scenario], world: int) -> dict:
    """Every rank: for each scenario, load the old checkpoint, add one, save with the fault armed; record the end.

    A record per rank is rewritten after every scenario, so a hang or a kill still leaves what happened before.
    """
    import torch.distributed as dist

    import workbench as wb
    from workbench.faults import FAULT_ENV

    rank = dist.get_rank()
    layout = layout_of(world)
    outcomes: dict[str, dict] = {}
    for scenario in scenarios:
        path = Path(root) / scenario.name
        state = _local_state(layout, rank)
        start = time.perf_counter()
        outcome: dict = {"error": None}
        limit = None
        try:
            if scenario.point.startswith("load."):
                os.environ[FAULT_ENV] = scenario.rule
                wb.load_hf(state, path, layout=layout, timeout=20)
            else:
                wb.load_hf(state, path, layout=layout, timeout=20)
                for tensor in state.values():
                    tensor.add_(1)
                if scenario.point == "rlimit":
                    limit = _limit_file_size(rank == scenario.rank)
                else:
                    os.environ[FAULT_ENV] = scenario.rule
                policy = wb.SavePolicy.full() if scenario.policy == "full" else wb.SavePolicy.minimal()
                handle = wb.save_hf(
                    state, path, layout=layout, policy=policy, budget_bytes=BUDGET, max_shard_bytes=SHARD_BYTES,
                    async_save=scenario.async_save, timeout=20, write_threads=2, write_mode=scenario.write_mode,
                )
                if scenario.async_save:
                    for tensor in state.values():
                        tensor.add_(41)  # the optimizer step, at once: the files must hold the call-time values
                    handle.wait()
        except Exception as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc)}
        finally:
            os.environ.pop(FAULT_ENV, None)
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        outcome["seconds"] = time.perf_counter() - start
        outcomes[scenario.name] = outcome
        (Path(records) / f"rank{rank}.json").write_text(json.dumps(outcomes))
    return outcomes


def _limit_file_size(on: bool):
    """On the failing rank, cap file sizes so writes fail with EFBIG (SIGXFSZ ignored); returns the old limit."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    if on:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, old[1]))
    return old


def run_killed(root: str, scenario: Scenario, delay: float | None, world: int) -> None:
    """Every rank loads, adds one and saves; ``scenario.rank`` dies by SIGKILL at the armed point, or after
    ``delay`` seconds from the start of the save when ``delay`` is given."""
    import torch.distributed as dist

    import workbench as wb
    from workbench.faults import FAULT_ENV

    rank = dist.get_rank()
    layout = layout_of(world)
    state = _local_state(layout, rank)
    path = Path(root) / scenario.name
    wb.load_hf(state, path, layout=layout)
    for tensor in state.values():
        tensor.add_(1)
    if delay is None:
        os.environ[FAULT_ENV] = scenario.rule
    elif rank == scenario.rank:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    policy = wb.SavePolicy.full() if scenario.policy == "full" else wb.SavePolicy.minimal()
    handle = wb.save_hf(state, path, layout=layout, policy=policy, budget_bytes=BUDGET, max_shard_bytes=SHARD_BYTES,
                        async_save=scenario.async_save, timeout=20, write_mode=scenario.write_mode)
    if scenario.async_save:
        handle.wait()
    time.sleep(1.0)  # a timed kill may still be due: let it land here rather than after the launcher returns


# -- from the parent ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one scenario came to: hung ranks, partial publishes, and everything else that was wrong."""

    scenario: str
    hangs: int
    partial_publishes: int
    problems: tuple[str, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        """True when nothing went wrong."""
        return not (self.hangs or self.partial_publishes or self.problems)


def _read(path: Path) -> dict[str, torch.Tensor]:
    from workbench.io.files.read import CheckpointReader

    with CheckpointReader(path) as reader:
        keys = reader.keys()
        return {k: reader.read(k) for k in keys}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want
    )


def check_published(root: Path, scenario: Scenario, *, expect: str) -> tuple[int, list[str]]:
    """(partial publishes, other problems) of what lies under ``root`` for ``scenario``; ``expect`` is "old",
    "new" or "either"."""
    from workbench.io.files.publish import validate_final
    from workbench.io.files.publish_types import is_temporary_path

    partial, problems = 0, []
    path = root / scenario.name
    for child in root.iterdir():  # nothing without the .incomplete name may hold partial data
        if child.is_dir() and not is_temporary_path(child) and not child.name.endswith(".old"):
            found = validate_final(child)
            if found:
                partial += 1
                problems.append(f"{child.name} is published but incomplete: {found[:2]}")
    if validate_final(path):
        return partial, problems
    got = _read(path)
    matches = {"old": _same(got, old_values()), "new": _same(got, new_values())}
    if expect == "either" and not any(matches.values()):
        problems.append(f"{path.name} holds neither the old nor the new values")
    elif expect in matches and not matches[expect]:
        problems.append(f"{path.name} does not hold the {expect} values bit for bit")
    return partial, problems


def verdict(root: Path, scenario: Scenario, outcomes: dict[int, dict], world: int, deadline: float) -> Verdict:
    """Judge one scenario of ``run_scenarios`` from every rank's recorded outcome and what is on disk."""
    succeeded = scenario.point in AFTER_PUBLISH
    problems: list[str] = []
    hangs = 0
    slowest = 0.0
    for rank in range(world):
        outcome = outcomes.get(rank, {}).get(scenario.name)
        if outcome is None:
            hangs += 1
            problems.append(f"rank {rank} never finished")
            continue
        slowest = max(slowest, outcome["seconds"])
        if outcome["seconds"] > deadline:
            problems.append(f"rank {rank} took {outcome['seconds']:.1f} s (> {deadline} s)")
        if succeeded:
            if outcome["error"] is not None:
                problems.append(f"rank {rank} raised {outcome['error']}: {outcome['message'][:200]}")
        elif outcome["error"] is None:
            problems.append(f"rank {rank} did not raise")
        elif f"rank {scenario.rank}" not in outcome["message"]:
            problems.append(f"rank {rank}'s error does not name rank {scenario.rank}: {outcome['message'][:300]}")
    expect = "new" if succeeded else "old"
    partial, found = check_published(root, scenario, expect=expect)
    return Verdict(scenario.name, hangs, partial, tuple(problems + found), slowest)


def standard_scenarios(world: int, *, seed: int = 0) -> list[Scenario]:
    """Every save point, sync and async, plus EFBIG through RLIMIT_FSIZE and the load points; the failing rank,
    action and policy rotate deterministically."""
    rng = random.Random(seed)
    actions = ("raise", "efbig", "enospc", "memory", "bug")
    out = []
    from workbench.faults import LOAD_POINTS, SAVE_POINTS

    for async_save in (False, True):
        for point in SAVE_POINTS:
            rank = 0 if point in RANK0_POINTS else rng.randrange(world)
            detail = "1" if point == "gather" else None
            mode = "gather" if point == "gather" else rng.choice(("direct", "gather"))
            policy = rng.choice(("minimal", "full"))
            out.append(Scenario(point, rank, rng.choice(actions), async_save, policy, detail, mode))
        out.append(Scenario("rlimit", world - 1, "efbig", async_save, "minimal", write_mode="direct"))
        out.append(Scenario("rlimit", 0, "efbig", async_save, "minimal", write_mode="gather"))
    for point in LOAD_POINTS:
        out.append(Scenario(point, rng.randrange(world), rng.choice(actions)))
    return out


def record_verdicts(verdicts: Sequence[Verdict]) -> list[dict]:
    """Verdicts as plain dicts (for JSON)."""
    return [asdict(v) for v in verdicts]
