"""Every figure kind over every sample layout: text >= 8 pt, nothing cut or overlapping, readable text colours,
round binary ticks on every byte axis, hi-dpi PNGs, and a zoom that makes the chosen rank's part readable."""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import pytest

from tests.viz.legibility import byte_axis_problems, problems
from tests.viz.support import SAMPLES
from workbench.layout.layout_file import load_layout
from workbench.run.simulated import plan_save
from workbench.viz.figures import plot_mesh, plot_schedule, plot_shard_offsets
from workbench.viz.ticks import is_byte_axis
from workbench.viz.widgets import Explorer

IDS = [p.stem for p in SAMPLES]


@cache
def _layout(name: str):
    return load_layout(next(p for p in SAMPLES if p.stem == name))


def _largest(layout):
    return max(layout.specs.values(), key=lambda s: math.prod(s.global_shape))


def _expert_key(layout):
    """An HF key of a fused (expert) parameter, or None when the layout fuses nothing."""
    fused = [s for s in layout.specs.values() if s.is_fused]
    if not fused:
        return None
    spec = max(fused, key=lambda s: math.prod(s.global_shape))
    return spec.hf_keys[len(spec.hf_keys) // 2]


def _figures(name: str):
    """Every figure kind of one sample: (label, figure)."""
    layout = _layout(name)
    spec = _largest(layout)
    middle = layout.mesh.size // 2 + 1
    last = layout.mesh.size - 1
    out = [
        ("offsets largest, middle rank", plot_shard_offsets(layout, spec.name, rank=middle)),
        ("offsets largest, no rank", plot_shard_offsets(layout, spec.name)),
        ("mesh holding, group outlined", plot_mesh(layout.mesh, spec, highlight=(middle, layout.mesh.dim_names[-1]))),
        ("mesh plain", plot_mesh(layout.mesh, highlight=last)),
    ]
    key = _expert_key(layout)
    if key is not None:
        out.append(("offsets expert key, rank 0", plot_shard_offsets(layout, key, rank=0)))
    schedule = plan_save(layout, ranks=[middle], budget_bytes=1 << 30).schedules[middle]
    out.append(("schedule, 1 GiB budget", plot_schedule(schedule)))
    times = [1e-3] * schedule.num_calls
    out.append(("schedule, measured", plot_schedule(schedule, measured={
        "call_seconds": times, "seconds": 1.0, "peak_bytes": schedule.peak_bytes + 1,
        "predicted_peak_bytes": schedule.peak_bytes * 2})))
    return out


def _explorer_figures(name: str):
    layout = _layout(name)
    ex = Explorer(layout, rank=layout.mesh.size // 2 + 1, background=False)
    spec = _largest(layout)
    picture = ex._offsets_picture(spec.name, None)
    # the explorer shows the zoom's boxes and labels as an SVG drawn from the same scene as these artists
    # (tests/viz/test_zoom_svg.py): drawn here by matplotlib on the explorer's figures, they are checked too
    picture.drawing.show_rank(ex.rank.value)
    out = [(f"explorer {n}", f) for n, f in zip(("overview", "zoom"), picture.figs)]
    out.append(("explorer mesh", ex._mesh_picture(spec.name).figs[0]))
    from workbench.viz.html import _layout_bytes_per_rank
    from workbench.viz.mesh_figure import amount_figure

    out.append(("explorer heat", amount_figure(layout.mesh, _layout_bytes_per_rank(layout), "bytes per rank",
                                               figsize=(5.2, 3.2))))
    return out


@pytest.mark.parametrize("name", IDS)
def test_every_figure_is_legible(name: str) -> None:
    found, sizes = [], []
    for label, fig in _figures(name) + _explorer_figures(name):
        broken, smallest = problems(fig, f"{name} / {label}")
        found += broken
        sizes.append(smallest)
    assert not found, f"{len(found)} legibility problem(s):\n" + "\n".join(found[:40])
    assert min(sizes) >= 8.0


@pytest.mark.parametrize("name", IDS)
def test_byte_axes_tick_round_binary_units(name: str) -> None:
    layout = _layout(name)
    rank = layout.mesh.size - 1
    figures = []
    for budget in (None, 1 << 30, 3 << 20):
        schedule = plan_save(layout, ranks=[rank], budget_bytes=budget).schedules[rank]
        figures.append((f"schedule budget={budget}", plot_schedule(schedule)))
    figures += [(label, fig) for label, fig in _explorer_figures(name) if label == "explorer heat"]
    checked = 0
    found = []
    for label, fig in figures:
        fig.canvas.draw()
        for ax in fig.axes:
            for axis in (ax.xaxis, ax.yaxis):
                if is_byte_axis(axis) and axis.get_majorticklabels():
                    checked += 1
                    found += byte_axis_problems(axis, f"{name} / {label} / {ax.get_label() or 'axes'}")
    assert checked >= 7  # two per schedule (bytes gathered, memory), the heat map's colour bar
    assert not found, "\n".join(found)


@pytest.mark.parametrize("name", IDS)
def test_thin_rank_parts_get_a_readable_zoom(name: str) -> None:
    layout = _layout(name)
    spec = _largest(layout)
    for rank in (0, layout.mesh.size // 2 + 1, layout.mesh.size - 1):
        fig = plot_shard_offsets(layout, spec.name, rank=rank)
        rows, cols = fig.view.shape
        mine = sorted((b for b in fig.view.boxes if b.rank == rank), key=lambda b: (b.row0, b.col0))
        if not mine:
            continue
        first = mine[0]
        thin = (first.row1 - first.row0) < 0.05 * rows or (first.col1 - first.col0) < 0.05 * cols
        zoom = [a for a in fig.axes if a.get_label() == "zoom"]
        assert bool(zoom) == thin, f"{name} rank {rank}: zoom panel {bool(zoom)}, thin part {thin}"
        if not thin:
            continue
        ax = zoom[0]
        (c0, c1), (r1, r0) = ax.get_xlim(), ax.get_ylim()
        fig.canvas.draw()
        box = ax.get_window_extent()
        # the rank's part fills at least a quarter of the zoom along each axis it was thin on, and >= 24 px
        for lo, hi, wlo, whi, pixels in ((first.row0, first.row1, r0, r1, box.height),
                                         (first.col0, first.col1, c0, c1, box.width)):
            share = (min(hi, whi) - max(lo, wlo)) / (whi - wlo)
            assert share >= 0.25 and share * pixels >= 24, f"{name} rank {rank}: {share:.3f} of the zoom"
        window = [p for p in fig.axes[0].patches if p.get_gid() == "zoom-window"]
        assert len(window) == 1 and window[0].get_y() <= first.row0 and first.row1 <= window[0].get_y() + \
            window[0].get_height(), "the overview outlines the zoomed window around the rank's part"


def test_deepseek_rank_777_is_zoomed_from_a_one_pixel_line() -> None:
    layout = _layout("deepseek_v3_671b")
    fig = plot_shard_offsets(layout, "model.layers.3.mlp.experts.fused_w1w3", rank=777)
    (run,) = layout["model.layers.3.mlp.experts.fused_w1w3"].runs(777)
    assert run.sizes[0] == 1024 and fig.view.shape[0] == 1024 * 1024
    (r0, r1), (c0, c1) = fig.zoom
    assert r0 <= run.global_offset[0] and run.global_offset[0] + 1024 <= r1 and r1 - r0 <= 4 * 1024
    assert (c0, c1) == (0, fig.view.shape[1])


@pytest.mark.parametrize("name", ["toy_expert_tp", "llama3_8b"])
def test_notebook_pngs_are_hidpi(name: str) -> None:
    layout = _layout(name)
    spec = _largest(layout)
    schedule = plan_save(layout, ranks=[0], budget_bytes=1 << 30).schedules[0]
    for fig in (plot_shard_offsets(layout, rank=0), plot_mesh(layout.mesh, spec), plot_schedule(schedule)):
        data, meta = fig._repr_png_()
        pixels = int.from_bytes(data[16:20], "big")
        assert pixels == 2 * meta["width"]  # two pixels per CSS pixel
        assert meta["width"] >= math.floor(100 * fig.get_figwidth() + 1e-6)  # >= 100 CSS pixels per inch


def test_explorer_images_are_hidpi() -> None:
    ex = Explorer(_layout("deepseek_v3_671b"), rank=777, background=False)
    for image, fig in ((ex.offsets, ex._offsets_picture(ex.param.value, None).figs[0]),
                       (ex.zoom_image, ex._offsets_picture(ex.param.value, None).figs[1]),
                       (ex.mesh_image, ex._mesh_picture(ex.param.value).figs[0])):
        pixels = int.from_bytes(image.value[16:20], "big")
        css = int(image.width)
        assert pixels == 2 * css and css >= math.floor(100 * fig.get_figwidth() + 1e-6)


def test_rank_colour_is_the_same_in_every_view() -> None:
    layout = _layout("gpt_oss_120b")
    spec = _largest(layout)
    rank = 37
    offsets = plot_shard_offsets(layout, spec.name, rank=rank)
    boxes = next(c for c in offsets.axes[0].collections if c.get_gid() == "boxes")
    faces = boxes.get_facecolors()[::-1]  # drawn in reverse box order
    mine = {tuple(np.round(faces[i], 6)) for i, b in enumerate(offsets.view.boxes) if b.rank == rank}
    mesh = plot_mesh(layout.mesh, spec)
    panel, i, j = mesh.drawing.cell(rank)
    strips = next(c for c in mesh.drawing.panels[panel].collections if c.get_gid() == "rank-strips")
    ranks = mesh.drawing.ranks[panel]
    k = int(np.flatnonzero(ranks.ravel() == rank)[0])
    assert mine == {tuple(np.round(strips.get_facecolors()[k], 6))}
    plain = plot_mesh(layout.mesh)
    cell = plain.drawing.panels[panel].images[0].get_array()[i, j]
    assert tuple(np.round(cell, 6)) in mine
    # neighbours along the hue dim (ep) and along the lightness dims differ
    coord = layout.mesh.coordinate(rank)
    others = {layout.mesh.rank_at((*coord[:1], (coord[1] + 1) % 8, coord[2])),
              layout.mesh.rank_at(((coord[0] + 1) % 4, *coord[1:]))}
    colours = mesh.drawing.colours
    assert all(colours(o) != colours(rank) for o in others)
