"""Matplotlib figures: shard offsets of a tensor, the device mesh, and the unshard schedule with its memory.

Every function returns a ``matplotlib.figure.Figure`` built without pyplot (headless-safe, nothing is shown
or kept alive by a global figure manager). Large tensors are drawn by runs (one rectangle per box a rank
holds), never element by element; the data comes from ``workbench.viz.views``. Each figure lives in its own
module (``offsets_figure``, ``mesh_figure``, ``schedule_figure``); the shared rules (text sizes, rank colours,
byte ticks) in ``_style``, ``colours`` and ``ticks``.
"""

from __future__ import annotations

from workbench.viz.mesh_figure import plot_mesh
from workbench.viz.offsets_figure import plot_shard_offsets
from workbench.viz.schedule_figure import measured_of, plot_schedule

__all__ = ["measured_of", "plot_mesh", "plot_schedule", "plot_shard_offsets"]
