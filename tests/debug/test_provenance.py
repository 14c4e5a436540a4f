"""Provenance (issue 22): a checkpoint that carries the layout it was saved with (workbench_layout.toml) lets diff and
diagnose name the ranks, with their mesh coordinates, whose shard of a key differs, and the ranks that held a key
the checkpoint lacks."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.debug.corpus import write
from tests.debug.test_diagnose_cli import TOY, _toy_tensors
from workbench.cli import main as workbench_main
from workbench.debug import diagnose, diff_checkpoints
from workbench.layout.layout_file import LAYOUT_FILE_NAME, load_layout, write_checkpoint_layout

UP1 = "model.layers.0.mlp.experts.1.up_proj.weight"


def _saved(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A checkpoint as save_hf leaves it: the files, and the layout it was saved with beside the index."""
    write(directory, tensors)
    write_checkpoint_layout(load_layout(TOY), directory)
    return directory


def test_the_rank_whose_shard_differs_is_named(tmp_path) -> None:
    good = _saved(tmp_path / "good", _toy_tensors())
    bad_tensors = _toy_tensors()
    bad_tensors[UP1] = bad_tensors[UP1].clone()
    bad_tensors[UP1][2:4] = 100.0  # a stale or garbled piece: rows 2:4 of expert 1's up_proj
    bad = _saved(tmp_path / "bad", bad_tensors)
    # toy layout (sample_meshes/toy_expert_tp.toml, LoadSpec's docstring): fused_w1w3 = [gate0, up0, gate1, up1],
    # S(0)@ep -> IS(0,2)@tp -> S(0)@fsdp; rank 7 = (fsdp 1, ep 1, tp 1) holds rows 14, 15 = rows 2:4 of up_proj 1,
    # rank 6 = (1, 1, 0) rows 12, 13 = rows 0:2 of it
    expected = (f"rows 2:4 of {UP1} were written from rank 7 (fsdp=1, ep=1, tp=1) (8 of 8 elements differ); "
                "the other 1 shard(s) are right")
    for report in (diff_checkpoints(good, bad), diagnose(bad, good), diagnose(bad, _toy_tensors())):
        (finding,) = report.findings
        assert finding.key == UP1 and finding.kind == "value_mismatch", report.to_text()
        assert finding.evidence["written_from"] == expected
        assert finding.evidence["differing_ranks"] == [7]
        assert report.stats["layout_file"].startswith(LAYOUT_FILE_NAME)
        # not "another run's weights": the other shard is right, so the fix is on the rank that wrote this one
        assert finding.hint.startswith("only the shards written from rank(s) 7 differ and the others are right")
    assert "rank 7 (fsdp=1, ep=1, tp=1)" in diff_checkpoints(good, bad).to_text()


def test_without_the_file_the_training_layout_names_them(tmp_path) -> None:
    good = write(tmp_path / "good", _toy_tensors())
    bad_tensors = _toy_tensors()
    bad_tensors[UP1] = bad_tensors[UP1].clone()
    bad_tensors[UP1][0:2] = 100.0
    bad = write(tmp_path / "bad", bad_tensors)
    (plain,) = diff_checkpoints(good, bad).findings
    assert "written_from" not in plain.evidence and "layout_file" not in diff_checkpoints(good, bad).stats
    (finding,) = diff_checkpoints(good, bad, layout=load_layout(TOY)).findings
    assert finding.evidence["written_from"].startswith(f"rows 0:2 of {UP1} were written from rank 6 (fsdp=1, ep=1, "
                                                       "tp=0)")


def test_keys_of_another_ep_rank_dropped_name_their_holders(tmp_path) -> None:
    good = _saved(tmp_path / "good", _toy_tensors())
    kept = {k: v for k, v in _toy_tensors().items() if "experts.1." not in k}  # consolidation kept ep=0's experts
    bad = _saved(tmp_path / "bad", kept)
    report = diff_checkpoints(good, bad)
    (group,) = report.groups()
    assert group.kind == "missing_key" and group.count == 3
    assert group.patterns == (("model.layers.0.mlp.experts.1.down_proj.weight", 1),
                              ("model.layers.0.mlp.experts.1.gate_proj.weight", 1),
                              ("model.layers.0.mlp.experts.1.up_proj.weight", 1))
    # ep = 1 on the (fsdp=2, ep=2, tp=2) mesh, row-major: ranks 2, 3, 6, 7. down_proj 1 (fused_w2 rows 4:8) is cut
    # over tp on dim 1, so all four hold it; gate_proj 1 (fused_w1w3 rows 8:12) goes to fsdp 0 (FSDP cuts the local
    # rows [8, 9, 12, 13] / [10, 11, 14, 15] last), up_proj 1 to fsdp 1
    holders = {
        "model.layers.0.mlp.experts.1.down_proj.weight": "ranks 2-3, 6-7 (ep=1)",
        "model.layers.0.mlp.experts.1.gate_proj.weight": "ranks 2-3 (fsdp=0, ep=1)",
        "model.layers.0.mlp.experts.1.up_proj.weight": "ranks 6-7 (fsdp=1, ep=1)",
    }
    assert {f.key: f.evidence["held_by"] for f in group.findings} == holders
    alone = diagnose(bad, load_layout(TOY))  # against the layout alone (no values), the same
    assert {f.key: f.evidence["held_by"] for f in alone.findings if f.kind == "missing_key"} == holders


def test_cli_json_names_the_ranks_and_a_bad_layout_file_is_a_note(tmp_path, capsys) -> None:
    good = _saved(tmp_path / "good", _toy_tensors())
    bad_tensors = _toy_tensors()
    bad_tensors["model.embed_tokens.weight"] = bad_tensors["model.embed_tokens.weight"].flip(1).contiguous()
    bad = _saved(tmp_path / "bad", bad_tensors)
    assert workbench_main(["diagnose", str(bad), "--expected", str(good), "--json"]) == 1
    body = json.loads(capsys.readouterr().out)
    (finding,) = body["findings"]
    # embed_tokens: 10 rows over the 8 ranks (fsdp+ep+tp): chunks of 2 on ranks 0-4, ranks 5-7 empty
    assert finding["evidence"]["written_from"] == ("every one of the 5 shards of model.embed_tokens.weight differs "
                                                   "(5 ranks)")
    assert finding["evidence"]["differing_ranks"] == [0, 1, 2, 3, 4]
    (bad / LAYOUT_FILE_NAME).write_text("[mesh]\n")
    report = diff_checkpoints(good, bad)
    assert "cannot be used" in report.stats["layout_file"] and "written_from" not in report.findings[0].evidence
    assert workbench_main(["diff", str(good), str(bad), "--layout", str(good)]) == 1  # a folder carrying a layout
    assert workbench_main(["diff", str(good), str(bad), "--layout", str(tmp_path)]) == 2  # a folder without one
    assert "without workbench_layout.toml" in capsys.readouterr().err


def _save_sharded(path: str) -> bool:
    """One rank of a 4-rank gloo save: 4 experts' down_proj fused, S(0)@ep x S(1)@tp, and a replicated norm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import workbench as wb
    from workbench.layout.key_map import HFKeys

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    g = torch.Generator().manual_seed(0)
    state = {"experts.w2": distribute_tensor(torch.randn(16, 8, generator=g).bfloat16(), mesh, [Shard(0), Shard(1)]),
             "norm": distribute_tensor(torch.randn(8, generator=g), mesh, [Replicate(), Replicate()])}
    keys = {"experts.w2": HFKeys(tuple(f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(4)), 0),
            "norm": HFKeys(("model.norm.weight",))}
    wb.save_hf(state, path, key_map=keys.get)
    return True


def test_save_hf_carries_its_layout_and_diagnose_names_the_rank(tmp_path) -> None:
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    import workbench as wb

    good = tmp_path / "good"
    wb.launch(_save_sharded, nprocs=4, args=(str(good),), timeout=120)
    carried = wb.load_layout(good / LAYOUT_FILE_NAME)
    index = json.loads((good / "model.safetensors.index.json").read_text())
    assert carried.fingerprint() == index["metadata"]["layout"]  # the very layout the save fingerprinted
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    key = "model.layers.0.mlp.experts.1.down_proj.weight"
    for f in bad.glob("*.safetensors"):
        tensors = load_file(f)
        if key in tensors:
            with safe_open(f, "pt") as handle:
                metadata = handle.metadata()
            tensors[key] = tensors[key].clone()
            tensors[key][:, 4:] = 7.0  # the columns tp rank 1 of ep rank 0 held
            save_file(tensors, f, metadata=metadata)
    (finding,) = wb.diagnose(bad, good).findings
    # 16 rows over ep=2 (experts 0-1 on ep 0), 8 columns over tp=2: expert 1's columns 4:8 are rank (ep 0, tp 1) = 1
    assert finding.evidence["written_from"] == (f"columns 4:8 of {key} were written from rank 1 (ep=0, tp=1) (16 of 16 "
                                                "elements differ); the other 1 shard(s) are right")
