"""HTML reprs: every object renders a table and a picture, bounded in size, and never raises."""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

from tests.viz.support import SAMPLES, cases, expert_tp_16, owners_from_runs
from workbench.io.hf.load import LoadReport
from workbench.io.hf.save import SaveResult
from workbench.io.hf.save_timings import SaveTimings
from workbench.layout.layout_file import load_layout, parse_placement
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec
from workbench.plan.load_plan import plan_hf_load
from workbench.plan.save_plan import plan_hf_save
from workbench.run.simulated import plan_save
from workbench.viz.colours import rank_colours
from workbench.viz.html import render_html

RECT = re.compile(r'<rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)" fill="(#[0-9a-f]{6})"/>')


def _objects(layout):
    spec = max(layout.specs.values(), key=lambda s: math.prod(s.global_shape))
    rank = layout.mesh.size - 1
    schedule = plan_save(layout, ranks=[rank], budget_bytes=1 << 30).schedules[rank]
    return [layout.mesh, spec, layout, plan_hf_load(spec, rank), plan_hf_save(spec, rank), schedule]


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_every_object_of_every_sample(path: Path) -> None:
    layout = load_layout(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a renderer that fails would warn and fall back: not here
        for obj in _objects(layout):
            text = obj._repr_html_()
            assert text.startswith('<div class="workbench-repr"'), type(obj).__name__
            assert "<table" in text and "<script" not in text
            assert len(text) < 200_000, f"{type(obj).__name__}: {len(text)} characters"


def test_layout_groups_repeated_layers() -> None:
    layout = load_layout(next(p for p in SAMPLES if p.stem == "deepseek_v3_671b"))
    text = layout._repr_html_()
    assert "model.layers.{3..61}.mlp.experts.fused_w1w3" in text
    assert "model.layers.3.mlp" not in text  # 989 parameters summarized by pattern, not listed
    assert "989 in 28 pattern(s)" in text


def test_spec_picture_colours_are_the_owners() -> None:
    spec = expert_tp_16()  # 16 x 4: the 240 x 120 picture has one raster row per tensor row
    text = spec._repr_html_()
    colour = rank_colours(spec.mesh)
    by_hex = {"#" + "".join(f"{round(255 * c):02x}" for c in colour(r)[:3]): r for r in spec.mesh.all_ranks()}
    owners = owners_from_runs(spec)[:, 0]
    rows = np.full(16, -2)
    for _, y, _, h, fill in RECT.findall(text):
        first, count = round(float(y) / 7.5), round(float(h) / 7.5)
        rows[first : first + count] = by_hex[fill]
    np.testing.assert_array_equal(rows, owners)
    assert text.count('stroke-dasharray="3,2"') == 3  # boundaries between the 4 HF keys


@pytest.mark.parametrize("name", sorted(cases()))
def test_spec_cases_render(name: str) -> None:
    spec = cases()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = render_html(spec)
    assert spec.describe_shards().replace(">", "&gt;") in text


def test_results_render() -> None:
    saved = SaveResult(path=Path("/tmp/ckpt"), rank=3, files=("model-00001-of-00002.safetensors",),
                       bytes_written=4096, seconds=0.5, calls=7, predicted_peak_bytes=1 << 20)
    text = render_html(saved)
    assert ">4 KiB<" in text and ">1 MiB<" in text and ">8 KiB/s<" in text
    timed = dataclasses.replace(saved, timings=SaveTimings(plan=0.012, snapshot=0.25, write=1.5, writeback_wait=0.75))
    text = render_html(timed)
    assert "timings" in text and "snapshot 0.250" in text and "writeback_wait 0.750" in text
    loaded = LoadReport(path=Path("/tmp/ckpt"), rank=1, parameters=5, bytes_read=2048, bytes_owned=1024, seconds=0.1,
                        missing=("a.weight",))
    text = render_html(loaded)
    assert "PROBLEMS" in text and "a.weight" in text and "2.000x" in text


def test_a_failing_renderer_warns_and_shows_the_repr() -> None:
    class LoadSpec:  # looks like one by name, but has none of its fields
        def __repr__(self) -> str:
            return "<broken & spec>"

    with pytest.warns(RuntimeWarning, match="could not render LoadSpec"):
        text = render_html(LoadSpec())
    assert text.startswith("<pre") and "&lt;broken &amp; spec&gt;" in text


FONT = re.compile(r'font-size(?:="|:\s*)([\d.]+)')
TEXT = re.compile(r'<text x="([\d.]+)" y="([\d.]+)"[^>]*fill="(#[0-9a-f]{6})">')
GROUP = re.compile(r'<g transform="translate\(([\d.]+),0\)">(.*?)</g>')


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_html_text_is_large_enough_and_theme_safe(path: Path) -> None:
    for obj in _objects(load_layout(path)):
        text = obj._repr_html_()
        sizes = [float(s) for s in FONT.findall(text)]
        assert sizes and min(sizes) >= 11, f"{type(obj).__name__}: font sizes {sorted(set(sizes))} (8 pt = 10.7 px)"
        # no fixed text colour that a dark notebook theme would hide: text colours are the theme's or chosen
        # against the fill they sit on
        assert "color: #" not in text, type(obj).__name__


def test_layout_heat_map_numbers_read_on_their_fill() -> None:
    from tests.viz.legibility import contrast

    text = load_layout(next(p for p in SAMPLES if p.stem == "toy_expert_tp"))._repr_html_()
    checked = 0
    for x0, group in GROUP.findall(text):
        rects = [(float(x), float(y), float(w), float(h), fill) for x, y, w, h, fill in RECT.findall(group)]
        for x, y, ink in TEXT.findall(text):
            x, y = float(x) - float(x0), float(y)
            under = [fill for rx, ry, rw, rh, fill in rects if rx <= x <= rx + rw and ry <= y <= ry + rh]
            if not under:
                continue
            rgb = [int(under[-1][i : i + 2], 16) / 255 for i in (1, 3, 5)]
            ink_rgb = [int(ink[i : i + 2], 16) / 255 for i in (1, 3, 5)]
            assert contrast(ink_rgb, rgb) >= 4.5, f"text {ink} on {under[-1]}"
            checked += 1
    assert checked >= 8  # every rank's number of the 8-rank toy


@pytest.mark.parametrize("shape", [(0, 4), (4, 0), (0,)], ids=str)
def test_a_zero_size_spec_keeps_its_table_without_a_picture(shape: tuple[int, ...]) -> None:
    spec = LoadSpec.from_placements("z", "z", shape, MeshSpec((8,), ("dp",)), [parse_placement("S(0)")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to the bare repr
        text = render_html(spec)
    assert text.startswith('<div class="workbench-repr"') and "LoadSpec z" in text
    assert f">{shape}<" in text  # the global shape row
    assert "<svg" not in text


def test_names_with_markup_are_escaped_in_every_repr() -> None:
    evil = "<script>alert(1)</script>&x"
    mesh = MeshSpec((2, 2), ("dp<b>", "tp&"))
    name = f"model.{evil}.weight"
    spec = LoadSpec.from_placements(name, [f"{name}.a", f"{name}.b"], (8, 4), mesh,
                                    [parse_placement("S(0)"), parse_placement("S(1)")], fused_dim=0)
    layout = Layout(mesh=mesh, specs={name: spec}, dtypes={name: "bfloat16"}, name=f"layout {evil}")
    schedule = plan_save(layout, budget_bytes=16).schedules[1]
    raw = re.compile(r"<script|<b>|&(?!amp;|lt;|gt;|quot;|#)")
    for obj in (mesh, spec, layout, plan_hf_load(spec, 1), plan_hf_save(spec, 1), schedule):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            text = render_html(obj)
        assert not raw.findall(text), (type(obj).__name__, raw.findall(text))
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&amp;x" in render_html(layout)
