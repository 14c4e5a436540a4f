"""The cause a finding names is the one the bytes and the layout support, not one a key's name suggests.

Each broken tensor is built by hand the way the bug builds it (a ``torch.cat`` of the ranks' shards in the wrong
order, keys written under shifted names); the expected words are the project's, written out here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.debug.corpus import write
from workbench.debug import diff_checkpoints
from workbench.layout.layout_file import load_layout


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _layout(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "layout.toml"
    path.write_text(text)
    return path


def _only(report, key: str):
    (finding,) = report.by_key(key)
    return finding


# -- "gate/up halves swapped" only where gate and up are two halves on that dim ------------------------------------
GATE = "model.layers.0.mlp.experts.0.gate_proj.weight"
FSDP2 = """name = "fsdp2"
[mesh]
shape = [2]
dim_names = ["fsdp"]
[[param]]
name = "model.layers.0.mlp.experts.0.gate_proj.weight"
hf_keys = ["model.layers.0.mlp.experts.0.gate_proj.weight"]
global_shape = [8, 6]
placements = ["S(0)"]
"""


@pytest.mark.parametrize(("with_layout", "words"), [(False, "rank order reversed (S(0) over 2 ranks)"),
                                                     (True, "rank order reversed (S(0)@fsdp over 2 ranks)")])
def test_reversed_fsdp_shards_of_a_plain_gate_proj_are_a_rank_order_bug(tmp_path, with_layout, words) -> None:
    # a gate_proj has no up half: its 2 FSDP shards (rows 0:4 on rank 0, 4:8 on rank 1) concatenated in reverse
    good = _rand(8, 6)
    ref, bad = write(tmp_path / "ref", {GATE: good}), write(tmp_path / "bad", {GATE: torch.cat([good[4:], good[:4]])})
    layout = load_layout(_layout(tmp_path, FSDP2)) if with_layout else None
    finding = _only(diff_checkpoints(ref, bad, layout=layout), GATE)
    assert finding.transform == words and "gate" not in finding.hint, finding


QWEN = """name = "qwen-like"
[mesh]
shape = [2, 2]
dim_names = ["fsdp", "ep"]
[[param]]
name = "model.layers.0.mlp.experts.fused_w1w3"
hf_keys = ["model.layers.0.mlp.experts.{e}.gate_proj.weight", "model.layers.0.mlp.experts.{e}.up_proj.weight"]
keys_for = { e = 4 }
global_shape = [16, 4]
fused_dim = 0
placements = ["SS(0,2)", "S(0)"]
[[param]]
name = "model.layers.0.mlp.experts.fused_w2"
hf_keys = ["model.layers.0.mlp.experts.{e}.down_proj.weight"]
keys_for = { e = 4 }
global_shape = [16, 2]
fused_dim = 0
placements = ["SS(0,2)", "S(0)"]
"""


def _qwen_experts(seed: int = 0) -> dict[str, torch.Tensor]:
    shapes = {"gate_proj": (2, 4), "up_proj": (2, 4), "down_proj": (4, 2)}
    return {f"model.layers.0.mlp.experts.{e}.{p}.weight": _rand(*shape, seed=seed * 100 + 10 * e + i)
            for e in range(4) for i, (p, shape) in enumerate(shapes.items())}


def test_ep_ranks_in_reverse_name_the_ep_cut_not_gate_and_up(tmp_path) -> None:
    # 4 experts over ep=2: ep rank 0 holds experts 0, 1, rank 1 experts 2, 3; gathered rank 1 first, so expert e's
    # keys hold expert (e + 2) % 4's tensors, in the gate/up keys and in down_proj (no gate/up at all) alike
    good = _qwen_experts()
    bad = {k: good[k.replace(f"experts.{e}.", f"experts.{(e + 2) % 4}.")] for e in range(4) for k in good
           if f".experts.{e}." in k}
    report = diff_checkpoints(write(tmp_path / "ref", good), write(tmp_path / "bad", bad),
                              layout=load_layout(_layout(tmp_path, QWEN)))
    for param in ("fused_w1w3", "fused_w2"):
        finding = _only(report, f"model.layers.0.mlp.experts.{param}")
        assert finding.transform == "rank order reversed (S(0)@ep over 2 ranks)", finding


def test_the_layouts_fused_gate_up_keys_name_a_gate_up_swap_in_every_expert(tmp_path) -> None:
    good = _qwen_experts(seed=1)
    swapped = {k: good[k.replace("gate_proj", "up_proj") if "gate_proj" in k else k.replace("up_proj", "gate_proj")]
               for k in good}  # every expert's gate and up written into each other's key
    report = diff_checkpoints(write(tmp_path / "ref", good), write(tmp_path / "bad", swapped),
                              layout=load_layout(_layout(tmp_path, QWEN)))
    finding = _only(report, "model.layers.0.mlp.experts.fused_w1w3")
    assert finding.transform == "gate/up halves swapped in each of 4 groups (experts) (dim 0)", finding


STACKED = "model.layers.0.mlp.experts.gate_up_proj"


def test_stacked_experts_reversed_on_dim_0_are_not_gate_and_up(tmp_path) -> None:
    # [E, 2I, H] with E = 4 over ep=2 gathered rank 1 first: dim 0 holds experts, never gate and up
    good = _rand(4, 8, 6)
    report = diff_checkpoints(write(tmp_path / "ref", {STACKED: good}),
                              write(tmp_path / "bad", {STACKED: torch.cat([good[2:], good[:2]])}))
    assert _only(report, STACKED).transform == "rank order reversed (S(0) over 2 ranks)"


def test_a_gate_up_swap_that_is_also_two_shards_reversed_names_both(tmp_path) -> None:
    # [up; gate] on dim 1 of stacked experts, and [up; gate] of a 2-d gate_up under a layout cutting it in two over tp:
    # the same bytes as two shards concatenated in reverse, so both readings are named
    good = _rand(4, 8, 6)
    report = diff_checkpoints(write(tmp_path / "ref", {STACKED: good}),
                              write(tmp_path / "bad", {STACKED: torch.cat([good[:, 4:], good[:, :4]], dim=1)}))
    assert _only(report, STACKED).transform == ("gate/up halves swapped (dim 1) or rank order reversed (S(1) over 2 "
                                                "ranks): one map, two readings")
    key = "model.layers.0.mlp.gate_up_proj.weight"
    flat = _rand(8, 6, seed=2)
    tp2 = load_layout(_layout(tmp_path, FSDP2.replace("fsdp", "tp").replace(GATE, key)))
    report = diff_checkpoints(write(tmp_path / "ref2", {key: flat}),
                              write(tmp_path / "bad2", {key: torch.cat([flat[4:], flat[:4]])}), layout=tp2)
    finding = _only(report, key)
    assert finding.transform == ("gate/up halves swapped (dim 0) or rank order reversed (S(0)@tp over 2 ranks): one "
                                 "map, two readings")
    assert "cannot tell them apart" in finding.hint


# -- with a layout, the gather orders come from its cuts; no interleave it does not make ---------------------------
EP_FSDP = """name = "stacked-moe"
[mesh]
shape = [2, 2]
dim_names = ["fsdp", "ep"]
[[param]]
name = "model.layers.0.mlp.experts.gate_up_proj"
hf_keys = ["model.layers.0.mlp.experts.gate_up_proj"]
global_shape = [8, 4, 4]
placements = ["SS(0,2)", "S(0)"]
"""


def test_two_cuts_of_one_dim_gathered_in_the_wrong_mesh_order_are_named_from_the_layout(tmp_path) -> None:
    # ep cuts the 8 experts in two, fsdp each half in two: rank (fsdp f, ep e) holds experts 4e + 2f, 4e + 2f + 1.
    # Gathered fsdp-major (f0e0, f0e1, f1e0, f1e1) the blocks of 2 experts come as 0, 2, 1, 3
    good = _rand(8, 4, 4, seed=3)
    bad = torch.cat([good[0:2], good[4:6], good[2:4], good[6:8]])
    ref, act = write(tmp_path / "ref", {STACKED: good}), write(tmp_path / "bad", {STACKED: bad})
    finding = _only(diff_checkpoints(ref, act, layout=load_layout(_layout(tmp_path, EP_FSDP))), STACKED)
    assert finding.transform == ("shards gathered fsdp-major instead of ep-major (dim 0 cut by ep, fsdp, outer first, "
                                 "over 4 ranks)"), finding
    assert "ep-major" in finding.hint and "interleave" not in finding.hint


def test_no_interleaved_shard_is_claimed_on_a_dim_the_layout_cuts_without_one(tmp_path) -> None:
    # blocks 0, 2, 1, 3 of a tensor the layout cuts in two contiguous pieces over tp: the layout's contiguous cut
    # reassembled as if interleaved, never "an interleaved shard gathered as contiguous"
    key = "model.layers.0.self_attn.o_proj.weight"
    good = _rand(8, 6, seed=4)
    bad = torch.cat([good[0:2], good[4:6], good[2:4], good[6:8]])
    ref, act = write(tmp_path / "ref", {key: good}), write(tmp_path / "bad", {key: bad})
    tp2 = load_layout(_layout(tmp_path, FSDP2.replace("fsdp", "tp").replace(GATE, key)))
    finding = _only(diff_checkpoints(ref, act, layout=tp2), key)
    assert finding.transform == "contiguous shards assembled as interleaved (IS(0,2)@tp over 2 ranks)", finding
    assert "cut contiguously" in finding.hint and "gathered as contiguous" not in finding.transform
    assert "IS(0,2)" in _only(diff_checkpoints(ref, act), key).transform  # without a layout, that reading stays


@pytest.mark.parametrize("factor", [3, 4])
def test_a_contiguous_cut_reassembled_as_interleaved_is_named_with_the_layout_too(tmp_path, factor) -> None:
    # a layout with a plain S(0)@tp dropped this gather bug (it names no interleaved layout, only a wrong
    # reassembly) and named a "3x2 mesh read column-major" the layout does not have
    key, world = "model.layers.0.self_attn.o_proj.weight", 2
    rows, stripe = world * factor * 2, 2
    good = _rand(rows, 4)
    local = good.chunk(world)  # rank r holds rows r*rows/world:(r+1)*rows/world; reassembled as IS(0, factor)
    bad = torch.empty_like(good)
    for r in range(world):
        for j in range(factor):
            bad[(j * world + r) * stripe:(j * world + r + 1) * stripe] = local[r][j * stripe:(j + 1) * stripe]
    layout = load_layout(_layout(tmp_path, f'name = "tp"\n[mesh]\nshape = [{world}]\ndim_names = ["tp"]\n[[param]]\n'
                                           f'name = "{key}"\nhf_keys = ["{key}"]\nglobal_shape = [{rows}, 4]\n'
                                           'placements = ["S(0)"]\n'))
    report = diff_checkpoints(write(tmp_path / "ref", {key: good}), write(tmp_path / "bad", {key: bad}), layout=layout)
    finding = _only(report, key)
    assert finding.transform == f"contiguous shards assembled as interleaved (IS(0,{factor})@tp over 2 ranks)", finding
