"""Placement normalization: DTensor placements -> ShardDescriptors in forward (application) order."""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from workbench import _compat
from workbench.errors import LayoutError
from workbench.layout import InterleavedShard, ShardDescriptor, normalize_placements
from workbench.mesh import MeshSpec

S, R, IS = Shard, Replicate, InterleavedShard


def SS(dim: int, split_factor: int) -> Any:
    return _compat.make_strided_shard(dim, split_factor)


CASES = [
    # (mesh shape, mesh dim names, placements, tensor ndim, expected descriptors), one edge per row
    pytest.param((4,), ("tp",), (S(0),), 2, ["S(0)@tp"], id="one-shard"),
    pytest.param((2, 3), ("a", "b"), (S(0), S(0)), 1, ["S(0)@a", "S(0)@b"], id="shards-stack-left-to-right"),
    pytest.param((2, 3), ("a", "b"), (S(0), S(1)), 2, ["S(0)@a", "S(1)@b"], id="cuts-on-two-tensor-dims"),
    pytest.param((2, 3), ("a", "b"), (S(1), S(0)), 2, ["S(1)@a", "S(0)@b"], id="mesh-order-across-dims"),
    pytest.param((2, 3), ("a", "b"), (R(), S(0)), 1, ["S(0)@b"], id="replicate-cuts-nothing"),
    pytest.param((2, 3), ("a", "b"), (R(), R()), 3, [], id="fully-replicated"),
    pytest.param((2, 2), ("fsdp", "tp"), (SS(0, 2), S(0)), 2, ["S(0)@tp", "S(0)@fsdp"], id="fsdp-over-tp-applied-last"),
    pytest.param(
        (2, 2, 2), ("fsdp", "ep", "tp"), (SS(0, 4), S(0), IS(0, 2)), 2,
        ["S(0)@ep", "IS(0,2)@tp", "S(0)@fsdp"], id="fsdp-over-expert-tp",
    ),
    pytest.param(
        (2, 2, 2), ("rep", "fsdp", "tp"), (R(), SS(0, 2), S(0)), 2, ["S(0)@tp", "S(0)@fsdp"],
        id="hsdp-replicate-outer-strided-next",
    ),
    pytest.param((2, 4), ("rep", "fsdp"), (R(), S(0)), 2, ["S(0)@fsdp"], id="hsdp-without-tp"),
    pytest.param((2, 2), ("fsdp", "tp"), (S(0), S(1)), 2, ["S(0)@fsdp", "S(1)@tp"], id="fsdp-plain-when-tp-cuts-dim1"),
    pytest.param((2,), ("a",), (SS(0, 3),), 1, ["IS(0,3)@a"], id="bare-strided-is-interleave"),
    pytest.param((2, 2), ("a", "b"), (S(0), SS(0, 2)), 1, ["S(0)@a", "IS(0,2)@b"], id="torch-doc-S-then-SS"),
    pytest.param(
        (2, 2), ("ep", "tp"), (S(0), SS(0, 2)), 1, ["S(0)@ep", "IS(0,2)@tp"],
        id="interleaved-shard-rebuilt-as-bare-strided",
    ),
    pytest.param((2, 2), ("a", "b"), (IS(0, 2), S(0)), 1, ["IS(0,2)@a", "S(0)@b"], id="IS-never-deferred"),
    pytest.param((2, 2), ("a", "b"), (SS(0, 2), S(0)), 1, ["S(0)@b", "S(0)@a"], id="same-layout-bare-SS-deferred"),
    pytest.param((3, 2), ("a", "b"), (SS(0, 5), S(0)), 1, ["IS(0,5)@a", "S(0)@b"], id="unexplained-factor-interleaves"),
    pytest.param(
        (2, 2, 3), ("f", "a", "b"), (SS(0, 2), S(0), S(0)), 1, ["S(0)@a", "S(0)@f", "S(0)@b"],
        id="strided-explained-by-first-right-cut-only",
    ),
    pytest.param(
        (2, 3, 2), ("f", "a", "b"), (SS(1, 2), S(0), S(1)), 2, ["S(0)@a", "S(1)@b", "S(1)@f"],
        id="deferred-cut-after-all-non-deferred",
    ),
    pytest.param(
        (2, 2, 3), ("f", "a", "b"), (SS(0, 6), S(0), S(0)), 1, ["S(0)@a", "S(0)@b", "S(0)@f"],
        id="fsdp-factor-is-product-of-two-cuts",
    ),
    pytest.param((2,), ("a",), (SS(0, 1),), 1, ["S(0)@a"], id="split-factor-one-is-plain-shard"),
    pytest.param(
        (8, 2, 1), ("fsdp", "ep", "tp"), (SS(0, 2), S(0), IS(0, 2)), 2, ["S(0)@ep", "IS(0,2)@tp", "S(0)@fsdp"],
        id="fsdp-goes-after-size-1-cuts-too",
    ),
    pytest.param(
        (2, 1, 2, 1), ("f", "a", "b", "c"), (SS(0, 2), S(0), S(0), S(0)), 1,
        ["S(0)@a", "S(0)@b", "S(0)@c", "S(0)@f"], id="size-1-cuts-on-both-sides-of-the-product",
    ),
    pytest.param((2, 2), ("a", "b"), (S(-1), S(0)), 3, ["S(2)@a", "S(0)@b"], id="negative-dim"),
    pytest.param((2, 2), ("a", "b"), (IS(1, 2), S(0)), 2, ["IS(1,2)@a", "S(0)@b"], id="interleave-on-dim1"),
]


@pytest.mark.parametrize(("shape", "names", "placements", "ndim", "expected"), CASES)
def test_normalize(shape, names, placements, ndim, expected) -> None:
    mesh = MeshSpec(shape, names)
    got = normalize_placements(placements, mesh, ndim=ndim, name="w")
    assert [str(d) for d in got] == expected
    assert all(isinstance(d, ShardDescriptor) for d in got)


def test_interleaved_shard_becomes_interleave_factor() -> None:
    mesh = MeshSpec((2, 2), ("ep", "tp"))
    assert normalize_placements((S(0), IS(0, 2)), mesh, ndim=2) == (
        ShardDescriptor(0, "ep"),
        ShardDescriptor(0, "tp", interleave_factor=2),
    )


def test_mesh_dims_on_a_sub_mesh_and_a_flattened_group() -> None:
    mesh = MeshSpec((2, 2, 2), ("dp", "ep", "tp"))
    # tensor on the tp sub-mesh: dp and ep replicate it
    assert normalize_placements((S(0),), mesh, ndim=2, mesh_dims=("tp",)) == (ShardDescriptor(0, "tp"),)
    # one placement on the flattened (dp, ep) group, one on tp (the toy's q_proj)
    got = normalize_placements((SS(0, 2), S(0)), mesh, ndim=2, mesh_dims=(("dp", "ep"), "tp"))
    assert got == (ShardDescriptor(0, "tp"), ShardDescriptor(0, ("dp", "ep")))
    # mesh dims may be given by index too
    assert normalize_placements((S(1),), mesh, ndim=2, mesh_dims=(2,)) == (ShardDescriptor(1, "tp"),)


def test_fallback_strided_shard_normalizes_like_torchs() -> None:
    mesh = MeshSpec((2, 2), ("fsdp", "tp"))
    fallback = _compat._FallbackStridedShard(0, 2)
    assert normalize_placements((fallback, S(0)), mesh, ndim=1) == normalize_placements((SS(0, 2), S(0)), mesh, ndim=1)


# -- errors -----------------------------------------------------------------------------------------
MESH = MeshSpec((2, 2), ("ep", "tp"))

ERRORS = [
    # (placements, kwargs, substrings the message must contain), one error path per row
    pytest.param((S(0),), {}, ["'experts.w13'", "found 1 placements", "2 mesh dims", "('ep', 'tp')"], id="too-few"),
    pytest.param((S(0), S(0), S(0)), {}, ["'experts.w13'", "found 3 placements", "2 mesh dims"], id="too-many"),
    pytest.param(
        (S(0), S(0)), {"mesh_dims": ("tp",)}, ["'experts.w13'", "2 placements", "1 mesh dims", "('tp',)"],
        id="count-vs-mesh-dims",
    ),
    pytest.param((Partial(), S(0)), {}, ["'experts.w13'", "Partial", "'ep'", "reduction"], id="partial"),
    pytest.param((S(0), Partial("avg")), {}, ["'experts.w13'", "Partial", "'tp'"], id="partial-avg"),
    pytest.param((S(2), R()), {}, ["'experts.w13'", "shards dim 2", "has 2 dims", "'ep'"], id="dim-out-of-range"),
    pytest.param(
        (R(), S(-3)), {}, ["'experts.w13'", "shards dim -3", "has 2 dims", "'tp'"], id="negative-dim-out-of-range",
    ),
    pytest.param((IS(5, 2), R()), {}, ["'experts.w13'", "shards dim 5"], id="interleave-dim-out-of-range"),
    pytest.param((object(), R()), {}, ["'experts.w13'", "unsupported placement"], id="unknown-placement-type"),
    pytest.param((S(0),), {"mesh_dims": ("pp",)}, ["'experts.w13'", "'pp'", "('ep', 'tp')"], id="unknown-mesh-dim"),
    pytest.param(
        (S(0),), {"mesh_dims": (("ep", "ep"),)}, ["'experts.w13'", "distinct mesh dims"],
        id="flattened-ref-repeats-a-dim",
    ),
]


@pytest.mark.parametrize(("placements", "kwargs", "needles"), ERRORS)
def test_errors_name_the_parameter(placements, kwargs, needles) -> None:
    with pytest.raises(LayoutError) as err:
        normalize_placements(placements, MESH, ndim=2, name="experts.w13", **kwargs)
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize(
    ("fsdp_placement", "why"),
    [
        (_compat.make_strided_shard(0, 4), "torch 2.13: split factor counts EP and the interleaved ETP"),
        (_compat.make_strided_shard(0, 2), "torch 2.11: split factor leaves the interleaved cut out"),
        (Shard(0), "torch 2.11 when it counts no inner cut at all"),
    ],
)
def test_fsdp_mesh_dims_are_applied_last_whatever_torch_wrote(fsdp_placement: object, why: str) -> None:
    mesh = MeshSpec((2, 2, 2), ("fsdp", "ep", "tp"))
    placements = [fsdp_placement, Shard(0), InterleavedShard(0, 2)]
    descriptors = normalize_placements(placements, mesh, ndim=2, name="w13", last_mesh_dims={"fsdp"})
    assert [str(d) for d in descriptors] == ["S(0)@ep", "IS(0,2)@tp", "S(0)@fsdp"], why


@pytest.mark.parametrize("fsdp_placement", [_compat.make_strided_shard(0, 2), Shard(0)])
def test_a_flattened_fsdp_ref_is_applied_last_too(fsdp_placement: object) -> None:
    """torchtitan shards FSDP2 over ``dp_shard_cp``, flattened from two root dims: FSDP2 chunks the local tensor
    after the interleaved expert-TP cut there as well, whatever the split factor says."""
    mesh = MeshSpec((2, 2, 2), ("dp_shard", "cp", "tp"))
    refs = [("dp_shard", "cp"), "tp"]
    placements = [fsdp_placement, InterleavedShard(0, 2)]
    descriptors = normalize_placements(placements, mesh, ndim=2, name="w13", mesh_dims=refs,
                                       last_mesh_dims={("dp_shard", "cp")})
    assert [d.mesh_dim for d in descriptors] == ["tp", ("dp_shard", "cp")]
