"""The ranks prove they agree before any data moves: ranks called with different arguments get an error naming
the ranks and the first call (or writer) that differs, on every rank, instead of a hang or a torn file."""

from __future__ import annotations

from pathlib import Path

import pytest

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
        budget, writers = out["budget"], out["writers"]
        assert budget is not None and writers is not None, (rank, out)
        assert "refused before any data moved" in budget and "group fsdp [0, 1]: call 0 differs" in budget, budget
        assert "rank 0: wave 0 round 0" in budget and "rank 1: wave 0 round 0" in budget, budget
        assert "writer maps differ between ranks [0] and [1]" in writers, writers
        assert "is written by rank" in writers, writers
    assert not (tmp_path / "budget").exists() and not (tmp_path / "writers").exists()
