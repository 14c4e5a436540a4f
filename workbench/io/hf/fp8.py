"""FP8 weights at run time: block dequantization, float8-safe gathers, and a dequantized state to save as bf16.

* ``dequantize_blocks(weight, scale_inv, block)``: ``weight * scale_inv`` broadcast over blocks, in float32, then
  cast (DeepSeek-V3's ``weight_dequant``, on any device, no kernel).
* ``Float8Communicator(inner)``: gloo has no float8 type ("Invalid scalar type"); this wraps any communicator and
  gathers 1-byte float dtypes as their bytes (``uint8``), bit for bit. Pass it to ``save_hf(..., comm=...)``.
* ``dequantized_state(model, layout, block)``: every float8 weight dequantized with its scale *on its own rank*
  (``workbench.layout.fp8`` proved each rank's scale rows are the blocks of its weight rows), the scales dropped,
  with the matching layout: ``save_hf(state, path, layout=layout)`` writes a bf16 checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from workbench.errors import LayoutError
from workbench.layout.fp8 import DEFAULT_BLOCK, FLOAT8_DTYPES, SCALE_SUFFIX, fp8_scale_names, with_fp8_scales
from workbench.layout.model_layout import Layout, local_tensors
from workbench.mesh import MeshDimRef
from workbench.run.communicator import own_prepare_gather

__all__ = ["Float8Communicator", "dequantize_blocks", "dequantized_state"]

_BYTE_FLOATS = frozenset(d for d in (getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")) if d is not None)


def dequantize_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``weight[i, j] * scale_inv[i // bm, j // bn]`` computed in float32, returned in ``dtype``.

    Raises:
        LayoutError: the scale's shape is not ``ceil(weight.shape / block)``.
    """
    want = tuple(-(-s // b) for s, b in zip(weight.shape, block))
    if len(block) != weight.dim() or tuple(scale_inv.shape) != want:
        raise LayoutError(f"a weight of shape {tuple(weight.shape)} in blocks of {tuple(block)} needs scales of shape "
                          f"{want}, got {tuple(scale_inv.shape)}")
    scale = scale_inv.float()
    for dim, size in enumerate(block):
        scale = scale.repeat_interleave(size, dim=dim).narrow(dim, 0, weight.shape[dim])
    return (weight.float() * scale).to(dtype)


class Float8Communicator:
    """A communicator that gathers float8 tensors as bytes (``uint8`` views) and forwards everything else.

    gloo's all-gather refuses float8 ("Invalid scalar type"); the bytes gathered are the same either way.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rank = inner.rank

    def prepare_gather(self, send: torch.Tensor, mesh_dim: MeshDimRef) -> Any:
        """The wrapped communicator's ``prepare_gather`` of what ``send`` travels as (a float8 tensor's bytes), so a
        receive buffer that cannot be made fails before the ranks' flags; None where it has none."""
        prepare = own_prepare_gather(self.inner)
        return prepare(_travelling(send), mesh_dim) if prepare is not None else None

    def all_gather(self, send: torch.Tensor, mesh_dim: MeshDimRef, *, prepared: Any = None) -> torch.Tensor:
        """``inner.all_gather`` on the bytes of a float8 tensor, viewed back as float8 (into ``prepared``'s buffer
        when given)."""
        extra = {} if prepared is None else {"prepared": prepared}
        out = self.inner.all_gather(_travelling(send), mesh_dim, **extra)
        return out.view(send.dtype) if send.dtype in _BYTE_FLOATS else out

    def any_flag(self, mesh_dim: MeshDimRef, flag: bool) -> bool:
        """As the wrapped communicator."""
        return self.inner.any_flag(mesh_dim, flag)

    def barrier(self) -> None:
        """As the wrapped communicator."""
        self.inner.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """As the wrapped communicator."""
        return self.inner.all_gather_object(obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _travelling(send: torch.Tensor) -> torch.Tensor:
    """What ``send`` is gathered as: a float8 tensor's bytes, any other tensor itself."""
    return send.contiguous().view(torch.uint8) if send.dtype in _BYTE_FLOATS else send


def dequantized_state(
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    layout: Layout,
    *,
    block: Sequence[int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
    suffix: str = SCALE_SUFFIX,
) -> tuple[dict[str, torch.Tensor], Layout]:
    """This rank's local tensors with every float8 weight dequantized (scales dropped), and their layout.

    Every rank calls it; no communication. Pass both to ``save_hf(state, path, layout=layout)``. The returned layout
    gives the dequantized weights ``dtype`` and every other parameter the dtype ``layout`` gave it, if any (none is
    assumed: ``save_hf`` writes such a tensor in its own dtype).

    Raises:
        LayoutError: a float8 weight has no scale in ``layout``, a cut falls inside a block, or the layout gives
            float8 for a tensor that is not float8 (dequantizing it would scale it twice).
    """
    # a float8 weight is found by its tensor's dtype too (a layout built from specs gives none); the other
    # parameters keep what the layout gave (none stays none)
    locals_ = local_tensors(model, layout)  # one walk of the model: the checked layout names the same parameters
    found = {n: str(t.dtype).removeprefix("torch.") for n, t in locals_.items()}
    # a weight the layout calls float8 whose tensor is not (already dequantized) would be scaled a second time
    wrong = [f"{n!r} is {found[n]}" for n, d in layout.dtypes.items()
             if d in FLOAT8_DTYPES and found[n] not in FLOAT8_DTYPES]
    if wrong:
        raise LayoutError(f"the layout gives float8 for parameter(s) whose tensor is not float8 "
                          f"({', '.join(wrong[:3])}): dequantizing them would apply their scales a second time; "
                          "give the layout the tensors' dtypes")
    layout = Layout(layout.mesh, layout.specs, {**layout.dtypes, **{n: d for n, d in found.items()
                                                                   if d in FLOAT8_DTYPES}}, name=layout.name)
    checked = with_fp8_scales(layout, block=block, suffix=suffix)
    scales = fp8_scale_names(layout, suffix=suffix)
    missing = [s for s in scales.values() if s not in layout.specs]
    if missing:
        raise LayoutError(f"float8 weight(s) without a scale in the layout: {missing[:3]} (expected names ending "
                          f"in {suffix!r})")
    me = _rank(checked)
    state, specs, dtypes = {}, {}, {}
    dropped = set(scales.values())
    for name, spec in checked.specs.items():
        if name in dropped:
            continue
        local = locals_[name]
        if name in scales:
            scale_local = locals_[scales[name]]
            want = checked.specs[scales[name]].local_shape(me)
            if tuple(scale_local.shape) != want:
                raise LayoutError(f"parameter {scales[name]!r}: rank {me} holds {tuple(scale_local.shape)}, its layout "
                                  f"says {want}")
            local = dequantize_blocks(local, scale_local, block, dtype)
            dtypes[name] = str(dtype).removeprefix("torch.")
        elif name in checked.dtypes:  # a dtype the layout was not given stays unknown: the save takes the tensor's
            dtypes[name] = checked.dtypes[name]
        state[name] = local
        specs[name] = spec
    return state, Layout(checked.mesh, specs, dtypes, name=checked.name)


def _rank(layout: Layout) -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    if layout.mesh.size != 1:
        raise LayoutError(f"{layout.mesh!r} has {layout.mesh.size} ranks but torch.distributed is not initialized")
    return layout.mesh.all_ranks()[0]
