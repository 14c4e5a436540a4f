"""The ranks prove they agree before any data moves: ranks called with different arguments get an error naming
the ranks and the first call (or writer) that differs, on every rank, instead of a hang or a torn file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb


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
        "budget": {"budget_bytes": 64 if rank == 1 else 1 << 20, "write_mode": "gather"},  # other waves on rank 1
        "writers": {"max_writers": 1 if rank == 1 else None, "write_mode": "gather"},  # another writer map
        # direct: rank 0 made the temporary directory and every file at full size before the refusal
        "direct": {"max_writers": 1 if rank == 1 else None, "write_mode": "direct"},
    }
    for name, kwargs in cases.items():
        try:
            wb.save_hf(state, Path(root) / name, layout=layout, policy=wb.SavePolicy.full(), **kwargs)
            out[name] = None
        except wb.SaveFailed as exc:
            out[name] = str(exc)
    return out


@pytest.mark.slow
def test_ranks_with_different_arguments_are_refused_before_any_data_moves(tmp_path: Path) -> None:
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
    """Ranks that pass a different ``max_shard_bytes``, ``fp32_keys_pattern`` or ``dtype``: the same gathers (or none,
    in direct mode), other files or other bytes in them."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    rank = dist.get_rank()
    mesh = wb.MeshSpec((2,), ("fsdp",))
    specs = {f"w{i}": wb.LoadSpec.from_placements(f"w{i}", f"model.w{i}", (8, 4), mesh, [Shard(0)]) for i in range(4)}
    layout = wb.Layout(mesh, specs)
    state = {n: torch.full((4, 4), float(rank)) for n in specs}
    cases = {
        "shard": {"max_shard_bytes": 64 if rank == 1 else 1 << 20},
        "fp32": {"dtype": torch.bfloat16, "fp32_keys_pattern": r"w1$" if rank == 1 else None},
        "dtype": {"dtype": torch.bfloat16 if rank == 1 else None},
    }
    out = {}
    for mode in ("direct", "gather"):
        for name, kwargs in cases.items():
            try:
                wb.save_hf(state, Path(root) / f"{name}-{mode}", layout=layout, write_mode=mode, timeout=30, **kwargs)
                out[name, mode] = None
            except wb.SaveFailed as exc:
                out[name, mode] = str(exc)
    return out


@pytest.mark.slow
def test_ranks_with_different_files_or_save_dtypes_are_refused_naming_the_argument(tmp_path: Path) -> None:
    results = wb.launch(_disagree_on_files, nprocs=2, args=(str(tmp_path),), timeout=180)
    for rank, out in results.items():
        for (case, mode), message in out.items():
            assert message is not None, (rank, case, mode)
            assert "refused before any data moved" in message and "the ranks' plans differ" in message, message
        for mode in ("direct", "gather"):
            assert "max_shard_bytes" in out["shard", mode] and (
                "rank(s) 0: 2 file(s) of at most 1048576 bytes; rank(s) 1: 4 file(s) of at most 64 bytes"
                in out["shard", mode]), out
            fp32 = out["fp32", mode]
            assert "key 'model.w1' is saved as bfloat16 on rank(s) 0 and float32 on rank(s) 1" in fp32, fp32
            assert "dtype= and fp32_keys_pattern" in fp32, fp32
            dtype = out["dtype", mode]
            assert "key 'model.w0' is saved as float32 on rank(s) 0 and bfloat16 on rank(s) 1" in dtype, dtype
            assert "(3 more key(s) differ)" in dtype, dtype
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_files_problem_names_the_first_key_dtype_or_the_shard_size_and_leaves_writer_maps_to_check_agreement() -> None:
    from workbench.io.hf.save_planning import files_problem

    same = ((("a", "float32"), ("b", "bfloat16")), 2, 1000)
    b_fp32 = ((("a", "float32"), ("b", "float32")), 2, 1000)
    smaller = ((("a", "float32"), ("b", "bfloat16")), 3, 500)
    assert files_problem([same, b_fp32, same], same_writers=False) == (
        "key 'b' is saved as bfloat16 on rank(s) 0, 2 and float32 on rank(s) 1: every rank must pass the same dtype= "
        "and fp32_keys_pattern")
    assert files_problem([same, smaller], same_writers=True) == (
        "the ranks plan different files (rank(s) 0: 2 file(s) of at most 1000 bytes; rank(s) 1: 3 file(s) of at most "
        "500 bytes): every rank must pass the same max_shard_bytes")
    assert files_problem([same, smaller], same_writers=False) is None  # check_agreement names the writer maps
    other = ((("a", "float32"), ("b", "bfloat16")), 3, 1000)
    assert files_problem([same, other], same_writers=True).endswith("every rank must pass the same call arguments")
