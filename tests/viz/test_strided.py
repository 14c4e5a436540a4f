"""``strided_shard`` is torch's FSDP2 placement, and layouts built with it are the ones FSDP2 makes."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Shard

from workbench import _compat
from workbench.errors import LayoutError
from workbench.layout import InterleavedShard, LoadSpec
from workbench.layout.strided import strided_shard
from workbench.mesh import MeshSpec


def test_is_torchs_strided_shard() -> None:
    placement = strided_shard(0, 4)
    assert _compat.is_strided_shard(placement)
    assert _compat.strided_split_factor(placement) == 4
    assert placement == _compat.make_strided_shard(0, 4)


def test_expert_tp_rows() -> None:
    mesh = MeshSpec((2, 2, 2), ("fsdp", "ep", "tp"))
    spec = LoadSpec.from_placements(
        "w", "w", (16, 4), mesh, [strided_shard(0, 4), Shard(0), InterleavedShard(0, num_local_stripes=2)]
    )
    rows = {r: [g for g, n in spec.segments(r)[0] for g in range(g, g + n)] for r in (0, 4, 5)}
    assert rows == {0: [0, 1], 4: [4, 5], 5: [6, 7]}  # the docstring's table, from DESIGN.md's example


@pytest.mark.parametrize(("dim", "factor", "match"), [(-1, 2, "dim must be"), (0, 0, "split_factor must"),
                                                      (0, True, "split_factor must")])
def test_bad_arguments(dim, factor, match) -> None:
    with pytest.raises(LayoutError, match=match):
        strided_shard(dim, factor)
