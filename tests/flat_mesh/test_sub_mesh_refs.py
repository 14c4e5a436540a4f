"""sub_mesh_refs: which root mesh dims a (flattened) sub-mesh dim spans, read from its ranks alone."""

from __future__ import annotations

import pytest

from workbench.layout.model_layout import sub_mesh_refs
from workbench.mesh import MeshSpec

CASES = [
    # torchtitan's dp_shard_cp over (dp_shard, cp), size-1 tp ignored
    (MeshSpec((2, 2, 1), ("dp_shard", "cp", "tp")), MeshSpec((4,), ("dp_shard_cp",)), 3, (("dp_shard", "cp"),)),
    # HSDP over a flattened shard dim: the replica dim keeps its name
    (MeshSpec((2, 1, 2), ("rep", "shard", "cp")), MeshSpec((2, 2), ("rep", "shard_cp")), 2, ("rep", ("shard", "cp"))),
    # a name that spells no dims: found by ranks (rank 1's group along "a" of a 2x2 mesh is 1, 3)
    (MeshSpec((2, 2), ("a", "b")), MeshSpec((2,), ("x",), (1, 3)), 1, ("a",)),
    # non-adjacent dims flattened, found by ranks: (a, c) through rank 0 of a 2x3x2 mesh is 0, 1, 6, 7
    (MeshSpec((2, 3, 2), ("a", "b", "c")), MeshSpec((4,), ("ac",), (0, 1, 6, 7)), 0, (("a", "c"),)),
    # a sub-mesh in the root's own dim names
    (MeshSpec((2, 2), ("ep", "etp")), MeshSpec((2,), ("etp",), (2, 3)), 3, ("etp",)),
]


@pytest.mark.parametrize(("root", "sub", "rank", "refs"), CASES)
def test_sub_mesh_refs(root: MeshSpec, sub: MeshSpec, rank: int, refs: tuple) -> None:
    assert sub_mesh_refs(root, sub, rank) == refs


def test_ranks_that_no_root_dims_explain_give_none() -> None:
    root = MeshSpec((2, 2), ("a", "b"))
    assert sub_mesh_refs(root, MeshSpec((2,), ("diag",), (0, 3)), 0) is None
