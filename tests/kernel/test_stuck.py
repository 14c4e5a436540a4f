"""A rank that cannot be freed from a collective: the kernel still answers, names it, refuses new cells, and a
restart gives a working kernel.

The kernel is installed with ``close_sockets=False``, so a live DeviceMesh on the idle rank keeps the gloo
connections of the interrupted collective open (what every kernel did before ``sever``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.support import execute, jupyter_path
from tests.kernel.test_kernel import MESH
from workbench.kernel.spec import install_kernel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    from jupyter_client.manager import start_new_kernel

    prefix = tmp_path_factory.mktemp("jupyter-prefix")
    install_kernel(nprocs=2, backend="gloo", name="wb-keep-2", prefix=str(prefix), close_sockets=False,
                   hang_timeout=2)
    with jupyter_path(Path(prefix)):
        manager, client = start_new_kernel(kernel_name="wb-keep-2", startup_timeout=120)
        try:
            yield manager, client
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=True)


def test_a_rank_stuck_for_good_is_named_and_restart_works(kernel: tuple[Any, Any]) -> None:
    manager, client = kernel
    assert execute(client, MESH).result == "[0.0, 1.0]"
    reported = threading.Event()

    def watch(msg: dict) -> None:
        if msg["msg_type"] == "stream" and "still running after" in msg["content"]["text"] and not reported.is_set():
            reported.set()
            manager.interrupt_kernel()

    start = time.monotonic()
    out = execute(client, "if rank == 0:\n    dist.all_reduce(torch.ones(1))\n'done'", timeout=60, on_output=watch)
    assert time.monotonic() - start < 40
    stderr = out.streams["stderr"]
    assert "rank(s) 0 wait in a collective that the other ranks left (rank 1 finished the cell)" in stderr
    assert "destroying the process groups so they return" in stderr and "closing" not in stderr
    assert "rank(s) 0 still wait in a collective" in stderr and "giving up on this cell" in stderr
    assert "dist.all_reduce" in stderr  # where rank 0 is stuck
    assert out.reply["ename"] == "RankStuck" and out.reply["evalue"].startswith("[rank 0]")
    refused = execute(client, "1 + 1", timeout=30)
    assert refused.reply["ename"] == "RanksNotReady" and "rank(s) 0 are still stuck" in refused.reply["evalue"]
    manager.restart_kernel(now=True)
    client.wait_for_ready(timeout=120)
    again = execute(client, MESH.replace("(2,))", "(2,))\nt = torch.ones(1)\ndist.all_reduce(t)") + ", t.item()")
    assert again.result == "([0.0, 1.0], 2.0)", again.error_text
