"""``write_mode="auto"`` across hosts: the host names and rank 0's probe file travel with the first agreement; when
the ranks report different hosts, one more exchange asks whether each sees the probe (direct if all do, else
gather), and the probe never outlives the call."""

from __future__ import annotations

from pathlib import Path

import torch

import workbench as wb
from workbench.io.files.read import CheckpointReader


def _save_as_two_hosts(root: str, hide_probe: bool) -> dict:
    import socket

    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    rank = dist.get_rank()
    if rank == 1:  # rank 1 claims another host; with hide_probe, it cannot see rank 0's files either
        socket.gethostname = lambda: "another-host"
        if hide_probe:
            real_exists = Path.exists
            Path.exists = lambda self: False if ".probe-" in self.name else real_exists(self)
    mesh = wb.MeshSpec((2,), ("fsdp",))
    layout = wb.Layout(mesh, {"w": wb.LoadSpec.from_placements("w", "model.w", (8, 4), mesh, [Shard(0)])})
    local = {"w": torch.arange(32.0).reshape(8, 4)[rank * 4 : (rank + 1) * 4].clone()}
    result = wb.save_hf(local, Path(root) / "ckpt", layout=layout)
    return {"mode": result.write_mode, "left": sorted(p.name for p in Path(root).iterdir())}


def test_auto_across_hosts_probes_once_and_cleans_up(tmp_path: Path) -> None:
    for hide, want in ((False, "direct"), (True, "gather")):
        root = tmp_path / want
        root.mkdir()
        results = wb.launch(_save_as_two_hosts, nprocs=2, args=(str(root), hide), timeout=120)
        assert {r["mode"] for r in results.values()} == {want}
        assert results[0]["left"] == ["ckpt"]  # no probe file left behind
        with CheckpointReader(root / "ckpt") as reader:
            assert torch.equal(reader.read("model.w"), torch.arange(32.0).reshape(8, 4))
