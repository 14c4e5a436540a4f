"""LoadSpec: schema, derived facts, key regions, from_tensor and every error path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from tests.strategies import FsdpLayout, assemble_local, fsdp_layouts, global_array
from workbench import _compat
from workbench.errors import LayoutError
from workbench.layout import InterleavedShard, KeyRegion, LoadSpec, ShardDescriptor
from workbench.mesh import MeshSpec

S, R, IS = Shard, Replicate, InterleavedShard


def SS(dim: int, split_factor: int) -> Any:
    return _compat.make_strided_shard(dim, split_factor)


KEYS4 = ("k0", "k1", "k2", "k3")
TOY_KEYS = tuple(f"experts.{e}.{p}_proj.weight" for e in range(2) for p in ("gate", "up"))
FSDP_EP_TP = MeshSpec((2, 2, 2), ("fsdp", "ep", "tp"))


# -- schema and derived facts -------------------------------------------------------------------
def test_unsharded_spec() -> None:
    spec = LoadSpec(name="model.layers.0.mlp.gate.weight", hf_keys="model.layers.0.mlp.gate.weight",
                    global_shape=(128, 64), mesh=MeshSpec((1,)))
    assert spec.hf_keys == ("model.layers.0.mlp.gate.weight",)  # a lone string becomes a 1-tuple
    assert not spec.is_fused and not spec.is_sharded and not spec.is_interleaved
    assert spec.fused_dim is None and spec.key_size is None and spec.shards == ()
    assert spec.origin_shape is None and spec.visible_shape == (128, 64)
    assert spec.describe_shards() == "replicated"
    assert spec.runs(0) == spec.runs(0)  # cached answers are stable


def test_fused_interleaved_spec_facts() -> None:
    spec = LoadSpec.from_placements("w13", TOY_KEYS, (16, 4), FSDP_EP_TP, (SS(0, 4), S(0), IS(0, 2)), fused_dim=0)
    assert spec.is_fused and spec.is_sharded and spec.is_interleaved
    assert spec.key_size == 4
    assert [d.interleave_factor for d in spec.shards] == [1, 2, 1]  # descriptor order is preserved
    assert spec.shards_of_dim(0) == spec.shards and spec.shards_of_dim(1) == ()
    assert repr(spec) == (
        "LoadSpec('w13', hf_keys=4 keys, global_shape=(16, 4), fused_dim=0, "
        "shards=[S(0)@ep -> IS(0,2)@tp -> S(0)@fsdp], mesh=MeshSpec(fsdp=2, ep=2, tp=2))"
    )


def test_origin_shape_equal_to_global_is_dropped_and_negative_fused_dim_resolves() -> None:
    spec = LoadSpec(name="w", hf_keys=("a", "b"), global_shape=(4, 6), mesh=MeshSpec((1,)),
                    fused_dim=-1, origin_shape=(4, 6))
    assert spec.origin_shape is None
    assert spec.fused_dim == 1
    assert spec.key_size == 3


def test_descriptor_mesh_dims_are_resolved() -> None:
    mesh = MeshSpec((2, 2), ("ep", "tp"))
    spec = LoadSpec(name="w", hf_keys="w", global_shape=(8,), mesh=mesh,
                    shards=(ShardDescriptor(0, 0), ShardDescriptor(0, ["tp"], 2)))  # type: ignore[arg-type]
    assert spec.shards == (ShardDescriptor(0, "ep"), ShardDescriptor(0, "tp", 2))


@pytest.mark.parametrize(("mesh", "placements", "mesh_dims", "groups"), [
    # fully sharded: one replica group holding every rank
    (FSDP_EP_TP, (SS(0, 4), S(0), IS(0, 2)), None, ((0, 1, 2, 3, 4, 5, 6, 7),)),
    # HSDP: one group per replicate coordinate
    (MeshSpec((2, 2, 2), ("rep", "fsdp", "tp")), (R(), S(0), S(1)), None, ((0, 1, 2, 3), (4, 5, 6, 7))),
    # a tensor on the tp sub-mesh: every (fsdp, ep) pair is a replica group
    (FSDP_EP_TP, (S(0),), ("tp",), ((0, 1), (2, 3), (4, 5), (6, 7))),
    # replicated on every rank: each rank is its own replica group
    (MeshSpec((3,)), (R(),), None, ((0,), (1,), (2,))),
])
def test_replica_groups(mesh, placements, mesh_dims, groups) -> None:
    spec = LoadSpec.from_placements("w", "w", (8, 4), mesh, placements, mesh_dims=mesh_dims)
    assert spec.replica_groups() == groups
    assert spec.coverage().ok
    assert spec.coverage().replica_groups == len(groups)


# -- key regions ---------------------------------------------------------------------------------
KEY_REGION_CASES = [
    # (spec factory, rank, expected regions), one edge per row
    pytest.param(
        lambda: LoadSpec.from_placements("w", KEYS4, (480, 8), MeshSpec((4,)), (S(0),), fused_dim=0,
                                         origin_shape=(400, 8)),
        3, [KeyRegion("k3", (60, 0), (40, 8), (0, 0))], id="origin-clips-fp8-padding",
    ),
    pytest.param(
        lambda: LoadSpec.from_placements("w", KEYS4, (480, 8), MeshSpec((8,)), (S(0),), fused_dim=0,
                                         origin_shape=(400, 8)),
        7, [], id="padding-only-rank-reads-nothing",
    ),
    pytest.param(
        lambda: LoadSpec.from_placements("w", KEYS4, (400, 8), MeshSpec((2,)), (IS(0, 2),), fused_dim=0),
        0, [KeyRegion("k0", (0, 0), (100, 8), (0, 0)), KeyRegion("k2", (0, 0), (100, 8), (100, 0))],
        id="interleave-skips-the-middle-key",
    ),
    pytest.param(
        lambda: LoadSpec.from_placements("w", KEYS4, (8, 2), MeshSpec((2,)), (S(0),), fused_dim=0),
        0, [KeyRegion("k0", (0, 0), (2, 2), (0, 0)), KeyRegion("k1", (0, 0), (2, 2), (2, 0))],
        id="one-run-spans-two-keys",
    ),
    pytest.param(
        lambda: LoadSpec.from_placements("w", ("a", "b"), (4, 6), MeshSpec((3,)), (S(1),), fused_dim=1),
        1, [KeyRegion("a", (0, 2), (4, 1), (0, 0)), KeyRegion("b", (0, 0), (4, 1), (0, 1))],
        id="fused-on-dim1",
    ),
    pytest.param(
        lambda: LoadSpec.from_placements("w", "k", (4, 10), MeshSpec((2,)), (S(1),), origin_shape=(4, 7)),
        1, [KeyRegion("k", (0, 5), (4, 2), (0, 0))], id="unfused-padding-on-dim1",
    ),
    pytest.param(
        lambda: LoadSpec.from_placements("w13", TOY_KEYS, (16, 4), FSDP_EP_TP, (SS(0, 4), S(0), IS(0, 2)),
                                         fused_dim=0),
        5, [KeyRegion("experts.0.up_proj.weight", (2, 0), (2, 4), (0, 0))], id="toy-rank5-up-proj-rows-2-3",
    ),
    pytest.param(
        lambda: LoadSpec.from_placements("w", "k", (1, 1, 1024), MeshSpec((2,)), (S(0),)),
        1, [], id="zero-size-contiguous-shard",
    ),
]


@pytest.mark.parametrize(("factory", "rank", "expected"), KEY_REGION_CASES)
def test_key_regions(factory: Callable[[], LoadSpec], rank: int, expected: list[KeyRegion]) -> None:
    assert list(factory().key_regions(rank)) == expected


def test_key_region_text() -> None:
    region = KeyRegion("k3", (60, 0), (40, 8), (0, 0))
    assert str(region) == "k3[60:100, 0:8] -> local[0:40, 0:8]"


@settings(max_examples=150)
@given(fsdp_layouts(max_mesh_size=4, max_len=12), st.data())
def test_key_regions_rebuild_the_local_tensor_minus_padding(layout: FsdpLayout, data) -> None:
    """Reading every key region out of per-key tensors reproduces the local tensor, padding excluded."""
    shape = layout.global_shape
    origin = tuple(data.draw(st.integers(0, n), label="origin") for n in shape)
    fused = data.draw(st.integers(0, len(shape) - 1), label="fused_dim")
    nkeys = data.draw(st.sampled_from([k for k in range(1, 5) if origin[fused] % k == 0]), label="keys")
    keys = tuple(f"k{i}" for i in range(nkeys))
    spec = LoadSpec.from_placements("w", keys, shape, layout.mesh, layout.placements,
                                    fused_dim=fused if nkeys > 1 else None, origin_shape=origin)
    full = global_array(shape)
    visible = full[tuple(slice(0, o) for o in origin)]
    per_key = dict(zip(keys, np.array_split(visible, nkeys, axis=fused))) if nkeys > 1 else {keys[0]: visible}
    for rank in layout.mesh.all_ranks():
        expected = assemble_local(spec, rank, full)
        if expected.size:
            coords = np.unravel_index(expected, shape)
            padding = np.zeros(expected.shape, dtype=bool)
            for d, o in enumerate(origin):
                padding |= coords[d] >= o
            expected[padding] = -1
        got = np.full(spec.local_shape(rank), -1, dtype=np.int64)
        for region in spec.key_regions(rank):
            key_box = tuple(slice(o, o + s) for o, s in zip(region.key_offset, region.sizes))
            local_box = tuple(slice(o, o + s) for o, s in zip(region.local_offset, region.sizes))
            assert (got[local_box] == -1).all()  # regions never overlap
            got[local_box] = per_key[region.hf_key][key_box]
        assert np.array_equal(got, expected)


# -- from_tensor ---------------------------------------------------------------------------------
def test_from_tensor_plain_tensor() -> None:
    spec = LoadSpec.from_tensor("w", ["k0", "k1"], torch.zeros(128, 64), fused_dim=0, origin_shape=(120, 64))
    assert spec.hf_keys == ("k0", "k1")
    assert spec.global_shape == (128, 64)
    assert spec.fused_dim == 0 and spec.shards == () and spec.origin_shape == (120, 64)
    assert spec.mesh == MeshSpec((1,), ("world",))
    replicated = LoadSpec.from_tensor("b", "b", torch.zeros(3), mesh=MeshSpec((4,)))
    assert replicated.replica_groups() == ((0,), (1,), (2,), (3,))


def test_from_tensor_one_rank_dtensor() -> None:
    with _compat.fake_process_group(0, 1):
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        dt = DTensor.from_local(torch.zeros(128, 64), mesh, (S(0),), run_check=False)
        spec = LoadSpec.from_tensor("gate", "gate", dt)
    assert spec.global_shape == (128, 64)
    assert spec.fused_dim is None
    assert spec.shards == (ShardDescriptor(0, "fsdp"),)
    assert spec.mesh == MeshSpec((1,), ("fsdp",))


def _expert_tp_local(e: int, t: int) -> torch.Tensor:
    rows = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)[8 * e : 8 * e + 8]
    return torch.cat([rows[2 * t : 2 * t + 2], rows[4 + 2 * t : 6 + 2 * t]])


def test_from_tensor_on_a_sub_mesh_with_and_without_the_root_mesh() -> None:
    with _compat.fake_process_group(5, 8):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("fsdp", "ep", "tp"))
        _, e, t = mesh.get_coordinate()
        dt = DTensor.from_local(_expert_tp_local(e, t), mesh["ep", "tp"], (S(0), IS(0, 2)), run_check=False)
        rooted = LoadSpec.from_tensor("w13", "w13", dt, mesh=FSDP_EP_TP)
        own = LoadSpec.from_tensor("w13", "w13", dt)
    assert rooted == LoadSpec.from_placements(
        "w13", "w13", (16, 3), FSDP_EP_TP, (S(0), IS(0, 2)), mesh_dims=("ep", "tp")
    )
    assert rooted.replica_groups() == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert own.mesh == MeshSpec((2, 2), ("ep", "tp"), ranks=(4, 5, 6, 7))  # the sub-mesh of fsdp coordinate 1
    assert own.describe_shards() == "S(0)@ep -> IS(0,2)@tp"
    assert [r.global_offset[0] for r in own.runs(5)] == [2, 6]  # rank 5 = (ep 0, tp 1)


def _uneven_tp_dtensor(rank: int, local_rows: int) -> Any:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return DTensor.from_local(torch.zeros(local_rows, 2), mesh, (S(0),), run_check=False,
                              shape=torch.Size((9, 2)), stride=(2, 1))


def test_from_tensor_rank_override_is_checked() -> None:
    with _compat.fake_process_group(0, 2):
        dt = _uneven_tp_dtensor(0, 5)  # 9 rows over 2: rank 0 holds 5, rank 1 holds 4
        assert LoadSpec.from_tensor("w", "w", dt).local_shape(0) == (5, 2)
        with pytest.raises(LayoutError, match=r"rank 1 holds a local tensor of shape \(5, 2\)"):
            LoadSpec.from_tensor("w", "w", dt, rank=1)


# -- errors --------------------------------------------------------------------------------------
MESH = MeshSpec((2, 2), ("ep", "tp"))


def _spec(**kw: Any) -> LoadSpec:
    base: dict[str, Any] = {"name": "experts.w13", "hf_keys": "k", "global_shape": (8, 4), "mesh": MESH}
    base.update(kw)
    return LoadSpec(**base)


def _placed(placements: Any, shape: Any = (8, 4), keys: Any = "k", **kw: Any) -> LoadSpec:
    return LoadSpec.from_placements("experts.w13", keys, shape, MESH, placements, **kw)


ERRORS = [
    # (builder, substrings the message must contain), one error path per row
    pytest.param(lambda: _spec(hf_keys=("a", "b")), ["2 hf_keys", "['a', 'b']", "need fused_dim"],
                 id="fused-dim-missing"),
    pytest.param(lambda: _spec(hf_keys=("a", "b", "c", "d")), ["4 hf_keys", "['a', ..., 'd']", "fused_dim"],
                 id="fused-dim-missing-many-keys"),
    pytest.param(lambda: _spec(fused_dim=0), ["fused_dim=0 is set", "one HF key 'k'"], id="fused-dim-with-one-key"),
    pytest.param(lambda: _spec(hf_keys=("a", "b", "c"), fused_dim=0, global_shape=(10, 4)),
                 ["3 hf_keys", "fused dim 0", "length 10", "(10, 4)"], id="keys-do-not-divide-fused-dim"),
    pytest.param(lambda: _spec(hf_keys=KEYS4, fused_dim=0, global_shape=(480, 8), origin_shape=(402, 8)),
                 ["4 hf_keys", "length 402"], id="keys-do-not-divide-visible-length"),
    pytest.param(lambda: _spec(hf_keys=("a", "b"), fused_dim=2), ["fused_dim 2", "out of range", "(8, 4)"],
                 id="fused-dim-out-of-range"),
    pytest.param(lambda: _spec(origin_shape=(9, 4)), ["origin_shape (9, 4)", "global_shape (8, 4)"],
                 id="origin-larger-than-global"),
    pytest.param(lambda: _spec(origin_shape=(8,)), ["origin_shape (8,)", "global_shape (8, 4)"],
                 id="origin-wrong-rank"),
    pytest.param(lambda: _placed((S(2), R())), ["shards dim 2", "has 2 dims"], id="placement-dim-out-of-range"),
    pytest.param(lambda: _spec(shards=(ShardDescriptor(3, "tp"),)), ["S(3)@tp", "cuts dim 3 of a 2-d tensor"],
                 id="descriptor-dim-out-of-range"),
    pytest.param(lambda: _spec(shards=(ShardDescriptor(0, "tp"), ShardDescriptor(1, "tp"))),
                 ["mesh dim 'tp' cuts the tensor twice", "S(0)@tp", "S(1)@tp"], id="mesh-dim-used-twice"),
    pytest.param(lambda: _spec(shards=(ShardDescriptor(0, "pp"),)), ["S(0)@pp", "mesh dim 'pp' is not in",
                 "MeshSpec(ep=2, tp=2)", "('ep', 'tp')"], id="descriptor-unknown-mesh-dim"),
    pytest.param(lambda: _placed((S(0), R()), mesh_dims=("ep", "pp")), ["mesh dim 'pp' is not in"],
                 id="mesh-dims-unknown-mesh-dim"),
    pytest.param(lambda: _spec(shards=(ShardDescriptor(0, ("ep", "tp")), ShardDescriptor(1, "tp"))),
                 ["mesh dim 'tp' cuts the tensor twice", "S(0)@ep+tp"], id="flattened-group-overlaps-a-dim"),
    pytest.param(lambda: _placed((S(0), S(1)), mesh_dims=("tp", "tp")), ["mesh dim 'tp' cuts the tensor twice"],
                 id="mesh-dims-repeat-a-dim"),
    pytest.param(lambda: LoadSpec.from_placements("experts.w13", "k", (10, 4), MeshSpec((2,), ("tp",)),
                                                  (IS(0, 3),)),
                 ["IS(0,3)@tp", "N=10", "W*F=2*3=6", "'tp'", "(10, 4)"], id="uneven-interleave"),
    pytest.param(lambda: LoadSpec.from_placements("experts.w13", "k", (10, 4), MeshSpec((3, 2), ("ep", "tp")),
                                                  (S(0), IS(0, 2))),
                 ["IS(0,2)@tp", "N=2", "W*F=2*2=4"], id="interleave-uneven-after-uneven-ep-cut"),
    pytest.param(lambda: _placed((Partial(), S(0))), ["Partial", "'ep'"], id="partial"),
    pytest.param(lambda: _placed((S(0),)), ["found 1 placements", "2 mesh dims"], id="placement-count"),
    pytest.param(lambda: _spec(shards=("S(0)@tp",)), ["must be ShardDescriptors"], id="shard-not-a-descriptor"),
    pytest.param(lambda: _spec(hf_keys=("a", "a", "b"), fused_dim=0, global_shape=(9, 4)), ["hf_keys repeat ['a']"],
                 id="duplicate-keys"),
    pytest.param(lambda: _spec(hf_keys=()), ["hf_keys must be a non-empty list"], id="no-keys"),
    pytest.param(lambda: _spec(global_shape=(8, -1)), ["global_shape (8, -1) has a negative size"],
                 id="negative-size"),
    pytest.param(lambda: _spec(global_shape="8x4"), ["global_shape must be a sequence of ints"], id="shape-not-ints"),
]


@pytest.mark.parametrize(("build", "needles"), ERRORS)
def test_errors_name_the_parameter(build: Callable[[], Any], needles: list[str]) -> None:
    with pytest.raises(LayoutError) as err:
        build()
    msg = str(err.value)
    assert "'experts.w13'" in msg
    for needle in needles:
        assert needle in msg, msg


def test_empty_name_is_rejected() -> None:
    with pytest.raises(LayoutError, match="name must be a non-empty string"):
        _spec(name="")


def test_from_tensor_local_shape_mismatch_names_everything() -> None:
    with _compat.fake_process_group(1, 2):
        dt = _uneven_tp_dtensor(1, 5)  # rank 1 should hold 4 of the 9 rows
        with pytest.raises(LayoutError) as err:
            LoadSpec.from_tensor("experts.w13", "k", dt)
    msg = str(err.value)
    for needle in ["'experts.w13'", "rank 1", "(5, 2)", "give (4, 2)", "(9, 2)", "S(0)@tp", "run_check=False"]:
        assert needle in msg, msg


def test_from_tensor_root_mesh_missing_dims() -> None:
    with _compat.fake_process_group(0, 2):
        dt = _uneven_tp_dtensor(0, 5)
        with pytest.raises(LayoutError) as err:
            LoadSpec.from_tensor("experts.w13", "k", dt, mesh=MeshSpec((2,), ("dp",)))
    msg = str(err.value)
    for needle in ["'experts.w13'", "('tp',)", "missing ['tp']"]:
        assert needle in msg, msg
