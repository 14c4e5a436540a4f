"""4 gloo ranks: FSDP2 over a flattened sub-mesh (torchtitan's ``dp_shard_cp``), HSDP, and HSDP over a flattened
shard dim, each read by ``Layout.from_model`` and saved with ``save_hf``; the files equal the unsharded model. DCP
checkpoints written with ``DCPSavePlanner`` on one of these meshes load into another."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from workbench.run import launch

# uneven sizes on purpose: 10 rows over 4 ranks are 3, 3, 3, 1; 7 over 2 are 4, 3
CASES = {
    # name: (mesh shape, mesh dim names, dims flattened into dp_shard_cp or None, FSDP mesh dims, expected cut)
    "flat": ((2, 2, 1), ("dp_shard", "cp", "tp"), ("dp_shard", "cp"), ("dp_shard_cp",), "S(0)@dp_shard+cp"),
    "hsdp": ((2, 2), ("dp_replicate", "dp_shard"), None, ("dp_replicate", "dp_shard"), "S(0)@dp_shard"),
    "hsdp_flat": ((2, 1, 2), ("dp_replicate", "dp_shard", "cp"), ("dp_shard", "cp"),
                  ("dp_replicate", "dp_shard_cp"), "S(0)@dp_shard+cp"),
}

MODES = {"flat": ("direct",), "hsdp": ("direct", "gather"), "hsdp_flat": ("direct",)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(7, 8), nn.Linear(8, 10), nn.Linear(10, 6, bias=False))


def _ranks(root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from workbench import _compat
    from workbench._compat_mesh import flatten_mesh
    from workbench.io.dcp.planners import DCPLoadPlanner, DCPSavePlanner
    from workbench.io.hf.save import save_hf
    from workbench.layout.model_layout import Layout

    def build(case: str) -> nn.Module:
        shape, names, flattened, fsdp_dims, _ = CASES[case]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        if flattened:
            flatten_mesh(mesh, flattened, "dp_shard_cp")
        fsdp_mesh = mesh[fsdp_dims] if len(fsdp_dims) > 1 else mesh[fsdp_dims[0]]
        model = _model()
        for layer in model:
            _compat.fully_shard(layer, mesh=fsdp_mesh)
        _compat.fully_shard(model, mesh=fsdp_mesh)
        return model

    out = {}
    for case in CASES:
        model = build(case)
        layout = Layout.from_model(model)
        out[case] = {
            "cuts": {n: s.describe_shards() for n, s in layout.specs.items()},
            "coverage": all(r.ok for r in layout.coverage().values()),
            "replicas": {n: len(s.replica_groups()) for n, s in layout.specs.items()},
            "mesh": layout.mesh.dim_names,
        }
        for mode in MODES[case]:  # each rank writes its own bytes / writers gather whole keys
            save_hf(model, Path(root) / f"{case}_{mode}", layout=layout, write_mode=mode)
        dcp.save(model.state_dict(), checkpoint_id=Path(root) / f"dcp_{case}", planner=DCPSavePlanner(model))
    # DCP across these meshes: FSDP over dp_shard_cp (4 ranks) -> HSDP (2 x 2), and HSDP over dp_shard_cp -> flat
    for source, target in (("flat", "hsdp"), ("hsdp_flat", "flat")):
        model = build(target)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(float("nan"))
        dcp.load(model.state_dict(), checkpoint_id=Path(root) / f"dcp_{source}", planner=DCPLoadPlanner(model))
        out[f"dcp {source} -> {target}"] = {n: p.full_tensor() for n, p in model.state_dict().items()}
    return out


@pytest.mark.slow
def test_flattened_and_hsdp_meshes_are_read_and_saved(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    results = launch(_ranks, nprocs=4, args=(str(tmp_path),), timeout=180)
    want = {k: v.detach() for k, v in _model().state_dict().items()}
    for case, (_, names, _, _, cut) in CASES.items():
        for rank, r in results.items():
            got = r[case]
            assert got["mesh"] == names, (case, rank)
            assert set(got["cuts"].values()) == {cut}, (case, rank, got["cuts"])
            assert got["coverage"], (case, rank)
            replicas = 2 if "hsdp" in case else 1  # HSDP: two replica groups hold a full copy each
            assert set(got["replicas"].values()) == {replicas}, (case, rank, got["replicas"])
        for mode in MODES[case]:
            saved = {}
            for f in (tmp_path / f"{case}_{mode}").glob("*.safetensors"):
                saved.update(load_file(f))
            assert saved.keys() == want.keys(), (case, mode)
            for key, tensor in want.items():
                assert saved[key].dtype == tensor.dtype and torch.equal(saved[key], tensor), (case, mode, key)
    for rank, r in results.items():  # full_tensor() is a sound oracle here: plain Shard(0), no interleave
        for what in ("dcp flat -> hsdp", "dcp hsdp_flat -> flat"):
            assert r[what].keys() == want.keys()
            assert all(torch.equal(r[what][k], want[k]) for k in want), (rank, what)
