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
    assert f"rank 0 holds none of {key}" in ex.message.value
    ex.rank.value = min(holders)
    assert ex.message.value == ""


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
    assert "rank 778 (dp=12, ep=10)" in ex.info.value and "planning" in ex.schedule_note.value
    assert ex.schedule_image.value == before  # the refresh returned without the schedule
    gate.set()
    ex.settle()
    assert ex.schedule_image.value != before and "rank 778:" in ex.schedule_note.value
    shown = ex._schedule(778)
    assert f"{shown.num_calls} call(s)" in ex.schedule_note.value
