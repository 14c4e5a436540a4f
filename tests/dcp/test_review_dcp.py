"""Review of the DCP side: cases where a user got silently wrong data or an error that named nothing useful."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workbench.errors import CheckpointError
from workbench.io.dcp.convert import dcp_to_hf
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec

ONE = MeshSpec((1,), ("world",))


def _save_plain(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": dict(tensors)}, checkpoint_id=path, no_dist=True)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_to_hf_refuses_a_cast_that_makes_values_inf(tmp_path: Path) -> None:
    # two keys fused on dim 0; the second holds 1e5, over float16's largest value 65504
    fused = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 1e5], [-6.0, 7.0]])
    _save_plain(tmp_path / "dcp", {"w": fused})
    layout = Layout(ONE, {"w": LoadSpec(name="w", hf_keys=["a.weight", "b.weight"], global_shape=(4, 2), mesh=ONE,
                                        fused_dim=0)})
    with pytest.raises(CheckpointError, match=r"'model\.w' \(HF key 'b\.weight'\).*float16.*100000\.0"):
        dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", layout, dtype=torch.float16, allow_pickle=True)
    assert not (tmp_path / "hf").exists() and not (tmp_path / ".hf.incomplete").exists()

    # bfloat16 holds 1e5 (rounded): the same conversion goes through, each key torch's own cast of its rows
    from safetensors.torch import load_file

    dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", layout, dtype=torch.bfloat16, allow_pickle=True)
    got = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        got.update(load_file(f))
    assert torch.equal(got["a.weight"], fused[:2].to(torch.bfloat16))
    assert torch.equal(got["b.weight"], fused[2:].to(torch.bfloat16))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_to_hf_refuses_config_files_named_like_its_own_files(tmp_path: Path) -> None:
    # config_files=[*source.glob("*.json")] took the source model's index along; copied last, it replaced the index
    # just written, and publishing refused the result only after the whole conversion, as "different saves"
    _save_plain(tmp_path / "dcp", {"w": torch.ones(2, 2)})
    layout = Layout(ONE, {"w": LoadSpec(name="w", hf_keys=["w.weight"], global_shape=(2, 2), mesh=ONE)})
    source = tmp_path / "source"
    source.mkdir()
    for name in ("config.json", "model.safetensors.index.json", "model-00001-of-00001.safetensors"):
        (source / name).write_text("{}")
    for clash in ("model.safetensors.index.json", "model-00001-of-00001.safetensors"):
        with pytest.raises(CheckpointError, match=rf"config file\(s\) \['{source / clash}'\] would overwrite"):
            dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", layout, config_files=[source / "config.json", source / clash],
                      allow_pickle=True)
    assert not (tmp_path / "hf").exists() and not (tmp_path / ".hf.incomplete").exists()


def _load_error(state: dict, path: Path) -> str:
    import torch.distributed.checkpoint as dcp

    from workbench.io.dcp.planners import DCPLoadPlanner

    try:
        dcp.load(state, checkpoint_id=path, planner=DCPLoadPlanner(), no_dist=True)
    except BaseException as exc:  # DCP wraps a rank's error in CheckpointException, a BaseException
        return str(exc)
    return ""


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_load_refuses_a_narrowing_cast_that_changes_a_value(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from workbench import _compat

    big = torch.tensor([[1.0, 1e5], [3.0, -4.0]])  # 1e5 is over float16's largest value, 65504
    small = torch.tensor([[1.5, -2.0], [3.0, 60000.0]])
    _save_plain(tmp_path / "dcp", {"big": big, "small": small})

    # a plain target (torch's default read items): torch's copy made 1e5 inf, silently
    target = {"model": {"big": torch.zeros(2, 2, dtype=torch.float16)}}
    message = _load_error(target, tmp_path / "dcp")
    assert "'model.big'" in message and "float16" in message and "100000.0" in message, message
    assert not torch.isinf(target["model"]["big"]).any()

    with _compat.fake_process_group(0, 1):  # a DTensor target (the planner's own read items)
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        tensor = DTensor.from_local(torch.zeros(2, 2, dtype=torch.float16), mesh, (Shard(0),))
        message = _load_error({"model": {"big": tensor}}, tmp_path / "dcp")
        assert "'model.big'" in message and "100000.0" in message, message
        assert not torch.isinf(tensor.to_local()).any()

        # values that fit load as torch's own cast of them; a cast that keeps the range (into bfloat16) is not checked
        fits = DTensor.from_local(torch.zeros(2, 2, dtype=torch.float16), mesh, (Shard(0),))
        wide = DTensor.from_local(torch.zeros(2, 2, dtype=torch.bfloat16), mesh, (Shard(0),))
        assert _load_error({"model": {"small": fits, "big": wide}}, tmp_path / "dcp") == ""
        assert torch.equal(fits.to_local(), small.to(torch.float16))
        assert torch.equal(wide.to_local(), big.to(torch.bfloat16))
