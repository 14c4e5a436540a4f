"""Groups whose mesh order is not torch's, and replica groups that do not hold the same model, on real gloo ranks.

torch numbers the ranks of a process group in sorted order; a device mesh may list them otherwise (a custom rank
array, a flattened dim). A gather or a replica broadcast must follow the mesh's order, or pieces land permuted:
values are compared with the source tensors, read back with safetensors itself. Ranks that hold different
parameters (pipeline stages over one root mesh) but call ``save_hf`` or ``load_hf`` as one model must fail on every
rank: not publish a checkpoint that lacks a stage, not exchange each other's values. A replica whose batch buffer
cannot be made must not leave its peers waiting.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb

FULL = {
    "model.w.weight": torch.arange(32.0).reshape(4, 8),
    "model.norm.weight": torch.arange(1.0, 9.0),
    "model.norm2.weight": torch.arange(11.0, 19.0),
    "model.scale": (torch.arange(8.0) / 7).to(torch.float8_e4m3fn),
}


EP_FSDP = {
    "model.w1": torch.arange(28.0).reshape(7, 4).to(torch.bfloat16),
    "model.w2": torch.arange(24.0).reshape(6, 4).to(torch.bfloat16),
    "model.n1": torch.tensor([1.0, 2.0]),
    "model.experts": torch.arange(8.0).reshape(2, 4).to(torch.bfloat16),
    "model.n2": torch.tensor([3.0, 4.0]),
}


def _permuted(root: str) -> dict:
    """On a mesh [[0, 2], [1, 3]]: save the rows of w cut over both dims by gathers; load the replicated norms and
    an FP8 vector (replicated over both dims: one flattened group in the mesh's order, not torch's)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=("rep", "shard"))
    saved = {"model.w.weight": distribute_tensor(FULL["model.w.weight"], mesh, [Shard(0), Shard(0)])}
    wb.save_hf(saved, Path(root) / "gathered", write_mode="gather", timeout=30)
    target = {
        "model.norm.weight": distribute_tensor(torch.zeros(8), mesh, [Replicate(), Replicate()]),
        "model.norm2.weight": distribute_tensor(torch.zeros(8), mesh, [Replicate(), Replicate()]),
        # (distribute_tensor broadcasts, and gloo has no float8)
        "model.scale": DTensor.from_local(torch.zeros(8, dtype=torch.float8_e4m3fn), mesh, [Replicate(), Replicate()]),
        "model.w.weight": distribute_tensor(torch.zeros(4, 8), mesh, [Replicate(), Shard(0)]),
    }
    report = wb.load_hf(target, Path(root) / "source", strict=False, timeout=30)
    wrong = [k for k, t in target.items() if not torch.equal(t.full_tensor().view(torch.uint8),
                                                              FULL[k].view(torch.uint8))]
    # EP x FSDP with uneven shards and two dtypes: replicated over dp for the experts, over ep for the rest, with
    # readers that differ between the two groups of a rank (a legitimate model: it must load)
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    placements = {"w1": [Shard(0), Replicate()], "w2": [Shard(0), Replicate()], "n1": [Shard(0), Replicate()],
                  "experts": [Replicate(), Shard(0)], "n2": [Shard(0), Replicate()]}
    target2 = {f"model.{n}": distribute_tensor(torch.zeros_like(EP_FSDP[f"model.{n}"]), mesh2, p)
               for n, p in placements.items()}
    wb.load_hf(target2, Path(root) / "ep_fsdp", timeout=30)
    wrong += [k for k, t in target2.items() if not torch.equal(t.full_tensor(), EP_FSDP[k])]
    return {"received": report.bytes_received > 0, "wrong": wrong, "rank": rank}


@pytest.mark.slow
def test_a_mesh_in_another_order_than_torchs_gathers_and_shares_in_its_own(tmp_path: Path) -> None:
    wb.save_hf(FULL, tmp_path / "source")
    wb.save_hf(EP_FSDP, tmp_path / "ep_fsdp")
    results = wb.launch(_permuted, nprocs=4, args=(str(tmp_path),), timeout=180)
    assert all(r["wrong"] == [] and r["received"] for r in results.values()), results
    gathered = load_file(next((tmp_path / "gathered").glob("*.safetensors")))
    assert torch.equal(gathered["model.w.weight"], FULL["model.w.weight"])


def _stages(root: str) -> dict[str, tuple[str, str]]:
    """Two pipeline stages on one (pp, dp) root mesh, each holding its own layer, call save_hf and load_hf as if
    one model: each stage's parameter looks replicated over pp."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    key = f"model.layers.{rank // 2}.w"
    state = {key: distribute_tensor(torch.full((4, 8), float(rank // 2)), mesh["dp"], [Shard(0)])}
    out = {}
    try:
        wb.save_hf(state, Path(root) / "saved", timeout=30)
        out["save"] = ("saved", "")
    except wb.SaveFailed as exc:
        out["save"] = ("SaveFailed", str(exc))
    try:
        wb.load_hf(state, Path(root) / "stages", strict=False, timeout=30)
        out["load"] = ("loaded", str(state[key].to_local().tolist()))
    except wb.LoadFailed as exc:
        out["load"] = ("LoadFailed", str(exc))
    return out


@pytest.mark.slow
def test_stages_called_as_one_model_fail_on_every_rank(tmp_path: Path) -> None:
    """Saved as one model, the stages published a checkpoint holding layer 0 alone; loaded as one, stage 1 got
    layer 0's values. Both are refused on every rank before any data moves, naming the ranks."""
    wb.save_hf({"model.layers.0.w": torch.zeros(4, 8), "model.layers.1.w": torch.ones(4, 8)}, tmp_path / "stages")
    results = wb.launch(_stages, nprocs=4, args=(str(tmp_path),), timeout=180)
    assert {r["save"][0] for r in results.values()} == {"SaveFailed"}, results
    assert all("parameter 'model.layers.0.w' is held by rank(s) 0, 1 and not by rank(s) 2, 3" in r["save"][1]
               for r in results.values()), results
    assert not (tmp_path / "saved").exists() and not list(tmp_path.glob(".saved*"))
    assert {r["load"][0] for r in results.values()} == {"LoadFailed"}, results
    assert all("replicas over 'pp' but hold different replicated parameters" in r["load"][1]
               for r in results.values())


def _no_buffer(root: str) -> tuple[str, float]:
    """Rank 0 cannot make the buffer of its replica batch (out of memory): both ranks fail at once."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate

    import workbench.io.hf.load as hf_load

    rank = dist.get_rank()
    mesh = wb.MeshSpec((2,), ("dp",))
    layout = wb.Layout(mesh, {"norm": wb.LoadSpec.from_placements("norm", "model.norm.weight", (8,), mesh,
                                                                  [Replicate()])})
    if rank == 0:
        class NoMemory:
            def __getattr__(self, name: str):
                return getattr(torch, name)

            @staticmethod
            def cat(*args, **kwargs):
                raise torch.OutOfMemoryError("no memory for the replica batch (injected)")

        hf_load.torch = NoMemory()
    started = time.perf_counter()
    try:
        wb.load_hf({"norm": torch.zeros(8)}, Path(root) / "source", layout=layout, strict=False, timeout=60)
    except wb.LoadFailed as exc:
        return str(exc).splitlines()[1].strip(), time.perf_counter() - started
    return "loaded", time.perf_counter() - started


@pytest.mark.slow
def test_a_replica_that_cannot_make_its_batch_buffer_fails_every_rank_at_once(tmp_path: Path) -> None:
    wb.save_hf(FULL, tmp_path / "source")
    results = wb.launch(_no_buffer, nprocs=2, args=(str(tmp_path),), timeout=120)
    assert all(r[0].startswith("rank 0 failed while sharing replicated parameters: OutOfMemoryError")
               for r in results.values()), results
    assert max(r[1] for r in results.values()) < 20  # not the 60 s timeout


def _replicas_once_on_rank_0(root: str) -> tuple[str, list[float]]:
    """Rank 0 shares its replicas' reads, rank 1 reads them itself (the ranks passed different arguments)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate

    rank = dist.get_rank()
    mesh = wb.MeshSpec((2,), ("dp",))
    layout = wb.Layout(mesh, {"norm": wb.LoadSpec.from_placements("norm", "model.norm.weight", (8,), mesh,
                                                                  [Replicate()])})
    target = {"norm": torch.zeros(8)}
    try:
        wb.load_hf(target, Path(root) / "source", layout=layout, strict=False, read_replicas_once=rank == 0,
                   timeout=60)
    except wb.LoadFailed as exc:
        return str(exc).splitlines()[1].strip(), target["norm"].tolist()
    return "loaded", target["norm"].tolist()


@pytest.mark.slow
def test_ranks_that_pass_different_read_replicas_once_are_told_so(tmp_path: Path) -> None:
    wb.save_hf(FULL, tmp_path / "source")
    results = wb.launch(_replicas_once_on_rank_0, nprocs=2, args=(str(tmp_path),), timeout=120)
    for message, values in results.values():
        assert message == ("the ranks passed different read_replicas_once (True on rank(s) 0 and False on rank(s) "
                           "1): every rank must pass the same"), message
        assert values == [0.0] * 8  # no tensor was changed
