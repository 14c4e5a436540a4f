"""Key maps: runtime parameter name -> the HF key(s) it holds (and the dim several keys are fused on)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from workbench.errors import LayoutError

__all__ = ["HFKeys", "KeyMap", "clean_name", "resolve_key_map"]

# the attributes wrappers hold a module under, as whole components of a name at any depth (activation
# checkpointing, torch.compile, FSDP1), and DDP's (DataParallel's), which leads the name once
_WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})
_DDP_PREFIX = "module"


@dataclass(frozen=True, slots=True)
class HFKeys:
    """The HF keys of one runtime tensor, concatenated in this order along ``fused_dim``."""

    keys: tuple[str, ...]
    fused_dim: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", (self.keys,) if isinstance(self.keys, str) else tuple(self.keys))
        if len(self.keys) > 1 and self.fused_dim is None:
            object.__setattr__(self, "fused_dim", 0)


# A callable returning a key, a list of keys (fused on dim 0) or HFKeys, or None for "not saved"; or a
# table {regex: replacement or [replacements]} whose first fully matching pattern wins (``\1`` groups expand).
KeyMap = Callable[[str], "str | Sequence[str] | HFKeys | None"] | Mapping[str, "str | Sequence[str]"]


def clean_name(name: str) -> str:
    """A runtime name without wrapper prefixes (activation checkpointing, torch.compile, FSDP1, DDP): only whole
    dotted components go, so ``text_module.weight`` stays itself (a text replace of ``module.`` made it
    ``text_weight``), and of DDP's ``module`` only the leading one (a child of the model may be named so)."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_COMPONENTS]
    if len(parts) > 1 and parts[0] == _DDP_PREFIX:
        parts = parts[1:]
    return ".".join(parts)


def resolve_key_map(key_map: KeyMap | None) -> Callable[[str], HFKeys | None]:
    """A callable ``name -> HFKeys | None`` from any accepted key-map form (None: the identity)."""
    if key_map is None:
        return lambda name: HFKeys((name,))
    if callable(key_map):
        return lambda name: _as_keys(key_map(name), name)
    table = [(re.compile(pattern), value) for pattern, value in key_map.items()]

    def lookup(name: str) -> HFKeys | None:
        for pattern, value in table:
            match = pattern.fullmatch(name)
            if match:
                templates = [value] if isinstance(value, str) else list(value)
                return _as_keys([match.expand(t) for t in templates], name)
        return None

    return lookup


def _as_keys(value: object, name: str) -> HFKeys | None:
    if value is None or isinstance(value, HFKeys):
        return value
    if isinstance(value, str):
        return HFKeys((value,))
    if isinstance(value, Sequence) and value and all(isinstance(k, str) for k in value):
        return HFKeys(tuple(value))
    raise LayoutError(f"key map returned {value!r} for parameter {name!r}; expected a key, a list of keys or HFKeys")
