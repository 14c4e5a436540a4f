"""The bug classes public converters shipped in 2025-2026, each generated with its byte-level effect and named with
the right kind and transform (issue 22).

Every broken tensor is built the way the bug builds it: the reference is cut into each rank's local shard with the
layout (``LoadSpec.runs``), and the buggy consolidation is written out by hand below (a plain ``torch.cat`` in the
wrong order, a shard saved as the whole tensor, ...); nothing is built from the debugger's own maps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from tests.debug.corpus import write
from workbench.debug import diff_checkpoints
from workbench.layout import InterleavedShard, LoadSpec
from workbench.layout.model_layout import Layout
from workbench.mesh import MeshSpec


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _locals(spec: LoadSpec, full: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's local shard of ``full`` under ``spec`` (rank order)."""
    out = []
    for rank in spec.mesh.all_ranks():
        local = torch.empty(spec.local_shape(rank), dtype=full.dtype)
        for run in spec.runs(rank):
            local[run.local_slices()] = full[run.global_slices()]
        out.append(local)
    return out


def _spec(name: str, shape: tuple[int, ...], mesh: MeshSpec, placements: list, keys: list[str] | None = None,
          **kw) -> LoadSpec:
    return LoadSpec.from_placements(name, keys or [name], shape, mesh, placements, **kw)


def _tp(w: int) -> MeshSpec:
    return MeshSpec((w,), ("tp",))


# -- each case: (reference tensors, broken tensors, layout or None, key, kind, words in the transform) ----------------
def _case_gate_up_fused():
    key = "model.layers.0.mlp.gate_up_proj.weight"
    good = _rand(8, 6)
    gate, up = good[:4], good[4:]
    return {key: good}, {key: torch.cat([up, gate])}, None, key, "permuted", "gate/up halves swapped"


def _case_gate_up_keys_swapped():
    gate, up = "model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight"
    good = {gate: _rand(4, 6, seed=1), up: _rand(4, 6, seed=2)}
    return good, {gate: good[up], up: good[gate]}, None, gate, "misplaced_tensor", f"gate/up swapped with {up}"


def _case_gate_up_plain_concat_under_tp():
    # gate_up under TP=2: each rank holds [gate_r; up_r] (IS(0,2)); the converter concatenated the ranks' tensors
    key = "model.layers.0.mlp.gate_up_proj.weight"
    good = _rand(16, 6)
    spec = _spec(key, (16, 6), _tp(2), [InterleavedShard(0, 2)])
    broken = torch.cat(_locals(spec, good))  # [g0, u0, g1, u1] where [g0, g1, u0, u1] is right
    return {key: good}, {key: broken}, None, key, "permuted", "interleaved shard gathered as contiguous (IS(0,2) over 2"


def _case_gate_up_plain_concat_under_wide_tp(w: int):
    # the same bug under tp=4 or 8 without a layout: its map is also "contiguous shards assembled as interleaved
    # (IS(0,w) over 2 ranks)", the inverse story, whose fix ("gather a plain Shard") is what caused it
    key = "model.layers.0.mlp.gate_up_proj.weight"
    good = _rand(8 * w, 6)
    broken = torch.cat(_locals(_spec(key, (8 * w, 6), _tp(w), [InterleavedShard(0, 2)]), good))
    words = f"interleaved shard gathered as contiguous (IS(0,2) over {w} ranks)"
    return {key: good}, {key: broken}, None, key, "permuted", words


def _case_qkv_plain_concat_under_tp():
    key = "model.layers.0.self_attn.qkv_proj.weight"
    good = _rand(12, 4)
    spec = _spec(key, (12, 4), _tp(2), [InterleavedShard(0, 3)])  # [q; k; v], each cut over tp: F = 3 stripes
    layout = Layout(spec.mesh, {key: spec})
    broken = torch.cat(_locals(spec, good))
    return ({key: good}, {key: broken}, layout, key, "permuted",
            "interleaved shard gathered as contiguous (IS(0,3)@tp over 2 ranks)")


def _case_interleave_applied_twice():
    # the wrong gather of fused QKV under TP=2 (F=3), applied again on its own output by a second conversion
    key = "model.layers.0.self_attn.qkv_proj.weight"
    good = _rand(12, 4, seed=3)
    spec = _spec(key, (12, 4), _tp(2), [InterleavedShard(0, 3)])
    once = torch.cat(_locals(spec, good))
    twice = torch.cat(_locals(spec, once))
    assert not torch.equal(twice, good) and not torch.equal(twice, once)
    return ({key: good}, {key: twice}, Layout(spec.mesh, {key: spec}), key, "permuted",
            "interleave gathered as contiguous twice (IS(0,3)@tp over 2 ranks)")


def _case_square_transposed():
    key = "model.layers.0.self_attn.o_proj.weight"
    good = _rand(8, 8)
    return {key: good}, {key: good.T.contiguous()}, None, key, "permuted", "transposed"


def _case_string_sorted_16():
    key = "model.embed_tokens.weight"
    good = _rand(32, 4)
    spec = _spec(key, (32, 4), MeshSpec((16,), ("fsdp",)), [Shard(0)])
    shards = _locals(spec, good)
    order = sorted(range(16), key=lambda r: f"rank_{r}")  # 'rank_10' < 'rank_2'
    assert order[:4] == [0, 1, 10, 11]
    return ({key: good}, {key: torch.cat([shards[r] for r in order])}, None, key, "permuted",
            "shards in string-sorted rank order (S(0) over 16 ranks")


def _case_string_sorted_12_with_layout():
    key = "model.embed_tokens.weight"
    good = _rand(24, 4)
    spec = _spec(key, (24, 4), MeshSpec((12,), ("dp",)), [Shard(0)])
    shards = _locals(spec, good)
    order = sorted(range(12), key=str)
    return ({key: good}, {key: torch.cat([shards[r] for r in order])}, Layout(spec.mesh, {key: spec}), key,
            "permuted", "shards in string-sorted rank order (S(0)@dp over 12 ranks")


def _case_shard_saved_as_replicated():
    key = "lm_head.weight"
    good = _rand(24, 4)
    spec = _spec(key, (24, 4), _tp(4), [Shard(0)])
    return ({key: good}, {key: _locals(spec, good)[1]}, None, key, "partial_shard",
            "rank 1's contiguous shard of 4 (slices 6:12 of 24 on dim 0)")


def _case_one_tp_shard_written_by_every_rank():
    # row-parallel down_proj cut on dim 1 over tp=4; every rank wrote rank 0's shard into its own slot
    key = "model.layers.0.mlp.down_proj.weight"
    good = _rand(6, 8)
    spec = _spec(key, (6, 8), _tp(4), [Shard(1)])
    shards = _locals(spec, good)
    broken = torch.cat([shards[0]] * 4, dim=1)
    return ({key: good}, {key: broken}, Layout(spec.mesh, {key: spec}), key, "partial_shard",
            "rank 0's shard written in every rank's slot (S(1)@tp over 4 ranks)")


def _case_qkv_fused_in_another_order():
    # a GQA attention's fused projection (16 q heads, 4 kv heads, head_dim 2) saved as [k, q, v] where the model reads
    # [q, k, v]: three parts of unequal size, so no equal-block order names it
    key = "model.layers.0.self_attn.qkv_proj.weight"
    q, k, v = _rand(32, 6, seed=3), _rand(8, 6, seed=4), _rand(8, 6, seed=5)
    return ({key: torch.cat([q, k, v])}, {key: torch.cat([k, q, v])}, None, key, "permuted",
            "q/k/v fused in the order k, q, v (q of 32 rows, k and v of 8 each)")


def _case_gate_up_rows_interleaved():
    # a fused gate_up saved with gate and up rows alternating (row 2i: gate row i, 2i+1: up row i) where the model
    # reads the gate block then the up block
    key = "model.layers.0.mlp.gate_up_proj.weight"
    gate, up = _rand(8, 6, seed=6), _rand(8, 6, seed=7)
    return ({key: torch.cat([gate, up])}, {key: torch.stack([gate, up], dim=1).reshape(16, 6)}, None, key,
            "permuted", "gate and up rows interleaved")


CASES: dict[str, Callable] = {
    "qkv_fused_in_another_order": _case_qkv_fused_in_another_order,
    "gate_up_rows_interleaved": _case_gate_up_rows_interleaved,
    "gate_up_fused_halves_swapped": _case_gate_up_fused,
    "gate_up_keys_swapped": _case_gate_up_keys_swapped,
    "gate_up_plain_concat_under_tp": _case_gate_up_plain_concat_under_tp,
    "gate_up_plain_concat_under_tp4": lambda: _case_gate_up_plain_concat_under_wide_tp(4),
    "gate_up_plain_concat_under_tp8": lambda: _case_gate_up_plain_concat_under_wide_tp(8),
    "qkv_plain_concat_under_tp": _case_qkv_plain_concat_under_tp,
    "interleave_applied_twice": _case_interleave_applied_twice,
    "square_transposed": _case_square_transposed,
    "string_sorted_rank_order": _case_string_sorted_16,
    "string_sorted_rank_order_layout": _case_string_sorted_12_with_layout,
    "shard_saved_as_replicated": _case_shard_saved_as_replicated,
    "one_tp_shard_by_every_rank": _case_one_tp_shard_written_by_every_rank,
}


@pytest.mark.parametrize("name", list(CASES))
def test_bug_class_is_named(tmp_path: Path, name: str) -> None:
    good, bad, layout, key, kind, words = CASES[name]()
    norm = {"model.norm.weight": torch.ones(4)}  # an untouched key beside it
    report = diff_checkpoints(write(tmp_path / "ref", good | norm), write(tmp_path / "bad", good | bad | norm),
                              layout=layout)
    about = report.by_key(key)
    assert about, report.to_text()
    assert about[0].kind == kind, report.to_text()
    assert words in (about[0].transform or ""), report.to_text()
    assert {f.kind for f in report.findings} == {kind}, report.to_text()


def test_keys_of_other_ep_ranks_dropped(tmp_path: Path) -> None:
    # 8 experts' down_proj fused over ep=2 (4 each), columns over tp=2; consolidation kept only ep rank 0's experts
    mesh = MeshSpec((2, 2), ("ep", "tp"))
    keys = [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(8)]
    spec = LoadSpec.from_placements("layers.0.w2", keys, (32, 6), mesh, [Shard(0), Shard(1)], fused_dim=0)
    layout = Layout(mesh, {spec.name: spec})
    good = {k: _rand(4, 6, seed=i) for i, k in enumerate(keys)}
    report = diff_checkpoints(write(tmp_path / "ref", good), write(tmp_path / "bad", {k: good[k] for k in keys[:4]}),
                              layout=layout)
    (group,) = report.groups()
    assert group.kind == "missing_key" and group.count == 4
    assert group.patterns == (("model.layers.0.mlp.experts.{4..7}.down_proj.weight", 4),)
    assert group.shared["held_by"] == "ranks 2-3 (ep=1)"  # ep = 1 of the (ep=2, tp=2) mesh: ranks 2 and 3


def test_keys_of_other_pp_stages_dropped(tmp_path: Path) -> None:
    good = {f"model.layers.{i}.{p}.weight": _rand(2, 2, seed=i) for i in range(4) for p in ("q", "k", "norm")}
    kept = {k: v for k, v in good.items() if int(k.split(".")[2]) < 2}  # stage 1 (layers 2-3) never written
    report = diff_checkpoints(write(tmp_path / "ref", good), write(tmp_path / "bad", kept))
    (group,) = report.groups()
    assert group.count == 6 and {p for p, _ in group.patterns} == {
        "model.layers.{2,3}.q.weight", "model.layers.{2,3}.k.weight", "model.layers.{2,3}.norm.weight"}


def test_html_shows_the_found_order_beside_the_right_one(tmp_path: Path) -> None:
    good, bad, layout, _, _, _ = _case_qkv_plain_concat_under_tp()
    report = diff_checkpoints(write(tmp_path / "ref", good), write(tmp_path / "bad", bad), layout=layout)
    (finding,) = report.findings
    # 12 rows, IS(0,3) over 2 ranks: runs of 2; rank 0 holds blocks 0, 2, 4, rank 1 blocks 1, 3, 5: concatenated
    assert finding.evidence["order"] == [0, 2, 4, 1, 3, 5] and finding.evidence["block_rows"] == 2
    page = report._repr_html_()
    right = page.index(">right<")
    found = page.index(">found<")
    assert right < found
    cells = [int(c.split("</span>")[0]) for c in page[found:].split("'>")[1:] if c.split("</span>")[0].isdigit()]
    assert cells[:6] == [0, 2, 4, 1, 3, 5]
    cells = [int(c.split("</span>")[0]) for c in page[right:found].split("'>")[1:] if c.split("</span>")[0].isdigit()]
    assert cells == [0, 1, 2, 3, 4, 5]


def test_replicated_is_not_blamed_on_one_rank() -> None:
    # a replicated parameter's one box is held by every rank: provenance names the replicas, not one writer
    from workbench.debug.provenance import key_shards, ranks_text

    mesh = MeshSpec((2, 2), ("dp", "tp"))
    spec = LoadSpec.from_placements("norm", ["model.norm.weight"], (4,), mesh, [Replicate(), Shard(0)])
    layout = Layout(mesh, {"norm": spec})
    shards = key_shards(layout, "model.norm.weight")
    assert [(s.box, s.ranks) for s in shards] == [(((0, 2),), (0, 2)), (((2, 4),), (1, 3))]
    assert ranks_text(layout, "model.norm.weight", (0, 2)) == "ranks 0, 2 (tp=0; replicas)"
