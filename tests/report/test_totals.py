"""Per-rank totals, outliers and uneven shards, checked against direct per-parameter sums."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from workbench.layout.layout_file import load_layout
from workbench.report.totals import key_bytes, outlier_ranks, rank_totals, uneven_shards

ROOT = Path(__file__).resolve().parents[2]
TOY = load_layout(ROOT / "sample_meshes" / "toy_expert_tp.toml")


def _direct(layout, rank):
    held = sum(math.prod(layout[n].local_shape(rank)) * layout.dtype(n).itemsize for n in layout)
    read = sum(math.prod(r.sizes) * layout.dtype(n).itemsize for n in layout for r in layout[n].key_regions(rank))
    return held, read


@pytest.mark.parametrize("sample", ["toy_expert_tp", "gpt_oss_120b"])
def test_totals_equal_direct_sums(sample: str) -> None:
    layout = TOY if sample == "toy_expert_tp" else load_layout(ROOT / "sample_meshes" / f"{sample}.toml")
    totals = rank_totals(layout)
    assert sorted(totals) == list(layout.mesh.all_ranks())
    for rank in (0, 1, layout.mesh.size - 1):
        assert (totals[rank].bytes_held, totals[rank].bytes_read) == _direct(layout, rank)


def test_toy_rank_5() -> None:
    # rank 5 (fsdp=1, ep=0, tp=1): embed 0 rows (10 over 8: 2,2,2,2,2,0,0,0), q_proj 1 row of 4, w1w3 2x4,
    # w2 2x2 (bf16), norm 1 float32 element: 0 + 8 + 16 + 8 + 4 = 36 B
    t = rank_totals(TOY, [5])[5]
    assert (t.bytes_held, t.empty_tensors, t.tensors, t.coordinate) == (36, 1, 4, (1, 0, 1))


def test_outliers_and_empty() -> None:
    out = outlier_ranks(rank_totals(TOY))
    # ranks 0-4 hold an embedding chunk (16 B) on top of 36 B; 5 holds 36 B; 6, 7 also lose their q_proj row
    assert (out.most, out.most_value) == ((0, 1, 2, 3, 4), 52)
    assert (out.least, out.least_value, out.empty) == ((6, 7), 28, ())


def test_uneven_shards_of_the_toy() -> None:
    uneven = {u.name: u for u in uneven_shards(TOY)}
    # embed: largest shard 2 rows x 4 x 2 B = 16 B on 8 ranks = 128 B reserved for 80 B held: 48 B wasted
    embed = uneven["model.embed_tokens.weight"]
    assert (embed.max_bytes, embed.waste_bytes, embed.empty_ranks) == (16, 48, 3)
    assert set(uneven) == {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"}


def test_key_bytes() -> None:
    sizes = key_bytes(TOY)
    assert sizes["model.layers.0.mlp.experts.1.up_proj.weight"] == 4 * 4 * 2  # 4 rows x 4 cols bf16
    assert sum(sizes.values()) == 336  # the sample table's total bytes
