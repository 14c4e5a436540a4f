"""Reports of a pipeline stage's sub-mesh: its ranks are a custom array (4..7), not 0..size-1."""

from __future__ import annotations

import pytest

from workbench.layout.layout_file import parse_placement
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec
from workbench.report import summarize_layout
from workbench.viz.text import layout_report


def _stage(ranks: tuple[int, ...]) -> Layout:
    mesh = MeshSpec((2, len(ranks) // 2), ("dp", "tp"), ranks=ranks)
    spec = LoadSpec.from_placements("w", "w", (8, 4 * len(ranks)), mesh,
                                    [parse_placement("S(0)"), parse_placement("S(1)")])
    return Layout(mesh=mesh, specs={"w": spec}, dtypes={"w": "bfloat16"}, name="stage1")


def test_a_small_stage_reports_every_one_of_its_ranks() -> None:
    layout = _stage((4, 5, 6, 7))
    for report in (summarize_layout(layout), layout_report(layout)):
        assert report.ranks == (4, 5, 6, 7)
        assert "rank 4  (dp=0, tp=0): holds 64 B" in str(report)
    report = summarize_layout(layout, ranks=[7])
    assert report.ranks == (7,) and "rank 7  (dp=1, tp=1)" in str(report)
    assert "w[4:8, 8:16] -> local[0:4, 0:8]" in report.full()


def test_a_large_stage_defaults_to_its_first_rank() -> None:
    layout = _stage(tuple(range(32, 64)))
    assert summarize_layout(layout).ranks == (32,)
    assert layout_report(layout).ranks == (32,)
    assert "rank 63  (dp=1, tp=15)" in str(summarize_layout(layout, ranks=[63]))


@pytest.mark.parametrize("ranks", [[0], [3, 4], [8]])
def test_a_rank_outside_the_stage_names_its_ranks(ranks: list[int]) -> None:
    with pytest.raises(ValueError, match=r"outside 'stage1''s 4 ranks \(4-7\)"):
        summarize_layout(_stage((4, 5, 6, 7)), ranks=ranks)
