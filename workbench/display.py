"""Rich notebook reprs without an import up a layer: value types ask this registry, and ``workbench.viz`` fills it.

The exact core (``MeshSpec``, ``LoadSpec``, ``Layout``, the plans, the schedule) and the results of a save or
load carry an ``_repr_html_`` that looks its class up here; the presentation layer registers one renderer per
class when it is imported (``import workbench`` imports it). A class with no renderer answers ``None``, and a
notebook then shows its text ``repr``, so the core never needs the presentation layer to work. This module imports
nothing from workbench.

::

    register_html(LoadSpec, render_load_spec)   # in workbench.viz
    spec._repr_html_()                          # -> the renderer's HTML, or None
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["html_of", "register_html"]

_RENDERERS: dict[type, Callable[[Any], str]] = {}


def register_html(cls: type, render: Callable[[Any], str]) -> None:
    """Render instances of ``cls`` (and of its subclasses without their own renderer) with ``render``."""
    _RENDERERS[cls] = render


def html_of(obj: Any) -> str | None:
    """The HTML of ``obj`` from the renderer registered for its class or nearest base, or None when none is."""
    for cls in type(obj).__mro__:
        render = _RENDERERS.get(cls)
        if render is not None:
            return render(obj)
    return None
