"""Figures read back: what was drawn equals what the layout and the schedule say (computed apart from viz)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from torch.distributed.tensor import Shard

from tests.viz.support import SAMPLES, cases, expert_tp_16, owners_from_runs
from workbench.errors import LayoutError
from workbench.layout import LoadSpec
from workbench.layout.layout_file import load_layout
from workbench.mesh import MeshSpec
from workbench.run.simulated import plan_save
from workbench.viz.figures import plot_mesh, plot_schedule, plot_shard_offsets

CASES = cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_owners_equal_runs(name: str) -> None:
    spec = CASES[name]
    fig = plot_shard_offsets(spec)
    expected = owners_from_runs(spec)
    if expected.ndim == 1:
        expected = expected[None, :]
    np.testing.assert_array_equal(fig.owners, expected, err_msg=name)


def test_expert_tp_rows_of_design_table() -> None:
    # DESIGN.md: (ep,tp)=(0,0) holds rows [0,1,4,5], (0,1) [2,3,6,7], (1,0) [8..13 even pairs], (1,1) [10,11,14,15];
    # FSDP2 then gives fsdp=0 the first two of them and fsdp=1 the last two. rank = fsdp*4 + ep*2 + tp.
    rows = {0: [0, 1], 4: [4, 5], 1: [2, 3], 5: [6, 7], 2: [8, 9], 6: [12, 13], 3: [10, 11], 7: [14, 15]}
    expected = np.empty(16, dtype=np.int64)
    for rank, held in rows.items():
        expected[held] = rank
    fig = plot_shard_offsets(expert_tp_16(), rank=5)
    np.testing.assert_array_equal(fig.owners[:, 0], expected)
    assert all(fig.owners[:, c].tolist() == expected.tolist() for c in range(4))
    outlined = [p for p in fig.axes[0].patches if p.get_gid() == "rank-5"]
    assert sorted((p.get_y(), p.get_height()) for p in outlined) == [(6, 2)]


def test_hf_key_view_is_the_keys_rows() -> None:
    spec = expert_tp_16()
    whole = owners_from_runs(spec)
    for k, key in enumerate(spec.hf_keys):
        fig = plot_shard_offsets(spec, key=key)
        np.testing.assert_array_equal(fig.owners, whole[4 * k : 4 * k + 4], err_msg=key)


def test_replicas_and_empty_ranks_are_reported() -> None:
    hsdp = plot_shard_offsets(CASES["hsdp_replicas"]).view
    assert (hsdp.holders() == 2).all()
    empty = plot_shard_offsets(CASES["empty_rank"]).view
    assert empty.empty_ranks == (3,)
    padded = plot_shard_offsets(CASES["fp8_padding"]).view
    assert padded.padding == (10, None)
    assert [b for b, _ in padded.key_bounds] == [0, 5]


def test_nd_tensor_index_picks_the_slice() -> None:
    mesh = MeshSpec((2, 2), ("ep", "tp"))
    spec = LoadSpec.from_placements("x", "x", (4, 6, 8), mesh, [Shard(0), Shard(2)])
    whole = owners_from_runs(spec)
    for expert in range(4):
        fig = plot_shard_offsets(spec, dims=(1, 2), index=expert)
        np.testing.assert_array_equal(fig.owners, whole[expert], err_msg=f"expert {expert}")
    with pytest.raises(LayoutError, match=r"index 4 on dim 0 is outside 0..3"):
        plot_shard_offsets(spec, dims=(1, 2), index=4)
    with pytest.raises(LayoutError, match="two different dims"):
        plot_shard_offsets(spec, dims=(1, 1))


def test_large_view_owns_by_cells() -> None:
    layout = load_layout(SAMPLES_BY_NAME["deepseek_v3_671b"])
    spec = max(layout.specs.values(), key=lambda s: math.prod(s.global_shape))
    fig = plot_shard_offsets(spec)
    rows, cols = fig.owner_edges
    assert fig.owners.shape == (len(rows) - 1, len(cols) - 1) == (1024, 1)
    for rank in (0, 1, 63, 64, 777, 1023):
        (run,) = spec.runs(rank)
        i = int(np.searchsorted(rows, run.global_offset[0]))
        assert rows[i + 1] - rows[i] == run.sizes[0] and fig.owners[i, 0] == rank


SAMPLES_BY_NAME = {p.stem: p for p in SAMPLES}


@pytest.mark.parametrize("name", sorted(CASES))
def test_mesh_holds_what_spec_says(name: str) -> None:
    spec = CASES[name]
    rank = spec.mesh.size - 1
    ref = spec.mesh.dim_names[-1]
    fig = plot_mesh(spec.mesh, spec, highlight=(rank, ref))
    for r in spec.mesh.all_ranks():
        assert fig.held[spec.mesh.coordinate(r)] == math.prod(spec.local_shape(r))
    assert fig.highlighted == spec.mesh.group_ranks(rank, ref)
    # the outlined cells, read back from the drawn outlines (lower-left corner of each path = column, row)
    drawn = []
    for ax, ranks in zip(fig.drawing.panels, fig.drawing.ranks):
        for outline in (c for c in ax.collections if c.get_gid() == "highlight"):
            if tuple(outline.get_edgecolor()[0][:3]) != (0.0, 0.0, 0.0):
                continue  # the white halo under a single rank's outline
            for path in outline.get_paths():
                x, y = path.vertices.min(axis=0)
                drawn.append(int(ranks[round(y), round(x)]))
    assert sorted(drawn) == sorted(fig.highlighted)


def _toy_schedule(budget: int | None):
    layout = load_layout(SAMPLES_BY_NAME["toy_expert_tp"])
    return plan_save(layout, budget_bytes=budget).schedules[5]


@pytest.mark.parametrize("budget", [None, 200, 64])
def test_schedule_bars_are_the_calls_bytes(budget: int | None) -> None:
    schedule = _toy_schedule(budget)
    fig = plot_schedule(schedule)
    bars = {p.get_gid(): p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("call-")}
    assert len(bars) == schedule.num_calls
    x = 0
    for n, call in enumerate(schedule.calls):
        bar = bars[f"call-{n}"]
        assert bar.get_width() == call.bytes_out == sum(math.prod(i.padded_shape) for i in call.items) * \
            call.dtype.itemsize * call.world
        assert bar.get_x() == x
        x += call.bytes_out
    # the replayed waterline peaks where the scheduler's own memory model says (no casts in this layout)
    assert max(fig.view.water_y) == schedule.peak_bytes
    if budget is not None:
        assert any(line.get_gid() == "budget" and line.get_ydata()[0] == budget for line in fig.axes[1].lines)


def test_schedule_overlays_measured_times_and_peak() -> None:
    schedule = _toy_schedule(200)
    times = [0.001 * (n + 1) for n in range(schedule.num_calls)]
    fig = plot_schedule(schedule, measured={"call_seconds": times, "peak_bytes": 150, "seconds": 1.0})
    assert len(fig.axes) == 3
    drawn = {p.get_gid(): p.get_height() for p in fig.axes[2].patches}
    assert [drawn[f"time-{n}"] for n in range(schedule.num_calls)] == times
    assert any(line.get_gid() == "measured-peak" for line in fig.axes[1].lines)
    # a SaveResult without per-call times (an empty tuple) adds no measured panel
    assert len(plot_schedule(schedule, measured={"call_seconds": (), "seconds": 1.0}).axes) == 2


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_every_figure_of_every_sample_renders(path) -> None:
    layout = load_layout(path)
    spec = max(layout.specs.values(), key=lambda s: math.prod(s.global_shape))
    rank = layout.mesh.size - 1
    figs = [
        plot_shard_offsets(layout, rank=rank),
        plot_mesh(layout.mesh, spec, highlight=(rank, layout.mesh.dim_names[-1])),
        plot_mesh(layout.mesh),
        plot_schedule(plan_save(layout, ranks=[rank], budget_bytes=1 << 30).schedules[rank]),
    ]
    for fig in figs:
        fig.canvas.draw()
        assert fig.get_axes()  # drawn; render times are measured by bench/viz.py, not asserted here


def test_schedule_over_budget_is_said_and_drawn_red_above_the_budget() -> None:
    schedule = _toy_schedule(64)
    assert schedule.peak_bytes > 64  # the toy's tensors do not fit 64 B: oversized, gathered alone
    fig = plot_schedule(schedule)
    assert "OVER BUDGET" in fig.axes[0].get_title() and "> budget 64 B" in fig.axes[0].get_title()
    mem = fig.axes[1]
    over = next(line for line in mem.lines if line.get_gid() == "waterline-over")
    clip = over.get_clip_box()  # matplotlib keeps a rectangular clip path as a box: the axes above y=64
    assert clip.y0 == pytest.approx(mem.transData.transform((0, 64))[1])
    assert over.get_color() == "#d62728"
    # under budget: nothing said
    assert "OVER" not in plot_schedule(_toy_schedule(None)).axes[0].get_title()


def test_schedule_tells_the_three_peaks_apart() -> None:
    from workbench.layout.layout_file import load_layout as load

    layout = load(SAMPLES_BY_NAME["toy_expert_tp"])
    queued = plan_save(layout, budget_bytes=400, queued_bytes=256).schedules[5]
    assert queued.peak_bytes > max(queued.wave_peaks)  # the writer queue adds to the gathers' peak
    fig = plot_schedule(queued, measured={"predicted_peak_bytes": 4096, "peak_bytes": 2048})
    lines = {line.get_gid(): line.get_ydata()[0] for line in fig.axes[1].lines if line.get_gid()}
    assert lines["gather-peak"] == max(queued.wave_peaks) == max(fig.view.water_y)
    assert lines["predicted-peak"] == queued.peak_bytes
    assert lines["save-predicted-peak"] == 4096 and lines["measured-peak"] == 2048
    labels = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert any("what the budget bounds" in t for t in labels) and any("writer queue" in t for t in labels)


def test_gloo_scratch_is_in_the_waterline() -> None:
    # notebook 04's case: with gather_scratch the scheduler counts the receive copy; the drawn waterline must too
    layout = load_layout(SAMPLES_BY_NAME["toy_expert_tp"])
    schedule = plan_save(layout, budget_bytes=300, gather_scratch=True).schedules[5]
    view = plot_schedule(schedule).view
    assert view.scratch and max(view.water_y) == max(schedule.wave_peaks) == schedule.peak_bytes
