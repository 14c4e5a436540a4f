"""Visualizers: text reports now; matplotlib figures, HTML reprs and ipywidgets explorers build on them."""

from workbench.viz.text import layout_report

__all__ = ["layout_report"]
