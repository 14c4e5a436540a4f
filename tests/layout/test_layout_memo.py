"""layout_and_locals: a repeat call on the same module reuses its layout, and anything Layout.from_model reads that
changes (a tensor object, a shape or dtype through ``param.data``, the key map) gives the fresh layout; the memo
keeps no module alive."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from workbench import _compat
from workbench.layout.model_layout import Layout, layout_and_locals, local_tensors


def _model(mesh, placements) -> nn.Module:
    model = nn.Module()
    for name, shape in (("a", (8, 4)), ("b", (6, 6))):
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        local = full.tensor_split(4, dim=0)[mesh.get_coordinate()[0]] if placements[0] == Shard(0) else full
        setattr(model, name, nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False,
                                                             shape=full.shape, stride=full.stride())))
    return model


def _same(a: Layout, b: Layout) -> bool:
    return a.mesh == b.mesh and dict(a.specs) == dict(b.specs) and dict(a.dtypes) == dict(b.dtypes)


def test_a_repeat_call_reuses_the_layout_and_a_change_is_seen() -> None:
    with _compat.fake_process_group(1, 4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
        model = _model(mesh, [Shard(0)])
        layout, locals_ = layout_and_locals(model)
        assert _same(layout, Layout.from_model(model))
        assert all(torch.equal(locals_[n], t) for n, t in local_tensors(model, layout).items())
        again, _ = layout_and_locals(model)
        assert again is layout  # remembered: nothing derived twice

        # a new tensor object under the same name (what FSDP2's reshard or a user's redistribute installs)
        model.b = nn.Parameter(DTensor.from_local(torch.zeros(6, 6), mesh, [Replicate()], run_check=False))
        changed, locals_ = layout_and_locals(model)
        assert changed is not layout and _same(changed, Layout.from_model(model))
        assert changed.specs["b"].shards == () and locals_["b"].shape == (6, 6)

        # the same object given another shape and dtype through .data (a plain, replicated parameter)
        model.c = nn.Parameter(torch.zeros(3, 2))
        before, _ = layout_and_locals(model)
        model.c.data = torch.zeros(5, 2, dtype=torch.bfloat16)
        after, locals_ = layout_and_locals(model)
        assert after is not before and _same(after, Layout.from_model(model))
        assert after.specs["c"].global_shape == (5, 2) and after.dtypes["c"] == "bfloat16"
        assert locals_["c"].shape == (5, 2)

        # another key map
        renamed, _ = layout_and_locals(model, {r"(.*)": r"model.\1"})
        assert renamed.specs["a"].hf_keys == ("model.a",)
        assert layout_and_locals(model, {r"(.*)": r"model.\1"})[0] is renamed  # an equal table is the same map

        # the same table object, edited in place: another map (a remembered object would keep the old entries)
        table = {r"(.*)": r"first.\1"}  # a new map: the layout remembered with it
        assert layout_and_locals(model, table)[0].specs["a"].hf_keys == ("first.a",)
        table[r"(.*)"] = r"other.\1"
        edited, _ = layout_and_locals(model, table)
        assert edited.specs["a"].hf_keys == ("other.a",)


def test_the_memo_keeps_no_module_alive() -> None:
    with _compat.fake_process_group(0, 4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
        model = _model(mesh, [Shard(0)])
        layout_and_locals(model)
        ref = weakref.ref(model)
        del model
        gc.collect()
        assert ref() is None


def test_a_state_dict_is_read_every_time() -> None:
    state = {"w": torch.ones(3, 2)}
    layout, locals_ = layout_and_locals(state)
    assert layout.specs["w"].global_shape == (3, 2) and locals_["w"] is not None
    state["w"] = torch.ones(5, 2)
    assert layout_and_locals(state)[0].specs["w"].global_shape == (5, 2)


def test_a_remembered_model_can_still_be_converted_and_the_conversion_is_seen() -> None:
    # torch converts DTensor parameters in place (swap_tensors), which refuses a tensor with a weak reference: the
    # memo must hold none, and the swapped contents (a new dtype, new storage) must not be taken for the old ones
    with _compat.fake_process_group(1, 4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
        model = _model(mesh, [Shard(0)])
        layout, _ = layout_and_locals(model)
        model.to(torch.bfloat16)  # raised "Cannot swap t1 because it has weakref associated with it"
        converted, locals_ = layout_and_locals(model)
        assert converted is not layout and dict(converted.dtypes) == {"a": "bfloat16", "b": "bfloat16"}
        assert all(t.dtype == torch.bfloat16 for t in locals_.values())
        model.to_empty(device="cpu")  # same dtypes and shapes, new storage: the layout stays, the locals are new
        again, locals_ = layout_and_locals(model)
        assert again is converted
        assert all(locals_[n].data_ptr() == t.data_ptr() for n, t in local_tensors(model, again).items())


def test_a_plain_module_swapped_on_conversion_after_a_load(tmp_path) -> None:
    from safetensors.torch import save_file

    import workbench as wb

    save_file({"weight": torch.arange(24.0).reshape(4, 6)}, str(tmp_path / "model.safetensors"))
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model = nn.Linear(6, 4, bias=False)
        wb.load_hf(model, tmp_path, rank=0)
        model.to(torch.float64)
        wb.load_hf(model, tmp_path, rank=0, cast=True)  # the new dtype, seen: cast into it
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert model.weight.dtype == torch.float64 and torch.equal(model.weight, torch.arange(24.0).reshape(4, 6).double())
