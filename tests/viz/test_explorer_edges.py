"""The explorer on what a checkpoint may hold: names with markup, a pipeline stage's sub-mesh, a scalar."""

from __future__ import annotations

import re

import ipywidgets
import pytest

from workbench.errors import LayoutError
from workbench.layout.layout_file import parse_placement
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec
from workbench.viz.widgets import explore

EVIL = "<script>alert(1)</script>&x"
# markup or a bare '&' that did not come from html.escape
RAW = re.compile(r"<script|<img|<i>|&(?!amp;|lt;|gt;|quot;|#)")


def _layout(mesh: MeshSpec, name: str = "w", layout_name: str = "stage") -> Layout:
    keys = [f"{name}.a", f"{name}.b"]
    spec = LoadSpec.from_placements(name, keys, (8, 4), mesh, [parse_placement("S(0)"), parse_placement("S(1)")],
                                    fused_dim=0)
    return Layout(mesh=mesh, specs={name: spec}, dtypes={name: "bfloat16"}, name=layout_name)


def _html_values(widget: ipywidgets.Widget) -> list[str]:
    found = [widget.value] if isinstance(widget, ipywidgets.HTML) else []
    for child in getattr(widget, "children", ()):
        found += _html_values(child)
    return found


def _raw(app: ipywidgets.Widget) -> list[str]:
    return [v[max(0, m.start() - 40): m.start() + 40] for v in _html_values(app) for m in RAW.finditer(v)]


def test_names_with_markup_are_escaped_in_every_html_value() -> None:
    mesh = MeshSpec((2, 2), ("dp<img src=x>", "tp&"))
    param = f"model.{EVIL}.weight"
    app = explore(_layout(mesh, param, f"ckpt {EVIL}"), background=False)
    ex = app.explorer
    assert _raw(app) == []
    ex.rank.value = 3
    ex.key.value = f"{param}.b"
    assert _raw(app) == []
    ex.param.value = "typed <i>&"  # names no parameter: a warning quoting it
    assert "typed &lt;i&gt;&amp;" in ex.message.value
    assert _raw(app) == []
    title = _html_values(app)[0]
    assert f"<b>ckpt {EVIL.replace('&', '&amp;').replace('<', '&lt;').replace('>', '&gt;')}</b>" in title
    assert "dp&lt;img src=x&gt;=1, tp&amp;=1" in ex.rank_view.value  # rank 3's coordinate


@pytest.mark.parametrize("ranks", [(4, 5, 6, 7), (7, 6, 5, 4), tuple(range(32, 64))], ids=["4-7", "reversed", "32-63"])
def test_a_sub_mesh_of_consecutive_ranks_slides_over_them(ranks: tuple[int, ...]) -> None:
    mesh = MeshSpec((2, len(ranks) // 2), ("dp", "tp"), ranks=ranks)
    ex = explore(_layout(mesh), background=False).explorer
    assert ex.rank.value == ranks[0]  # the mesh's first rank, not 0
    assert (ex.rank.min, ex.rank.max) == (min(ranks), max(ranks))
    last = ranks[-1]
    ex.rank.value = last
    assert [s.value for s in ex.coords] == list(mesh.coordinate(last))
    assert f"rank {last} (" in ex.rank_view.value
    ex.coords[0].value = 0
    assert ex.rank.value == mesh.rank_at((0, mesh.shape[1] - 1))
    ex = explore(_layout(mesh), rank=ranks[1], background=False).explorer
    assert ex.rank.value == ranks[1]


def test_a_sub_mesh_with_gaps_stops_at_its_ranks_only() -> None:
    mesh = MeshSpec((2, 2), ("dp", "tp"), ranks=(0, 2, 4, 6))
    ex = explore(_layout(mesh), background=False).explorer
    assert isinstance(ex.rank, ipywidgets.SelectionSlider)
    assert tuple(ex.rank.options) == (0, 2, 4, 6) and ex.rank.value == 0
    ex.rank.value = 4
    assert [s.value for s in ex.coords] == [1, 0]
    assert [ex._slider_step(4, 1), ex._slider_step(4, -1), ex._slider_step(6, 1)] == [6, 2, None]


def test_a_rank_outside_the_mesh_names_its_ranks() -> None:
    mesh = MeshSpec((2, 2), ("dp", "tp"), ranks=(4, 5, 6, 7))
    with pytest.raises(LayoutError, match=r"rank 0 is not in .*its ranks are 4-7"):
        explore(_layout(mesh), rank=0, background=False)


def test_a_scalar_parameter_shows_a_note_not_an_error() -> None:
    mesh = MeshSpec((8,), ("dp",))
    weight = LoadSpec.from_placements("w", "w", (8, 4), mesh, [parse_placement("S(0)")])
    scalar = LoadSpec.from_placements("logit_scale", "logit_scale", (), mesh, [parse_placement("R")])
    layout = Layout(mesh=mesh, specs={"w": weight, "logit_scale": scalar}, name="with-scalar")
    ex = explore(layout, background=False).explorer
    ex.param.value = "logit_scale"
    assert "logit_scale is a scalar (0-d)" in ex.message.value
    assert "held whole by 8 ranks" in ex.message.value
    assert ex.offsets.layout.display == "none" and ex.zoom_image.layout.display == "none"
    assert set(ex.marks) == {"mesh"}
    ex.rank.value = 5
    assert "rank 5 (dp=5): local () of ()" in ex.rank_view.value
    ex.param.value = "w"  # back to a tensor: its pictures and no note
    assert ex.message.value == "" and ex.offsets.layout.display is None and "offsets" in ex.marks


def test_a_layout_of_scalars_only_opens() -> None:
    mesh = MeshSpec((2, 2), ("dp", "tp"), ranks=(4, 5, 6, 7))
    scalar = LoadSpec.from_placements("s", "s", (), mesh, [parse_placement("R"), parse_placement("R")])
    ex = explore(Layout(mesh=mesh, specs={"s": scalar}, name="scalars"), background=False).explorer
    assert "held whole by 4 ranks" in ex.message.value and ex.rank.value == 4
