"""``ControlChannel``'s failure path in a fake world: the group it would destroy there is the default group, which
a failed exchange must leave alone (destroying it would end the world of every later call)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from workbench import _compat
from workbench.run import torch_comm


def test_a_failed_exchange_in_a_fake_world_leaves_the_world_up(monkeypatch: pytest.MonkeyPatch) -> None:
    with _compat.fake_process_group(0, 4):
        channel = torch_comm.ControlChannel(30.0, what="a test")

        def broken(*_: object, **__: object) -> None:
            raise RuntimeError("Connection closed by peer")

        monkeypatch.setattr(dist, "all_gather_object", broken)
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            channel.all_gather_object("status")
        assert dist.is_initialized() and dist.get_world_size() == 4
