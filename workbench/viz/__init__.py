"""Visualizers: text reports, matplotlib figures, HTML reprs and the ipywidgets explorer.

``plot_shard_offsets``, ``plot_mesh`` and ``plot_schedule`` return matplotlib Figures (headless-safe);
``explore`` returns an ipywidgets Widget; ``render_html`` is what every workbench object's ``_repr_html_`` uses.
"""

from workbench.viz.figures import plot_mesh, plot_schedule, plot_shard_offsets
from workbench.viz.html import render_html
from workbench.viz.measure import TimedCommunicator
from workbench.viz.text import layout_report
from workbench.viz.widgets import Explorer, explore

__all__ = [
    "Explorer",
    "TimedCommunicator",
    "explore",
    "layout_report",
    "plot_mesh",
    "plot_schedule",
    "plot_shard_offsets",
    "render_html",
]
