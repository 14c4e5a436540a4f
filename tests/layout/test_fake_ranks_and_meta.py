"""Layout.from_model when one process plays rank after rank on a fake process group (torch hands FSDP2 the same
DeviceMesh object for every rank: nothing read of it may be remembered across ranks), and tensors on the meta device
(refused up front, naming them, before a save creates anything)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import workbench as wb
from workbench import _compat
from workbench.errors import LayoutError
from workbench.layout.model_layout import Layout, layout_and_locals, local_tensors

FULL = torch.arange(15.0).reshape(5, 3)  # 5 rows over dp=2 and 3 columns over tp=2: uneven on both


def _fsdp_tp_model(mesh) -> nn.Module:
    model = nn.Module()
    model.w = nn.Parameter(distribute_tensor(FULL, mesh["tp"], [Shard(1)], src_data_rank=None))
    _compat.fully_shard(model, mesh=mesh["dp"])  # Shard(0) over dp, Shard(1) over tp
    return model


def test_every_simulated_rank_gets_its_own_uneven_layout() -> None:
    meshes = []
    for rank in range(4):
        with _compat.fake_process_group(rank, 4):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            model = _fsdp_tp_model(mesh)
            meshes.append(model.w.device_mesh)
            spec = Layout.from_model(model, {"w": "w"})["w"]
            assert spec.global_shape == (5, 3)
            assert spec.local_shape(rank) == tuple(model.w.to_local().shape)
    assert len({id(m) for m in meshes}) == 1  # the scenario itself: torch gave every rank the same DeviceMesh


def test_a_sliced_mesh_handed_to_every_rank_is_read_per_rank() -> None:
    """(pp, dp, tp): FSDP2's (dp, tp) mesh is a slice through this rank's pp coordinate, and the same object is
    handed to the ranks of both pp stages; its ranks (``.mesh``) are read for each rank."""
    for rank in range(8):
        with _compat.fake_process_group(rank, 8):
            mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
            model = _fsdp_tp_model(mesh)
            spec = Layout.from_model(model, {"w": "w"})["w"]
            assert spec.local_shape(rank) == tuple(model.w.to_local().shape)
            assert spec.mesh == wb.MeshSpec((2, 2, 2), ("pp", "dp", "tp"))


def _meta_linear() -> nn.Module:
    with torch.device("meta"):
        return nn.Linear(4, 3)


def _left_behind(root: Path) -> list[str]:
    return sorted(os.listdir(root))


@pytest.mark.parametrize("write_mode", ["direct", "gather"])
def test_save_of_a_meta_model_names_its_parameters_and_writes_nothing(tmp_path: Path, write_mode: str) -> None:
    with pytest.raises(LayoutError, match=r"2 parameter\(s\) are on the meta device.*'weight', 'bias'.*to_empty"):
        wb.save_hf(_meta_linear(), tmp_path / "ckpt", write_mode=write_mode)
    assert _left_behind(tmp_path) == []  # neither ckpt nor .ckpt.incomplete


def test_save_of_a_state_dict_with_one_meta_tensor_names_it(tmp_path: Path) -> None:
    state = {"a": torch.ones(2, 2), "b": torch.empty(3, device="meta"), "c": torch.zeros(4)}
    with pytest.raises(LayoutError, match=r"1 parameter\(s\) are on the meta device.*\['b'\]"):
        wb.save_hf(state, tmp_path / "ckpt")
    assert _left_behind(tmp_path) == []


def test_many_meta_tensors_are_counted_and_the_first_named() -> None:
    state = {f"t{i}": torch.empty(2, device="meta") for i in range(7)}
    with pytest.raises(LayoutError, match=r"7 parameter\(s\).*'t0', 't1', 't2', 't3', 't4'\] and 2 more"):
        layout_and_locals(state)


def test_a_remembered_model_moved_to_meta_is_refused_too() -> None:
    model = nn.Linear(4, 3)
    layout, _ = layout_and_locals(model)  # remembered
    model.to("meta")
    with pytest.raises(LayoutError, match="meta device"):
        layout_and_locals(model)
    with pytest.raises(LayoutError, match="meta device"):
        local_tensors(model, layout)


def test_load_into_a_meta_model_is_refused(tmp_path: Path) -> None:
    with torch.device("cpu"):
        wb.save_hf(nn.Linear(4, 3), tmp_path / "ckpt")
    with pytest.raises(LayoutError, match="meta device"):
        wb.load_hf(_meta_linear(), tmp_path / "ckpt")


def test_a_materialized_meta_model_saves(tmp_path: Path) -> None:
    model = _meta_linear()
    with pytest.raises(LayoutError):
        wb.save_hf(model, tmp_path / "ckpt")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.weight.copy_(torch.arange(12.0).reshape(3, 4))
        model.bias.zero_()
    wb.save_hf(model, tmp_path / "ckpt")
    again = nn.Linear(4, 3)
    wb.load_hf(again, tmp_path / "ckpt")
    assert torch.equal(again.weight, model.weight)
