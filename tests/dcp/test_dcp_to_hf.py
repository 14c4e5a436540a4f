"""dcp_to_hf in one process: fused keys on dim 1, FP8 tail padding, fp32 keys, several files and several batches;
the pickled ``.metadata`` is opened only with ``allow_pickle=True``."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from workbench.errors import CheckpointError
from workbench.io.dcp.convert import dcp_to_hf
from workbench.io.dcp.planners import DCPSavePlanner
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec

ONE = MeshSpec((1,), ("world",))


def _layout() -> Layout:
    specs = [
        # 4 keys of (6, 2) side by side on dim 1
        LoadSpec(name="fused", hf_keys=[f"k{i}" for i in range(4)], global_shape=(6, 8), mesh=ONE, fused_dim=1),
        # runtime rows padded 10 -> 12 (FP8 alignment); the checkpoint holds 10
        LoadSpec(name="padded", hf_keys=["padded.weight"], global_shape=(12, 4), mesh=ONE, origin_shape=(10, 4)),
        LoadSpec(name="norm", hf_keys=["norm.weight"], global_shape=(5,), mesh=ONE),
    ]
    return Layout(ONE, {s.name: s for s in specs}, {"fused": "float32", "padded": "float32", "norm": "float32"})


def _save_dcp(path: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    generator = torch.Generator().manual_seed(3)
    tensors = {"fused": torch.randn(6, 8, generator=generator), "padded": torch.randn(12, 4, generator=generator),
               "norm": torch.randn(5, generator=generator)}
    state = {"model": dict(tensors), "optim": {"step": torch.tensor(4.0)}}
    dcp.save(state, checkpoint_id=path, planner=DCPSavePlanner(), no_dist=True)
    return tensors


def _read_hf(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for name in sorted(set(index["weight_map"].values())):
        out.update(load_file(path / name))
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_to_hf_splits_trims_casts_in_small_batches(tmp_path: Path) -> None:
    tensors = _save_dcp(tmp_path / "dcp")
    config = tmp_path / "config.json"
    config.write_text("{}")
    result = dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", _layout(), dtype=torch.bfloat16,
                       fp32_keys_pattern=r"norm\.weight$", budget_bytes=100, max_shard_bytes=64,
                       config_files=[config], allow_pickle=True)
    got = _read_hf(tmp_path / "hf")
    want = {f"k{i}": tensors["fused"][:, 2 * i:2 * i + 2].to(torch.bfloat16) for i in range(4)}
    want["padded.weight"] = tensors["padded"][:10].to(torch.bfloat16)
    want["norm.weight"] = tensors["norm"]  # fp32 kept
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert result.batches == 3 and len(result.files) > 1 and result.keys == 6
    assert (tmp_path / "hf" / "config.json").is_file() and not (tmp_path / ".hf.incomplete").exists()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_to_hf_names_what_does_not_match(tmp_path: Path) -> None:
    _save_dcp(tmp_path / "dcp")
    layout = _layout()
    with pytest.raises(CheckpointError, match=r"'other\.fused': not in the checkpoint"):
        dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", layout, prefix="other.", allow_pickle=True)
    wrong = Layout(ONE, {"norm": LoadSpec(name="norm", hf_keys=["norm.weight"], global_shape=(6,), mesh=ONE)})
    with pytest.raises(CheckpointError, match=r"'model\.norm': saved global shape \(5,\), the layout says \(6,\)"):
        dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", wrong, allow_pickle=True)
    assert not (tmp_path / "hf").exists() and not (tmp_path / ".hf.incomplete").exists()


class _Tripwire:
    """Unpickling this creates the directory ``path``: a side effect that shows the pickle was loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def test_dcp_to_hf_refuses_the_pickle_without_opt_in(tmp_path: Path) -> None:
    (tmp_path / "dcp").mkdir()
    tripwire = tmp_path / "unpickled"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Tripwire(tripwire)))
    with pytest.raises(CheckpointError) as info:
        dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", _layout())
    message = str(info.value)
    for words in (str(tmp_path / "dcp" / ".metadata"), "is a Python pickle", "runs whatever code the file holds",
                  "dcp_to_hf(..., allow_pickle=True)"):
        assert words in message, message
    assert not tripwire.exists() and not (tmp_path / "hf").exists() and not (tmp_path / ".hf.incomplete").exists()

    # opted in, the pickle is loaded (the tripwire fires) and what it held is named as not DCP metadata
    with pytest.raises(CheckpointError, match=r"\.metadata does not hold DCP metadata: AttributeError"):
        dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", _layout(), allow_pickle=True)
    assert tripwire.is_dir() and not (tmp_path / "hf").exists()


def test_dcp_to_hf_without_metadata_is_not_a_dcp_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "dcp").mkdir()
    with pytest.raises(CheckpointError, match=r"dcp is not a DCP checkpoint: it has no \.metadata file"):
        dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", _layout(), allow_pickle=True)
