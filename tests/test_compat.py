"""workbench._compat: one test per shim, and the fallbacks against torch's own helpers."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import pickle
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from workbench import _compat
from workbench.layout import InterleavedShard

# -- placements ---------------------------------------------------------------------------------


def test_strided_shard_base_is_torchs_on_this_torch() -> None:
    from torch.distributed.tensor.placement_types import _StridedShard

    assert _compat.HAS_TORCH_STRIDED_SHARD
    assert _compat.StridedShardBase is _StridedShard


def test_make_strided_shard() -> None:
    p = _compat.make_strided_shard(1, 4)
    assert isinstance(p, _compat.StridedShardBase)
    assert p.dim == 1
    assert _compat.strided_split_factor(p) == 4


@pytest.mark.parametrize(("placement", "shard", "strided", "replicate", "partial"), [
    (Shard(0), True, False, False, False),  # plain shard
    (_compat.make_strided_shard(0, 2), False, True, False, False),  # torch's strided shard is not a Shard
    (InterleavedShard(0, 2), False, True, False, False),  # our subclass counts as strided
    (_compat._FallbackStridedShard(0, 2), False, True, False, False),  # the fallback too
    (Replicate(), False, False, True, False),  # replicate cuts nothing
    (Partial(), False, False, False, True),  # pending sum
    (Partial("avg"), False, False, False, True),  # another reduce op
])
def test_placement_predicates(placement, shard: bool, strided: bool, replicate: bool, partial: bool) -> None:
    assert _compat.is_shard(placement) is shard
    assert _compat.is_strided_shard(placement) is strided
    assert _compat.is_replicate(placement) is replicate
    assert _compat.is_partial(placement) is partial


def test_is_partial_recognizes_private_partials_by_name() -> None:
    class _MaskPartial:  # stands in for torch's private pending-reduction placements
        pass

    class NormPartial:
        pass

    assert _compat.is_partial(_MaskPartial())
    assert _compat.is_partial(NormPartial())
    assert not _compat.is_partial(SimpleNamespace())


def test_strided_split_factor_spellings() -> None:
    assert _compat.strided_split_factor(SimpleNamespace(split_factor=3)) == 3
    assert _compat.strided_split_factor(SimpleNamespace(sf=5)) == 5  # an older torch's spelling
    with pytest.raises(TypeError, match="has no split factor"):
        _compat.strided_split_factor(Shard(0))


def test_fallback_strided_shard() -> None:
    p = _compat._FallbackStridedShard(2, 3)
    assert _compat.is_strided_shard(p) and not _compat.is_shard(p)
    assert _compat.strided_split_factor(p) == 3
    assert p == _compat._FallbackStridedShard(2, 3)
    assert _compat._FallbackStridedShard(0).split_factor == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.dim = 0  # type: ignore[misc]


# -- chunk rule and torch's offsets ---------------------------------------------------------------
@pytest.mark.parametrize(("n", "world", "expected"), [
    (10, 3, [(4, 0), (4, 4), (2, 8)]),  # uneven
    (10, 4, [(3, 0), (3, 3), (3, 6), (1, 9)]),  # ceil rule, not array_split's 3,3,2,2
    (3, 4, [(1, 0), (1, 1), (1, 2), (0, 3)]),  # empty trailing rank, offset clamped to n
    (1, 2, [(1, 0), (0, 1)]),  # one element, two ranks
    (0, 2, [(0, 0), (0, 0)]),  # nothing to cut
])
def test_chunk_size_and_offset(n: int, world: int, expected: list[tuple[int, int]]) -> None:
    assert [_compat.chunk_size_and_offset(n, world, r) for r in range(world)] == expected


def test_chunk_fallback_equals_torch_over_a_grid() -> None:
    for n, world in itertools.product(range(0, 25), range(1, 10)):
        for index in range(world):
            assert _compat._chunk_fallback(n, world, index) == _compat.chunk_size_and_offset(n, world, index), (
                n, world, index,
            )


def test_chunk_size_and_offset_under_a_meta_default_device() -> None:
    with torch.device("meta"):  # modules are often built on meta; the helper must still answer ints
        assert _compat.chunk_size_and_offset(10, 4, 3) == (1, 9)


def test_torch_local_shape_and_offset() -> None:
    assert _compat.torch_local_shape_and_offset((8, 4), (2, 2), (1, 0), (Shard(0), Shard(1))) == ((4, 2), (4, 0))
    assert _compat.torch_local_shape_and_offset((5, 3), (2,), (1,), (Replicate(),)) == ((5, 3), (0, 0))


def test_local_shape_and_offset_fallback_equals_torch_for_shard_and_replicate() -> None:
    choices = [Replicate(), Shard(0), Shard(1)]
    for mesh_shape in [(3,), (2, 3), (4, 1), (2, 2, 2)]:
        for placements in itertools.product(choices, repeat=len(mesh_shape)):
            for global_shape in [(0, 3), (5, 7), (1, 9), (8, 8), (3, 2)]:
                for coord in itertools.product(*(range(s) for s in mesh_shape)):
                    fallback = _compat._local_shape_and_offset_fallback(global_shape, mesh_shape, coord, placements)
                    real = _compat.torch_local_shape_and_offset(global_shape, mesh_shape, coord, placements)
                    assert fallback[0] == real[0], (mesh_shape, placements, global_shape, coord)
                    # offsets only matter where the rank holds something on that dim
                    for d, size in enumerate(real[0]):
                        if size:
                            assert fallback[1][d] == real[1][d], (mesh_shape, placements, global_shape, coord)


def test_local_shape_and_offset_fallback_refuses_strided_shards() -> None:
    with pytest.raises(NotImplementedError, match="_StridedShard"):
        _compat._local_shape_and_offset_fallback((8,), (2, 2), (0, 0), (_compat.make_strided_shard(0, 2), Shard(0)))


def test_torch_explicit_order() -> None:
    order = _compat.torch_explicit_order((2, 3), (Shard(0), Shard(1)))
    try:
        from torch.distributed.tensor._utils import _explicit_order_placements  # noqa: F401
    except ImportError:
        assert order is None  # torch 2.13 dropped it; normalization does not need it
    else:
        assert order is not None and [m for m, _ in order] == [0, 1]


# -- InterleavedShard -------------------------------------------------------------------------------
def test_interleaved_shard_is_a_strided_shard() -> None:
    p = InterleavedShard(1, 4)
    assert isinstance(p, _compat.StridedShardBase)
    assert (p.dim, p.num_local_stripes, _compat.strided_split_factor(p)) == (1, 4, 4)
    assert repr(p) == "InterleavedShard(dim=1, num_local_stripes=4)"
    assert str(p) == "IS(1,4)"


@pytest.mark.parametrize("clone", [
    lambda p: pickle.loads(pickle.dumps(p)),  # checkpoints and multiprocessing pickle placements
    copy.deepcopy,  # DTensor specs are deep-copied (torch rebuilds placements in places)
    copy.copy,  # shallow copies too
], ids=["pickle", "deepcopy", "copy"])
def test_interleaved_shard_survives_copies(clone) -> None:
    p = InterleavedShard(0, 3)
    q = clone(p)
    assert type(q) is InterleavedShard
    assert (q.dim, q.num_local_stripes) == (0, 3)
    assert q == p and hash(q) == hash(p)


def test_interleaved_shard_split_matches_torchs_strided_split() -> None:
    # torch's _StridedShard(split_factor=F) split and our interleave agree: W*F equal runs, rank r takes r, r+W, ...
    t = torch.arange(12)
    shards, _ = InterleavedShard(0, 2)._split_tensor(t, 3, with_padding=False)
    assert [s.tolist() for s in shards] == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]


def test_interleaved_shard_accepted_by_dtensor_from_local() -> None:
    with _compat.fake_process_group(1, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
        dt = DTensor.from_local(torch.zeros(4, 3), mesh, (Shard(0), InterleavedShard(0, 2)), run_check=False)
        assert dt.shape == (16, 3)
        assert isinstance(dt.placements[1], InterleavedShard)
        assert _compat.is_dtensor(dt)
        assert _compat.dtensor_local(dt).shape == (4, 3)


# -- DTensor access, FSDP2, process groups -----------------------------------------------------------
def test_is_dtensor_and_dtensor_local() -> None:
    plain = torch.ones(2)
    assert not _compat.is_dtensor(plain)
    with _compat.fake_process_group(0, 1):
        mesh = init_device_mesh("cpu", (1,))
        dt = DTensor.from_local(plain, mesh, (Replicate(),), run_check=False)
        assert _compat.is_dtensor(dt)
        assert _compat.dtensor_local(dt) is dt._local_tensor
        # without _local_tensor, to_local() is used
        assert _compat.dtensor_local(SimpleNamespace(to_local=lambda: plain)) is plain


def test_fully_shard() -> None:
    with _compat.fake_process_group(1, 2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
        module = nn.Linear(3, 5, bias=False)  # weight (5, 3): rows 3, 2
        _compat.fully_shard(module, mesh=mesh)
        w = module.weight
        assert _compat.is_dtensor(w)
        assert tuple(w.placements) == (Shard(0),)
        assert w.to_local().shape == (2, 3)


def test_fake_process_group() -> None:
    assert not dist.is_initialized()
    with _compat.fake_process_group(3, 8):
        assert dist.is_initialized()
        assert (dist.get_rank(), dist.get_world_size()) == (3, 8)
    assert not dist.is_initialized()
    with _compat.fake_process_group(0, 2):  # a fresh group per rank, one after the other
        assert (dist.get_rank(), dist.get_world_size()) == (0, 2)
    assert not dist.is_initialized()


def test_fake_process_group_nested() -> None:
    with _compat.fake_process_group(3, 8):
        with _compat.fake_process_group(1, 2):  # entering replaces the outer group
            assert (dist.get_rank(), dist.get_world_size()) == (1, 2)
        assert not dist.is_initialized()
    assert not dist.is_initialized()  # regression: the outer exit used to raise "Process group cannot be None"


def test_fake_process_group_is_torn_down_on_error() -> None:
    with pytest.raises(RuntimeError, match="boom"), _compat.fake_process_group(0, 2):
        raise RuntimeError("boom")
    assert not dist.is_initialized()


def test_local_tensor_mode() -> None:
    mode = _compat.local_tensor_mode(2)
    try:
        from torch.distributed._local_tensor import LocalTensorMode
    except ImportError:
        assert mode is None
    else:
        assert isinstance(mode, LocalTensorMode)


def test_all_gather_flat_uses_the_installed_successor(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch 2.13 deprecates all_gather_into_tensor for all_gather_single: the shim must call the successor where it
    # exists and fall back to all_gather_into_tensor where it does not (each stand-in records its call)
    import torch.distributed as dist

    from workbench._compat import all_gather_flat

    calls: list[str] = []
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, send, group=None: calls.append("into_tensor"),
                        raising=False)
    monkeypatch.setattr(dist, "all_gather_single", lambda out, send, group=None: calls.append("single"),
                        raising=False)
    send, out = torch.arange(3.0), torch.empty(6)
    all_gather_flat(out, send, group="g")
    monkeypatch.delattr(dist, "all_gather_single")
    all_gather_flat(out, send, group="g")
    assert calls == ["single", "into_tensor"]


# -- process groups ------------------------------------------------------------------------------


def test_abort_nccl_communicators_leaves_gloo_groups_alone() -> None:
    """On NCCL it frees a rank stuck in a collective (tests/gpu/test_kernel_nccl.py); gloo groups are untouched."""
    assert _compat.abort_nccl_communicators() == 0  # no process group at all
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sub = dist.new_group([0])
        assert _compat.abort_nccl_communicators() == 0
        t = torch.ones(2)
        dist.all_reduce(t)
        dist.all_reduce(t, group=sub)
        assert t.tolist() == [1.0, 1.0] and dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_abort_nccl_communicators_aborts_each_nccl_backend_inside_one_group_call() -> None:
    calls: list[str] = []

    class ProcessGroupNCCL:  # what _get_backend(cuda) returns for an NCCL group (named as torch's class)
        def __init__(self, name: str) -> None:
            self.name = name

        def _group_start(self) -> None:
            calls.append("start")

        def _group_end(self) -> None:
            calls.append("end")

        def abort(self) -> None:
            calls.append(f"abort {self.name}")

    class Group:
        def __init__(self, backend: object) -> None:
            self.backend = backend

        def _get_backend(self, device: torch.device) -> object:
            if self.backend is None:
                raise RuntimeError(f"no backend for {device}")
            return self.backend

    world = SimpleNamespace(pg_map={Group(ProcessGroupNCCL("a")): 0, Group(None): 1, Group(ProcessGroupNCCL("b")): 2})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dist, "is_initialized", lambda: True)
        patch.setattr(dist.distributed_c10d, "_world", world)
        assert _compat.abort_nccl_communicators() == 2
    assert calls == ["start", "abort a", "abort b", "end"]


# -- flight recorder -----------------------------------------------------------------------------


def test_dump_nccl_trace_unpickles_torch_s_dump_without_stack_traces_or_says_none() -> None:
    from torch._C import _distributed_c10d as c10d

    calls: list[dict] = []
    dump = {"entries": [{"process_group": ("0", "default_pg"), "collective_seq_id": 4, "state": "started",
                         "profiling_name": "nccl:all_reduce"}], "pg_config": {}}

    def new_api(**kwargs: bool) -> bytes:  # torch >= 2.3: keyword flags
        calls.append(kwargs)
        return pickle.dumps(dump)

    def old_api() -> bytes:  # torch 2.2: no arguments
        calls.append({})
        return pickle.dumps(dump)

    with pytest.MonkeyPatch.context() as patch:
        patch.delattr(c10d, "_dump_nccl_trace", raising=False)
        assert _compat.dump_nccl_trace() is None  # a CPU build, or a torch without the recorder
        patch.setattr(c10d, "_dump_nccl_trace", new_api, raising=False)
        assert _compat.dump_nccl_trace(only_active=True) == dump
        assert calls == [{"includeCollectives": True, "includeStackTraces": False, "onlyActive": True}]
        patch.setattr(c10d, "_dump_nccl_trace", old_api, raising=False)
        assert _compat.dump_nccl_trace() == dump and calls[-1] == {}


def test_dump_fr_trace_shows_the_collective_a_gloo_rank_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")  # in case this process's recorder is not made yet
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        before = _compat.dump_fr_trace()
        if before is None:
            pytest.skip(f"torch {torch.__version__} has no flight recorder for gloo")
        t = torch.ones(2)
        dist.all_reduce(t)
        dist.all_reduce(t)
        entries = _compat.dump_fr_trace()["entries"]
    finally:
        dist.destroy_process_group()
    newest = entries[-1]
    assert newest["profiling_name"] == "gloo:all_reduce" and newest["process_group"][1] == "default_pg"
    assert newest["collective_seq_id"] == entries[-2]["collective_seq_id"] + 1  # numbered per group, in order


def test_default_store_is_the_worlds_store_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    assert not dist.is_initialized() and _compat.default_store() is None
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        found = _compat.default_store()
        before = store.num_keys()
        found.set("probe", "1")  # lands in the store the world was made with (under torch's prefix)
        assert found.get("probe") == b"1" and store.num_keys() == before + 1
        monkeypatch.delattr(c10d, "_get_default_store")  # a torch without the helper: None, callers skip
        assert _compat.default_store() is None
    finally:
        dist.destroy_process_group()
