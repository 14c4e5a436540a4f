"""An index shifted as a whole (``layers.N`` saved as ``layers.N+1``, experts numbered from 1) is one finding, and a
rename found by names and shapes is claimed only where the bytes do not say otherwise.

The broken checkpoints are written under hand-shifted names; the expected words are the project's, written out here.
"""

from __future__ import annotations

import pytest
import torch

from tests.debug.corpus import write
from workbench.debug import diff_checkpoints
from workbench.debug.renames import find_renames


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _only(report, key: str):
    (finding,) = report.by_key(key)
    return finding


def _layers(n_layers: int = 3, n_experts: int = 3) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": _rand(8, 4, seed=99)}
    for layer in range(n_layers):
        out[f"model.layers.{layer}.input_layernorm.weight"] = _rand(4, seed=10 * layer)
        for e in range(n_experts):
            for i, p in enumerate(("gate_proj", "up_proj")):
                seed = 1000 + 100 * layer + 10 * e + i
                out[f"model.layers.{layer}.mlp.experts.{e}.{p}.weight"] = _rand(2, 4, seed=seed)
    return out


def _renumbered(tensors: dict[str, torch.Tensor], component: str, by: int) -> dict[str, torch.Tensor]:
    def name(key: str) -> str:
        parts = key.split(".")
        if component in parts:
            at = parts.index(component) + 1
            parts[at] = str(int(parts[at]) + by)
        return ".".join(parts)

    return {name(k): v for k, v in tensors.items()}


@pytest.mark.parametrize(("component", "key", "transform", "count"), [
    ("layers", "model.layers.{1..3}", "every layer index is shifted by +1: each key holds the tensor of the index "
     "before it", 3 * 7),
    ("experts", "model.layers.{0..2}.mlp.experts.{1..3}", "every expert index is shifted by +1: each key holds the "
     "tensor of the index before it", 3 * 6),
])
def test_an_index_shifted_as_a_whole_is_one_finding(tmp_path, component, key, transform, count) -> None:
    # layers.N saved as layers.N+1 (a conversion loop off by one); experts numbered from 1: not renames of the first
    # index to the last one, nor each key "holding another key's tensor"
    good = _layers()
    report = diff_checkpoints(write(tmp_path / "ref", good), write(tmp_path / "bad", _renumbered(good, component, 1)))
    (finding,) = report.findings
    assert (finding.kind, finding.key, finding.transform) == ("renamed_key", key, transform), report.to_text()
    assert finding.evidence["keys"] == finding.evidence["same_bytes"] == count
    assert "expected_key" not in finding.evidence and report.stats["equal"] == len(good)


def test_a_shifted_key_whose_bytes_differ_is_compared_with_the_key_it_stands_for(tmp_path) -> None:
    good = _layers()
    bad = _renumbered(good, "layers", 1)
    bad["model.layers.3.input_layernorm.weight"] = good["model.layers.2.input_layernorm.weight"] + 1
    report = diff_checkpoints(write(tmp_path / "ref", good), write(tmp_path / "bad", bad))
    assert report.kinds() == {"renamed_key": 1, "value_mismatch": 1}, report.to_text()
    assert _only(report, "model.layers.{1..3}").evidence["same_bytes"] == 3 * 7 - 1
    # compared with layer 2's tensor, which it is off by 1 (bfloat16 rounding aside), not with layer 3's
    assert _only(report, "model.layers.3.input_layernorm.weight").evidence["max_abs_diff"] == pytest.approx(1, abs=0.01)


def test_a_rename_is_substituted_where_its_rule_was_learned() -> None:
    # the rule ".0." -> ".8." was learned on the 4th component: layers.8 must keep its own index
    missing = ["a.0.b.0.w", "a.8.b.0.w"]
    unexpected = ["a.0.b.8.w", "a.8.b.8.w"]
    found = {r.actual: r.expected for r in find_renames(missing, unexpected, lambda e, a: True)}
    assert found == {"a.0.b.8.w": "a.0.b.0.w", "a.8.b.8.w": "a.8.b.0.w"}


def test_a_rename_the_bytes_contradict_is_not_claimed(tmp_path) -> None:
    # layers 0, 1 saved as 1, 7: by names and shapes layers.7 "is layers.0 renamed", but it holds layer 1's tensor
    good = {k: v for k, v in _layers(n_layers=2).items() if ".layers." in k}
    bad = {k.replace(".layers.1.", ".layers.7.").replace(".layers.0.", ".layers.1."): v for k, v in good.items()}
    report = diff_checkpoints(write(tmp_path / "ref", good), write(tmp_path / "bad", bad))
    assert "renamed_key" not in report.kinds(), report.to_text()
    stray = _only(report, "model.layers.7.input_layernorm.weight")
    assert stray.kind == "unexpected_key" and stray.evidence["holds"] == "model.layers.1.input_layernorm.weight"
    assert "do not drop it" in stray.hint


def test_a_rename_whose_bytes_only_differ_is_still_named(tmp_path) -> None:
    # "model." dropped and the values of another step: the bytes match no reference key, so the names decide
    good = _layers(n_layers=1)
    later = {k.removeprefix("model."): v + 1 for k, v in good.items()}
    report = diff_checkpoints(write(tmp_path / "ref", good), write(tmp_path / "bad", later))
    assert report.kinds() == {"renamed_key": len(good), "value_mismatch": len(good)}, report.to_text()
