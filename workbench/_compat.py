"""Every private (or moving) torch API workbench touches, each behind one shim with a fallback.

torch.distributed's tensor internals move between releases: ``_StridedShard`` stopped being a
``Shard`` subclass (2.13), ``_explicit_order_placements`` is gone (2.13), the chunk helper became
public (``Shard.local_shard_size_and_offset``). Code outside this module never names a private torch
symbol; ``tests/test_compat.py`` checks each shim and its fallback.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "HAS_TORCH_STRIDED_SHARD",
    "StridedShardBase",
    "abort_nccl_communicators",
    "all_gather_flat",
    "chunk_size_and_offset",
    "default_store",
    "dtensor_local",
    "dump_fr_trace",
    "dump_nccl_trace",
    "fake_process_group",
    "fsdp_shard_mesh_dims",
    "fully_shard",
    "is_dtensor",
    "is_partial",
    "is_replicate",
    "is_shard",
    "is_strided_shard",
    "local_tensor_mode",
    "make_strided_shard",
    "root_mesh",
    "strided_split_factor",
    "torch_explicit_order",
    "torch_local_shape_and_offset",
]

# -- placements ---------------------------------------------------------------------------------
try:  # torch >= 2.4 ships it; 2.13 keeps it private.
    from torch.distributed.tensor.placement_types import _StridedShard as _TorchStridedShard

    HAS_TORCH_STRIDED_SHARD = True
except ImportError:  # pragma: no cover - exercised through _FallbackStridedShard's own test
    _TorchStridedShard = None
    HAS_TORCH_STRIDED_SHARD = False

from torch.distributed.tensor.placement_types import Partial, Replicate, Shard


@dataclass(frozen=True)
class _FallbackStridedShard:
    """Stand-in for torch's ``_StridedShard`` when a torch release no longer has it.

    It carries the same two fields, so layout math keeps working; it cannot be used as a DTensor
    placement.
    """

    dim: int
    split_factor: int = 1


StridedShardBase: type = _TorchStridedShard if HAS_TORCH_STRIDED_SHARD else _FallbackStridedShard


def make_strided_shard(dim: int, split_factor: int) -> Any:
    """A ``_StridedShard(dim, split_factor)`` of the installed torch (or the fallback type)."""
    if StridedShardBase is _FallbackStridedShard:
        return _FallbackStridedShard(dim, split_factor)
    return StridedShardBase(dim, split_factor=split_factor)


def is_strided_shard(placement: Any) -> bool:
    """True for torch's ``_StridedShard`` (and subclasses such as InterleavedShard) or the fallback."""
    return isinstance(placement, (StridedShardBase, _FallbackStridedShard))


def strided_split_factor(placement: Any) -> int:
    """The split factor of a strided shard (torch has spelled it ``split_factor`` and ``sf``)."""
    for attr in ("split_factor", "sf"):
        value = getattr(placement, attr, None)
        if value is not None:
            return int(value)
    raise TypeError(f"{placement!r} has no split factor")


def is_shard(placement: Any) -> bool:
    """True for a plain contiguous ``Shard`` (not a strided shard, which older torch subclassed)."""
    return isinstance(placement, Shard) and not is_strided_shard(placement)


def is_replicate(placement: Any) -> bool:
    """True for ``Replicate``."""
    return isinstance(placement, Replicate)


def is_partial(placement: Any) -> bool:
    """True for ``Partial`` and its private variants (pending reductions)."""
    return isinstance(placement, Partial) or type(placement).__name__.lstrip("_").endswith("Partial")


# -- chunk rule and torch's own offsets (used as an oracle by the tests) --------------------------
def chunk_size_and_offset(n: int, world: int, index: int) -> tuple[int, int]:
    """Size and offset of chunk ``index`` when ``n`` elements are cut over ``world`` ranks.

    Calls torch's helper (public ``Shard.local_shard_size_and_offset`` since 2.9; private before);
    falls back to the same ceil-chunk rule written out.
    """
    public = getattr(Shard, "local_shard_size_and_offset", None)  # static, torch >= 2.9
    private = getattr(Shard(0), "_local_shard_size_and_offset", None)  # bound method before
    helper = public or private
    if helper is not None:
        with torch.device("cpu"):  # the helper may allocate on the default device, even "meta"
            size, offset = helper(n, world, index)
        return int(size), int(offset)
    return _chunk_fallback(n, world, index)


def _chunk_fallback(n: int, world: int, index: int) -> tuple[int, int]:
    chunk = math.ceil(n / world) if world else 0
    start = min(chunk * index, n)
    return min(start + chunk, n) - start, start


def torch_local_shape_and_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """torch's ``_compute_local_shape_and_global_offset`` on plain data (no DeviceMesh needed).

    This is torch's opinion of where a rank's shard starts; it follows torch's literal left-to-right
    placement semantics, which differ from what FSDP2 really does for an uneven ``_StridedShard``.
    Fallback: the same left-to-right walk for ``Shard`` and ``Replicate`` (strided shards raise).
    """
    try:
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as helper
    except ImportError:  # pragma: no cover - depends on torch release
        helper = None
    if helper is not None:
        shape, offset = helper(tuple(global_shape), tuple(mesh_shape), list(coordinate), list(placements))
        return tuple(int(s) for s in shape), tuple(int(o) for o in offset)
    return _local_shape_and_offset_fallback(global_shape, mesh_shape, coordinate, placements)


def _local_shape_and_offset_fallback(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape, offset = list(global_shape), [0] * len(global_shape)
    for mesh_dim, p in enumerate(placements):
        if is_strided_shard(p):
            raise NotImplementedError("fallback offsets do not model _StridedShard")
        if is_shard(p):
            size, start = _chunk_fallback(shape[p.dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
            offset[p.dim] = offset[p.dim] + start if size else global_shape[p.dim]
            shape[p.dim] = size
    return tuple(shape), tuple(offset)


def torch_explicit_order(mesh_shape: Sequence[int], placements: Sequence[Any]) -> list[tuple[int, Any]] | None:
    """torch's own placement ordering, where this torch has one (``_explicit_order_placements``).

    Returns ``None`` when the helper is gone (torch 2.13) or refuses the placements; callers then
    rely on ``workbench.layout.normalize``, which is the source of truth either way.
    """
    try:
        from torch.distributed.tensor._utils import _explicit_order_placements as helper
    except ImportError:
        return None
    try:
        return list(helper(tuple(mesh_shape), tuple(placements)))
    except (RuntimeError, NotImplementedError, AssertionError, TypeError):
        return None


# -- DTensor access -------------------------------------------------------------------------------
def is_dtensor(value: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, DTensor)


def dtensor_local(value: Any) -> torch.Tensor:
    """The rank-local tensor of a DTensor, without autograd or communication."""
    local = getattr(value, "_local_tensor", None)
    return local if local is not None else value.to_local()


def root_mesh(device_mesh: Any) -> Any:
    """The root DeviceMesh a (sub-)mesh was sliced from (``_get_root_mesh``; ``_mesh_resources`` before)."""
    getter = getattr(device_mesh, "_get_root_mesh", None)
    if getter is not None:
        with contextlib.suppress(Exception):
            return getter()
    try:
        from torch.distributed.device_mesh import _mesh_resources

        return _mesh_resources.get_root_mesh(device_mesh)
    except (ImportError, AttributeError):
        return device_mesh


def fsdp_shard_mesh_dims(module: torch.nn.Module) -> set[str]:
    """Names of the mesh dims FSDP2 shards parameters over anywhere in ``module`` (empty when none).

    Reads FSDP2's private state (``_get_fsdp_state()._fsdp_param_group.mesh_info``); falls back to an empty set
    when that moves, and layouts then rely on the strided shard's split factor alone.
    """
    names: set[str] = set()
    for sub in module.modules():
        getter = getattr(sub, "_get_fsdp_state", None)
        if getter is None:
            continue
        try:
            info = getter()._fsdp_param_group.mesh_info
            dims = info.mesh.mesh_dim_names
            if dims:
                names.add(dims[getattr(info, "shard_mesh_dim", 0) or 0])
        except (AttributeError, IndexError, TypeError):
            continue
    return names


def all_gather_flat(output: torch.Tensor, send: torch.Tensor, group: Any = None) -> None:
    """Gather every rank's ``send`` into ``output`` (rank-major) with one collective.

    ``all_gather_single`` where this torch has it (2.13 deprecates ``all_gather_into_tensor`` for it), else
    ``all_gather_into_tensor``.
    """
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, send, group=group)


# -- FSDP2, fake process groups, local tensor mode ------------------------------------------------
def fully_shard(module: torch.nn.Module, **kwargs: Any) -> Any:
    """FSDP2's ``fully_shard`` (public since 2.6; ``torch.distributed._composable.fsdp`` before)."""
    try:
        from torch.distributed.fsdp import fully_shard as impl
    except ImportError:  # pragma: no cover
        from torch.distributed._composable.fsdp import fully_shard as impl
    return impl(module, **kwargs)


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """A default process group of any size in this one process, posing as ``rank`` (no comms).

    Uses torch's test-only ``FakeStore``/``fake`` backend. DeviceMeshes and FSDP2 can be built on it;
    collectives return garbage, so only metadata and rank-local values are meaningful.
    """
    import torch.distributed as dist

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:  # pragma: no cover
        raise RuntimeError("this torch has no fake process group (torch.testing._internal)") from exc
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():  # a nested fake_process_group may already have replaced and destroyed it
            dist.destroy_process_group()


def local_tensor_mode(world_size: int) -> Any:
    """torch's all-ranks-in-one-process simulation (``LocalTensorMode``), or ``None`` if absent."""
    try:
        from torch.distributed._local_tensor import LocalTensorMode
    except ImportError:
        return None
    return LocalTensorMode(world_size)


# -- process groups ------------------------------------------------------------------------------
def default_store() -> Any:
    """The key-value store of the default process group (``_get_default_store``), or None where this torch has no
    such helper or no world is initialized."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store
    except ImportError:  # pragma: no cover - a torch without it: callers skip what needs the store
        return None
    try:
        return _get_default_store()
    except (RuntimeError, ValueError):
        return None


def abort_nccl_communicators() -> int:
    """Abort the NCCL communicators of every process group of this process (``ncclCommAbort``); return how many
    groups had one. The groups stay registered: destroy them afterwards (``destroy_process_group``).

    A rank blocked in an NCCL collective, or in a CUDA sync waiting on one, returns even though its peers never
    joined; destroying the groups instead would wait for them. Safe from a thread other than the one blocked.
    Gloo backends are left alone (aborting a gloo group can itself block). The aborts run inside one NCCL group
    call, as torch's own ``_abort_process_group`` does (several communicators aborted one by one can deadlock).
    torch keeps the list of groups private (``_world.pg_map``); without it only the default group is aborted.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", None) or [dist.group.WORLD])
    backends = []
    for group in groups:
        try:
            backend = group._get_backend(torch.device("cuda"))
        except (RuntimeError, AttributeError, ValueError):
            continue
        if type(backend).__name__ == "ProcessGroupNCCL" and hasattr(backend, "abort"):
            backends.append(backend)
    if not backends:
        return 0
    grouped = hasattr(backends[0], "_group_start")
    if grouped:
        backends[0]._group_start()
    try:
        for backend in backends:
            backend.abort()
    finally:
        if grouped:
            backends[0]._group_end()
    return len(backends)


# -- flight recorder -----------------------------------------------------------------------------
def dump_nccl_trace(*, only_active: bool = False) -> dict[str, Any] | None:
    """torch's NCCL flight recorder of this process, as a dict (``entries``: the last collectives of every NCCL
    group, each with ``process_group`` (name, desc), ``profiling_name``, ``collective_seq_id`` and ``state``;
    ``pg_config``; ``pg_status``), or ``None`` where this torch has no NCCL recorder (CPU builds, releases
    without ``_dump_nccl_trace``).

    Stack traces are left out: symbolizing them needs the GIL, which a rank's stuck main thread may hold. The
    recorder holds entries only while ``TORCH_FR_BUFFER_SIZE`` / ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (read when the
    first group is made) is above 0; torch 2.10+ keeps 2000 by default, older releases none.
    """
    return _flight_recorder("_dump_nccl_trace", only_active)


def dump_fr_trace(*, only_active: bool = False) -> dict[str, Any] | None:
    """``dump_nccl_trace`` for the other backends' recorder (gloo; torch 2.8+), ``None`` where torch has none."""
    return _flight_recorder("_dump_fr_trace", only_active)


def _flight_recorder(name: str, only_active: bool) -> dict[str, Any] | None:
    import pickle

    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None
    dump = getattr(c10d, name, None)
    if dump is None:
        return None
    try:
        raw = dump(includeCollectives=True, includeStackTraces=False, onlyActive=only_active)
    except TypeError:  # torch <= 2.2 took no arguments
        raw = dump()
    return pickle.loads(raw)  # torch's own pickle of plain dicts and lists, made in this process
