"""The ranks prove they agree before any data moves: ranks called with different arguments get an error naming
the ranks and the first call (or writer) that differs, on every rank, instead of a hang or a torn file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb


def _planned_on_rank_1(rank: int, **changed: object) -> None:
    """On rank 1 only, the save's planner runs with ``changed`` arguments: two ranks whose planners differ though
    their calls are the same (``save_hf`` refuses different call arguments before it plans)."""
    from workbench.io.hf import save_session

    original = save_session.__dict__.setdefault("_original_plan_rank_save", save_session.plan_rank_save)
    save_session.plan_rank_save = original
    if rank == 1 and changed:
        save_session.plan_rank_save = lambda *args, **kwargs: original(*args, **{**kwargs, **changed})


def _disagree(root: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    rank = dist.get_rank()
    mesh = wb.MeshSpec((2,), ("fsdp",))
    specs = {f"w{i}": wb.LoadSpec.from_placements(f"w{i}", f"model.w{i}", (8, 4), mesh, [Shard(0)]) for i in range(4)}
    layout = wb.Layout(mesh, specs)
    state = {n: torch.full((4, 4), float(rank)) for n in specs}
    out = {}
    cases = {
        "budget": ({"budget": 64}, {"write_mode": "gather"}),  # other waves on rank 1
        "writers": ({"max_writers": 1}, {"write_mode": "gather"}),  # another writer map
        # direct: rank 0 made the temporary directory and every file at full size before the refusal
        "direct": ({"max_writers": 1}, {"write_mode": "direct"}),
    }
    for name, (planned, kwargs) in cases.items():
        _planned_on_rank_1(rank, **planned)
        try:
            wb.save_hf(state, Path(root) / name, layout=layout, policy=wb.SavePolicy.full(), **kwargs)
            out[name] = None
        except wb.SaveFailed as exc:
            out[name] = str(exc)
    _planned_on_rank_1(rank)
    return out


@pytest.mark.slow
def test_ranks_whose_planners_differ_are_refused_before_any_data_moves(tmp_path: Path) -> None:
    results = wb.launch(_disagree, nprocs=2, args=(str(tmp_path),), timeout=120)
    for rank, out in results.items():
        budget, writers, direct = out["budget"], out["writers"], out["direct"]
        assert budget is not None and writers is not None and direct is not None, (rank, out)
        assert "refused before any data moved" in direct and "writer maps differ" in direct, direct
        assert "refused before any data moved" in budget and "group fsdp [0, 1]: call 0 differs" in budget, budget
        assert "rank 0: wave 0 round 0" in budget and "rank 1: wave 0 round 0" in budget, budget
        assert "writer maps differ between ranks [0] and [1]" in writers, writers
        assert "is written by rank" in writers, writers
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # not even a hidden .NAME.incomplete


UNEVEN_NAMES = ("f0", "w1", "f2", "w3")


def _uneven_values() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {n: torch.randn(10, 64, generator=gen) for n in UNEVEN_NAMES}


def _save_uneven(path: str) -> str:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    rank = dist.get_rank()
    mesh = wb.MeshSpec((4,), ("fsdp",))
    layout = wb.Layout(mesh, {n: wb.LoadSpec.from_placements(n, n, (10, 64), mesh, [Shard(0)]) for n in UNEVEN_NAMES})
    state = {n: torch.chunk(t, 4)[rank].clone() for n, t in _uneven_values().items()}  # rows 3, 3, 3, 1
    try:
        wb.save_hf(state, path, layout=layout, budget_bytes=7040, dtype=torch.bfloat16, fp32_keys_pattern=r"^f",
                   write_mode="gather", timeout=60)
    except wb.SaveFailed as exc:
        return str(exc)
    return "ok"


@pytest.mark.slow
def test_ranks_of_uneven_shards_with_the_same_arguments_save_together(tmp_path: Path) -> None:
    # each rank plans alone; rank 3's 1-row shard used to pack other waves than ranks 0-2's 3 rows at this budget,
    # and every rank refused the save although every argument was the same
    from safetensors.torch import load_file

    results = wb.launch(_save_uneven, nprocs=4, args=(str(tmp_path / "ckpt"),), timeout=180)
    assert results == dict.fromkeys(range(4), "ok"), results
    saved = {k: v for f in (tmp_path / "ckpt").glob("*.safetensors") for k, v in load_file(f).items()}
    values = _uneven_values()
    want = {n: t if n.startswith("f") else t.to(torch.bfloat16) for n, t in values.items()}
    assert saved.keys() == want.keys()
    for key, tensor in want.items():
        assert saved[key].dtype == tensor.dtype and torch.equal(saved[key], tensor), key


def _disagree_on_files(root: str) -> dict:
    """Ranks that pass different arguments (refused by name before anything is written), and ranks whose planners
    plan other files or save dtypes from the same arguments (in direct mode nothing is gathered: no schedule
    differs)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    rank = dist.get_rank()
    mesh = wb.MeshSpec((2,), ("fsdp",))
    specs = {f"w{i}": wb.LoadSpec.from_placements(f"w{i}", f"model.w{i}", (8, 4), mesh, [Shard(0)]) for i in range(4)}
    layout = wb.Layout(mesh, specs)
    state = {n: torch.full((4, 4), float(rank)) for n in specs}
    passed = {
        "shard": {"max_shard_bytes": 64 if rank == 1 else 1 << 20},
        "fp32": {"dtype": torch.bfloat16, "fp32_keys_pattern": r"w1$" if rank == 1 else None},
        "dtype": {"dtype": torch.bfloat16 if rank == 1 else None},
        "async": {"async_save": rank == 0},  # rank 1 used to report a save that was never published as done
        "path": {},  # each rank its own folder: rank 1 failed writing into rank 0's missing temporary folder
    }
    planned = {
        "shard": {"max_shard_bytes": 64},
        "fp32": {"dtype": torch.bfloat16, "fp32_keys_pattern": r"w1$"},
        "dtype": {"dtype": torch.bfloat16},
    }
    out = {}
    for mode in ("direct", "gather"):
        for name, kwargs in passed.items():
            try:
                where = Path(root) / (f"{name}-{mode}" + (f"-{rank}" if name == "path" else ""))
                done = wb.save_hf(state, where, layout=layout, write_mode=mode, timeout=30, **kwargs)
                getattr(done, "wait", lambda: None)()
                out["passed", name, mode] = None
            except wb.SaveFailed as exc:
                out["passed", name, mode] = str(exc)
        for name, changed in planned.items():
            _planned_on_rank_1(rank, **changed)
            try:
                wb.save_hf(state, Path(root) / f"planned-{name}-{mode}", layout=layout, write_mode=mode, timeout=30)
                out["planned", name, mode] = None
            except wb.SaveFailed as exc:
                out["planned", name, mode] = str(exc)
            _planned_on_rank_1(rank)
    return out


@pytest.mark.slow
def test_ranks_with_different_arguments_or_files_are_refused_naming_what_differs(tmp_path: Path) -> None:
    results = wb.launch(_disagree_on_files, nprocs=2, args=(str(tmp_path),), timeout=180)
    passed = {
        "shard": "max_shard_bytes (1048576 on rank(s) 0, 64 on rank(s) 1)",
        "fp32": "fp32_keys_pattern (None on rank(s) 0, 'w1$' on rank(s) 1)",
        "dtype": "dtype (None on rank(s) 0, bfloat16 on rank(s) 1)",
        "async": "async_save (True on rank(s) 0, False on rank(s) 1)",
    }
    planned = {
        "shard": "the ranks plan different files (rank(s) 0: 2 file(s); rank(s) 1: 4 file(s))",
        "fp32": "key 'model.w0' is saved as float32 on rank(s) 0 and bfloat16 on rank(s) 1 (2 more key(s) differ)",
        "dtype": "key 'model.w0' is saved as float32 on rank(s) 0 and bfloat16 on rank(s) 1 (3 more key(s) differ)",
    }
    for rank, out in results.items():
        for (kind, case, mode), message in out.items():
            assert message is not None, (rank, kind, case, mode)
            if kind == "passed" and case == "path":
                paths = [repr(str(Path(tmp_path, f"path-{mode}-{r}").absolute())) for r in (0, 1)]
                assert f"arguments: path ({paths[0]} on rank(s) 0, {paths[1]} on rank(s) 1); every" in message, message
            elif kind == "passed":
                assert message.endswith(f"refused before anything was written: the ranks passed different "
                                        f"arguments: {passed[case]}; every rank must pass the same"), message
            else:
                assert "refused before any data moved: the ranks' plans differ: " in message, message
                assert planned[case] in message and "their planners differ" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_files_problem_names_the_first_key_dtype_or_the_files_and_leaves_writer_maps_to_check_agreement() -> None:
    from workbench.io.hf.save_planning import files_problem

    same = ((("a", "float32"), ("b", "bfloat16")), 2)
    b_fp32 = ((("a", "float32"), ("b", "float32")), 2)
    more = ((("a", "float32"), ("b", "bfloat16")), 3)
    assert files_problem([same, b_fp32, same], same_writers=False).startswith(
        "key 'b' is saved as bfloat16 on rank(s) 0, 2 and float32 on rank(s) 1: the ranks passed the same arguments")
    assert files_problem([same, more], same_writers=True).startswith(
        "the ranks plan different files (rank(s) 0: 2 file(s); rank(s) 1: 3 file(s)): the ranks passed the same")
    assert files_problem([same, more], same_writers=False) is None  # check_agreement names the writer maps
