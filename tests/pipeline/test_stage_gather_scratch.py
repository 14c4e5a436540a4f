"""A stage's gathers over a group whose global ranks are not in torch's order are copied back into mesh order: a
second buffer of the gather's size, which the save's schedule counts when ``gather_scratch`` says so. On a backend
that gathers in place (NCCL) only the reorder needs it, and every rank of every stage must decide alike (their
schedules pair their collectives)."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Shard

from workbench import _compat
from workbench.layout.load_spec import LoadSpec
from workbench.layout.model_layout import Layout
from workbench.layout.pipeline import PipelineLayout
from workbench.mesh import MeshSpec


@pytest.mark.parametrize(("ranks", "want"), [((0, 1, 2, 3), False), ((0, 1, 3, 2), True)])
def test_every_rank_of_every_stage_counts_a_reorder_copy(monkeypatch: pytest.MonkeyPatch, ranks: tuple[int, ...],
                                                         want: bool) -> None:
    from workbench.io.pipeline import save as pipeline_save
    from workbench.run import torch_comm

    subgroup = torch_comm._subgroup  # the fake world has no gloo: its flag groups are fake ones too
    monkeypatch.setattr(pipeline_save, "_subgroup", lambda groups, backend, timeout: subgroup(groups, None, timeout))
    mesh = MeshSpec((2, 2), ("pp", "fsdp"), ranks)  # stage 1 is global ranks 2, 3, listed (3, 2) in the second
    specs = {n: LoadSpec.from_placements(n, [f"hf.{n}"], (4, 2), mesh, [Shard(0)], mesh_dims=["fsdp"])
             for n in ("layers.0.w", "layers.1.w")}
    pipeline = PipelineLayout.from_layout(Layout(mesh, specs), "pp", lambda name: int(name.split(".")[1]))
    flags = {}
    for rank in range(4):
        with _compat.fake_process_group(rank, 4):
            try:
                flags[rank] = pipeline_save.StageCommunicator(pipeline, timeout=30).gather_scratch
            finally:
                torch_comm.forget_groups()
    assert flags == dict.fromkeys(range(4), want)

