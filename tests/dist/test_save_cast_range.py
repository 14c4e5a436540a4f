"""A save's cast into a smaller range changes no value: ``save_hf(dtype=torch.float16)`` of a float32 or bfloat16
model wrote every value over 65504 as inf, silently, and ``fp32_keys_pattern`` did the same to a float64 model's
values past float32's range. The save is refused on every rank before anything is written, naming the parameter,
its keys, the rank and the first value; values that fit are written as torch converts them (expected values:
safetensors' ``load_file`` against torch's own ``.to``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from workbench.errors import CheckpointError

_W = torch.linspace(-60000, 60000, 8 * 4, dtype=torch.float32).reshape(8, 4)


def _layout() -> wb.Layout:
    from torch.distributed.tensor import Shard

    mesh = wb.MeshSpec((2,), ("fsdp",))
    return wb.Layout(mesh, {"w": wb.LoadSpec.from_placements("w", "model.w", (8, 4), mesh, [Shard(0)])})


def _save_with_one_big_value(root: str) -> dict[str, str]:
    import torch.distributed as dist

    rank = dist.get_rank()
    local = _W[4 * rank:4 * (rank + 1)].clone()
    out = {}
    for mode in ("direct", "gather"):
        big = local.clone()
        if rank == 1:
            big[2, 1] = 1e5  # only rank 1 holds it: rank 0's tensor fits
        try:
            wb.save_hf({"w": big}, Path(root) / f"big_{mode}", layout=_layout(), dtype=torch.float16,
                       write_mode=mode, timeout=60)
            out[f"big_{mode}"] = "saved"
        except Exception as exc:  # the test reads each rank's error
            out[f"big_{mode}"] = f"{type(exc).__name__}: {exc}"
        wb.save_hf({"w": local}, Path(root) / f"fits_{mode}", layout=_layout(), dtype=torch.float16,
                   write_mode=mode, timeout=60)
    return out


@pytest.mark.slow
def test_a_save_into_float16_of_a_value_over_its_range_fails_on_every_rank(tmp_path: Path) -> None:
    results = wb.launch(_save_with_one_big_value, nprocs=2, backend="gloo", args=(str(tmp_path),), timeout=120)
    for mode in ("direct", "gather"):
        own, peer = results[1][f"big_{mode}"], results[0][f"big_{mode}"]
        assert own.startswith("CheckpointError"), own
        for part in ("parameter 'w' (HF key(s) model.w), rank 1", "1 of 16 float32 value(s) do not fit into float16",
                     "100000.0", "dtype=None"):
            assert part in own, (part, own)
        assert peer.startswith("SaveFailed") and "rank 1" in peer, peer
        assert not (tmp_path / f"big_{mode}").exists()  # nothing published, nothing left

        written = load_file(str(next((tmp_path / f"fits_{mode}").glob("*.safetensors"))))
        assert written["model.w"].dtype == torch.float16
        assert torch.equal(written["model.w"], _W.to(torch.float16))


def test_fp32_keys_pattern_refuses_a_float64_value_past_float32_and_checks_fused_keys_at_the_narrowest(
        tmp_path: Path) -> None:
    state = {"a.weight": torch.tensor([1.0, 1e300], dtype=torch.float64)}
    with pytest.raises(CheckpointError, match=r"parameter 'a.weight' .*1 of 2 float64 value\(s\) do not fit into "
                                              r"float32 \(the first, 1e\+300"):
        wb.save_hf(state, tmp_path / "a", fp32_keys_pattern="weight")
    assert not (tmp_path / "a").exists()

    # gate in float32 by the pattern, up in float16 by dtype=: a value float16 cannot hold is refused wherever it is
    from torch.distributed.tensor import Replicate

    mesh = wb.MeshSpec((1,), ("world",))
    spec = wb.LoadSpec.from_placements("gate_up", ["mlp.gate.weight", "mlp.up.weight"], (4, 2), mesh,
                                       [Replicate()], fused_dim=0)
    fused = torch.ones(4, 2)
    fused[0, 0] = 1e6  # in the gate's half
    with pytest.raises(CheckpointError, match=r"do not fit into float16"):
        wb.save_hf({"gate_up": fused}, tmp_path / "f", layout=wb.Layout(mesh, {"gate_up": spec}),
                   dtype=torch.float16, fp32_keys_pattern="gate")
    fused[0, 0] = 3.0
    wb.save_hf({"gate_up": fused}, tmp_path / "f", layout=wb.Layout(mesh, {"gate_up": spec}), dtype=torch.float16,
               fp32_keys_pattern="gate")
    written = load_file(str(next((tmp_path / "f").glob("*.safetensors"))))
    assert written["mlp.gate.weight"].dtype == torch.float32 and written["mlp.up.weight"].dtype == torch.float16
    assert torch.equal(written["mlp.gate.weight"], fused[:2]) and torch.equal(written["mlp.up.weight"],
                                                                               fused[2:].half())
