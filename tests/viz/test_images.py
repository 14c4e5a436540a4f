"""Image regression of a few figures against reviewed baselines (pytest-mpl; compared when run with ``--mpl``).

Baselines live in ``tests/viz/baseline/`` at 60 dpi (small files); regenerate them after a deliberate change
of the look with ``pytest --mpl-generate-path=tests/viz/baseline tests/viz/test_images.py`` and look at them.
The tolerance (RMS over 0-255 channels) absorbs text rasterized by another FreeType, not a moved outline, a
changed colour or a missing panel (``test_the_tolerance_catches_a_changed_figure``).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from tests.viz.support import SAMPLES, expert_tp_16
from workbench.layout.layout_file import load_layout
from workbench.run.simulated import plan_save
from workbench.viz.figures import plot_mesh, plot_schedule, plot_shard_offsets

TOLERANCE = 5
SAVE = {"dpi": 60}
COMPARE = {"baseline_dir": "baseline", "tolerance": TOLERANCE, "style": "default", "savefig_kwargs": SAVE}


@pytest.fixture(autouse=True)
def _needs_mpl(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("mpl_image_compare") and not (
        request.config.getoption("--mpl", default=False) or request.config.getoption("--mpl-generate-path",
                                                                                   default=None)):
        pytest.skip("image comparison runs with pytest-mpl's --mpl option")


def _graphics_only(fig):
    """What is compared: the drawing (boxes, colours, outlines, lines, images, the zoom window), each panel at
    its grid position and every text hidden. The layout engine places panels by the size of their labels, so
    another FreeType (other glyph metrics) would move every edge by a pixel or two; here nothing depends on
    glyphs (legends, whose swatches sit where their text puts them, are hidden too). Text sizes, overlaps and
    colours are checked by test_legibility."""
    from matplotlib.legend import Legend
    from matplotlib.text import Text

    fig.canvas.draw()
    fig.set_layout_engine("none")
    for ax in fig.axes:
        spec = ax.get_subplotspec()
        if spec is not None:
            ax.set_position(spec.get_position(fig))
    for artist in fig.findobj(lambda a: isinstance(a, (Text, Legend))):  # a legend's swatches follow its text
        artist.set_visible(False)
    return fig


@cache
def _layout(name: str):
    return load_layout(next(p for p in SAMPLES if p.stem == name))


def offsets_design_example():
    return plot_shard_offsets(expert_tp_16(), rank=5)


def mesh_toy_group():
    layout = _layout("toy_expert_tp")
    return plot_mesh(layout.mesh, layout["model.layers.0.mlp.experts.fused_w1w3"], highlight=(5, "tp"))


def schedule_toy_over_budget():
    return plot_schedule(plan_save(_layout("toy_expert_tp"), budget_bytes=64).schedules[5])


def offsets_deepseek_zoom():
    return plot_shard_offsets(_layout("deepseek_v3_671b"), "model.layers.3.mlp.experts.fused_w1w3", rank=777)


@pytest.mark.mpl_image_compare(**COMPARE)
def test_offsets_design_example():
    return _graphics_only(offsets_design_example())


@pytest.mark.mpl_image_compare(**COMPARE)
def test_mesh_toy_group():
    return _graphics_only(mesh_toy_group())


@pytest.mark.mpl_image_compare(**COMPARE)
def test_schedule_toy_over_budget():
    return _graphics_only(schedule_toy_over_budget())


@pytest.mark.mpl_image_compare(**COMPARE)
def test_offsets_deepseek_zoom():
    return _graphics_only(offsets_deepseek_zoom())


def test_the_tolerance_catches_a_changed_figure(tmp_path) -> None:
    """The comparison pytest-mpl makes, on what it compares: a redraw passes, so does a redraw whose glyphs
    have other metrics (FreeType's hinting off: labels of other widths, so another layout), and the rank
    outline moved by one rank fails."""
    import matplotlib
    import matplotlib.style
    from matplotlib.testing.compare import compare_images

    def save(name: str, rank: int, **rc) -> str:
        with matplotlib.style.context("default"), matplotlib.rc_context(rc):
            path = tmp_path / f"{name}.png"
            _graphics_only(plot_shard_offsets(expert_tp_16(), rank=rank)).savefig(path, **SAVE)
        return str(path)

    five = save("five", 5)
    assert compare_images(five, save("again", 5), tol=TOLERANCE) is None
    assert compare_images(five, save("unhinted", 5, **{"text.hinting": "no_hinting"}),
                          tol=TOLERANCE) is None
    moved = compare_images(five, save("four", 4), tol=TOLERANCE, in_decorator=True)
    assert moved is not None and np.isfinite(moved["rms"]) and moved["rms"] > 2 * TOLERANCE, moved
