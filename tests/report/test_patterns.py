"""Grouping names by layer pattern, with exceptions, and the layer structure of a real model."""

from __future__ import annotations

from pathlib import Path

from workbench.layout.layout_file import load_layout
from workbench.report.patterns import compress_indices, group_by_pattern, index_spans, render_pattern, split_template

ROOT = Path(__file__).resolve().parents[2]


def test_split_template_keeps_digits_inside_words() -> None:
    assert split_template("model.layers.3.mlp.experts.17.w1w3") == ("model.layers.{}.mlp.experts.{}.w1w3", (3, 17))
    assert split_template("model.layers.3.self_attn.q_a_proj.weight")[0] == "model.layers.{}.self_attn.q_a_proj.weight"
    assert split_template("lm_head.weight") == ("lm_head.weight", ())


def test_compress_indices() -> None:
    assert compress_indices([0, 1, 2, 61]) == "0..2,61"
    assert compress_indices([5]) == "5"
    assert compress_indices([0, 1, 3, 4, 5, 9]) == "0,1,3..5,9"  # two in a row stay a list


def test_layers_group_into_one_pattern() -> None:
    names = [f"model.layers.{i}.input_layernorm.weight" for i in range(61)] + ["model.norm.weight"]
    groups = group_by_pattern(names)
    assert [g.pattern for g in groups] == ["model.layers.{0..60}.input_layernorm.weight", "model.norm.weight"]
    assert len(groups[0]) == 61


def test_two_numbers_product_and_not() -> None:
    product = [f"m.layers.{layer}.experts.{e}.w" for layer in range(3, 62) for e in range(256)]
    assert group_by_pattern(product)[0].pattern == "m.layers.{3..61}.experts.{0..255}.w"
    # the last layer has fewer experts: not a product, so the blocks are named apart
    ragged = [f"m.layers.{layer}.experts.{e}.w" for layer in range(2) for e in range(4)] + ["m.layers.2.experts.0.w"]
    assert render_pattern("m.layers.{}.experts.{}.w", [split_template(n)[1] for n in ragged]) == (
        "m.layers.{0,1}.experts.{0..3}.w + m.layers.2.experts.0.w"
    )


def test_exceptions_are_the_minority_values() -> None:
    names = [f"model.layers.{i}.mlp.w" for i in range(62)]
    dense = {0, 1, 2, 61}
    groups = group_by_pattern(names, key=lambda n: "dense" if int(n.split(".")[2]) in dense else "moe")
    (group,) = groups  # one pattern, named once
    assert (group.pattern, group.value) == ("model.layers.{3..60}.mlp.w", "moe")
    assert [(e.pattern, e.value) for e in group.exceptions] == [("model.layers.{0..2,61}.mlp.w", "dense")]
    assert group.full_pattern == "model.layers.{0..61}.mlp.w"
    assert len(group.all_names) == 62


def test_deepseek_layer_structure() -> None:
    # from the sample's header: layers 0-2 dense MLP, 3-60 MoE, 61 the MTP layer (MoE plus its own modules)
    layout = load_layout(ROOT / "sample_meshes" / "deepseek_v3_671b.toml")
    (span,) = index_spans(layout.specs)
    assert span.prefix == "model.layers" and span.indices == tuple(range(62))
    partial = dict(span.partial)
    assert set(partial[(0, 1, 2)]) == {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
    assert "mlp.experts.fused_w1w3" in partial[tuple(range(3, 62))]
    assert set(partial[(61,)]) == {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                                   "shared_head.norm.weight", "shared_head.head.weight"}
