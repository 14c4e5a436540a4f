"""A listening kernel and a job of two "nodes" (two torchrun agents on this machine, one rank each, told apart by
WORKBENCH_KERNEL_HOST): the first cell waits for every rank and says who joined from where; a node killed during a
barrier ends the cell within the stated time naming its rank, host and last line, the other node's agent stops
at once (no 300 s exit barrier), and a new job joins the same kernel. Ranks that never join are named."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.kernel.support import execute, jupyter_path
from workbench.kernel.protocol import Link, encode, new_identity
from workbench.kernel.spec import install_kernel

pytestmark = pytest.mark.slow

DEAD_AFTER = 4


@dataclass
class Cluster:
    client: Any
    manager: Any
    command: list[str]  # what %ranks_connect printed, for one agent of a 2-node job (rendezvous port to fill in)
    log_dir: Path
    agents: list[subprocess.Popen] = field(default_factory=list)
    shut: bool = False

    def start_job(self) -> list[subprocess.Popen]:
        """Two agents (node0, node1) of one job, each with its log."""
        from workbench.run.launcher import _free_port

        endpoint = f"127.0.0.1:{_free_port()}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("WORKBENCH_KERNEL_")}
        job = []
        for node in ("node0", "node1"):
            log = open(self.log_dir / f"{node}-{len(self.agents)}.log", "wb")  # noqa: SIM115 (lives with the agent)
            words = [endpoint if w == "HOST:29400" else w for w in self.command]
            # the rendezvous store lives on node 0 (the --rdzv-endpoint host of a real job)
            at = words.index("--rdzv-backend")
            words[at:at] = ["--rdzv-conf", f"is_host={int(node == 'node0')}"]
            job.append(subprocess.Popen(words, stdout=log, stderr=subprocess.STDOUT,
                                        env={**env, "OMP_NUM_THREADS": "1", "WORKBENCH_KERNEL_HOST": node}))
        self.agents += job
        return job


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from jupyter_client.manager import start_new_kernel

    prefix = tmp_path_factory.mktemp("jupyter-prefix")
    install_kernel(nprocs=0, backend="gloo", name="wb-nodes", prefix=str(prefix), listen="127.0.0.1:0",
                   join_timeout=90, dead_after=DEAD_AFTER)
    with jupyter_path(prefix):
        manager, client = start_new_kernel(kernel_name="wb-nodes", startup_timeout=60)
    help_text = execute(client, "%ranks_connect", timeout=30).streams["stdout"]
    [line] = [s.strip() for s in help_text.splitlines() if s.strip().startswith("torchrun ")]
    words = shlex.split(line)
    values = {"NNODES": "2", "NPROC": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--start-method", "spawn",
               *(values.get(w, w) for w in words[1:])]
    state = Cluster(client, manager, command, prefix)
    try:
        yield state
    finally:
        client.stop_channels()
        if not state.shut:
            manager.shutdown_kernel(now=False)
        for agent in state.agents:
            if agent.poll() is None:
                _signal_node(agent, signal.SIGKILL)


def _signal_node(agent: subprocess.Popen, sig: int) -> None:
    """Signal an agent and every process under it, as if its node died (its ranks run in sessions of their own)."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        for process in [*psutil.Process(agent.pid).children(recursive=True), psutil.Process(agent.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(sig)
    if sig == signal.SIGKILL:
        agent.wait()


def _hosts(client: Any) -> dict[str, int]:
    out = execute(client, "import os\nprint(os.environ['WORKBENCH_KERNEL_HOST'], rank)", timeout=60)
    assert out.reply["status"] == "ok", out.error_text
    return {host: int(r) for host, r in re.findall(r"\] (node\d) (\d)", out.streams["stdout"])}


def test_the_first_cell_waits_for_every_rank_then_a_lost_node_ends_the_cell_and_a_new_job_joins(
        cluster: Cluster) -> None:
    client = cluster.client
    first_job = cluster.start_job()
    first = execute(client, "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()", timeout=120)
    assert first.reply["status"] == "ok", (first.error_text, first.streams)
    assert first.result == "3.0"
    progress = first.streams["stdout"]
    assert progress.startswith("waiting up to 90 s for the job's ranks: none joined yet\n"), progress
    assert progress.rstrip().endswith("all 2 ranks joined"), progress
    joined = execute(client, "%ranks_connect").streams["stdout"]
    assert "ranks joined: 0,1 (world size 2). By host: " in joined
    assert re.search(r"node0 rank \d; node1 rank \d|node1 rank \d; node0 rank \d", joined), joined
    hosts = _hosts(client)
    lost_rank, kept_rank = hosts["node1"], hosts["node0"]

    killed: dict[str, float] = {}

    def freeze_node1() -> None:
        time.sleep(3.5)  # the cell is in its barrier, and the kernel has seen where each rank is
        killed["at"] = time.monotonic()
        _signal_node(first_job[1], signal.SIGSTOP)  # node 1 vanishes: no process exits, no connection closes

    threading.Thread(target=freeze_node1, daemon=True).start()
    try:
        out = execute(client, f"import time\nif rank == {lost_rank}:\n    time.sleep(600)\ndist.barrier()",
                      timeout=60)
        ended = time.monotonic() - killed["at"]
    finally:
        _signal_node(first_job[1], signal.SIGKILL)
    assert out.reply["ename"] == "RanksLost", (out.reply, out.streams)
    # the connection goes when ZMTP heartbeats stay unanswered for 5 s; then the rank is lost (silent >= 4 s)
    assert ended < max(DEAD_AFTER, 5) + 4, ended
    text = out.error_text
    assert f"rank(s) {lost_rank} of the job are gone: nothing heard for {DEAD_AFTER} s or more" in text
    assert f"rank {lost_rank} on host node1: last seen File \"<ipython-input-" in text and "time.sleep(600)" in text
    # node 0's rank waited in the barrier (node 1's sockets stay open): the kernel freed it
    assert f"Rank(s) {kept_rank} were released from what they waited in (rank(s) {kept_rank} came back)" in text
    assert f"rank(s) {kept_rank} were told to exit" in text
    assert "Restart the job's ranks, e.g. with:\n  torchrun " in text
    start = time.monotonic()
    code = first_job[0].wait(timeout=30)  # node 0's agent stops at once, without torch's 300 s exit barrier
    assert code != 0 and time.monotonic() - start < 20
    print(f"\nnode lost -> cell error {ended:.1f} s (dead_after {DEAD_AFTER} s)")

    rejoin = time.monotonic()
    second_job = cluster.start_job()  # the same command again: the kernel was never restarted
    # the ended job's world size is forgotten: %%ranks 1 waits for the new ranks (it was checked against size 1)
    again = execute(client, "%%ranks 1\n('t' in globals(), world_size, rank)\n", timeout=120)
    print(f"a new job's ranks joined and ran a cell {time.monotonic() - rejoin:.1f} s after their agents started")
    assert again.reply["status"] == "ok", again.error_text
    assert again.result == "(False, 2, 1)"  # a new job: fresh ranks
    assert "all 2 ranks joined" in again.streams["stdout"]
    out = execute(client, "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()", timeout=60)
    assert out.result == "3.0", out.error_text
    assert [a.poll() for a in second_job] == [None, None]
    start = time.monotonic()
    cluster.manager.shutdown_kernel(now=False)  # every rank answers: they exit 0 and so do their agents
    cluster.shut = True
    assert [a.wait(timeout=60) for a in second_job] == [0, 0]
    assert time.monotonic() - start < 30


def test_ranks_that_never_join_are_named_with_the_hosts_of_those_that_did(tmp_path: Path) -> None:
    from jupyter_client.manager import start_new_kernel

    install_kernel(nprocs=0, backend="gloo", name="wb-half", prefix=str(tmp_path), listen="127.0.0.1:0",
                   join_timeout=2)
    with jupyter_path(tmp_path):
        manager, client = start_new_kernel(kernel_name="wb-half", startup_timeout=60)
    context = zmq.Context()
    try:
        help_text = execute(client, "%ranks_connect", timeout=30).streams["stdout"]
        address = re.search(r"--connect (\S+)", help_text).group(1)
        token = Path(re.search(r"--token-file (\S+)", help_text).group(1)).read_text().strip()
        peer = context.socket(zmq.DEALER)
        identity = new_identity(0)
        peer.setsockopt(zmq.IDENTITY, identity.encode())
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(address)
        link = Link(token.encode(), me="rank", rank=0, identity=identity)  # rank 0 of 2, alone
        peer.send_multipart(link.seal(encode({"op": "hello", "rank": 0, "world_size": 2, "local_rank": 0,
                                               "host": "gpu-node-7", "pid": 1, "backend": "gloo"})))
        start = time.monotonic()
        out = execute(client, "1 + 1", timeout=30, total=40)
        took = time.monotonic() - start
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
        context.destroy(linger=0)
    assert out.reply["ename"] == "RanksNotReady"
    assert out.reply["evalue"].startswith("rank(s) 1 of 2 did not join within 2 s (1 of 2 joined: gpu-node-7 rank 0)")
    assert "waiting up to 2 s for the job's ranks: 1 of 2 joined: gpu-node-7 rank 0\n" in out.streams["stdout"]
    assert 2 <= took < 10


def test_an_interrupt_while_the_first_cell_waits_for_ranks_gets_a_reply(tmp_path: Path) -> None:
    # the stop button pressed while no job has joined: the interrupt escaped the cell and Jupyter never got an
    # execute_reply (the frontend waits forever)
    from jupyter_client.manager import start_new_kernel

    install_kernel(nprocs=0, backend="gloo", name="wb-wait", prefix=str(tmp_path), listen="127.0.0.1:0",
                   join_timeout=120)
    with jupyter_path(tmp_path):
        manager, client = start_new_kernel(kernel_name="wb-wait", startup_timeout=60)
    try:
        threading.Timer(2.0, manager.interrupt_kernel).start()
        start = time.monotonic()
        out = execute(client, "1 + 1", timeout=30, total=40)
        assert time.monotonic() - start < 20
        assert out.reply["status"] == "error" and out.reply["ename"] == "KeyboardInterrupt", out.reply
        assert "nothing ran" in out.reply["evalue"]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
