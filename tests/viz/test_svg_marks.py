"""``_style.artists_svg``: some artists of a figure alone, as an SVG that lies exactly over the figure's PNG."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from matplotlib.patches import Rectangle

from workbench.viz import _style

SVG = "{http://www.w3.org/2000/svg}"


def _figure():
    fig = _style.new_figure((4.0, 3.0))
    ax = fig.add_subplot(1, 1, 1)
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 5)
    ax.plot([0, 10], [0, 5], gid="static-line")
    fig.canvas.draw()
    fig.set_layout_engine("none")
    return fig, ax


def test_only_the_artists_where_the_figure_draws_them() -> None:
    fig, ax = _figure()
    fig.set_dpi(200)  # the explorer draws its figures at 2x; the SVG is in points whatever the dpi
    box = ax.add_artist(Rectangle((2, 1), 3, 2, fill=False, gid="mark"))
    label = ax.text(5, 4, "r17", gid="label")
    svg = ET.fromstring(_style.artists_svg(fig, [box, label]))
    assert fig.dpi == 200
    assert (svg.get("width"), svg.get("height")) == ("288pt", "216pt")  # 4 x 3 inches
    assert svg.find(f".//{SVG}g[@id='static-line']") is None  # nothing else of the figure
    assert svg.find(f".//{SVG}text") is None  # text drawn as outlines: shown the same without the font
    assert svg.find(f".//{SVG}g[@id='label']") is not None
    numbers = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", svg.find(f".//{SVG}g[@id='mark']/{SVG}path").get("d"))]
    points = np.array(numbers).reshape(-1, 2)
    # data (2..5, 1..3) on axes spanning x 0..10, y 0..5, placed at ``pos`` in the figure; SVG y runs down
    pos = ax.get_position()
    x = [288 * (pos.x0 + v / 10 * pos.width) for v in (2, 5)]
    y = [216 * (1 - pos.y0 - v / 5 * pos.height) for v in (3, 1)]
    assert (points[:, 0].min(), points[:, 0].max()) == pytest.approx(x, abs=1e-3)
    assert (points[:, 1].min(), points[:, 1].max()) == pytest.approx(y, abs=1e-3)


def test_deterministic_and_transparent() -> None:
    fig, ax = _figure()
    box = ax.add_artist(Rectangle((2, 1), 3, 2, fill=False, linestyle="--"))
    first = _style.artists_svg(fig, [box])
    assert _style.artists_svg(fig, [box]) == first  # fixed clip-path ids, no date: one picture, one byte string
    text = first.decode()
    assert "<dc:date>" not in text and "fill: #ffffff" not in text  # no background under the marks
    assert 'clip-path="url(#' in text  # clipped to the axes, as the figure clips it
