"""8 gloo ranks: a Qwen3-MoE on EP2 x ETP2 x FSDP2 saves with save_hf, transformers loads it exactly, and
load_hf reads it back into another topology and into an unsharded model bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from workbench import Layout  # noqa: E402
from workbench.io.hf_load import load_hf  # noqa: E402
from workbench.io.index import read_checkpoint  # noqa: E402
from workbench.models import Qwen3MoeShape, qwen3_moe_key_map  # noqa: E402
from workbench.run import launch  # noqa: E402
from workbench.run.simulated import SimulatedWorld  # noqa: E402

CONFIG = dict(
    vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
    decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
)
NORMS = r"norm\.weight$"


def _ranks_save_and_reload(ref: str, out: str, shape: Qwen3MoeShape) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from workbench import Layout
    from workbench.io.hf_load import load_hf
    from workbench.io.hf_save import save_hf
    from workbench.models import build_qwen3_moe, qwen3_moe_key_map

    key_map = qwen3_moe_key_map(shape.num_experts)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("fsdp", "ep", "etp"))
    model = build_qwen3_moe(shape, mesh)
    first = load_hf(model, ref, key_map=key_map)
    saved = save_hf(model, out, key_map=key_map, fp32_keys_pattern=NORMS, budget_bytes=4096,
                    config_files=[Path(ref) / "config.json"], max_shard_bytes=8192)
    mesh2 = init_device_mesh("cpu", (2, 1, 4), mesh_dim_names=("fsdp", "ep", "etp"))
    model2 = build_qwen3_moe(shape, mesh2)
    second = load_hf(model2, out, key_map=key_map)
    layout2 = Layout.from_model(model2, key_map)
    from workbench import _compat

    locals2 = {name: _compat.dtensor_local(t).clone() for name, t in model2.state_dict(keep_vars=True).items()}
    return {"rank": dist.get_rank(), "first": first, "saved": saved, "second": second,
            "layout2": layout2 if dist.get_rank() == 0 else None, "locals2": locals2}


@pytest.mark.slow
def test_save_hf_from_ep_etp_fsdp_loads_in_transformers_and_reshards(tmp_path: Path) -> None:
    config = transformers.Qwen3MoeConfig(**CONFIG)
    torch.manual_seed(0)
    reference = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    ref_dir, out_dir = tmp_path / "reference", tmp_path / "saved"
    reference.save_pretrained(ref_dir)
    shape = Qwen3MoeShape.from_config(config)

    results = launch(_ranks_save_and_reload, nprocs=8, args=(str(ref_dir), str(out_dir), shape), timeout=180)

    # transformers loads what 8 ranks wrote: the same weights bit for bit, and exactly the logits of the
    # reference checkpoint loaded the same way (an in-memory model and its from_pretrained copy differ in
    # transformers itself, so the reference goes through from_pretrained too)
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    loaded = transformers.Qwen3MoeForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16).eval()
    single = transformers.Qwen3MoeForCausalLM.from_pretrained(ref_dir, dtype=torch.bfloat16).eval()
    want, got = reference.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) and want[k].dtype == got[k].dtype for k in want)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, single(ids).logits)

    # fp32 keys stay fp32; everything else is bf16; writers are spread over the ranks
    checkpoint = read_checkpoint(out_dir)
    for key, info in checkpoint.keys.items():
        assert info.dtype == ("F32" if key.endswith("norm.weight") else "BF16"), key
    writers = {r: results[r]["saved"].files for r in results if results[r]["saved"].files}
    assert len(writers) >= 4, writers
    assert (out_dir / "config.json").is_file() and not (tmp_path / ".saved.incomplete").exists()

    # every rank read exactly what it owns
    for r in results.values():
        assert r["first"].ok and r["first"].read_ratio == 1.0 and r["second"].read_ratio == 1.0

    # EP1 x ETP4 x FSDP2: every rank's local tensors equal what its load plan selects from the reference
    layout2 = results[0]["layout2"]
    hf = _reference_tensors(ref_dir)
    expected = SimulatedWorld(layout2.mesh).load(layout2, hf)
    for rank, r in results.items():
        for name, tensor in r["locals2"].items():
            want = expected[rank][name]
            assert tensor.dtype == want.dtype and torch.equal(tensor, want), (rank, name)

    # an unsharded model (one process, plain tensors) loads the same values
    plain = {name: torch.empty(spec.global_shape, dtype=layout2.dtype(name)) for name, spec in layout2.specs.items()}
    layout1 = Layout.from_model(plain, qwen3_moe_key_map(shape.num_experts))
    report = load_hf(plain, out_dir, layout=layout1)
    assert report.ok
    world1 = SimulatedWorld(layout1.mesh).load(layout1, hf)[0]
    for name, tensor in plain.items():
        assert torch.equal(tensor, world1[name]), name


def _reference_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")
