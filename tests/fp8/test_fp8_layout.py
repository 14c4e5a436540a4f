"""FP8 block scales follow their weight's cuts (pure layout math), and block dequantization."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from workbench.errors import LayoutError
from workbench.io.hf.fp8 import dequantize_blocks
from workbench.layout import InterleavedShard
from workbench.layout.fp8 import check_scale_spec, scale_spec, with_fp8_scales
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec

FSDP3 = MeshSpec((3,), ("fsdp",))
EP_ETP = MeshSpec((2, 2), ("ep", "etp"))


def _spec(shape, mesh, placements, keys=("w.weight",), fused_dim=None, origin=None) -> LoadSpec:
    return LoadSpec.from_placements("w", list(keys), shape, mesh, placements, fused_dim=fused_dim, origin_shape=origin)


@pytest.mark.parametrize(("weight", "block", "scale_rows"), [
    # 12 rows over 3 ranks: 4 rows = one block each
    (_spec((12, 8), FSDP3, [Shard(0)]), (4, 4), {0: ((0, 1),), 1: ((1, 1),), 2: ((2, 1),)}),
    # ragged tail: 10 rows over 3 ranks are 4, 4, 2; the last block is short and whole on rank 2
    (_spec((10, 8), FSDP3, [Shard(0)]), (4, 4), {0: ((0, 1),), 1: ((1, 1),), 2: ((2, 1),)}),
    # expert TP: 64 rows, EP2 then an interleave of 4 stripes over etp=2; runs of 4 rows = 1 block, 4 per rank
    (_spec((64, 8), EP_ETP, [Shard(0), InterleavedShard(0, 4)]), (4, 4),
     {0: ((0, 1), (2, 1), (4, 1), (6, 1)), 1: ((1, 1), (3, 1), (5, 1), (7, 1)),
      2: ((8, 1), (10, 1), (12, 1), (14, 1)), 3: ((9, 1), (11, 1), (13, 1), (15, 1))}),
    # replicated over 3 ranks: each holds every block
    (_spec((4, 8), FSDP3, [Replicate()]), (4, 4), {0: ((0, 1),), 1: ((0, 1),), 2: ((0, 1),)}),
])
def test_scale_rows_are_the_blocks_of_the_weight_rows(weight, block, scale_rows) -> None:
    scale = scale_spec(weight, block=block)
    assert scale.hf_keys == ("w.weight_scale_inv",) and scale.name == "w_scale_inv"
    for rank, rows in scale_rows.items():
        assert scale.segments(rank)[0] == rows, rank


def test_padded_weight_gives_a_padded_scale_with_its_visible_grid() -> None:
    scale = scale_spec(_spec((16, 8), FSDP3, [Replicate()], origin=(10, 8)), block=(4, 4))
    assert scale.global_shape == (4, 2) and scale.visible_shape == (3, 2)


@pytest.mark.parametrize(("weight", "block", "message"), [
    # 12 rows over 2 ranks: rank 0 ends at row 6, inside block 1 (rows 4:8)
    (_spec((12, 8), MeshSpec((2,), ("fsdp",)), [Shard(0)]), (4, 4),
     r"FP8 weight 'w\.weight': rank 0 is cut at index 6 of dim 0, inside scale block 1 \(indices 4:8\)"),
    # columns: 8 over 3 ranks are cut at 3 and 6
    (_spec((4, 8), FSDP3, [Shard(1)]), (4, 4), r"rank 0 is cut at index 3 of dim 1, inside scale block 0"),
    # interleaved runs of 2 rows in blocks of 4
    (_spec((32, 8), EP_ETP, [Shard(0), InterleavedShard(0, 4)]), (4, 4), r"'w\.weight'.*scale grid \(8, 2\)"),
    # fused keys of 6 rows each cannot be whole blocks of 4
    (_spec((12, 8), FSDP3, [Replicate()], keys=("a", "b"), fused_dim=0), (4, 4),
     r"2 fused keys is 6 long on dim 0, not a whole number of 4-wide scale blocks"),
])
def test_a_cut_inside_a_block_is_an_error_naming_key_block_and_rank(weight, block, message) -> None:
    with pytest.raises(LayoutError, match=message):
        scale_spec(weight, block=block)


def test_a_scale_held_with_other_cuts_than_its_weight_is_refused() -> None:
    mesh = MeshSpec((2,), ("fsdp",))
    weight = _spec((8, 8), mesh, [Shard(0)])
    replicated = LoadSpec.from_placements("w_scale_inv", ["w.weight_scale_inv"], (2, 2), mesh, [Replicate()])
    with pytest.raises(LayoutError, match=r"rank 0 holds scale blocks \[0:2\] on dim 0, but its weight rows "
                                          r"\[0:4\] need blocks \[0:1\]"):
        check_scale_spec(weight, replicated, (4, 4))
    layout = Layout(mesh, {"w": weight, "w_scale_inv": replicated}, {"w": "float8_e4m3fn"})
    with pytest.raises(LayoutError, match="holds scale blocks"):
        with_fp8_scales(layout, block=(4, 4))


def test_with_fp8_scales_adds_a_float32_scale_after_each_float8_weight() -> None:
    mesh = MeshSpec((2,), ("fsdp",))
    specs = {"w": _spec((8, 8), mesh, [Shard(0)]),
             "norm": LoadSpec.from_placements("norm", ["norm"], (8,), mesh, [Replicate()])}
    layout = with_fp8_scales(Layout(mesh, specs, {"w": "float8_e4m3fn"}), block=(4, 4))
    assert list(layout.specs) == ["w", "w_scale_inv", "norm"]
    assert layout.dtypes["w_scale_inv"] == "float32"
    assert layout.specs["w_scale_inv"].segments(1)[0] == ((1, 1),)


def test_dequantize_blocks_matches_a_block_by_block_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(10, 7, generator=generator) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, generator=generator) + 0.01
    want = torch.empty(10, 7, dtype=torch.bfloat16)
    for bi in range(3):  # blocks of 4 x 4; the last row block has 2 rows, the last column block 3 columns
        for bj in range(2):
            rows, cols = slice(4 * bi, 4 * bi + 4), slice(4 * bj, 4 * bj + 4)
            want[rows, cols] = (weight[rows, cols].float() * scale[bi, bj]).to(torch.bfloat16)
    assert torch.equal(dequantize_blocks(weight, scale, (4, 4)), want)
    with pytest.raises(LayoutError, match=r"needs scales of shape \(3, 2\), got \(2, 2\)"):
        dequantize_blocks(weight, scale[:2], (4, 4))
