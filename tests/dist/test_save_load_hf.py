"""8 gloo ranks: a Qwen3-MoE on EP2 x ETP2 x FSDP2 saves with save_hf, transformers loads it exactly, and
load_hf reads it back into another topology and into an unsharded model bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from workbench import Layout  # noqa: E402
from workbench.io.files.index import read_checkpoint  # noqa: E402
from workbench.io.hf.load import load_hf  # noqa: E402
from workbench.models import Qwen3MoeShape, qwen3_moe_key_map  # noqa: E402
from workbench.run import launch  # noqa: E402

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
    from workbench.io.hf.load import load_hf
    from workbench.io.hf.save import save_hf
    from workbench.models import build_qwen3_moe, qwen3_moe_key_map

    key_map = qwen3_moe_key_map(shape.num_experts)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("fsdp", "ep", "etp"))
    model = build_qwen3_moe(shape, mesh)
    first = load_hf(model, ref, key_map=key_map, cast=True)  # bf16 norms into the model's fp32 norms
    saved = save_hf(model, out, key_map=key_map, fp32_keys_pattern=NORMS, budget_bytes=4096,
                    config_files=[Path(ref) / "config.json"], max_shard_bytes=8192)
    mesh2 = init_device_mesh("cpu", (2, 1, 4), mesh_dim_names=("fsdp", "ep", "etp"))
    model2 = build_qwen3_moe(shape, mesh2)
    with _count_file_reads() as counted:  # bytes counted where safetensors hands them over, not from the plan
        second = load_hf(model2, out, key_map=key_map, cast=True)  # fp32 norms into a bf16 model
    layout2 = Layout.from_model(model2, key_map)
    saved_dtypes = {name: (torch.float32 if name.endswith("norm.weight") else torch.bfloat16) for name in layout2}
    owned = sum(t.to_local().numel() * saved_dtypes[n].itemsize for n, t in model2.state_dict(keep_vars=True).items())
    wrong = _check_locals_against_reference(model2, layout2, ref, shape, (2, 1, 4))
    return {"rank": dist.get_rank(), "first": first, "saved": saved, "second": second, "read2": counted[0],
            "ranges2": counted[1], "owned2": owned, "layout2": layout2 if dist.get_rank() == 0 else None,
            "wrong2": wrong}


def _check_locals_against_reference(model, layout, ref: str, shape, mesh_shape) -> list[str]:
    """Every local shard of this rank against the reference file cut by hand (not by workbench's planner, and not
    by DTensor's ``full_tensor``, which does not undo an interleaved shard under FSDP2): the names of the
    parameters whose local tensor differs.

    The builder's cuts, in the order they apply: experts over ep (dim 0), then over etp (``fused_w1w3``: an even
    interleave of its ``2 x local experts`` stripes; ``fused_w2``: dim 1), then FSDP2's chunk of dim 0, last;
    every other parameter: FSDP2's chunk of dim 0.
    """
    import torch.distributed as dist
    from safetensors.torch import load_file

    from tests.dcp.support import cut_by_hand

    hf = load_file(f"{ref}/model.safetensors")
    rank = dist.get_rank()
    wrong = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        full = torch.cat([hf[k] for k in layout.specs[name].hf_keys], dim=0)
        want = cut_by_hand(full, name, mesh_shape, rank, shape.num_experts)
        local = tensor.to_local()
        if not (local.dtype == tensor.dtype and torch.equal(local, want.to(local.dtype))):
            wrong.append(name)
    return wrong


class _count_file_reads:
    """Count the bytes the ``preadv`` system calls of workbench's reader return (the file layer, not the plan), and
    record which byte ranges of which file they read (``ranges``: ``(file name, start, end)``)."""

    def __enter__(self) -> list:
        import os
        import threading

        from workbench.io.files import box_reads

        self.module, self.original, self.count = box_reads.os, box_reads.os.preadv, [0, []]
        count, original, lock = self.count, self.original, threading.Lock()

        def preadv(fd, buffers, offset):
            n = original(fd, buffers, offset)
            name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
            with lock:
                count[0] += n
                count[1].append((name, offset, offset + n))
            return n

        self.module.preadv = preadv
        return count

    def __exit__(self, *exc) -> None:
        self.module.preadv = self.original


def _data_ranges(directory: Path) -> dict[str, tuple[int, int]]:
    """Each file's tensor data as one byte range, from its header (safetensors' layout: 8-byte length, JSON)."""
    import json
    import struct

    out = {}
    for file in directory.glob("*.safetensors"):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        out[file.name] = (8 + length, 8 + length + end)
    return out


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(m) for m in merged]


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

    # counted at the file layer: the whole world read every byte of the checkpoint exactly once (each rank its own
    # shards; a parameter replicated over ep x etp is read by one replica and broadcast to the other three)
    # (a box of short runs with less than a page between them is read as its span: the disk reads those pages
    # anyway, so ranks sharing a page may both read it; tests/dist/test_os_read_bytes.py counts the disk's bytes)
    data = _data_ranges(out_dir)
    read = {}
    for r in results.values():
        for name, start, end in r["ranges2"]:
            read.setdefault(name, []).append((start, end))
    assert {name: _union(spans) for name, spans in read.items()} == {name: [span] for name, span in data.items()}
    for r in results.values():
        assert r["first"].ok and r["second"].bytes_read == r["read2"] > 0, (r["rank"], r["read2"])

    # EP1 x ETP4 x FSDP2: every rank's local shards are the reference weights, cut by hand in the rank
    for r in results.values():
        assert r["wrong2"] == [], (r["rank"], r["wrong2"])
    layout2 = results[0]["layout2"]
    hf = _reference_tensors(ref_dir)

    # an unsharded model (one process, plain tensors) loads the same values
    plain = {name: torch.empty(spec.global_shape, dtype=layout2.dtype(name)) for name, spec in layout2.specs.items()}
    layout1 = Layout.from_model(plain, qwen3_moe_key_map(shape.num_experts))
    with _count_file_reads() as counted:
        report = load_hf(plain, out_dir, layout=layout1, cast=True)
    assert report.ok and counted[0] == report.bytes_read == sum(
        t.numel() * (4 if n.endswith("norm.weight") else 2) for n, t in plain.items()
    )
    for name, spec in layout1.specs.items():
        want = torch.cat([hf[k] for k in spec.hf_keys], dim=spec.fused_dim or 0).to(plain[name].dtype)
        assert torch.equal(plain[name], want), name


def _reference_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")
