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
