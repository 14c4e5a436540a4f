"""The explorer's state over a session: a policy the layout cannot take, and how many pictures it keeps."""

from __future__ import annotations

import html
import warnings

import pytest

from tests.viz.support import SAMPLES
from workbench.errors import PlanError
from workbench.layout.layout_file import load_layout
from workbench.plan.policy import SavePolicy
from workbench.plan.save_plan import plan_hf_save
from workbench.viz import widgets
from workbench.viz.widgets import explore

TOY = next(p for p in SAMPLES if p.stem == "toy_expert_tp")
W13 = "model.layers.0.mlp.experts.fused_w1w3"


@pytest.fixture(scope="module")
def toy():
    return load_layout(TOY)


def _why_not(toy, rank: int, policy: SavePolicy) -> str:
    """The planner's own refusal of ``policy`` for the toy's interleaved experts on ``rank``."""
    with pytest.raises(PlanError) as refused:
        plan_hf_save(toy[W13], rank, policy, runtime_dtype=toy.dtype(W13))
    return html.escape(str(refused.value), quote=False)


def test_a_policy_the_layout_cannot_take_says_why_in_the_note(toy) -> None:
    ex = explore(toy, rank=3, background=False).explorer
    ex.policy.value = "preserve(tp)"  # raised out of this change handler before
    assert _why_not(toy, 3, SavePolicy.preserve("tp")) in ex.schedule_note.value
    assert ex.schedule_image.layout.display == "none" and not ex.schedule_image.value  # not the 'full' picture
    ex.rank.value = 5
    assert "rank 5" in ex.schedule_note.value and _why_not(toy, 5, SavePolicy.preserve("tp")) in ex.schedule_note.value
    ex.policy.value = "full"
    assert "call(s)" in ex.schedule_note.value
    assert ex.schedule_image.layout.display is None and ex.schedule_image.value


def test_a_policy_refused_in_the_background_is_shown_not_warned(toy) -> None:
    ex = explore(toy, rank=3).explorer
    ex.settle()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex.policy.value = "preserve(tp)"
        ex.settle()
    assert not caught
    assert _why_not(toy, 3, SavePolicy.preserve("tp")) in ex.schedule_note.value
    assert ex.schedule_image.layout.display == "none"
    # a refusal that comes back after the controls moved on leaves the newer request's note alone
    ex.policy.value = "full"
    ex.settle()
    shown = ex.schedule_note.value
    ex._put_plan_error(("preserve(tp)", "unbounded", 3), "stale")
    assert ex.schedule_note.value == shown and ex.schedule_image.layout.display is None


def test_pictures_of_parameters_left_long_ago_are_dropped(toy, monkeypatch) -> None:
    # 4 pictures kept: the offsets and mesh pictures of 2 parameters (raising=False: the count is what is tested)
    monkeypatch.setattr(widgets, "_KEEP_PICTURES", 4, raising=False)
    names = list(toy.specs)
    ex = explore(toy, param=names[0], rank=3, background=False).explorer
    first = ex._offsets_picture(names[0], None)
    for name in names[1:]:
        ex.param.value = name
        assert len(ex._pictures) <= 4
    assert set(ex._pictures) == {("offsets", names[-2], None), ("mesh", names[-2]),
                                 ("offsets", names[-1], None), ("mesh", names[-1])}
    kept = ex._offsets_picture(names[-2], None)
    ex.param.value = names[-2]  # recent: shown from what was kept
    assert ex._offsets_picture(names[-2], None) is kept
    ex.param.value = names[0]  # left long ago: drawn again
    assert ex._offsets_picture(names[0], None) is not first


def test_the_shown_pictures_stay_while_hf_keys_of_one_parameter_come_and_go(toy, monkeypatch) -> None:
    monkeypatch.setattr(widgets, "_KEEP_PICTURES", 2, raising=False)
    ex = explore(toy, param=W13, rank=3, background=False).explorer
    mesh = ex._mesh_picture(W13)
    for key in toy[W13].hf_keys:
        ex.key.value = key
        assert set(ex._pictures) == {("offsets", W13, key), ("mesh", W13)}
    assert ex._mesh_picture(W13) is mesh
