"""Wrapper prefixes are stripped from parameter names as whole dotted components only: a name that merely contains
``module.`` (``text_module``, ``submodule``) was renamed (``text_module.weight`` -> ``text_weight``), so a save
wrote keys the model does not have and a load of the model's own keys missed them (a reviewer's repro)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench.layout.key_map import clean_name


@pytest.mark.parametrize(("raw", "clean"), [
    # names that only contain a wrapper's text keep it
    ("text_module.weight", "text_module.weight"),
    ("submodule.proj.weight", "submodule.proj.weight"),
    ("encoder.base_module.bias", "encoder.base_module.bias"),
    ("my_orig_mod.weight", "my_orig_mod.weight"),
    ("blocks.0.x_fsdp_wrapped_module.weight", "blocks.0.x_fsdp_wrapped_module.weight"),
    ("encoder.module.weight", "encoder.module.weight"),  # a child named "module", not DDP's wrapper
    # DDP / DataParallel: one leading "module."
    ("module.layer.weight", "layer.weight"),
    ("module.module.weight", "module.weight"),  # DDP around a model whose child is named "module"
    # torch.compile, FSDP1 and activation checkpointing wrap at any depth
    ("_orig_mod.layer.weight", "layer.weight"),
    ("layers.0._orig_mod.mlp.weight", "layers.0.mlp.weight"),
    ("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.weight",
     "layers.0.mlp.weight"),
    ("_orig_mod.module.text_module.weight", "text_module.weight"),  # compile(DDP(model))
    ("module._orig_mod.text_module.weight", "text_module.weight"),  # DDP(compile(model))
])
def test_clean_name_strips_wrapper_components_only(raw: str, clean: str) -> None:
    assert clean_name(raw) == clean


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.text_module = torch.nn.Linear(4, 4, bias=False)
        self.head = torch.nn.Linear(4, 2, bias=False)


class _Wrapped(torch.nn.Module):
    """What DDP's names look like: the model under ``module``."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.module = net


def _saved_keys(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_a_model_with_a_module_named_like_a_wrapper_saves_and_loads_its_own_keys(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = _Net()
    own = {k: v.detach().clone() for k, v in net.state_dict().items()}
    (tmp_path / "own").mkdir()
    save_file(own, str(tmp_path / "own" / "model.safetensors"))  # what safetensors / transformers write
    target = _Net()
    report = wb.load_hf(target, tmp_path / "own")
    assert report.ok and torch.equal(target.text_module.weight.detach(), own["text_module.weight"])
    wb.save_hf(_Wrapped(net), tmp_path / "saved")
    saved = _saved_keys(tmp_path / "saved")
    assert sorted(saved) == ["head.weight", "text_module.weight"]
    assert torch.equal(saved["text_module.weight"], own["text_module.weight"])


def test_ddp_prefix_goes_only_when_every_name_has_it() -> None:
    from workbench.layout.key_map import clean_names

    ddp = ["module.layer.weight", "module._orig_mod.head.weight", "module.module.weight"]
    assert list(clean_names(ddp).values()) == ["layer.weight", "head.weight", "module.weight"]
    own = ["module.weight", "head.weight"]  # a model whose own child is named "module", beside another
    assert clean_names(own) == {"module.weight": "module.weight", "head.weight": "head.weight"}
    assert clean_names(["_orig_mod.module.w", "_orig_mod.module.v"]) == {"_orig_mod.module.w": "w",
                                                                          "_orig_mod.module.v": "v"}


class _WithChildNamedModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(4, 4, bias=False)  # an adapter, a block: a child that happens to be "module"
        self.head = torch.nn.Linear(4, 2, bias=False)


def test_a_model_whose_own_child_is_named_module_saves_and_loads_its_own_keys(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = _WithChildNamedModule()
    want = {k: v.detach().clone() for k, v in net.state_dict().items()}
    wb.save_hf(net, tmp_path / "saved")
    saved = _saved_keys(tmp_path / "saved")
    assert sorted(saved) == ["head.weight", "module.weight"]  # the model's own state_dict keys
    assert all(torch.equal(saved[k], want[k]) for k in want)
    target = _WithChildNamedModule()
    assert wb.load_hf(target, tmp_path / "saved").ok
    assert torch.equal(target.module.weight.detach(), want["module.weight"])
    wb.save_hf(_Wrapped(_WithChildNamedModule()), tmp_path / "wrapped")  # DDP around it: its names, as HF has them
    assert sorted(_saved_keys(tmp_path / "wrapped")) == ["head.weight", "module.weight"]
