"""The tensor operations of one unshard step: pack, unpack, merge, merge_in_place, finalize, split_keys."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

from tests.run.support import spec
from workbench.errors import PlanError
from workbench.layout import InterleavedShard
from workbench.mesh import MeshSpec
from workbench.plan.policy import SavePolicy
from workbench.plan.save_plan import plan_hf_save
from workbench.plan.schedule import GatherItem
from workbench.run.unshard_ops import finalize, merge, merge_in_place, pack, split_keys, unpack

T = torch.tensor


def item(name: str, dim: int, factor: int, padded: tuple[int, ...], merged: tuple[int, ...]) -> GatherItem:
    return GatherItem(name=name, step=0, dim=dim, interleave_factor=factor, padded_shape=padded, merged_shape=merged,
                      bound_numel=0)


def test_pack_zero_pads_each_tensor_to_its_item_and_concatenates() -> None:
    items = [item("a", 0, 1, (2, 2), (3, 2)), item("b", 1, 1, (1, 3), (1, 5))]
    flat = pack([T([[1.0, 2.0]]), T([[3.0, 4.0, 5.0]])], items, torch.float32)
    assert torch.equal(flat, T([1.0, 2.0, 0.0, 0.0, 3.0, 4.0, 5.0]))
    empty = pack([torch.zeros(0, 2)], [item("e", 0, 1, (1, 2), (1, 2))], torch.float32)
    assert torch.equal(empty, torch.zeros(2))  # an empty rank still sends a full (zero) chunk


def test_unpack_gives_chunks_per_item_per_rank() -> None:
    items = [item("a", 0, 1, (2,), (4,)), item("b", 0, 1, (1, 2), (2, 2))]
    gathered = torch.arange(8.0)  # rank 0: a=[0,1], b=[[2,3]]; rank 1: a=[4,5], b=[[6,7]]
    chunks = unpack(gathered, items, world=2)
    assert [c.tolist() for c in chunks[0]] == [[0.0, 1.0], [4.0, 5.0]]
    assert [c.tolist() for c in chunks[1]] == [[[2.0, 3.0]], [[6.0, 7.0]]]
    assert chunks[0][1].data_ptr() == gathered[4:].data_ptr()  # views, no copies
    with pytest.raises(PlanError, match="gathered buffer has 7 elements, expected 2 x 3"):
        unpack(torch.zeros(7), [item("a", 0, 1, (3,), (5,))], world=2)


@pytest.mark.parametrize(
    ("chunks", "dim", "factor", "merged", "expected"),
    [
        # contiguous, uneven: 2+2+(1 real + 1 pad) trimmed to 5
        ([[0, 1], [2, 3], [4, -9]], 0, 1, (5,), [0, 1, 2, 3, 4]),
        # interleave W=2 F=2 (run 1): [rank][run] -> [run][rank]
        ([[0, 2], [1, 3]], 0, 2, (4,), [0, 1, 2, 3]),
        # interleave W=2 F=3 (run 2)
        ([[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]], 0, 3, (12,), list(range(12))),
        # interleave W=3 F=2 (run 1)
        ([[0, 3], [1, 4], [2, 5]], 0, 2, (6,), list(range(6))),
    ],
)
def test_merge_undoes_one_cut(chunks, dim, factor, merged, expected) -> None:
    out = merge([T(c, dtype=torch.float32) for c in chunks], item("x", dim, factor, (len(chunks[0]),), merged))
    assert out.tolist() == expected


def test_merge_on_dim_1_with_padding() -> None:
    chunks = [T([[0.0, 1], [5, 6]]), T([[2.0, 3], [7, 8]]), T([[4.0, -1], [9, -1]])]
    out = merge(chunks, item("x", 1, 1, (2, 2), (2, 5)))
    assert torch.equal(out, torch.arange(10.0).reshape(2, 5)) and out.is_contiguous()


def test_merge_in_place_only_for_a_contiguous_dim0_cut() -> None:
    gathered = T([0.0, 1, 2, 3, 4, -1])
    view = merge_in_place(gathered, item("x", 0, 1, (2,), (5,)), world=3)
    assert view.tolist() == [0, 1, 2, 3, 4] and view.data_ptr() == gathered.data_ptr()
    assert merge_in_place(gathered, item("x", 1, 1, (1, 2), (1, 6)), world=3) is None
    assert merge_in_place(gathered, item("x", 0, 2, (2,), (6,)), world=3) is None


def test_finalize_checks_the_runtime_shape_and_trims_padding() -> None:
    mesh = MeshSpec((2,), ("fsdp",))
    plan = plan_hf_save(spec("w", "w", (4, 3), mesh, [Shard(0)], origin_shape=(3, 2)), 0)
    out = finalize(torch.arange(12.0).reshape(4, 3), plan)
    assert torch.equal(out, T([[0.0, 1], [3, 4], [6, 7]])) and out.is_contiguous()
    with pytest.raises(PlanError, match=r"parameter 'w', rank 0: after unsharding the tensor has shape \(3, 3\), "
                                        r"expected \(4, 3\)"):
        finalize(torch.zeros(3, 3), plan)


def test_split_keys_on_dim_0_and_dim_1_with_per_key_dtypes() -> None:
    mesh = MeshSpec((1,), ("m",))
    rows = plan_hf_save(spec("w", ["a", "b", "c"], (3, 2), mesh, [Shard(0)], fused_dim=0),
        0, runtime_dtype=torch.float32, dtype=torch.bfloat16, fp32_keys_pattern="^b$")
    pieces = split_keys(torch.arange(6.0).reshape(3, 2), rows)
    assert list(pieces) == ["a", "b", "c"]
    assert [p.dtype for p in pieces.values()] == [torch.bfloat16, torch.float32, torch.bfloat16]
    assert pieces["b"].tolist() == [[2.0, 3.0]]
    cols = plan_hf_save(spec("qkv", ["q", "k"], (2, 4), mesh, [Shard(1)], fused_dim=1), 0)
    pieces = split_keys(torch.arange(8.0).reshape(2, 4), cols)
    assert pieces["q"].tolist() == [[0.0, 1.0], [4.0, 5.0]] and pieces["k"].tolist() == [[2.0, 3.0], [6.0, 7.0]]
    assert all(p.is_contiguous() for p in pieces.values())


def test_split_keys_of_a_preserved_interleave_names_the_local_keys() -> None:
    mesh = MeshSpec((2,), ("etp",))
    plan = plan_hf_save(spec("w", ["k0", "k1", "k2", "k3"], (8,), mesh, [InterleavedShard(0, 2)], fused_dim=0),
        1, SavePolicy.preserve("etp"))
    pieces = split_keys(T([2.0, 3, 6, 7]), plan)
    assert {k: v.tolist() for k, v in pieces.items()} == {"k1": [2.0, 3.0], "k3": [6.0, 7.0]}
