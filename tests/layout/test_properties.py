"""Property tests: workbench's runs against torch's offsets, FSDP2's physical chunking and brute force.

The main property draws random meshes (1-3 dims of size 1-8), random uneven tensors (1-3 dims of
length 0-20) and placements the way FSDP2 builds them on top of random Shard/Replicate placements,
then checks every rank of the mesh.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Replicate, Shard

from tests.strategies import (
    FsdpLayout,
    assemble_local,
    fsdp_layouts,
    fsdp_physical_slices,
    global_array,
    interleave_indices,
    local_cover_counts,
    meshes,
    torch_slices,
)
from workbench import _compat
from workbench.errors import LayoutError
from workbench.layout import InterleavedShard, LoadSpec, ShardDescriptor, check_coverage, normalize_placements
from workbench.layout.runs import dim_segments
from workbench.mesh import MeshSpec


def _check_every_rank(layout: FsdpLayout) -> None:
    spec = layout.spec()
    full = global_array(layout.global_shape)
    compare_with_torch = not layout.has_uneven_strided_shard()
    strided = "even strided" if layout.has_strided_shard() else "no strided"
    event(f"{layout.kind}, {strided if compare_with_torch else 'uneven strided'}")
    for rank in spec.mesh.all_ranks():
        coord = spec.mesh.coordinate(rank)
        local = assemble_local(spec, rank, full)
        # (iv) local_shape agrees with the runs, and the runs tile the local tensor exactly once
        assert local.shape == spec.local_shape(rank)
        assert (local_cover_counts(spec, rank) == 1).all()
        runs = spec.runs(rank)
        assert [r.local_offset for r in runs] == sorted(r.local_offset for r in runs)
        assert all(all(s > 0 for s in r.sizes) for r in runs)
        # (ii) always: what FSDP2 physically stores (torch box of the inner placements, then torch.chunk)
        expected = full[fsdp_physical_slices(layout, coord)]
        assert np.array_equal(local, expected), (rank, coord, spec.describe_shards())
        # (i) torch's own helper, where it is right (no uneven strided shard, pytorch issue 168134)
        if compare_with_torch:
            torch_view = full[torch_slices(layout.global_shape, layout.mesh.shape, coord, layout.placements)]
            assert np.array_equal(local, torch_view), (rank, coord, spec.describe_shards())
    # (iii) every element once per replica group
    assert spec.coverage().ok


@settings(max_examples=2000)
@given(fsdp_layouts())
def test_runs_match_torch_and_fsdp2_on_every_rank(layout: FsdpLayout) -> None:
    _check_every_rank(layout)


@settings(max_examples=500)
@given(fsdp_layouts(strided_only=True))
def test_strided_runs_match_torch_and_fsdp2_on_every_rank(layout: FsdpLayout) -> None:
    """The same checks, only on layouts where FSDP2 prepends a _StridedShard (even and uneven)."""
    assert layout.has_strided_shard()
    _check_every_rank(layout)


@settings(max_examples=400)
@given(
    world=st.integers(1, 5),
    factor=st.integers(1, 5),
    run=st.integers(1, 3),
    ndim=st.integers(1, 3),
    data=st.data(),
)
def test_interleave_on_any_dim_matches_brute_force(world: int, factor: int, run: int, ndim: int, data) -> None:
    dim = data.draw(st.integers(0, ndim - 1), label="dim")
    shape = [data.draw(st.integers(1, 3), label=f"len{d}") for d in range(ndim)]
    shape[dim] = world * factor * run
    mesh = MeshSpec((world,), ("tp",))
    spec = LoadSpec.from_placements("w", "w", shape, mesh, (InterleavedShard(dim, factor),))
    assert spec.shards == (ShardDescriptor(dim, "tp", factor),)
    full = global_array(shape)
    for rank in range(world):
        indices = interleave_indices(shape[dim], world, rank, factor)
        assert np.array_equal(assemble_local(spec, rank, full), np.take(full, indices, axis=dim))
        # F runs per rank (merged into one when world == 1: then the rank holds the whole dim)
        assert len(spec.runs(rank)) == (1 if world == 1 else factor)
    assert spec.coverage().ok


@settings(max_examples=300)
@given(
    ep=st.integers(1, 4),
    tp=st.integers(1, 4),
    fsdp=st.integers(1, 4),
    stripes=st.integers(1, 4),
    run=st.integers(1, 3),
    cols=st.integers(1, 3),
)
def test_expert_tp_under_fsdp_matches_index_bookkeeping(
    ep: int, tp: int, fsdp: int, stripes: int, run: int, cols: int
) -> None:
    """EP contiguous -> ETP interleave -> FSDP chunk, by following index lists by hand.

    FSDP's chunk of the ETP-local rows may be uneven (any fsdp size over ``stripes * run`` rows).
    """
    rows = ep * tp * stripes * run
    mesh = MeshSpec((fsdp, ep, tp), ("fsdp", "ep", "tp"))
    outer = ep * tp
    fsdp_p = _compat.make_strided_shard(0, outer) if outer > 1 else Shard(0)  # FSDP2's rule
    spec = LoadSpec.from_placements("w", "w", (rows, cols), mesh, (fsdp_p, Shard(0), InterleavedShard(0, stripes)))
    full = global_array((rows, cols))
    for f, e, t in itertools.product(range(fsdp), range(ep), range(tp)):
        ep_rows = list(range(e * rows // ep, (e + 1) * rows // ep))
        etp_rows = [ep_rows[i] for i in interleave_indices(len(ep_rows), tp, t, stripes)]
        size, offset = _compat.chunk_size_and_offset(len(etp_rows), fsdp, f)
        held = etp_rows[offset : offset + size]
        rank = mesh.rank_at((f, e, t))
        assert np.array_equal(assemble_local(spec, rank, full), full[held]), (f, e, t)
    assert spec.coverage().ok


@settings(max_examples=300)
@given(data=st.data())
def test_check_coverage_counts_like_a_dense_array(data) -> None:
    """check_coverage's compressed-grid count equals a brute-force per-element count."""
    ndim = data.draw(st.integers(1, 3), label="ndim")
    shape = tuple(data.draw(st.integers(1, 6), label="shape") for _ in range(ndim))
    nranks = data.draw(st.integers(1, 5), label="ranks")
    boxes: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    dense = np.zeros(shape, dtype=np.int64)
    for rank in range(nranks):
        for _ in range(data.draw(st.integers(0, 3), label="boxes")):
            offset = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
            sizes = tuple(data.draw(st.integers(0, n - o)) for n, o in zip(shape, offset))
            boxes.setdefault(rank, []).append((offset, sizes))
            dense[tuple(slice(o, o + s) for o, s in zip(offset, sizes))] += 1
    report = check_coverage("t", shape, boxes, [tuple(range(nranks))])
    assert report.hole_elements == int((dense == 0).sum())
    assert report.overlap_elements == int(np.maximum(dense - 1, 0).sum())
    assert report.ok == bool((dense == 1).all())
    for hole in report.holes:
        assert (dense[tuple(slice(o, o + s) for o, s in zip(hole.global_offset, hole.sizes))] == 0).all()
    for overlap in report.overlaps:
        assert (dense[tuple(slice(o, o + s) for o, s in zip(overlap.global_offset, overlap.sizes))] > 1).all()
        assert len(overlap.ranks) >= 1


def _any_placement(ndim: int) -> st.SearchStrategy[Any]:
    dims = st.integers(0, ndim - 1)
    return st.one_of(
        st.just(Replicate()),
        dims.map(Shard),
        st.builds(InterleavedShard, dims, st.integers(2, 3)),
        st.builds(_compat.make_strided_shard, dims, st.sampled_from([1, 2, 3, 4, 6])),
    )


@settings(max_examples=600)
@given(data=st.data())
def test_construction_rejects_exactly_the_layouts_no_rank_can_hold(data) -> None:
    """LoadSpec's up-front evenness check is exact: it raises iff some rank's cut is an uneven
    interleave, and a spec it accepts answers every rank and covers the tensor exactly."""
    mesh = data.draw(meshes(max_size=4), label="mesh")
    shape = tuple(data.draw(st.lists(st.integers(0, 24), min_size=1, max_size=2), label="shape"))
    placements = tuple(data.draw(_any_placement(len(shape)), label=f"p{i}") for i in range(mesh.ndim))
    shards = normalize_placements(placements, mesh, ndim=len(shape), name="w")
    brute_error = None
    for rank in mesh.all_ranks():
        for dim, length in enumerate(shape):
            cuts = [
                (d, mesh.group_size(d.mesh_dim), mesh.group_rank(rank, d.mesh_dim)) for d in shards if d.dim == dim
            ]
            try:
                dim_segments(length, cuts)
            except LayoutError as exc:
                brute_error = exc
    try:
        spec = LoadSpec(name="w", hf_keys="w", global_shape=shape, mesh=mesh, shards=shards)
    except LayoutError as exc:
        assert brute_error is not None, f"rejected a layout every rank can hold: {exc}"
        event("rejected: uneven interleave")
        return
    assert brute_error is None, f"accepted a layout a rank cannot hold: {brute_error}"
    event("accepted, interleaved" if spec.is_interleaved else "accepted, contiguous only")
    full = global_array(shape)
    for rank in mesh.all_ranks():
        assert (local_cover_counts(spec, rank) == 1).all()
        assert (assemble_local(spec, rank, full) >= 0).all()
    assert spec.coverage().ok
