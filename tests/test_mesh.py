"""MeshSpec: rank <-> coordinate arithmetic, groups along mesh dims and flattened groups."""

from __future__ import annotations

import itertools

import pytest
from torch.distributed.device_mesh import init_device_mesh

from workbench import _compat
from workbench.errors import LayoutError
from workbench.mesh import MeshSpec, format_mesh_dim

TOY = MeshSpec((2, 2, 2), ("fsdp", "ep", "tp"))


@pytest.mark.parametrize(("shape", "rank", "coord"), [
    ((2, 3, 4), 0, (0, 0, 0)),  # first rank
    ((2, 3, 4), 5, (0, 1, 1)),  # last dim varies fastest
    ((2, 3, 4), 12, (1, 0, 0)),  # carry into the first dim
    ((2, 3, 4), 23, (1, 2, 3)),  # last rank
    ((7,), 6, (6,)),  # 1-D mesh
    ((1, 1), 0, (0, 0)),  # size-1 dims
])
def test_row_major_coordinates(shape: tuple[int, ...], rank: int, coord: tuple[int, ...]) -> None:
    mesh = MeshSpec(shape)
    assert mesh.coordinate(rank) == coord
    assert mesh.rank_at(coord) == rank


def test_every_rank_round_trips() -> None:
    mesh = MeshSpec((3, 1, 4))
    assert [mesh.rank_at(mesh.coordinate(r)) for r in range(mesh.size)] == list(range(12))
    assert mesh.all_ranks() == tuple(range(12))
    assert (mesh.ndim, mesh.size, mesh.dim_names) == (3, 12, ("dim0", "dim1", "dim2"))


def test_docstring_table() -> None:
    assert TOY.coordinate(5) == (1, 0, 1)
    assert TOY.group_rank(0, "tp") == 0 and TOY.group_rank(5, "tp") == 1
    assert TOY.group_ranks(0, "ep") == (0, 2) and TOY.group_ranks(5, "ep") == (5, 7)


def test_custom_rank_array() -> None:
    # a DeviceMesh over a permutation of ranks 4..7: the row-major flat positions map to these ranks
    mesh = MeshSpec((2, 2), ("a", "b"), ranks=(4, 6, 5, 7))
    assert mesh.all_ranks() == (4, 6, 5, 7)
    assert mesh.coordinate(6) == (0, 1)
    assert mesh.rank_at((1, 0)) == 5
    assert mesh.group_ranks(4, "b") == (4, 6)
    assert mesh.group_ranks(4, "a") == (4, 5)
    assert mesh.group_rank(7, ("a", "b")) == 3
    assert repr(mesh) == "MeshSpec(a=2, b=2, custom ranks)"
    with pytest.raises(LayoutError, match=r"rank 0 is not in MeshSpec\(a=2, b=2, custom ranks\)"):
        mesh.coordinate(0)


def test_identity_rank_array_is_the_default() -> None:
    assert MeshSpec((2, 2), ranks=(0, 1, 2, 3)) == MeshSpec((2, 2))
    assert MeshSpec((2, 2), ranks=(0, 1, 2, 3)).ranks is None
    assert hash(MeshSpec((2, 2), ranks=[0, 1, 2, 3])) == hash(MeshSpec((2, 2)))


@pytest.mark.parametrize(("ref", "rank", "size", "group_rank", "group"), [
    ("tp", 5, 2, 1, (4, 5)),  # plain mesh dim
    (("fsdp", "ep"), 5, 4, 2, (1, 3, 5, 7)),  # flattened, row-major over (fsdp, ep): (1, 0) -> 2
    (("ep", "fsdp"), 5, 4, 1, (1, 5, 3, 7)),  # the order of the listed dims matters
    (("fsdp", "ep", "tp"), 6, 8, 6, tuple(range(8))),  # the whole mesh as one group
    (("ep",), 3, 2, 1, (1, 3)),  # a one-name tuple behaves like the name
])
def test_groups_along_refs(ref, rank: int, size: int, group_rank: int, group: tuple[int, ...]) -> None:
    assert TOY.group_size(ref) == size
    assert TOY.group_rank(rank, ref) == group_rank
    assert TOY.group_ranks(rank, ref) == group


@pytest.mark.parametrize("mesh", [
    TOY,  # the toy 2x2x2 mesh
    MeshSpec((2, 3, 2), ("a", "b", "c")),  # unequal sizes: group orders differ per ref
    MeshSpec((3, 2), ("x", "y"), ranks=(10, 3, 7, 0, 4, 1)),  # custom, unsorted ranks
])
def test_groups_partition_the_ranks(mesh: MeshSpec) -> None:
    refs = list(mesh.dim_names) + [
        tuple(c) for k in range(2, mesh.ndim + 1) for c in itertools.permutations(mesh.dim_names, k)
    ]
    for ref in refs:
        groups = mesh.groups(ref)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == sorted(mesh.all_ranks()), ref  # every rank exactly once
        assert len(flat) == len(set(flat))
        assert all(len(g) == mesh.group_size(ref) for g in groups)
        assert [g[0] for g in groups] == sorted(g[0] for g in groups)  # ordered by first rank
        for g in groups:
            assert [mesh.group_rank(r, ref) for r in g] == list(range(len(g)))  # group-rank order
            assert all(mesh.group_ranks(r, ref) == g for r in g)


def test_resolve_and_format() -> None:
    assert TOY.resolve("tp") == "tp"
    assert TOY.resolve(1) == "ep"
    assert TOY.resolve(("fsdp",)) == "fsdp"
    assert TOY.resolve(["fsdp", 1]) == ("fsdp", "ep")
    assert TOY.dim_indices(("tp", "fsdp")) == (2, 0)
    assert format_mesh_dim("tp") == "tp"
    assert format_mesh_dim(("fsdp", "ep")) == "fsdp+ep"
    assert repr(TOY) == "MeshSpec(fsdp=2, ep=2, tp=2)"


ERRORS = [
    # (callable, message pattern), one error path per row
    pytest.param(lambda: MeshSpec(()), "non-empty tuple of positive sizes", id="empty-shape"),
    pytest.param(lambda: MeshSpec((2, 0)), r"positive sizes, got \(2, 0\)", id="zero-size"),
    pytest.param(lambda: MeshSpec((2, 2), ("a",)), r"2 mesh dims \(2, 2\) but 1 dim names", id="names-count"),
    pytest.param(lambda: MeshSpec((2, 2), ("a", "a")), "must be unique", id="duplicate-names"),
    pytest.param(lambda: MeshSpec((2,), ("a+b",)), "free of '\\+'", id="plus-in-name"),
    pytest.param(lambda: MeshSpec((2, 2), ("a", "")), "non-empty", id="empty-name"),
    pytest.param(lambda: MeshSpec((2,), ranks=(0, 1, 2)), "must list 2 distinct non-negative ranks", id="rank-count"),
    pytest.param(lambda: MeshSpec((2,), ranks=(3, 3)), "distinct", id="duplicate-ranks"),
    pytest.param(lambda: MeshSpec((2,), ranks=(-1, 0)), "non-negative", id="negative-rank"),
    pytest.param(lambda: TOY.coordinate(8), r"rank 8 is not in .*ranks 0\.\.7", id="rank-out-of-range"),
    pytest.param(lambda: TOY.rank_at((0, 2, 0)), r"coordinate \(0, 2, 0\) is outside", id="coordinate-outside"),
    pytest.param(lambda: TOY.rank_at((0, 0)), r"coordinate \(0, 0\) is outside", id="coordinate-too-short"),
    pytest.param(lambda: TOY.resolve("pp"), r"mesh dim 'pp' is not in .*known mesh dims", id="unknown-name"),
    pytest.param(lambda: TOY.resolve(3), "mesh dim 3 is not in", id="index-out-of-range"),
    pytest.param(lambda: TOY.resolve(True), "mesh dim True is not in", id="bool-is-not-an-index"),
    pytest.param(lambda: TOY.resolve(("ep", "ep")), "must list distinct mesh dims", id="flattened-repeat"),
    pytest.param(lambda: TOY.resolve(()), "must list distinct mesh dims", id="flattened-empty"),
]


@pytest.mark.parametrize(("call", "pattern"), ERRORS)
def test_errors(call, pattern: str) -> None:
    with pytest.raises(LayoutError, match=pattern):
        call()


def test_from_device_mesh_on_a_fake_process_group() -> None:
    with _compat.fake_process_group(5, 8):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("fsdp", "ep", "tp"))
        root = MeshSpec.from_device_mesh(mesh)
        ep_tp = MeshSpec.from_device_mesh(mesh["ep", "tp"])
        fsdp = MeshSpec.from_device_mesh(mesh["fsdp"])
    assert root == TOY
    assert ep_tp == MeshSpec((2, 2), ("ep", "tp"), ranks=(4, 5, 6, 7))  # rank 5 sits at fsdp coordinate 1
    assert ep_tp.coordinate(5) == (0, 1)
    assert fsdp == MeshSpec((2,), ("fsdp",), ranks=(1, 5))
    assert fsdp.group_rank(5, "fsdp") == 1


def test_from_device_mesh_without_names() -> None:
    with _compat.fake_process_group(0, 6):
        spec = MeshSpec.from_device_mesh(init_device_mesh("cpu", (2, 3)))
    assert spec == MeshSpec((2, 3), ("dim0", "dim1"))
