"""Shared helpers for the plan and run tests: random layouts, exact tensor comparison, independent oracles.

The oracles never call workbench's plan or run code: a rank's local tensor is rebuilt from the spec's
descriptors with plain index arithmetic (torch.chunk's ceil rule, the expert-TP interleave rule), so a
test comparing workbench with them compares two independent derivations. Only the descriptor order
(``spec.shards``, placement normalization) is taken from workbench; its own tests live in tests/layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Replicate, Shard

from workbench import _compat
from workbench.layout import InterleavedShard, LoadSpec
from workbench.layout.model_layout import Layout
from workbench.layout.normalize import normalize_placements
from workbench.mesh import MeshSpec

DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.float64, torch.int32)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# -- tensors ------------------------------------------------------------------------------------------
def random_tensor(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random raw bit patterns of ``dtype`` (NaNs, infinities and -0.0 included): equality is bitwise."""
    width = _BITS[dtype.itemsize]
    info = torch.iinfo(width)
    raw = torch.randint(info.min, info.max, tuple(shape), dtype=torch.int64, generator=gen).to(width)
    return raw.view(dtype)


def finite_tensor(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random finite values (for tests that cast between dtypes)."""
    if dtype.is_floating_point:
        return (torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * 100).to(dtype)
    return torch.randint(-1000, 1000, tuple(shape), generator=gen, dtype=torch.int64).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits (integer view of the same width)."""
    return t.contiguous().view(_BITS[t.dtype.itemsize]) if t.dtype != torch.bool else t


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Same dtype, same shape, same bits."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(bits(got), bits(want)), f"{what}: values differ"


# -- independent oracles --------------------------------------------------------------------------------
def oracle_chunk(n: int, world: int, index: int) -> range:
    """torch.chunk's rule written out: chunk = ceil(n / world), trailing chunks short or empty."""
    chunk = -(-n // world) if n else 0
    start = min(chunk * index, n)
    return range(start, min(start + chunk, n))


def oracle_dim_indices(spec: LoadSpec, rank: int, dim: int) -> list[int]:
    """Global indices of ``dim`` held by ``rank``, in local order, from the descriptors alone."""
    held = list(range(spec.global_shape[dim]))
    for d in spec.shards:
        if d.dim != dim:
            continue
        world = spec.mesh.group_size(d.mesh_dim)
        index = spec.mesh.group_rank(rank, d.mesh_dim)
        if d.interleave_factor == 1:
            held = [held[i] for i in oracle_chunk(len(held), world, index)]
        else:
            f = d.interleave_factor
            run = len(held) // (world * f)
            held = [held[(j * world + index) * run + i] for j in range(f) for i in range(run)]
    return held


def canonical_tensor(spec: LoadSpec, hf: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The runtime global tensor: keys concatenated on the fused dim, zero tail padding to global_shape."""
    keys = [hf[k] for k in spec.hf_keys]
    visible = keys[0] if spec.fused_dim is None else torch.cat(keys, dim=spec.fused_dim)
    out = torch.zeros(spec.global_shape, dtype=dtype)
    out[tuple(slice(0, s) for s in visible.shape)] = visible
    return out


def oracle_local(spec: LoadSpec, rank: int, canonical: torch.Tensor) -> torch.Tensor:
    """``rank``'s local tensor (padding is zero because ``canonical`` is zero there)."""
    index = np.ix_(*[np.array(oracle_dim_indices(spec, rank, d), dtype=np.int64)
                     for d in range(len(spec.global_shape))])
    return canonical[tuple(torch.from_numpy(i) for i in index)]


def oracle_kept_output(
    spec: LoadSpec, rank: int, canonical: torch.Tensor, gathered_mesh_dims: set[str]
) -> torch.Tensor:
    """Output of a gather-only save: the cuts touching none of ``gathered_mesh_dims`` stay applied (their
    indices, in local order), every other cut is undone, and tail padding is dropped."""
    per_dim = []
    for dim, length in enumerate(spec.global_shape):
        held = list(range(length))
        for d in spec.shards:
            names = {d.mesh_dim} if isinstance(d.mesh_dim, str) else set(d.mesh_dim)
            if d.dim != dim or names & gathered_mesh_dims:
                continue
            world, index = spec.mesh.group_size(d.mesh_dim), spec.mesh.group_rank(rank, d.mesh_dim)
            if d.interleave_factor == 1:
                held = [held[i] for i in oracle_chunk(len(held), world, index)]
            else:
                f, run = d.interleave_factor, len(held) // (world * d.interleave_factor)
                held = [held[(j * world + index) * run + i] for j in range(f) for i in range(run)]
        per_dim.append(np.array([i for i in held if i < spec.visible_shape[dim]], dtype=np.int64))
    index = np.ix_(*per_dim)
    return canonical[tuple(torch.from_numpy(i) for i in index)]


def padding_mask(plan: Any) -> torch.Tensor:
    """True where no read of a load plan lands (tail padding), from the plan's reads."""
    covered = torch.zeros(plan.target_shape, dtype=torch.int64)
    for r in plan.reads:
        covered[r.local_slices()] += 1
    assert covered.numel() == 0 or int(covered.max()) <= 1, "two reads land on the same local element"
    return covered == 0


# -- random layouts -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamGeometry:
    """What stays fixed between two layouts of one parameter: keys, checkpoint-visible shape, dtype."""

    name: str
    hf_keys: tuple[str, ...]
    visible_shape: tuple[int, ...]
    fused_dim: int | None
    dtype: torch.dtype

    @property
    def key_shape(self) -> tuple[int, ...]:
        shape = list(self.visible_shape)
        if self.fused_dim is not None:
            shape[self.fused_dim] //= len(self.hf_keys)
        return tuple(shape)


@st.composite
def geometries(draw: st.DrawFn, max_params: int = 3) -> tuple[ParamGeometry, ...]:
    """1..max_params parameters: plain, fused on dim 0 or dim 1, some dims zero-length."""
    out = []
    for p in range(draw(st.integers(1, max_params))):
        ndim = draw(st.integers(1, 3))
        shape = [draw(st.integers(0, 7)) for _ in range(ndim)]
        nkeys = draw(st.sampled_from([1, 1, 2, 3, 4]))
        fused = None
        if nkeys > 1:
            fused = draw(st.integers(0, min(1, ndim - 1)))  # fused on dim 0 or on dim 1
            shape[fused] = nkeys * draw(st.integers(1, 3))
            keys = tuple(f"p{p}.k{j}" for j in range(nkeys))
        else:
            keys = (f"p{p}.weight",)
        out.append(ParamGeometry(f"p{p}", keys, tuple(shape), fused, draw(st.sampled_from(DTYPES))))
    return tuple(out)


@st.composite
def small_meshes(draw: st.DrawFn, max_ranks: int = 64) -> MeshSpec:
    """1-3 mesh dims of size 1-4 (named m0, m1, m2)."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
    if math.prod(shape) > max_ranks:
        shape = tuple(min(s, 2) for s in shape)
    return MeshSpec(shape, tuple(f"m{i}" for i in range(ndim)))


@st.composite
def realizations(draw: st.DrawFn, geom: ParamGeometry, mesh: MeshSpec) -> LoadSpec:
    """A random runtime layout of ``geom`` on ``mesh``: TP / EP / ETP interleave / FSDP2-strided / HSDP /
    flattened FSDP, uneven contiguous cuts, and FP8-style tail padding (``origin_shape < global_shape``)."""
    ndim = len(geom.visible_shape)
    kinds = ["plain", "fsdp"] + (["hsdp", "flat"] if mesh.ndim >= 2 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "flat":  # one cut over two mesh dims flattened into one group (FSDP over fsdp+ep)
        dim = draw(st.integers(0, ndim - 1))
        return _finish(draw, geom, mesh, [Shard(dim)], [(mesh.dim_names[0], mesh.dim_names[1])])
    fsdp_at = {"plain": None, "fsdp": 0, "hsdp": 1}[kind]
    placements: list[Any] = []
    inner: dict[int, int] = {}  # tensor dim -> product of the inner group sizes cutting it
    for m in range(mesh.ndim):
        size = mesh.shape[m]
        if (kind == "hsdp" and m == 0) or m == fsdp_at:
            placements.append(Replicate())
            continue
        choice = draw(st.sampled_from(["R", "S", "S", "IS"]))
        if choice == "R":
            placements.append(Replicate())
            continue
        dim = draw(st.integers(0, ndim - 1))
        factor = draw(st.integers(2, 3)) if choice == "IS" else 1
        placements.append(InterleavedShard(dim, factor) if factor > 1 else Shard(dim))
        inner[dim] = inner.get(dim, 1) * size
    if fsdp_at is not None:  # FSDP2's rule: _StridedShard(d, k) over the inner cuts of d, else Shard(d)
        dim = draw(st.integers(0, ndim - 1))
        split = inner.get(dim, 1)
        placements[fsdp_at] = _compat.make_strided_shard(dim, split) if split > 1 else Shard(dim)
    return _finish(draw, geom, mesh, placements, None)


def _finish(draw: st.DrawFn, geom: ParamGeometry, mesh: MeshSpec, placements: list[Any],
            mesh_dims: list[Any] | None) -> LoadSpec:
    ndim = len(geom.visible_shape)
    order = normalize_placements(placements, mesh, ndim=ndim, mesh_dims=mesh_dims, name=geom.name)
    shape = []
    for dim, visible in enumerate(geom.visible_shape):
        chain = [d for d in order if d.dim == dim]
        last_is = max((i for i, d in enumerate(chain) if d.is_interleaved), default=-1)
        divisor = math.prod(mesh.group_size(d.mesh_dim) * d.interleave_factor for d in chain[: last_is + 1])
        if divisor > 1:  # an interleave needs W*F | N everywhere: pad the tail up (FP8-style padding)
            shape.append(-(-visible // divisor) * divisor + divisor * draw(st.integers(0, 1)))
        else:
            shape.append(visible + draw(st.sampled_from([0, 0, 0, 1, 2])))
    spec = LoadSpec.from_placements(
        geom.name, geom.hf_keys, shape, mesh, placements, fused_dim=geom.fused_dim,
        origin_shape=geom.visible_shape, mesh_dims=mesh_dims,
    )
    return spec


@st.composite
def layouts(draw: st.DrawFn, geoms: tuple[ParamGeometry, ...], max_ranks: int = 64) -> Layout:
    """A Layout of ``geoms`` on a random mesh."""
    mesh = draw(small_meshes(max_ranks))
    specs = {g.name: draw(realizations(g, mesh)) for g in geoms}
    return Layout(mesh, specs, {g.name: str(g.dtype).removeprefix("torch.") for g in geoms}, name="random")


def hf_checkpoint(geoms: Sequence[ParamGeometry], seed: int, *, finite: bool = False) -> dict[str, torch.Tensor]:
    """Random HF tensors for every key of ``geoms``."""
    gen = torch.Generator().manual_seed(seed)
    make = finite_tensor if finite else random_tensor
    return {k: make(g.key_shape, g.dtype, gen) for g in geoms for k in g.hf_keys}


def layout_of(mesh: MeshSpec, *specs: LoadSpec, dtypes: Mapping[str, str] | None = None) -> Layout:
    """A Layout of hand-made specs."""
    return Layout(mesh, {s.name: s for s in specs}, dict(dtypes or {}), name="test")


def spec(name: str, keys: Sequence[str] | str, shape: Sequence[int], mesh: MeshSpec, placements: Sequence[Any],
         **kwargs: Any) -> LoadSpec:
    """Shorthand for LoadSpec.from_placements."""
    return LoadSpec.from_placements(name, keys, shape, mesh, placements, **kwargs)


__all__ = [
    "DTYPES",
    "ParamGeometry",
    "assert_same",
    "bits",
    "canonical_tensor",
    "finite_tensor",
    "geometries",
    "hf_checkpoint",
    "layout_of",
    "layouts",
    "oracle_chunk",
    "oracle_dim_indices",
    "oracle_kept_output",
    "oracle_local",
    "padding_mask",
    "random_tensor",
    "realizations",
    "small_meshes",
    "spec",
]


@st.composite
def moe_layouts(draw: st.DrawFn) -> tuple[Layout, tuple[ParamGeometry, ...]]:
    """An MoE layer the way XTuner lays it out: ``fused_w1w3`` (gate/up per expert, fused on dim 0, EP then
    expert-TP interleave then FSDP2), ``fused_w2`` (down per expert, EP on dim 0, expert TP on dim 1) and a
    router FSDP-sharded over every rank. The EP size divides the expert count, so ``preserve("ep")`` is
    key-aligned."""
    ep, etp, fsdp = draw(st.integers(2, 4)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    mesh = MeshSpec((fsdp, ep, etp), ("fsdp", "ep", "etp"))
    local_experts = draw(st.integers(1, 2))
    experts = ep * local_experts
    inter = etp * draw(st.integers(1, 2))  # rows per gate/up key, divisible by etp
    hidden = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))
    w13_keys = tuple(f"e{e}.{p}" for e in range(experts) for p in ("gate", "up"))
    w2_keys = tuple(f"e{e}.down" for e in range(experts))
    geoms = (
        ParamGeometry("fused_w1w3", w13_keys, (experts * 2 * inter, hidden), 0, dtype),
        ParamGeometry("fused_w2", w2_keys, (experts * hidden, inter), 0 if experts > 1 else None, dtype),
        ParamGeometry("router", ("router",), (experts, hidden), None, torch.float32),
    )
    hidden_pad = draw(st.sampled_from([0, 0, 1]))  # FP8-style tail padding on the non-fused dim
    specs = {
        "fused_w1w3": LoadSpec.from_placements(
            "fused_w1w3", w13_keys, (experts * 2 * inter, hidden + hidden_pad), mesh,
            [_compat.make_strided_shard(0, ep * etp) if ep * etp > 1 else Shard(0), Shard(0),
             InterleavedShard(0, 2 * local_experts)],
            fused_dim=0, origin_shape=(experts * 2 * inter, hidden),
        ),
        "fused_w2": LoadSpec.from_placements(
            "fused_w2", w2_keys, (experts * hidden, inter), mesh,
            [_compat.make_strided_shard(0, ep) if ep > 1 else Shard(0), Shard(0), Shard(1)],
            fused_dim=0 if experts > 1 else None,
        ),
        "router": LoadSpec.from_placements("router", "router", (experts, hidden), mesh,
                                           [Shard(0)], mesh_dims=[("fsdp", "ep", "etp")]),
    }
    layout = Layout(mesh, specs, {g.name: str(g.dtype).removeprefix("torch.") for g in geoms}, name="moe")
    return layout, geoms
