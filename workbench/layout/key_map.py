"""Key maps: runtime parameter name -> the HF key(s) it holds (and the dim several keys are fused on)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from workbench.errors import LayoutError

__all__ = ["HFKeys", "KeyMap", "clean_name", "clean_names", "resolve_key_map"]

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
    """One runtime name without wrapper prefixes (activation checkpointing, torch.compile, FSDP1, DDP): only whole
    dotted components go, so ``text_module.weight`` stays itself (a text replace of ``module.`` made it
    ``text_weight``). A name alone cannot tell DDP's leading ``module`` from a child of that name: it goes here;
    ``clean_names`` decides from all of a model's names."""
    return clean_names((name,))[name]


def clean_names(names: Iterable[str]) -> dict[str, str]:
    """Every runtime name of one model (or state dict) without wrapper prefixes: the wrappers' components at any
    depth, and DDP's (DataParallel's) leading ``module`` only when every name has it (a wrapper holds the whole
    model there), so a model whose own child is named ``module`` beside others keeps that child's names."""
    parts = {raw: [p for p in raw.split(".") if p not in _WRAPPER_COMPONENTS] for raw in names}
    wrapped = bool(parts) and all(len(p) > 1 and p[0] == _DDP_PREFIX for p in parts.values())
    return {raw: ".".join(p[1:] if wrapped else p) for raw, p in parts.items()}


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
