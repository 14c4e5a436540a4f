"""The explorer, driven in-process: moving its controls changes the views, and what it shows is the layout's."""

from __future__ import annotations

import html
import io

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


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)


def test_rank_slider_moves_the_outline(toy) -> None:
    app = explore(toy, param=W13, rank=4, background=False)
    assert isinstance(app, ipywidgets.Widget)
    ex = app.explorer
    at4 = ex.offsets.value
    ex.rank.value = 5
    at5 = ex.offsets.value
    assert at5 != at4
    assert [s.value for s in ex.coords] == list(toy.mesh.coordinate(5))
    # the outline moved from rank 4's rows (4:6) to rank 5's rows (6:8): pixels change only around those rows
    changed = np.nonzero((_pixels(at4) != _pixels(at5)).any(axis=(1, 2)))[0]
    fig = ex._offsets_picture(W13, None).drawing.fig
    ax = fig.axes[0]
    height = fig.get_figheight() * fig.dpi
    def pixel_row(row: float) -> float:
        return height - ax.transData.transform((0, row))[1]
    slack = 2.5 * fig.dpi / 72  # half the outline's white halo (3.6 pt) plus antialiasing, in pixels
    assert pixel_row(4) - slack <= changed.min() and changed.max() <= pixel_row(8) + slack
    ex.rank.value = 4
    assert ex.offsets.value == at4  # deterministic: back to the same picture


def test_coordinate_sliders_pick_the_rank(toy) -> None:
    ex = explore(toy, background=False).explorer
    fsdp, ep, tp = ex.coords
    fsdp.value, ep.value, tp.value = 1, 1, 0
    assert ex.rank.value == toy.mesh.rank_at((1, 1, 0)) == 6
    assert "rank 6 (fsdp=1, ep=1, tp=0)" in ex.info.value
    for region in toy[ex.param.value].key_regions(6):
        assert html.escape(str(region), quote=False) in ex.info.value


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
    alone = ex.mesh_image.value
    ex.group.value = "tp"
    assert ex.mesh_image.value != alone
    ex.group.value = "(rank only)"
    assert ex.mesh_image.value == alone
