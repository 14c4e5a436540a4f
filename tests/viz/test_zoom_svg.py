"""The explorer's zoom panel as an SVG (``OffsetsFigure.zoom_svg``) draws what the matplotlib zoom panel draws:
the same boxes and outlines at the same places, and every label with the same text, size and colour, placed
so that matplotlib itself, anchoring that text at the SVG's baseline, covers the label's extent (to a third of a
CSS pixel)."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from matplotlib.patches import Rectangle
from matplotlib.text import Text
from matplotlib.transforms import Bbox, IdentityTransform
from torch.distributed.tensor import Replicate, Shard

from tests.viz.support import SAMPLES
from workbench.layout import LoadSpec
from workbench.layout.layout_file import load_layout
from workbench.mesh import MeshSpec
from workbench.viz import _style
from workbench.viz.offsets_figure import OffsetsFigure
from workbench.viz.views import shard_view

SVG = "{http://www.w3.org/2000/svg}"
_HA = {"start": "left", "middle": "center", "end": "right"}


def _deepseek() -> OffsetsFigure:
    layout = load_layout(next(p for p in SAMPLES if p.stem == "deepseek_v3_671b"))
    spec = max(layout.specs.values(), key=lambda s: math.prod(s.global_shape))
    return _explorer_drawing(spec)


def _thin_columns() -> OffsetsFigure:
    """8 of 256 columns a rank, each part held by two replicas: column labels, ``xK`` marks, two-line names."""
    mesh = MeshSpec((2, 32), ("rep", "tp"))
    spec = LoadSpec.from_placements("w", "w", (8, 256), mesh, [Replicate(), Shard(1)])
    return _explorer_drawing(spec)


def _explorer_drawing(spec: LoadSpec) -> OffsetsFigure:
    """The drawing as the explorer makes it: the zoom in a figure of its own, laid out and drawn at 2x."""
    drawing = OffsetsFigure(spec, shard_view(spec), rank=None, zoom_panel="separate", figsize=(5.6, 4.6),
                            rank_note=False)
    drawing.zoom_fig.set_dpi(_style.DPI * 2)
    drawing.zoom_fig.canvas.draw()
    return drawing


def _points(fig, bbox) -> np.ndarray:
    """A display-pixel bbox as (x0, top, x1, bottom) in points from the figure's top left (the SVG's frame)."""
    k = 72 / fig.dpi
    height = fig.get_figheight() * 72
    return np.array([bbox.x0 * k, height - bbox.y1 * k, bbox.x1 * k, height - bbox.y0 * k])


def _compare(drawing: OffsetsFigure, rank: int | None) -> tuple[int, int]:
    svg = ET.fromstring(drawing.zoom_svg(rank))
    drawing.show_rank(rank)  # the same panel drawn by matplotlib
    fig = drawing.zoom_fig
    renderer = fig.canvas.get_renderer()
    mine = [a for a in drawing.dynamic if a.axes is drawing.zoom]
    width, height = fig.get_figwidth() * 72, fig.get_figheight() * 72
    assert svg.get("viewBox") == f"0 0 {width:g} {height:g}" and svg.get("width") == f"{width:g}pt"

    # boxes and outlines: the same rectangles in the same order
    rects = [r for r in svg.iter(f"{SVG}rect") if r.get("stroke") in ("#ffffff", "#000000")
             and not (r.get("fill") == "none" and r.get("stroke-width") == "0.8")]  # the panel's frame aside
    patches = [a for a in mine if isinstance(a, Rectangle)]
    assert len(rects) == len(patches)
    for rect, patch in zip(rects, patches):
        x, y, w, h = (float(rect.get(k)) for k in ("x", "y", "width", "height"))
        corners = patch.get_transform().transform([[0, 0], [1, 1]])  # the unit square -> display pixels
        want = _points(fig, Bbox([corners.min(0), corners.max(0)]))
        assert [x, y, x + w, y + h] == pytest.approx(list(want), abs=0.01)
        assert float(rect.get("stroke-width")) == patch.get_linewidth()
        fill = rect.get("fill")
        assert fill == ("none" if not patch.get_fill() else _hex(patch.get_facecolor()))

    # labels: same text, size and colour; matplotlib anchoring the text at the SVG's (x, last baseline) covers it
    texts = [a for a in mine if isinstance(a, Text)]
    labels = list(svg.iter(f"{SVG}text"))
    assert sorted(t.get_text() for t in texts) == sorted("\n".join(s.text for s in e) for e in labels)
    by_text = {"\n".join(s.text for s in e): e for e in labels}
    for artist in texts:
        element = by_text[artist.get_text()]
        spans = list(element)
        assert float(element.get("font-size")) == artist.get_fontsize() >= 8
        assert _hex(element.get("fill")) == _hex(artist.get_color())
        assert len({s.get("x") for s in spans}) == 1
        x, base = float(spans[0].get("x")), float(spans[-1].get("y"))
        k = fig.dpi / 72
        check = fig.text(x * k, (height - base) * k, artist.get_text(), fontsize=artist.get_fontsize(),
                         ha=_HA[element.get("text-anchor")], va="baseline", transform=IdentityTransform())
        got = _points(fig, check.get_window_extent(renderer))
        check.remove()
        # within a quarter point (a third of a CSS pixel): matplotlib measures hinted glyphs at the figure's dpi,
        # so a line with tall letters ("k", "h") may sit a fraction of a pixel off the font's ascent
        assert list(got) == pytest.approx(list(_points(fig, artist.get_window_extent(renderer))), abs=0.25), \
            artist.get_text()
    return len(patches), len(texts)


def _hex(colour) -> str:
    return _style.matplotlib().colors.to_hex(colour)


def test_deepseek_zoom_svg_draws_the_matplotlib_panel() -> None:
    drawing = _deepseek()
    for rank in (777, 0, 1023):
        boxes, labels = _compare(drawing, rank)
        assert boxes >= 3 and labels >= 4  # two neighbours and the rank, their names and the row offsets


def test_thin_columns_zoom_svg_draws_the_matplotlib_panel() -> None:
    drawing = _thin_columns()
    _, labels = _compare(drawing, 5)
    scene = drawing.zoom_scene(5)
    assert scene.col_values and any(b.label and "x2" in b.label for b in scene.boxes)
    assert any(b.label and "\n" in b.label for b in scene.boxes)  # the rank's name on two lines
    assert labels >= len(scene.col_values) + len(scene.row_values) + 2


def test_zoom_svg_message_when_no_rank_is_chosen() -> None:
    drawing = _thin_columns()
    _compare(drawing, None)
    svg = ET.fromstring(drawing.zoom_svg(None))
    assert [e.get("id") for e in svg.iter(f"{SVG}text")] == ["zoom-message"]
    assert not [r for r in svg.iter(f"{SVG}rect") if r.get("fill") not in (None, "none")]
