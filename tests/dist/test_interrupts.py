"""A rank interrupted mid-save (``KeyboardInterrupt``: Ctrl-C in a notebook, or any exception that is not an
``Exception``) never leaves its peer waiting: 2 gloo ranks, the interrupt injected on rank 1 in a writer thread and
between two gathers. Every rank raises well under the save's timeout (30 s): rank 1 its interrupt, rank 0 a
``SaveFailed`` naming rank 1; nothing is published, the old checkpoint stays; the next save in the same processes
publishes. And a collective that timed out (one rank stalled past the timeout) does not leave cached process groups
out of step for the next save or load with the same timeout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.faults.harness import layout_of, new_values, old_values, write_old_checkpoint
from tests.io.support import all_slots_free, read_checkpoint

FAILING = 1
TIMEOUT = 30.0
BOUND = 2.0  # seconds every rank may take to raise, with TIMEOUT 30 (the old code: rank 0 waited the timeout)
BUDGET = 256  # bytes: several gather waves


def _arm(point: str | None, rank: int, action: str = "interrupt", seconds: float = 0.0):
    """Hook the fault points seen by the save and the load on ``FAILING`` (``fault_hook``); returns the undo."""
    from workbench.faults import fault_hook

    if point is None or rank != FAILING:
        return lambda: None
    name, _, detail = point.partition(":")

    def fault(at: str, rank: int, where: object = None) -> None:
        if at != name or (detail and str(where) != detail):
            return
        if action == "stall":
            time.sleep(seconds)
            return
        if action == "bug":
            raise RuntimeError(f"injected: a bug at {point} on rank {rank}")
        raise KeyboardInterrupt(f"injected: interrupted at {point} on rank {rank}")

    hook = fault_hook(fault)
    hook.__enter__()
    return lambda: hook.__exit__(None, None, None)


def _state(layout, rank: int, root: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's pieces of the old checkpoint, and of the new values (old + 1) that its saves write."""
    from tests.faults.harness import _local_state

    old = _local_state(layout, rank)
    wb.load_hf(old, root / "source", layout=layout, timeout=TIMEOUT)
    return old, {n: t + 1 for n, t in old.items()}


def _steps(root: str, steps: list[tuple]) -> dict:
    """Each step ``(kind, name, fault point, action, seconds, timeout, options)`` on every rank; what it raised."""
    import torch.distributed as dist

    rank = dist.get_rank()
    layout = layout_of(2)
    out = {}
    for kind, name, point, action, seconds, timeout, options in steps:
        old, state = _state(layout, rank, Path(root))
        undo = _arm(point, rank, action, seconds)
        start = time.perf_counter()
        got: dict = {"error": None}
        try:
            if kind == "save":
                wb.save_hf(state, Path(root) / name, layout=layout, budget_bytes=BUDGET, max_shard_bytes=256,
                           timeout=timeout, **options)
            else:
                fresh = {n: torch.zeros_like(t) for n, t in state.items()}
                wb.load_hf(fresh, Path(root) / name, layout=layout, timeout=timeout)
                got["loaded"] = all(torch.equal(fresh[n], old[n]) for n in old)  # the old checkpoint
        except BaseException as exc:  # the interrupt too: the old code let it out of rank 1 only
            got = {"error": type(exc).__name__, "message": str(exc),
                   "failed_ranks": list(getattr(exc, "failed_ranks", ()))}
        finally:
            undo()
        got["seconds"] = time.perf_counter() - start
        out[name] = got
    return out


def _old(root: Path, names: list[str]) -> None:
    write_old_checkpoint(root / "source")
    for name in names:
        write_old_checkpoint(root / name)


def _kept_old(root: Path, name: str) -> None:
    from workbench.io.files.publish import validate_final

    assert validate_final(root / name) == []
    got, want = read_checkpoint(root / name), old_values()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
    assert [p.name for p in root.iterdir() if p.name.startswith(f".{name}.")] == []  # no .NAME.incomplete left


def _published_new(root: Path, name: str) -> None:
    got, want = read_checkpoint(root / name), new_values()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name


def test_an_interrupt_on_one_rank_fails_every_rank_at_once(tmp_path: Path) -> None:
    steps = [
        ("save", "in-writer", "write", "interrupt", 0.0, TIMEOUT, {"write_mode": "direct"}),
        ("save", "in-gather-writer", "write", "interrupt", 0.0, TIMEOUT, {"write_mode": "gather"}),
        ("save", "between-gathers", "gather:1", "interrupt", 0.0, TIMEOUT, {"write_mode": "gather"}),
        ("save", "after", None, "", 0.0, TIMEOUT, {"write_mode": "gather"}),
    ]
    _old(tmp_path, [s[1] for s in steps])
    results = wb.launch(_steps, nprocs=2, args=(str(tmp_path), steps), timeout=150)

    for name, stage in (("in-writer", "writing"), ("in-gather-writer", "writing"),
                        ("between-gathers", "gathering (wave")):
        interrupted, peer = results[FAILING][name], results[0][name]
        assert interrupted["error"] == "KeyboardInterrupt", (name, interrupted)  # its own interrupt, re-raised
        assert interrupted["message"].startswith("injected: interrupted at"), (name, interrupted)
        assert peer["error"] == "SaveFailed" and peer["failed_ranks"] == [FAILING], (name, peer)
        lines = peer["message"].splitlines()
        assert lines[0] == f"save to {tmp_path / name} failed; nothing was published.", (name, lines)
        assert lines[1].startswith(f"  rank {FAILING} failed while {stage}"), (name, lines)
        assert "KeyboardInterrupt: injected: interrupted at" in lines[1], (name, lines)
        for rank in (0, 1):
            assert results[rank][name]["seconds"] < BOUND, (name, rank, results[rank][name])
        _kept_old(tmp_path, name)
    assert all(results[r]["after"]["error"] is None for r in (0, 1)), results
    _published_new(tmp_path, "after")


@pytest.mark.parametrize(("kind", "point"), [("save", "gather:1"), ("load", "load.read")])
def test_groups_a_timed_out_collective_left_behind_are_not_reused(tmp_path: Path, kind: str, point: str) -> None:
    # rank 1 stalls 3 s before its second gathering wave (save) or its first read (load), past the 1.5 s timeout:
    # rank 0's flag exchange times out (a broken collective), then both status exchanges. The next save or load uses
    # the same timeout, so the same cached groups unless they were dropped (the old code: its flag exchange failed)
    short = 1.5
    options = {"write_mode": "gather"} if kind == "save" else {}
    steps = [(kind, "stalled", point, "stall", 3.0, short, options), (kind, "after", None, "", 0.0, short, options)]
    _old(tmp_path, ["stalled", "after"])
    results = wb.launch(_steps, nprocs=2, args=(str(tmp_path), steps), timeout=150)

    error = "SaveFailed" if kind == "save" else "LoadFailed"
    for rank in (0, 1):
        assert results[rank]["stalled"]["error"] == error, (rank, results[rank]["stalled"])
        after = results[rank]["after"]
        assert after["error"] is None and after.get("loaded", True), (rank, after)
    _kept_old(tmp_path, "stalled")
    if kind == "save":
        _published_new(tmp_path, "after")


def test_an_interrupt_during_a_load_fails_every_rank_at_once(tmp_path: Path) -> None:
    # rank 1 is interrupted reading its slices: it raises its own interrupt, rank 0 a LoadFailed naming it, both
    # well under the timeout (the old code let the interrupt out of rank 1 alone; rank 0 waited the whole timeout)
    steps = [("load", "interrupted", "load.read", "interrupt", 0.0, TIMEOUT, {}),
             ("load", "after", None, "", 0.0, TIMEOUT, {})]
    _old(tmp_path, ["interrupted", "after"])
    results = wb.launch(_steps, nprocs=2, args=(str(tmp_path), steps), timeout=150)

    interrupted, peer = results[FAILING]["interrupted"], results[0]["interrupted"]
    assert interrupted["error"] == "KeyboardInterrupt", interrupted
    assert peer["error"] == "LoadFailed" and peer["failed_ranks"] == [FAILING], peer
    assert "KeyboardInterrupt: injected: interrupted at" in peer["message"], peer
    for rank in (0, 1):
        assert results[rank]["interrupted"]["seconds"] < BOUND, (rank, results[rank]["interrupted"])
        assert results[rank]["after"]["error"] is None and results[rank]["after"]["loaded"], results[rank]["after"]


def _loads(root: str, world: int, steps: list[tuple[str, str | None, str]], landing: bool = False) -> dict:
    """Every rank loads the old checkpoint once per step ``(name, fault point, action)``, the fault armed on
    ``FAILING`` only (``interrupt``: a KeyboardInterrupt, ``bug``: a RuntimeError); what each load raised.
    ``landing``: the loads take a GPU load's path (``load._CPU_LANDING_RING``): boxes land from the reading threads."""
    import torch.distributed as dist

    from tests.faults.harness import _local_state
    from workbench.io.files.staging import StagingRing
    from workbench.io.hf import load as load_module

    if landing:
        load_module._CPU_LANDING_RING = StagingRing(3, 3 * 4096, pinned=False)
    rank = dist.get_rank()
    layout = layout_of(world)
    clean = _local_state(layout, rank)
    wb.load_hf(clean, Path(root) / "source", layout=layout, timeout=TIMEOUT)
    out = {}
    for name, point, action in steps:
        fresh = _local_state(layout, rank)
        undo = _arm(point, rank, action)
        start = time.perf_counter()
        got: dict = {"error": None}
        try:
            wb.load_hf(fresh, Path(root) / "source", layout=layout, timeout=TIMEOUT)
            got["loaded"] = all(torch.equal(fresh[n], clean[n]) for n in clean)
            got["values"] = fresh
        except BaseException as exc:  # the interrupt too: the old code let it out of the interrupted rank alone
            got = {"error": type(exc).__name__, "message": str(exc), "cause": type(exc.__cause__).__name__,
                   "failed_ranks": list(getattr(exc, "failed_ranks", ())),
                   "untouched": all(not t.any() for t in fresh.values())}
        finally:
            undo()
        got["seconds"] = time.perf_counter() - start
        if landing:  # every slot of the ring back, whatever the load did
            got["ring_free"] = all_slots_free(load_module._CPU_LANDING_RING)
        out[name] = got
    return out


def test_a_failure_after_the_reads_started_and_before_the_agreement_changes_no_tensor(tmp_path: Path) -> None:
    # A GPU load's path (boxes land from the reading threads): every rank plans its reads and starts those landing
    # on the device into the staging ring before the ranks agree that every rank checked the checkpoint, so the
    # reads overlap the agreement. Rank 1 then raises (a bug, an interrupt) before the agreement: every rank fails
    # well under the timeout, the peers with a LoadFailed naming rank 1 and the stage, and no rank has copied a byte
    # into its tensors (they are still zeros) or kept a slot of its ring. A load after them succeeds.
    steps = [("bug", "load.planned", "bug"), ("interrupt", "load.planned", "interrupt"), ("after", None, "")]
    write_old_checkpoint(tmp_path / "source")
    results = wb.launch(_loads, nprocs=2, args=(str(tmp_path), 2, steps, True), timeout=150)

    for name, cause in (("bug", "RuntimeError: injected: a bug"), ("interrupt", "KeyboardInterrupt: injected")):
        for rank in range(2):
            got = results[rank][name]
            assert got["seconds"] < BOUND and got["untouched"] and got["ring_free"], (name, rank, got)
            if rank == FAILING:
                assert got["error"] == ("RuntimeError" if name == "bug" else "KeyboardInterrupt"), (name, got)
                continue
            assert got["error"] == "LoadFailed" and got["failed_ranks"] == [FAILING], (name, rank, got)
            assert f"  rank {FAILING} failed while planning its reads: {cause}" in got["message"], got["message"]
            assert "no tensor was changed" in got["message"], got["message"]
    for rank in range(2):
        after = results[rank]["after"]
        assert after["error"] is None and after["loaded"] and after["ring_free"], (rank, after)


@pytest.mark.parametrize("landing", [False, True], ids=["cpu-path", "gpu-path"])
def test_a_failure_while_sharing_replicas_fails_every_rank_at_once(tmp_path: Path, landing: bool) -> None:
    # 4 ranks (ep=2 x fsdp=2): the replicated norm, embed and proj are read once per replica group and broadcast in
    # three batches (over ep, and over ep+fsdp). Rank 1 is interrupted before the first batch and before the second
    # (after one broadcast ran), raises a plain error before the second, and is interrupted reporting its status.
    # Every rank ends well under the timeout (30 s): rank 1 with its interrupt (chained to the LoadFailed), the
    # others with a LoadFailed naming rank 1 and the cause. The old code let the interrupt out of rank 1 alone and
    # its peers waited in the next flag exchange for the whole timeout. A load after them all succeeds.
    # ``landing``: the loads take a GPU load's path (the boxes land from the reading threads), and rank 1 also fails
    # reading (its peers learn it at the first flag of the broadcasts). The last load's values are checked against
    # the boxes torch says each rank holds.
    steps = [("share-0", "load.share:0", "interrupt"), ("share-1", "load.share:1", "interrupt"),
             ("share-bug", "load.share:1", "bug"), ("status", "load.status", "interrupt")]
    stages = {"share-0": "sharing replicated parameters", "share-1": "sharing replicated parameters",
              "share-bug": "sharing replicated parameters", "status": "reporting its status"}
    if landing:
        steps.append(("read-bug", "load.read", "bug"))
        stages["read-bug"] = "reading its slices"
    steps.append(("after", None, ""))
    write_old_checkpoint(tmp_path / "source")
    results = wb.launch(_loads, nprocs=4, args=(str(tmp_path), 4, steps, landing), timeout=150)

    for name, stage in stages.items():
        cause = "RuntimeError: injected: a bug" if name.endswith("bug") else "KeyboardInterrupt: injected: interrupted"
        for rank in range(4):
            got = results[rank][name]
            assert got["seconds"] < BOUND, (name, rank, got)
            if rank == FAILING and not name.endswith("bug"):
                assert got["error"] == "KeyboardInterrupt" and got["cause"] == "LoadFailed", (name, got)
                continue
            assert got["error"] == "LoadFailed" and got["failed_ranks"] == [FAILING], (name, rank, got)
            assert f"  rank {FAILING} failed while {stage}: {cause}" in got["message"], (name, rank, got["message"])
    for rank in range(4):
        assert results[rank]["after"]["error"] is None and results[rank]["after"]["loaded"], results[rank]["after"]
        got = results[rank]["after"]["values"]
        want = _expected_locals(rank)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want), rank


def _expected_locals(rank: int) -> dict[str, torch.Tensor]:
    """This rank's local tensors of the 4-rank harness model (ep=2 x fsdp=2) from the old checkpoint, cut from the
    global values where torch's own ``compute_local_shape_and_global_offset`` says the rank's box lies."""
    from torch.distributed.tensor import Replicate, Shard

    from tests.strategies import torch_slices

    values = old_values()
    wholes = {"embed": values["model.embed.weight"], "proj": values["model.proj.weight"],
              "norm": values["model.norm.weight"],
              "experts": torch.cat([values[f"model.experts.{e}.weight"] for e in range(4)])}
    placements = {"embed": [Replicate(), Shard(0)], "experts": [Shard(0), Shard(0)], "proj": [Replicate(), Shard(1)],
                  "norm": [Replicate(), Replicate()]}
    coordinate = [rank // 2, rank % 2]
    return {n: whole[torch_slices(whole.shape, (2, 2), coordinate, placements[n])] for n, whole in wholes.items()}
