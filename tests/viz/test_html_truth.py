"""The HTML pictures and figure notes say what the layout holds (a reviewer's three cases): a load plan cut along
dim 2 draws each key's read in its own place, tail padding along the columns is marked, and a note that lists some
uneven local sizes says how many it leaves out."""

from __future__ import annotations

import re

import matplotlib

matplotlib.use("Agg")

from torch.distributed.tensor import Shard

import workbench as wb

_RECT = re.compile(r'<rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)" fill="(#\w+)"')


def test_a_load_plan_cut_along_dim_2_draws_each_keys_read_apart() -> None:
    # two keys fused on dim 2 of a (4, 3, 8) local tensor: the picture drew dims 0 and 1, both reads as the whole
    spec = wb.LoadSpec.from_placements("f", ["a.weight", "b.weight"], (4, 3, 8), wb.MeshSpec((2,), ("tp",)),
                                       [Shard(0)], fused_dim=2)
    plan = wb.plan_hf_load(spec, 0)
    assert [r.local_offset[2] for r in plan.reads] == [0, 4]  # what the expectation below rests on
    html = wb.viz.render_html(plan)
    reads = [tuple(float(v) for v in m[:4]) for m in _RECT.findall(html)[1:]]  # the first rect is the background
    assert reads == [(0.0, 0.0, 100.0, 100.0), (100.0, 0.0, 100.0, 100.0)], reads  # columns 0-4 and 4-8 of 8
    assert "dims 0 (down) and 2 (across)" in html


def test_tail_padding_along_the_columns_is_marked_in_the_spec_picture() -> None:
    mesh = wb.MeshSpec((4,), ("dp",))
    shards = wb.LoadSpec.from_placements("p", "p", (8, 12), mesh, [Shard(1)]).shards
    spec = wb.LoadSpec(name="p", hf_keys=("p",), global_shape=(8, 12), origin_shape=(8, 10), mesh=mesh,
                       shards=shards)
    html = wb.viz.render_html(spec)
    grey = re.findall(r'<rect x="([\d.]+)" y="0" width="([\d.]+)" height="[\d.]+" fill="#999"', html)
    assert grey == [("200.0", "40.0")], grey  # columns 10-12 of 12, on a picture 240 wide
    assert "grey: tail padding" in html


def test_a_note_listing_some_uneven_sizes_counts_the_rest() -> None:
    mesh = wb.MeshSpec((2, 3, 2), ("a", "b", "c"))
    spec = wb.LoadSpec.from_placements("w", "w", (13, 7), mesh, [Shard(0), Shard(0), Shard(1)])
    sizes = sorted({spec.local_shape(r) for r in mesh.all_ranks() if 0 not in spec.local_shape(r)})
    assert len(sizes) == 6
    fig = wb.viz.plot_shard_offsets(spec)
    notes = [line for line in fig._supxlabel.get_text().split("\n") if "uneven" in line]
    shown = ", ".join(f"{a}x{b}" for a, b in sizes[:5])
    assert notes == [f"6 uneven local sizes: {shown} and 1 more"], notes
