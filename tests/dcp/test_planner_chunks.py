"""The DCP planners' chunks and read items for every rank of a small expert-TP tensor, on a fake process group.

The expected boxes are DESIGN.md's worked example, written out by hand: 16 rows = 2 experts x (gate 4 + up 4) on
(ep=2, etp=2) with ``Shard(0), InterleavedShard(0, 2)``; (ep, etp) = (0,0) holds rows 0,1,4,5; (0,1) rows 2,3,6,7;
(1,0) rows 8,9,12,13; (1,1) rows 10,11,14,15.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from workbench import _compat
from workbench.errors import CheckpointError
from workbench.io.dcp.planners import DCPLoadPlanner, DCPSavePlanner
from workbench.layout import InterleavedShard

ROWS = {0: (0, 1, 4, 5), 1: (2, 3, 6, 7), 2: (8, 9, 12, 13), 3: (10, 11, 14, 15)}
COLS = 3


def _dtensor(rank: int, values: torch.Tensor | None = None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "etp"))
    full = torch.arange(16 * COLS, dtype=torch.float32).reshape(16, COLS)
    local = full[list(ROWS[rank])].clone() if values is None else values
    return DTensor.from_local(local, mesh, (Shard(0), InterleavedShard(0, num_local_stripes=2)), run_check=False,
                              shape=torch.Size((16, COLS)), stride=(COLS, 1)), full


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_save_plan_has_one_chunk_per_run_with_the_runs_data(rank: int) -> None:
    with _compat.fake_process_group(rank, 4):
        tensor, full = _dtensor(rank)
        planner = DCPSavePlanner()
        planner.set_up_planner({"w": tensor, "step": torch.tensor(2.0)}, is_coordinator=rank == 0)
        plan = planner.create_local_plan()
        chunks = {item.index.fqn: [] for item in plan.items}
        for item in plan.items:
            chunks[item.index.fqn].append(item)
        first, second = ROWS[rank][0], ROWS[rank][2]  # each rank holds two runs of two rows
        got = [(tuple(i.tensor_data.chunk.offsets), tuple(i.tensor_data.chunk.sizes)) for i in chunks["w"]]
        assert got == [((first, 0), (2, COLS)), ((second, 0), (2, COLS))]
        for item, start in zip(chunks["w"], (first, second)):
            assert torch.equal(planner.resolve_data(item), full[start:start + 2])
            assert tuple(item.tensor_data.size) == (16, COLS)
        assert len(chunks["step"]) == 1  # plain tensors go torch's default way


def _metadata(size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Metadata:
    properties = TensorProperties(dtype=torch.float32)
    boxes = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks]
    return Metadata(state_dict_metadata={"w": TensorStorageMetadata(properties, torch.Size(size), boxes)})


@pytest.mark.parametrize("rank", [0, 3])
def test_load_plan_reads_each_run_from_a_whole_saved_tensor(rank: int) -> None:
    with _compat.fake_process_group(rank, 4):
        tensor, full = _dtensor(rank, torch.zeros(4, COLS))
        planner = DCPLoadPlanner()
        planner.set_up_planner({"w": tensor}, _metadata((16, COLS), [((0, 0), (16, COLS))]), rank == 0)
        plan = planner.create_local_plan()
        reads = sorted(plan.items, key=lambda r: tuple(r.storage_offsets))
        assert [tuple(r.storage_offsets) for r in reads] == [(ROWS[rank][0], 0), (ROWS[rank][2], 0)]
        assert all(tuple(r.lengths) == (2, COLS) for r in reads)
        for read in reads:  # DCP copies the stored slice into the view resolve_tensor returns
            start = read.storage_offsets[0]
            planner.resolve_tensor(read).copy_(full[start:start + 2])
        assert torch.equal(tensor.to_local(), full[list(ROWS[rank])])


def test_load_plan_splits_reads_across_saved_chunks() -> None:
    # saved as 4 chunks of 4 rows (FSDP4-like); rank 1 wants rows 2-3 and 6-7: one read from chunk 0, one from 1
    with _compat.fake_process_group(1, 4):
        tensor, _ = _dtensor(1, torch.zeros(4, COLS))
        planner = DCPLoadPlanner()
        saved = [((r, 0), (4, COLS)) for r in (0, 4, 8, 12)]
        planner.set_up_planner({"w": tensor}, _metadata((16, COLS), saved), False)
        reads = planner.create_local_plan().items
        got = sorted((tuple(r.storage_index.offset), tuple(r.storage_offsets), tuple(r.dest_offsets)) for r in reads)
        assert got == [((0, 0), (2, 0), (0, 0)), ((4, 0), (2, 0), (0, 0))]


def test_load_refuses_a_different_global_shape_and_a_missing_key() -> None:
    with _compat.fake_process_group(0, 4):
        tensor, _ = _dtensor(0)
        planner = DCPLoadPlanner()
        planner.set_up_planner({"w": tensor}, _metadata((8, COLS), [((0, 0), (8, COLS))]), True)
        with pytest.raises(CheckpointError, match=r"'w'.*\(8, 3\).*\(16, 3\)"):
            planner.create_local_plan()
        planner = DCPLoadPlanner()
        planner.set_up_planner({"v": tensor}, _metadata((16, COLS), [((0, 0), (16, COLS))]), True)
        with pytest.raises(CheckpointError, match=r"Missing key.*'v'"):
            planner.create_local_plan()
        planner = DCPLoadPlanner(allow_partial_load=True)
        planner.set_up_planner({"v": tensor}, _metadata((16, COLS), [((0, 0), (16, COLS))]), True)
        assert planner.create_local_plan().items == []
