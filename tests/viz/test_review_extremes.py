"""What a person sees at the extremes: 1,024-rank meshes, many runs, empty and 0-d tensors, odd names."""

from __future__ import annotations

import io
import warnings

import matplotlib
import pytest
from torch.distributed.tensor import Replicate, Shard

from tests.viz.legibility import problems
from workbench.layout import InterleavedShard, LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec
from workbench.run.simulated import plan_save
from workbench.viz.figures import plot_mesh, plot_schedule, plot_shard_offsets
from workbench.viz.html import render_html

matplotlib.use("Agg")

MESH_1024 = MeshSpec((8, 128), ("dp", "tp"))


def test_offsets_of_65536_interleaved_runs_take_kilobytes() -> None:
    # expert TP with 64 stripes per rank on 1,024 ranks: 64 x 1,024 runs of 2 rows each
    spec = LoadSpec.from_placements("e", [f"e{i}" for i in range(64)], (8 * 128 * 64 * 2, 16), MESH_1024,
                                    [Shard(0), InterleavedShard(0, num_local_stripes=64)], fused_dim=0)
    fig = plot_shard_offsets(spec, rank=1023)  # its time is measured in bench/RESULTS.md, not here
    svg = io.BytesIO()
    fig.savefig(svg, format="svg")
    assert len(fig.view.boxes) == 64 * 1024
    assert len(svg.getvalue()) < 2 << 20, f"{len(svg.getvalue()):,} B of SVG"


def test_html_of_a_scalar_parameter_is_its_table_not_a_warning() -> None:
    spec = LoadSpec.from_placements("scale", "scale", (), MeshSpec((2, 2), ("dp", "tp")), [Replicate(), Replicate()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        page = render_html(spec)
    assert "LoadSpec scale" in page and "global shape" in page and "<pre" not in page


def test_offsets_of_a_zero_row_parameter_label_its_one_edge_once() -> None:
    spec = LoadSpec.from_placements("none", "none", (0, 4), MeshSpec((2, 4), ("dp", "tp")), [Replicate(), Shard(0)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = plot_shard_offsets(spec, rank=3)
        fig.canvas.draw()
    rows = [t.get_text() for t in fig.axes[0].get_yticklabels() if t.get_text()]
    assert rows == ["0"]  # not '0' repeated down an invented range
    assert fig.view.empty_ranks == tuple(range(8))


@pytest.mark.parametrize("shape", [(2, 2, 4, 2, 16), (4, 2, 2, 2, 2, 8)])
def test_mesh_of_torchtitans_many_named_dims_is_legible(shape: tuple[int, ...]) -> None:
    # torchtitan's world mesh at 1,024 ranks: panel titles and the colour key's dim names must not collide or be cut
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")[: len(shape)]
    mesh = MeshSpec(shape, names)
    found, _ = problems(plot_mesh(mesh), f"plot_mesh{shape}")
    assert found == []


def test_schedule_of_a_rank_with_nothing_to_gather_draws_without_warnings() -> None:
    mesh = MeshSpec((2, 2), ("dp", "tp"))
    replicated = Layout(mesh, {"r": LoadSpec.from_placements("r", "r", (4, 4), mesh, [Replicate(), Replicate()])})
    schedule = plan_save(replicated, ranks=(0,)).schedules[0]  # every rank holds it whole: no all-gather
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = plot_schedule(schedule)
        fig.canvas.draw()
    assert "0 call(s)" in fig.get_suptitle()
