"""FP8 block scales laid out with their weight: the scale grid follows the weight's cuts, block for block.

DeepSeek-V3 and other recent checkpoints store a ``float8_e4m3fn`` weight ``W`` of shape ``(M, N)`` next to a
float32 key ``W_scale_inv`` of shape ``(ceil(M/bm), ceil(N/bn))``: element ``(i, j)`` of the weight dequantizes
as ``W[i, j] * scale_inv[i // bm, j // bn]`` (blocks of 128 x 128 in DeepSeek-V3). A sharded runtime holds the
scale tensor with the same cuts as its weight, so each rank's scale rows are exactly the blocks of its weight rows
and dequantization is rank-local. That only works when every cut falls on a block boundary; a cut inside a block
is an error that names the key, the block and the rank.

Example, weight (12, 8), block (4, 4), FSDP over 3 ranks (``S(0)@fsdp``); the scale (3, 2) gets ``S(0)@fsdp`` too:

====  ==============  ===============
rank  weight rows     scale rows
====  ==============  ===============
0     0:4             0:1 (block 0)
1     4:8             1:2 (block 1)
2     8:12            2:3 (block 2)
====  ==============  ===============

Over 2 ranks the weight is cut at row 6, inside block 1 (rows 4:8): ``scale_spec`` raises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from workbench.errors import LayoutError
from workbench.layout.load_spec import LoadSpec
from workbench.layout.runs import Segment

__all__ = [
    "DEFAULT_BLOCK",
    "FLOAT8_DTYPES",
    "SCALE_SUFFIX",
    "check_scale_spec",
    "fp8_scale_names",
    "scale_shape",
    "scale_spec",
    "with_fp8_scales",
]

DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
FLOAT8_DTYPES = frozenset({"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"})


def scale_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """Shape of the block-scale tensor of a weight of ``shape``: ``ceil(shape / block)`` per dim."""
    if len(block) != len(shape) or any(b < 1 for b in block):
        raise LayoutError(f"FP8 block {tuple(block)} must give one positive size per dim of shape {tuple(shape)}")
    return tuple(math.ceil(s / b) for s, b in zip(shape, block))


def scale_spec(
    weight: LoadSpec,
    *,
    block: Sequence[int] = DEFAULT_BLOCK,
    name: str | None = None,
    suffix: str = SCALE_SUFFIX,
) -> LoadSpec:
    """The LoadSpec of ``weight``'s block scales: same mesh, same cuts, one element per block.

    HF keys are the weight's keys plus ``suffix`` (``x.weight`` -> ``x.weight_scale_inv``), fused on the same dim.
    Checked for every rank of the mesh (``check_scale_spec``).

    Raises:
        LayoutError: a cut inside a block (naming the key, block, rank and cut), fused keys not a whole number of
            blocks long, or an interleave the scale grid cannot follow.
    """
    block = tuple(int(b) for b in block)
    global_shape = scale_shape(weight.global_shape, block)
    visible = scale_shape(weight.visible_shape, block)
    where = f"FP8 weight {weight.hf_keys[0]!r} (parameter {weight.name!r})"
    if weight.fused_dim is not None and weight.key_size % block[weight.fused_dim]:
        raise LayoutError(
            f"{where}: each of its {len(weight.hf_keys)} fused keys is {weight.key_size} long on dim "
            f"{weight.fused_dim}, not a whole number of {block[weight.fused_dim]}-wide scale blocks"
        )
    try:
        scale = LoadSpec(
            name=name or weight.name + suffix,
            hf_keys=tuple(k + suffix for k in weight.hf_keys),
            global_shape=global_shape,
            mesh=weight.mesh,
            shards=weight.shards,
            fused_dim=weight.fused_dim,
            origin_shape=None if visible == global_shape else visible,
        )
    except LayoutError as exc:
        raise LayoutError(f"{where}: its scale grid {global_shape} (block {block}) cannot take its cuts: {exc}") \
            from None
    check_scale_spec(weight, scale, block)
    return scale


def check_scale_spec(weight: LoadSpec, scale: LoadSpec, block: Sequence[int] = DEFAULT_BLOCK) -> None:
    """Prove that on every rank the scale's elements are exactly the blocks of the weight's elements, in order.

    Raises:
        LayoutError: the scale has the wrong global shape, a weight cut falls inside a block (the message names
            the key, block, rank and cut), or the scale's own cuts give a rank other blocks than its weight needs.
    """
    block = tuple(int(b) for b in block)
    key = weight.hf_keys[0]
    want = scale_shape(weight.global_shape, block)
    if scale.global_shape != want:
        raise LayoutError(
            f"FP8 scale {scale.hf_keys[0]!r} has global shape {scale.global_shape}; weight {key!r} of shape "
            f"{weight.global_shape} in blocks of {block} needs {want}"
        )
    seen: set[Any] = set()
    for rank in weight.mesh.all_ranks():
        coord = tuple(weight.mesh.coordinate(rank)[i] for i in _cutting_dims(weight))
        if coord in seen:  # ranks that differ only on replicating mesh dims hold the same rows
            continue
        seen.add(coord)
        weight_segments, scale_segments = weight.segments(rank), scale.segments(rank)
        for dim, (segs, got) in enumerate(zip(weight_segments, scale_segments)):
            need = _block_segments(segs, weight.global_shape[dim], block[dim], key=key, dim=dim, rank=rank,
                                   weight=weight)
            if need != got:
                raise LayoutError(
                    f"FP8 scale {scale.hf_keys[0]!r}: rank {rank} holds scale blocks {_fmt(got)} on dim {dim}, but its "
                    f"weight rows {_fmt(segs)} need blocks {_fmt(need)} (block {block[dim]}; weight shards "
                    f"{weight.describe_shards()}, scale shards {scale.describe_shards()})"
                )


def _cutting_dims(spec: LoadSpec) -> tuple[int, ...]:
    return tuple(sorted({i for d in spec.shards for i in spec.mesh.dim_indices(d.mesh_dim)}))


def _block_segments(
    segments: Sequence[Segment], length: int, size: int, *, key: str, dim: int, rank: int, weight: LoadSpec
) -> tuple[Segment, ...]:
    out: list[Segment] = []
    for start, n in segments:
        for cut in (start, start + n):
            if cut % size and cut != length:
                b = cut // size
                raise LayoutError(
                    f"FP8 weight {key!r}: rank {rank} is cut at index {cut} of dim {dim}, inside scale block {b} "
                    f"(indices {b * size}:{min((b + 1) * size, length)}); every cut of an FP8 weight must fall on a "
                    f"block boundary (block size {size}, shards {weight.describe_shards()}, mesh {weight.mesh!r})"
                )
        first, stop = start // size, math.ceil((start + n) / size)
        if out and out[-1][0] + out[-1][1] == first:
            out[-1] = (out[-1][0], out[-1][1] + stop - first)
        else:
            out.append((first, stop - first))
    return tuple(out)


def _fmt(segments: Sequence[Segment]) -> str:
    return "[" + ", ".join(f"{g}:{g + n}" for g, n in segments) + "]"


def fp8_scale_names(layout: Any, *, suffix: str = SCALE_SUFFIX) -> dict[str, str]:
    """``{float8 weight name: its scale's name}`` for every float8 parameter of ``layout`` (scale may be absent)."""
    return {n: n + suffix for n in layout.specs if layout.dtypes.get(n) in FLOAT8_DTYPES}


def with_fp8_scales(layout: Any, *, block: Sequence[int] = DEFAULT_BLOCK, suffix: str = SCALE_SUFFIX) -> Any:
    """``layout`` with every float8 weight followed by its float32 block scale (checked when the layout already
    has it, derived with ``scale_spec`` when not).

    Raises:
        LayoutError: as ``scale_spec`` / ``check_scale_spec``.
    """
    from workbench.layout.model_layout import Layout

    specs: dict[str, LoadSpec] = {}
    dtypes = dict(layout.dtypes)
    scales = fp8_scale_names(layout, suffix=suffix)
    for name, spec in layout.specs.items():
        if name in specs:
            continue
        specs[name] = spec
        if name not in scales:
            continue
        scale_name = scales[name]
        if scale_name in layout.specs:
            check_scale_spec(spec, layout.specs[scale_name], block)
            specs[scale_name] = layout.specs[scale_name]
        else:
            specs[scale_name] = scale_spec(spec, block=block, name=scale_name, suffix=suffix)
            dtypes[scale_name] = "float32"
    return Layout(layout.mesh, specs, dtypes, name=layout.name)
