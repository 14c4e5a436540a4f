"""Ranks started by a "scheduler" join a kernel that starts none: ``workbench kernel install --nprocs 0 --listen``,
then ``torchrun ... -m workbench.run.kernel.worker --connect ADDRESS`` (here a local 2-rank torchrun)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.kernel.support import execute, jupyter_path
from workbench.run.kernel.spec import install_kernel

pytestmark = pytest.mark.slow


def test_torchrun_ranks_join_a_listening_kernel(tmp_path: Path) -> None:
    from jupyter_client.manager import start_new_kernel

    from workbench.run.launcher import _free_port

    install_kernel(nprocs=0, backend="gloo", name="wb-listen", prefix=str(tmp_path), listen="127.0.0.1:0")
    with jupyter_path(tmp_path):
        manager, client = start_new_kernel(kernel_name="wb-listen", startup_timeout=60)
    agent = None
    try:
        early = execute(client, "1 + 1", timeout=30)  # no ranks yet: a clear answer, not a hang
        assert early.reply["ename"] == "RanksNotReady" and "ranks joined so far: none" in early.reply["evalue"]
        help_text = execute(client, "%ranks_connect").streams["stdout"]
        connect = re.search(r"--connect '([^']+)'", help_text)
        assert connect, help_text
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
                   "--start-method", "spawn", "-m", "workbench.run.kernel.worker", "--backend", "gloo",
                   "--connect", connect.group(1)]
        assert shlex.split(help_text.split("\n")[1])[-6:-2] == ["-m", "workbench.run.kernel.worker", "--backend",
                                                                "gloo"]  # the command we run is the one it prints
        log = tmp_path / "torchrun.log"
        with open(log, "wb") as out:
            agent = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 90
        joined = ""
        while time.monotonic() < deadline and "ranks joined: 0,1 " not in joined:
            assert agent.poll() is None, log.read_text()
            joined = execute(client, "%ranks_connect").streams["stdout"]
            time.sleep(0.5)
        assert "ranks joined: 0,1 (world size 2)" in joined, log.read_text()
        out = execute(client, "import os\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\n"
                              "print('rank', rank, 'of', world_size, 'started by torchrun:',\n"
                              "      'TORCHELASTIC_RUN_ID' in os.environ)\n"
                              "t.item()")
        assert out.reply["status"] == "ok", out.error_text
        assert out.streams["stdout"] == ("[0] rank 0 of 2 started by torchrun: True\n"
                                         "[1] rank 1 of 2 started by torchrun: True\n")
        assert out.result == "3.0"  # 1 + 2: the collective ran across the joined ranks
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)  # tells the ranks to exit
        if agent is not None:
            try:
                assert agent.wait(timeout=30) == 0  # the ranks left cleanly, so torchrun did too
            finally:
                if agent.poll() is None:
                    os.killpg(agent.pid, 9)
