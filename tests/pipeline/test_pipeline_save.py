"""Pipeline stages: 2 stages x FSDP2 on 4 gloo ranks save one HF checkpoint that transformers loads bit-exactly;
the DeepSeek-V3 PP x EP x FSDP sample layout splits into stages that cover every key once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from workbench.run import launch  # noqa: E402

CONFIG = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, head_dim=8, tie_word_embeddings=False)
STAGE_OF_LAYER = {0: 0, 1: 0, 2: 1, 3: 1}


def _ranks(ref: str, out: str) -> dict:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from workbench import _compat
    from workbench.io.pipeline.save import pipeline_layout_from_model, save_hf_pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "fsdp"))
    stage = mesh.get_coordinate()[0]
    model = transformers.Qwen3ForCausalLM.from_pretrained(ref, dtype=torch.bfloat16)
    for index, s in STAGE_OF_LAYER.items():  # keep this stage's layers (at their own indices: names stay HF's)
        if s != stage:
            model.model.layers[index] = nn.Module()
    if stage == 0:
        model.model.norm, model.lm_head = None, None
    else:
        model.model.embed_tokens = None
    for layer in model.model.layers:
        if any(True for _ in layer.parameters()):
            _compat.fully_shard(layer, mesh=mesh["fsdp"])
    _compat.fully_shard(model, mesh=mesh["fsdp"])
    pipeline = pipeline_layout_from_model(model)
    save_hf_pipeline(model, out, pipeline, config_files=[Path(ref) / "config.json"], max_shard_bytes=20_000)
    # by gathers too: the stage communicator's groups, in the stage mesh's order
    save_hf_pipeline(model, out + "-gather", pipeline, config_files=[Path(ref) / "config.json"], write_mode="gather")
    return {"rank": dist.get_rank(), "stage": stage, "params": [len(s) for s in pipeline.stages],
            "stage_ranks": [pipeline.stage_ranks(s) for s in range(2)]}


@pytest.mark.slow
def test_two_stages_save_one_checkpoint_transformers_loads(tmp_path: Path) -> None:
    config = transformers.Qwen3Config(**CONFIG)
    torch.manual_seed(0)
    reference = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    reference.save_pretrained(tmp_path / "ref")
    results = launch(_ranks, nprocs=4, args=(str(tmp_path / "ref"), str(tmp_path / "out")), timeout=180)
    assert {r["stage"] for r in results.values()} == {0, 1}
    for r in results.values():
        assert r["stage_ranks"] == [(0, 1), (2, 3)]
        # stage 0: embedding + 2 layers x 11 tensors; stage 1: 2 layers x 11 + norm + lm_head
        assert r["params"] == [23, 24], r["params"]

    loaded = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16).eval()
    single = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.bfloat16).eval()
    want, got = single.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) and want[k].dtype == got[k].dtype for k in want)
    gathered = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "out-gather", dtype=torch.bfloat16)
    assert all(torch.equal(want[k], v) for k, v in gathered.state_dict().items())
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, single(ids).logits)
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 2 and files[-1].endswith(f"-of-{len(files):05d}.safetensors"), files
    assert not list(tmp_path.glob(".out*")), list(tmp_path.glob(".*"))
