"""DeviceMesh flattening, a private torch API, behind one shim (kept apart from the shared ``_compat.py``).

torchtitan flattens mesh dims for FSDP (``mesh["dp_shard", "cp"]._flatten("dp_shard_cp")``); torch has no public
name for it up to 2.13. ``Layout.from_model`` needs none of this (it reads a flattened dim from its ranks); tests
and sample scripts that *build* such meshes call ``flatten_mesh``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["flatten_mesh"]


def flatten_mesh(device_mesh: Any, dims: Sequence[str], name: str | None = None) -> Any:
    """The 1-D mesh of ``device_mesh``'s ``dims`` flattened into one, named ``name`` (default ``"_".join(dims)``).

    Raises:
        NotImplementedError: this torch has no way to flatten a DeviceMesh.
    """
    sub = device_mesh[tuple(dims)] if len(dims) > 1 else device_mesh[dims[0]]
    name = name or "_".join(dims)
    flatten = getattr(sub, "_flatten", None)
    if flatten is None:  # pragma: no cover - depends on the torch release
        raise NotImplementedError(f"this torch cannot flatten mesh dims {tuple(dims)} (DeviceMesh._flatten is gone)")
    return flatten(name)
