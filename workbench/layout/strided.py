"""``strided_shard``: the public name of FSDP2's strided placement (torch's private ``_StridedShard``)."""

from __future__ import annotations

from typing import Any

from workbench import _compat
from workbench.errors import LayoutError

__all__ = ["strided_shard"]


def strided_shard(dim: int, split_factor: int) -> Any:
    """The placement FSDP2 puts on a tensor that TP or EP already cut: ``_StridedShard(dim, split_factor)``.

    FSDP2 lists its shard *first* in a DTensor's placements (its mesh dim is the outer one), but physically
    cuts the TP/EP-local tensor *last*; ``split_factor`` is the product of the cuts already applied on ``dim``
    (their group sizes). workbench applies it last, as FSDP2 does, and layout files spell it ``SS(dim,k)``.

    Example: expert TP under FSDP2 on (fsdp=2, ep=2, tp=2), 16 rows, each EP rank's 8 rows interleaved over
    tp, then halved by fsdp::

        placements = [wb.strided_shard(0, 4), Shard(0), wb.InterleavedShard(0, num_local_stripes=2)]

    ====  ==============  ==========
    rank  (fsdp, ep, tp)  rows held
    ====  ==============  ==========
    0     (0, 0, 0)       0, 1
    4     (1, 0, 0)       4, 5
    5     (1, 0, 1)       6, 7
    ====  ==============  ==========

    Returns the installed torch's ``_StridedShard`` (a real DTensor placement), or workbench's fallback type
    on a torch without one.

    Raises:
        LayoutError: ``dim`` is negative or ``split_factor`` is not a positive int.
    """
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
        raise LayoutError(f"strided_shard: dim must be a non-negative int, got {dim!r}")
    if not isinstance(split_factor, int) or isinstance(split_factor, bool) or split_factor < 1:
        raise LayoutError(f"strided_shard: split_factor must be an int >= 1, got {split_factor!r}")
    return _compat.make_strided_shard(dim, split_factor)
