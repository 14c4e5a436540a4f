"""Image regression of a few figures against reviewed baselines (pytest-mpl; ``--mpl`` is in pyproject's pytest
``addopts``, so every run compares them; ``-o addopts=""`` runs them without comparing).

Baselines live in ``tests/viz/baseline/`` at 60 dpi (small files); regenerate them after a deliberate change
of the look with ``pytest --mpl-generate-path=tests/viz/baseline tests/viz/test_images.py`` and look at them.
The tolerance (RMS over 0-255 channels) absorbs text rasterized by another FreeType, not a moved outline, a
changed colour or a missing panel (``test_the_tolerance_catches_a_changed_figure``, and end to end, as
``make test`` runs it, ``test_a_changed_figure_fails_against_its_baseline``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from tests.viz.support import SAMPLES, expert_tp_16
from workbench.layout.layout_file import load_layout
from workbench.run.simulated import plan_save
from workbench.viz.figures import plot_mesh, plot_schedule, plot_shard_offsets

ROOT = Path(__file__).resolve().parents[2]
BASELINE = Path(__file__).resolve().parent / "baseline"
TOLERANCE = 5
SAVE = {"dpi": 60}
COMPARE = {"baseline_dir": "baseline", "tolerance": TOLERANCE, "style": "default", "savefig_kwargs": SAVE}


@pytest.fixture(autouse=True)
def _needs_mpl(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("mpl_image_compare") and not (
        request.config.getoption("--mpl", default=False) or request.config.getoption("--mpl-generate-path",
                                                                                   default=None)):
        pytest.skip("image comparison runs with pytest-mpl's --mpl option (in pyproject's addopts)")


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


@pytest.mark.slow
def test_a_changed_figure_fails_against_its_baseline(tmp_path) -> None:
    """pytest run with this project's settings (pyproject's ``addopts``) compares a marked figure with its
    baseline: the baseline's own figure passes, the same figure with rank 4 outlined instead of rank 5 fails."""
    probe = tmp_path / "test_changed_figure.py"
    probe.write_text(
        "import pytest\n"
        "from tests.viz.test_images import COMPARE, _graphics_only, expert_tp_16, plot_shard_offsets\n"
        f"BASE = dict(COMPARE, baseline_dir={str(BASELINE)!r}, filename='test_offsets_design_example.png')\n"
        "@pytest.mark.mpl_image_compare(**BASE)\n"
        "def test_as_reviewed():\n"
        "    return _graphics_only(plot_shard_offsets(expert_tp_16(), rank=5))\n"
        "@pytest.mark.mpl_image_compare(**BASE)\n"
        "def test_outline_moved():\n"
        "    return _graphics_only(plot_shard_offsets(expert_tp_16(), rank=4))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"),
         "--rootdir", str(tmp_path), f"--mpl-results-path={tmp_path / 'results'}", str(probe)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert "1 failed, 1 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert "FAILED test_changed_figure.py::test_outline_moved" in run.stdout, run.stdout[-3000:]
