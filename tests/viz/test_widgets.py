"""The explorer, driven in-process: moving its controls changes the views, and what it shows is the layout's."""

from __future__ import annotations

import html
import io
import re
import xml.etree.ElementTree as ET

import ipywidgets
import numpy as np
import pytest
from PIL import Image

from tests.viz.support import SAMPLES
from workbench.layout.layout_file import load_layout
from workbench.plan.policy import SavePolicy
from workbench.run.simulated import plan_save
from workbench.viz.widgets import explore

TOY = next(p for p in SAMPLES if p.stem == "toy_expert_tp")
W13 = "model.layers.0.mlp.experts.fused_w1w3"


@pytest.fixture(scope="module")
def toy():
    return load_layout(TOY)


def _svg(data: bytes) -> ET.Element:
    return ET.fromstring(bytes(data))


def _path_points(svg: ET.Element, gid: str) -> np.ndarray:
    """The (x, y) points, in the SVG's point units, of the path of the artist with ``gid``."""
    group = svg.find(f".//{{http://www.w3.org/2000/svg}}g[@id='{gid}']")
    assert group is not None, f"no artist {gid!r} in the marks"
    numbers = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", group[0].get("d"))]
    return np.array(numbers).reshape(-1, 2)


def test_rank_slider_moves_the_outline(toy) -> None:
    app = explore(toy, param=W13, rank=4, background=False)
    assert isinstance(app, ipywidgets.Widget)
    ex = app.explorer
    base, at4 = ex.offsets.value, ex.marks["offsets"]
    ex.rank.value = 5
    assert [s.value for s in ex.coords] == list(toy.mesh.coordinate(5))
    assert ex.offsets.value == base  # the static picture stays; only its marks change
    at5 = ex.marks["offsets"]
    assert at5 != at4
    # rank 5 holds rows 6:8 of 16, every column: its outline sits there on the overview's axes (point units,
    # y down, from the axes' place in the figure)
    assert [(r.global_offset, r.sizes) for r in toy[W13].runs(5)] == [((6, 0), (2, 4))]
    fig = ex._offsets_picture(W13, None).drawing.fig
    box = fig.axes[0].get_position()
    width, height = fig.get_figwidth() * 72, fig.get_figheight() * 72
    points = _path_points(_svg(at5), "rank-5")
    def y(row: float) -> float:
        return height * (1 - box.y1 + row / 16 * box.height)
    assert points[:, 1].min() == pytest.approx(y(6), abs=0.01) and points[:, 1].max() == pytest.approx(y(8), abs=0.01)
    assert points[:, 0].min() == pytest.approx(width * box.x0, abs=0.01)
    assert points[:, 0].max() == pytest.approx(width * box.x1, abs=0.01)
    assert _svg(at5).find(".//{http://www.w3.org/2000/svg}g[@id='rank-4']") is None
    ex.rank.value = 4
    assert ex.marks["offsets"] == at4  # deterministic: back to the same picture


def _overlay(ex) -> dict[str, dict[str, str]]:
    """The inline ``<svg>`` elements of the explorer's overlay, by picture: their attributes and style."""
    from html.parser import HTMLParser

    found: dict[str, dict[str, str]] = {}

    class Parser(HTMLParser):
        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            if tag == "svg":
                style = dict(p.split(":", 1) for p in attrs["style"].split(";") if p)
                found[attrs["data-picture"]] = {**attrs, **style}

    Parser().feed(ex.rank_view.value)
    return found


def _px(value: str) -> float:
    return float(value.removesuffix("px"))


def test_marks_lie_exactly_over_their_pictures(toy) -> None:
    deepseek = load_layout(next(p for p in SAMPLES if p.stem == "deepseek_v3_671b"))
    for ex, names in ((explore(toy, param=W13, rank=3, background=False).explorer, ("offsets", "mesh")),
                      (explore(deepseek, rank=777, background=False).explorer, ("offsets", "zoom", "mesh"))):
        grid = ex.pictures.layout
        rows = grid.grid_template_rows.split()
        assert rows[0] == "auto"  # the text's row: the overlay's text sets its height
        rows = [0.0, *(_px(r) for r in rows[1:])]
        columns = [_px(c) for c in grid.grid_template_columns.split()]
        assert ex.rank_view.layout.grid_area == f"1 / 1 / {len(rows) + 1} / {len(columns) + 1}"  # over every cell
        images = {"offsets": ex.offsets, "zoom": ex.zoom_image, "mesh": ex.mesh_image}
        overlay = _overlay(ex)
        assert sorted(overlay) == sorted(names)
        for name in names:
            image, svg = images[name], overlay[name]
            assert image.layout.margin == ex.rank_view.layout.margin == "0"
            row, column = (int(v) for v in image.layout.grid_area.split(" / ")[:2])
            # the picture's cell starts where its marks do, and the PNG (2 pixels per CSS pixel) fills that size
            assert (_px(svg["left"]), _px(svg["top"])) == (sum(columns[:column - 1]), sum(rows[1:row - 1]))
            png_width, png_height = Image.open(io.BytesIO(image.value)).size
            assert (_px(svg["width"]), _px(svg["height"])) == (png_width / 2, png_height / 2)
            assert int(image.width) == png_width // 2
            assert columns[column - 1] >= png_width / 2 and rows[row - 1] >= png_height / 2
            # the SVG in points (72 per inch) over a figure of 100 CSS pixels per inch
            view = [float(v) for v in svg["viewbox"].split()]
            assert (view[2] * 100 / 72, view[3] * 100 / 72) == pytest.approx((png_width / 2, png_height / 2))
        text = ex.rank_view.value
        assert "<?xml" not in text and "<metadata" not in text and "<style" not in text  # nothing page-wide
        assert "fill: #ffffff" not in text  # no opaque background under the marks


def test_a_rank_change_from_the_page_sends_one_message(toy, monkeypatch) -> None:
    ex = explore(toy, param=W13, rank=4, background=False).explorer
    sent: list[tuple[ipywidgets.Widget, object]] = []
    monkeypatch.setattr(ipywidgets.Widget, "send_state", lambda self, key=None: sent.append((self, key)))
    ex.rank.set_state({"value": 5})  # as the page sends it: (fsdp=1, ep=0, tp=0) -> (1, 0, 1)
    coordinate = [(s, k) for s, k in sent if s in ex.coords]
    assert coordinate == [(ex.coords[2], "value")]  # the tp slider follows the rank
    assert [(s, k) for s, k in sent if s not in ex.coords] == [(ex.rank_view, "value")]
    assert "rank 5 (fsdp=1, ep=0, tp=1)" in ex.rank_view.value and 'data-picture="offsets"' in ex.rank_view.value


def test_coordinate_sliders_pick_the_rank(toy) -> None:
    ex = explore(toy, background=False).explorer
    fsdp, ep, tp = ex.coords
    fsdp.value, ep.value, tp.value = 1, 1, 0
    assert ex.rank.value == toy.mesh.rank_at((1, 1, 0)) == 6
    assert "rank 6 (fsdp=1, ep=1, tp=0)" in ex.rank_view.value
    for region in toy[ex.param.value].key_regions(6):
        assert html.escape(str(region), quote=False) in ex.rank_view.value


def test_parameter_and_key_choice(toy) -> None:
    ex = explore(toy, param="model.norm.weight", background=False).explorer
    assert list(ex.key.options) == ["(whole tensor)"]
    ex.param.value = W13
    assert list(ex.key.options)[1:] == list(toy[W13].hf_keys)
    whole = ex.offsets.value
    ex.key.value = toy[W13].hf_keys[1]
    assert ex.offsets.value != whole
    assert ex._offsets_picture(W13, toy[W13].hf_keys[1]).drawing.view.shape == (4, 4)


@pytest.mark.parametrize(("policy", "budget"), [("full", "1/4"), ("minimal", "unbounded"), ("preserve(ep)", "1/2")])
def test_policy_and_budget_give_the_planned_schedule(toy, policy: str, budget: str) -> None:
    ex = explore(toy, rank=5).explorer  # schedules planned and drawn in the background
    ex.settle()
    before = ex.schedule_image.value
    ex.policy.value, ex.budget.value = policy, budget
    largest = max(t.global_shape[0] * (t.global_shape[1] if len(t.global_shape) > 1 else 1)
                  * toy.dtype(n).itemsize for n, t in toy.specs.items())
    bytes_ = None if budget == "unbounded" else largest // int(budget.split("/")[1])
    rule = {"full": SavePolicy.full(), "minimal": SavePolicy.minimal(), "preserve(ep)": SavePolicy.preserve("ep")}
    expected = plan_save(toy, ranks=[5], policy=rule[policy], budget_bytes=bytes_).schedules[5]
    ex.settle()
    shown = ex._schedule(5)
    assert shown.structure() == expected.structure() and shown.peak_bytes == expected.peak_bytes
    assert f"{expected.num_calls} call(s)" in ex.schedule_note.value
    assert ex.schedule_image.value != before


def test_group_outline_changes_the_mesh(toy) -> None:
    ex = explore(toy, rank=5, background=False).explorer
    base, alone = ex.mesh_image.value, ex.marks["mesh"]
    ex.group.value = "tp"
    assert ex.mesh_image.value == base and ex.marks["mesh"] != alone
    # rank 5's group along tp is ranks 4 and 5: one thin outline per cell and a bold one around the block
    assert toy.mesh.group_ranks(5, "tp") == (4, 5)
    groups = _svg(ex.marks["mesh"]).findall(".//{http://www.w3.org/2000/svg}g[@id='highlight']")
    assert len(groups) == 1 and len(groups[0].findall("{http://www.w3.org/2000/svg}path")) == 2
    assert len(_svg(ex.marks["mesh"]).findall(".//{http://www.w3.org/2000/svg}g[@id='group']")) == 2
    ex.group.value = "(rank only)"
    assert ex.marks["mesh"] == alone


def test_pickers_are_searchable(toy) -> None:
    ex = explore(toy, background=False).explorer
    for picker in (ex.param, ex.key):
        assert isinstance(picker, ipywidgets.Combobox) and picker.ensure_option  # type to filter, no free text
    assert list(ex.param.options) == list(toy.specs)
    ex.param.value = "model.layers.0.mlp.experts.fused_w1w"  # typed, not (yet) a parameter: nothing changes
    assert ex._param_value == W13 and "no parameter is named" in ex.message.value


def test_a_rank_holding_none_of_the_key_says_so(toy) -> None:
    ex = explore(toy, param=W13, rank=0, background=False).explorer
    key = toy[W13].hf_keys[3]  # expert 1's up_proj: rows 12:16, held by ranks 6 and 7 (fsdp x ep x tp)
    ex.key.value = key
    holders = {r for r in toy.mesh.all_ranks() if any(reg.hf_key == key for reg in toy[W13].key_regions(r))}
    assert 0 not in holders and holders
    assert f"rank 0 holds none of {key}" in ex.rank_view.value
    ex.rank.value = min(holders)
    assert "holds none" not in ex.rank_view.value


def test_deepseek_rank_change_draws_the_zoom_and_never_waits_for_a_schedule() -> None:
    import threading

    layout = load_layout(next(p for p in SAMPLES if p.stem == "deepseek_v3_671b"))
    ex = explore(layout, rank=777).explorer
    ex.settle()
    assert ex.zoom_image.layout.display != "none" and ex.zoom_image.value  # 1,024 of 1,048,576 rows: zoomed
    gate = threading.Event()
    ex._worker.submit(("hold",), gate.wait, None)  # the background thread is busy
    ex.policy.value = "minimal"  # schedules now planned per rank, in the background
    before = ex.schedule_image.value
    ex.rank.value = 778
    assert "rank 778 (dp=12, ep=10)" in ex.rank_view.value and "planning" in ex.schedule_note.value
    assert ex.schedule_image.value == before  # the refresh returned without the schedule
    gate.set()
    ex.settle()
    assert ex.schedule_image.value != before and "planning" not in ex.schedule_note.value
    shown = ex._schedule(778)
    assert f"{shown.num_calls} call(s)" in ex.schedule_note.value


def test_ranks_next_to_the_chosen_one_are_drawn_ahead(toy, monkeypatch) -> None:
    from workbench.viz import _style

    ex = explore(toy, param=W13, rank=5).explorer  # rank 5 is (fsdp=1, ep=0, tp=1)
    ex.settle()
    drawn: list[int] = []
    real = _style.artists_svg
    monkeypatch.setattr(_style, "artists_svg", lambda fig, artists: drawn.append(1) or real(fig, artists))
    # one step on the rank slider (4, 6) or on a coordinate slider (fsdp -> 1, ep -> 7, tp -> 4): kept already
    for rank in (6, 4, 1, 7):
        ex.rank.value = rank
        assert not drawn, f"rank {rank} was drawn on the change, not ahead"
        fresh = explore(toy, param=W13, rank=rank, background=False).explorer
        assert ex.marks["offsets"] == fresh.marks["offsets"]  # what was drawn ahead is that rank's
        assert ex.marks["mesh"] == fresh.marks["mesh"]
        drawn.clear()
        ex.rank.value = 5
        ex.settle()
        drawn.clear()
    ex = explore(toy, param=W13, rank=0).explorer
    ex.settle()
    drawn.clear()
    ex.rank.value = 3  # (0, 1, 1): two steps from rank 0 on the slider and on the coordinate sliders
    assert drawn


def test_drawing_ahead_stops_when_a_control_moves(toy) -> None:
    import threading

    ex = explore(toy, param=W13, rank=5).explorer  # draws ahead 6, 4, 1 and 7
    ex.settle()
    offsets, mesh = ex._offsets_picture(W13, None), ex._mesh_picture(W13)
    started, release = threading.Event(), threading.Event()
    real = offsets._svg

    def slow(n, artists):  # the first drawing ahead for rank 2 waits until a control has moved
        if threading.current_thread() is not threading.main_thread():
            started.set()
            assert release.wait(10)
        return real(n, artists)

    offsets._svg = slow
    ex.rank.value = 2  # ahead, in order: 1 (kept already), 3's marks and mesh outline, then 6's and 0's
    assert started.wait(10)
    ex.group.value = "tp"  # a control moves while rank 3 is drawn ahead (the refresh does not wait for it)
    assert ex.marks["mesh"] == mesh._kept[(2, 3)]
    offsets._svg = real
    release.set()
    ex.settle()
    assert ("marks", 3) in offsets._kept  # the step under way ends ...
    outlined = {key for key in mesh._kept if len(key) == 1}
    assert not outlined & {(3,), (0,)}, outlined  # ... and the rest of that drawing ahead is dropped


def test_a_rank_change_sends_the_zoom_as_marks_drawn_ahead() -> None:
    from torch.distributed.tensor import Shard

    from workbench.layout import LoadSpec
    from workbench.layout.model_layout import Layout
    from workbench.mesh import MeshSpec
    from workbench.viz.offsets_figure import OffsetsFigure

    mesh = MeshSpec((32,), ("dp",))
    spec = LoadSpec.from_placements("w", "w", (64, 4), mesh, [Shard(0)])  # 2 of 64 rows a rank: zoomed
    layout = Layout(mesh, {"w": spec}, name="thin")
    ex = explore(layout, rank=10).explorer
    ex.settle()
    frame = ex.zoom_image.value
    assert ex.zoom_image.layout.display != "none" and 'data-picture="zoom"' in ex.rank_view.value
    assert b"r10 (dp=10)" in bytes(ex.marks["zoom"])  # the rank's boxes and labels are an SVG over the frame
    drawn: list[int | None] = []
    real = OffsetsFigure.zoom_svg

    def counted(self, rank):
        drawn.append(rank)
        return real(self, rank)

    OffsetsFigure.zoom_svg = counted
    try:
        ex.rank.value = 11  # drawn ahead: nothing drawn on the change
        assert drawn == []
        fresh = explore(layout, rank=11, background=False).explorer
        assert ex.marks["zoom"] == fresh.marks["zoom"]
        assert ex.zoom_image.value == frame == fresh.zoom_image.value  # the frame is sent once per parameter
        ex.settle()
        drawn.clear()
        ex.rank.value = 25  # far from any rank shown: drawn on the change, as an SVG
        assert drawn == [25] and b"r25 (dp=25)" in bytes(ex.marks["zoom"]) and ex.zoom_image.value == frame
    finally:
        OffsetsFigure.zoom_svg = real
