"""SavePolicy.minimal writes the same checkpoint as full, with fewer gathers: key-aligned fused cuts stay."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.run.support import geometries, hf_checkpoint, layouts, moe_layouts
from tests.run.test_round_trip import check_written_once
from workbench import load_layout
from workbench.plan.policy import SavePolicy
from workbench.run.simulated import SimulatedWorld, plan_save


@settings(max_examples=150)
@given(st.data())
def test_minimal_writes_what_full_writes(data: st.DataObject) -> None:
    if data.draw(st.booleans(), label="moe"):
        layout, geoms = data.draw(moe_layouts())
    else:
        geoms = data.draw(geometries())
        layout = data.draw(layouts(geoms))
    hf = hf_checkpoint(geoms, seed=data.draw(st.integers(0, 9)))
    world = SimulatedWorld(layout.mesh)
    loaded = world.load(layout, hf)
    budget = data.draw(st.sampled_from([None, 64, 4096]), label="budget")
    check_written_once(world.save(layout, loaded, policy=SavePolicy.minimal(), budget_bytes=budget), hf)
    full = plan_save(layout, policy=SavePolicy.full(), budget_bytes=budget)
    minimal = plan_save(layout, policy=SavePolicy.minimal(), budget_bytes=budget)
    for rank in layout.mesh.all_ranks():  # never more traffic than a full save
        assert minimal.schedules[rank].bytes_moved <= full.schedules[rank].bytes_moved


def test_minimal_keeps_ep_over_whole_experts_and_gathers_the_rest() -> None:
    layout = load_layout(Path(__file__).resolve().parents[2] / "sample_meshes" / "qwen3_30b_a3b.toml")
    plans = {p.name: p for p in plan_save(layout, ranks=[9], policy=SavePolicy.minimal()).plans[9]}
    w13 = plans["model.layers.0.mlp.experts.fused_w1w3"]
    # rank 9 = (fsdp=1, ep=1): EP gives experts 16..31 (32 keys), FSDP's cut of 8 leaves 4 whole keys per rank:
    # both cuts fall on key boundaries, so the experts need no gather at all and rank 9 writes experts 18-19
    assert [str(s.descriptor) for s in w13.steps if s.preserved] == ["S(0)@ep", "S(0)@fsdp"]
    assert w13.pending == ()
    assert w13.hf_keys == tuple(
        f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in (18, 19) for p in ("gate", "up")
    )
    dense = plans["model.embed_tokens.weight"]
    assert not dense.preserves_shards and dense.hf_keys == ("model.embed_tokens.weight",)


def test_one_rank_plan_knows_every_keys_writer() -> None:
    # save_hf plans only its own rank; the writers it sees must still cover every key of the checkpoint
    layout = load_layout(Path(__file__).resolve().parents[2] / "sample_meshes" / "toy_expert_tp.toml")
    for rank in (0, 5):
        writers = plan_save(layout, ranks=[rank], policy=SavePolicy.minimal()).writers
        assert set(writers) == set(layout.hf_keys)
        assert writers == plan_save(layout, policy=SavePolicy.minimal()).writers
