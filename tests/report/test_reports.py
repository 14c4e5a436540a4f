"""Golden-shape tests of the layout and save summaries on the DeepSeek-V3 sample (1,024 ranks)."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from workbench.layout import InterleavedShard, LoadSpec
from workbench.layout.layout_file import load_layout
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec
from workbench.plan.policy import SavePolicy
from workbench.report import summarize_layout, summarize_save
from workbench.run.simulated import plan_save

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


@pytest.fixture(scope="module")
def deepseek():
    return load_layout(ROOT / "sample_meshes" / "deepseek_v3_671b.toml")


@pytest.fixture(scope="module")
def full_save(deepseek):
    return plan_save(deepseek, ranks=[0], policy=SavePolicy.full(), budget_bytes=4 * GIB)


def test_one_rank_summary_is_short_and_names_every_pattern_once(deepseek) -> None:
    text = str(summarize_layout(deepseek, ranks=[0]))
    lines = text.splitlines()
    assert len(lines) < 80
    # every distinct template of the parameter names (numbers replaced), derived here from the names alone
    templates = {re.sub(r"(?<=\.)\d+(?=\.)", "#", n) for n in deepseek}
    assert len(templates) == 28
    table = lines[next(i for i, ln in enumerate(lines) if ln.startswith("rank 0 ")) + 2:]
    rows = [ln.split()[0] for ln in table if ln.startswith("  ") and "." in ln.split()[0]]
    named = [re.sub(r"\{[0-9.,]+\}|(?<=\.)\d+(?=\.)", "#", r) for r in rows]
    for template in templates:
        assert named.count(template) == 1, template
    assert "model.layers.{0..61}.input_layernorm.weight" in text and "model.layers.{3..61}.mlp.gate.weight" in text
    # coverage: a count, not 989 'exact' lines; no CLI flag in a Python report
    assert "coverage: all 989 parameters exact" in text and text.count("exact") == 1
    assert "--" not in text


def test_summary_totals_match_the_layout(deepseek) -> None:
    report = summarize_layout(deepseek, ranks=[0])
    held = sum(math.prod(deepseek[n].local_shape(0)) * deepseek.dtype(n).itemsize for n in deepseek)
    assert report.totals[0].bytes_held == held
    assert report.to_dict()["ranks"][0]["bytes_held"] == held
    assert report.total_bytes == 1_368_979_721_216  # sample_meshes/README.md's table
    assert "1.25 TiB" in str(report).splitlines()[0]


def test_full_listing_has_every_line(deepseek) -> None:
    full = summarize_layout(deepseek, ranks=[0], params="model.layers.1*").full()
    assert "model.layers.17.input_layernorm.weight[7:14]" not in full  # rank 0 holds [0:7]
    assert "model.layers.17.input_layernorm.weight[0:7] -> local[0:7]" in full
    assert full.count("  exact     ") == len([n for n in deepseek if n.startswith("model.layers.1")])


def test_overrun_warning_first_when_peak_over_budget(deepseek, full_save) -> None:
    report = summarize_save(deepseek, full_save, ranks=[0])
    head = "\n".join(str(report).splitlines()[:6])
    assert "predicted peak 14.2 GiB is over the 4 GiB budget" in head
    # fused_w1w3 is 256 experts x 2 x 2048 rows x 7168 x 2 B = 14 GiB; fused_w2 256 x 7168 x 2048 x 2 B = 7 GiB
    assert "model.layers.{3..61}.mlp.experts.fused_w1w3: 59 x 14 GiB" in head
    assert "model.layers.{3..61}.mlp.experts.fused_w2: 59 x 7 GiB" in head
    assert report.findings[0].kind == "over_budget" and not report.ok


def test_no_warning_within_budget(deepseek) -> None:
    roomy = plan_save(deepseek, ranks=[0], policy=SavePolicy.full(), budget_bytes=64 * GIB)
    report = summarize_save(deepseek, roomy, ranks=[0])
    assert roomy.schedules[0].peak_bytes <= 64 * GIB
    assert "over the" not in str(report) and report.ok
    assert str(report).splitlines()[1].startswith("attention: nothing")


def test_save_to_dict_totals(deepseek, full_save) -> None:
    data = summarize_save(deepseek, full_save, ranks=[0]).to_dict()
    schedule = full_save.schedules[0]
    (rank,) = data["ranks"]
    assert (rank["peak_bytes"], rank["bytes_received"], rank["calls"]) == (
        schedule.peak_bytes, schedule.bytes_moved, schedule.num_calls)
    assert {o["name"] for o in rank["oversized"]} == {
        f"model.layers.{i}.mlp.experts.fused_{w}" for i in range(3, 62) for w in ("w1w3", "w2")}
    assert data["writers"]["keys"] == 46183


def test_heavy_writer_is_flagged() -> None:
    toy = load_layout(ROOT / "sample_meshes" / "toy_expert_tp.toml")
    plan_set = plan_save(toy, ranks=[0], policy=SavePolicy.full(), max_writers=8)
    # force every key onto rank 3 but one: rank 3 carries far more than the mean of the two writers
    writers = dict.fromkeys(plan_set.writers, 3)
    writers["model.norm.weight"] = 0
    forced = dataclasses.replace(plan_set, writers=writers)
    report = summarize_save(toy, forced, ranks=[0])
    kinds = {f.kind: f for f in report.findings}
    assert "heavy_writer" not in kinds  # 2 writers: 332 B vs mean 168 B is under 2x
    writers = {k: (3 if i else i + 1) for i, k in enumerate(plan_set.writers)}
    writers.update({"model.norm.weight": 0, "model.layers.0.self_attn.q_proj.weight": 2})
    forced = dataclasses.replace(plan_set, writers=writers)
    report = summarize_save(toy, forced, ranks=[0])
    assert [f.kind for f in report.findings] == ["heavy_writer"]
    assert "rank 3:" in report.findings[0].details[0]


def test_reprs_speak_human_units(deepseek, full_save) -> None:
    text = repr(full_save.schedules[0])
    assert "15267266560" not in text and "peak=14.2 GiB" in text and "OVER BUDGET" in text
    assert "budget 4 GiB, predicted peak 14.2 GiB" in str(full_save.schedules[0]).splitlines()[0]
    assert "! predicted peak 14.2 GiB is over the budget 4 GiB" in str(full_save.schedules[0]).splitlines()[1]
    assert "size=1.25 TiB" in repr(deepseek)


def test_summary_lists_every_region_a_rank_reads_of_one_key() -> None:
    # an InterleavedShard of 2 stripes on tp=2: rows 0:8 are stripes [0:2][2:4][4:6][6:8], rank 1 holds the
    # second and fourth (worked out by hand), in one key per layer; the three layers share one line per region
    mesh = MeshSpec((2,), ("tp",))
    names = [f"model.layers.{i}.mlp.gate_up_proj" for i in range(3)]
    specs = {n: LoadSpec.from_placements(n, n, (8, 4), mesh, [InterleavedShard(0, num_local_stripes=2)])
             for n in names}
    text = str(summarize_layout(Layout(mesh, specs, name="interleaved"), ranks=[1]))
    assert text.split("key regions:\n")[1].splitlines() == [
        "    model.layers.{0..2}.mlp.gate_up_proj[2:4, 0:4] -> local[0:2, 0:4]",
        "    model.layers.{0..2}.mlp.gate_up_proj[6:8, 0:4] -> local[2:4, 0:4]",
    ]
