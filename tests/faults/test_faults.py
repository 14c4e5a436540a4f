"""Fault injection on real gloo ranks: a rank that fails anywhere in a save or a load never hangs its peers, every
rank raises an error naming it, and the checkpoint at the path is always whole (the old one, or the new one when
the failure came after the publish). The full tally (>= 50 crashes) is ``bench/faults.py``; this is its fast subset.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import workbench as wb
from tests.faults.harness import (
    Scenario,
    check_published,
    run_killed,
    run_scenarios,
    verdict,
    write_old_checkpoint,
)
from workbench.faults import FAULT_ENV, FaultRule, parse_faults

DEADLINE = 30.0  # seconds any rank may take to raise (the bound; typical: well under one)

FAST_2 = [
    Scenario("plan", 1, "raise"),
    Scenario("snapshot", 0, "memory", async_save=True),
    Scenario("gather", 1, "bug", policy="full", detail="1", write_mode="gather"),
    Scenario("gather", 1, "bug", detail="1", write_mode="gather"),  # minimal: wave 1 gathers nothing, wave 2 does
    Scenario("write", 1, "enospc", async_save=True),
    Scenario("write", 0, "raise", write_mode="gather"),
    Scenario("fsync", 0, "efbig"),
    Scenario("status", 1, "raise", async_save=True, write_mode="gather"),
    Scenario("index", 0, "raise"),
    Scenario("rename", 0, "bug", async_save=True),
    Scenario("cleanup", 0, "raise", async_save=True),  # after the publish: the save has succeeded
    Scenario("rlimit", 1, "efbig"),  # a real EFBIG: RLIMIT_FSIZE on rank 1
    Scenario("load.read", 1, "raise"),
]
FAST_4 = [
    # crosses EP and FSDP groups
    Scenario("gather", 3, "raise", async_save=True, policy="full", detail="1", write_mode="gather"),
    Scenario("write", 2, "efbig", policy="full"),
]


def _launch(tmp_path: Path, scenarios: list[Scenario], world: int) -> tuple[Path, dict[int, dict]]:
    root, records = tmp_path / "ckpts", tmp_path / "records"
    root.mkdir()
    records.mkdir()
    for scenario in scenarios:
        write_old_checkpoint(root / scenario.name)
    error = None
    try:
        wb.launch(run_scenarios, nprocs=world, args=(str(root), str(records), scenarios, world), timeout=240)
    except wb.LaunchError as exc:
        error = exc
    outcomes = {}
    for rank in range(world):
        record = records / f"rank{rank}.json"
        outcomes[rank] = json.loads(record.read_text()) if record.is_file() else {}
    assert error is None, error
    return root, outcomes


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_no_injected_failure_hangs_tears_or_publishes_a_partial_checkpoint(tmp_path: Path, world: int) -> None:
    scenarios = FAST_2 if world == 2 else FAST_4
    root, outcomes = _launch(tmp_path, scenarios, world)
    bad = [v for v in (verdict(root, s, outcomes, world, DEADLINE) for s in scenarios) if not v.ok]
    assert not bad, "\n".join(f"{v.scenario}: {v.problems}" for v in bad)
    # the errors say what happened, where: rank, stage and cause
    message = outcomes[0][Scenario("write", 1, "enospc", async_save=True).name]["message"] if world == 2 else ""
    if world == 2:
        assert "rank 1 failed while writing" in message and "No space left on device" in message, message
        rlimit = outcomes[0][Scenario("rlimit", 1, "efbig").name]["message"]
        assert "rank 1 failed while" in rlimit and "File too large" in rlimit, rlimit


@pytest.mark.slow
@pytest.mark.parametrize(("point", "delay"), [("write", None), (None, 0.3)])
def test_a_rank_killed_mid_save_leaves_the_old_or_the_new_checkpoint_whole(
    tmp_path: Path, point: str | None, delay: float | None
) -> None:
    scenario = Scenario(point or "gather", 1, "kill", async_save=delay is not None, policy="full")
    root = tmp_path / "ckpts"
    root.mkdir()
    write_old_checkpoint(root / scenario.name)
    with pytest.raises(wb.LaunchError, match="rank 1"):
        wb.launch(run_killed, nprocs=2, args=(str(root), scenario, delay, 2), timeout=120)
    partial, problems = check_published(root, scenario, expect="either")
    assert partial == 0 and not problems, problems


def test_fault_rules_parse_and_typos_are_refused() -> None:
    assert parse_faults("gather:1@0:kill; write") == (
        FaultRule("gather", "1", frozenset({0}), "kill"),
        FaultRule("write", None, None, "raise"),
    )
    assert parse_faults("fsync@*:efbig")[0] == FaultRule("fsync", None, None, "efbig")
    assert parse_faults("write:enospc")[0] == FaultRule("write", None, None, "enospc")
    with pytest.raises(ValueError, match="unknown fault point 'wirte'"):
        parse_faults("wirte@1")
    with pytest.raises(ValueError, match="unknown action 'explode'"):
        parse_faults("write@1:explode")


def test_an_armed_fault_fires_only_where_and_when_it_is_armed(monkeypatch: pytest.MonkeyPatch) -> None:
    from workbench.faults import InjectedFault, fault_point

    monkeypatch.setenv(FAULT_ENV, "gather:2@1:enospc")
    fault_point("gather", 0, 2)  # another rank
    fault_point("gather", 1, 1)  # another wave
    fault_point("write", 1)  # another point
    with pytest.raises(OSError, match="No space left on device") as info:
        fault_point("gather", 1, 2)
    assert info.value.errno == 28 and not isinstance(info.value, InjectedFault)
