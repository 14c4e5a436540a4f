"""Ranks a scheduler started for a listening kernel exit once the kernel is gone: no signed word from it for
WORKBENCH_KERNEL_SILENCE_S seconds while their connection to it does not hold (it was SIGKILLed, OOM-killed, its host
or the network went down). A kernel that is merely busy keeps them: it pings during long cells, and a kernel that
waits without pinging keeps its connection (libzmq answers heartbeats without the GIL)."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.kernel.support import execute, jupyter_path
from workbench.kernel.protocol import ENV_SILENCE, Link, Rejected, encode, write_token_file
from workbench.kernel.ranks import LOST_EXIT_CODE, REFUSED_EXIT_CODE
from workbench.kernel.spec import install_kernel
from workbench.kernel.worker import _KernelWatch, _silence_limit

SILENCE = 5  # seconds: the ranks' limit in the kernel test (the default is 30)


def _agent(command: list[str], log: Path, silence: float) -> subprocess.Popen:
    """A torchrun agent as a scheduler starts it (none of the kernel's own variables), its ranks' limit set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKBENCH_KERNEL_")}
    env.update({ENV_SILENCE: f"{silence:g}", "OMP_NUM_THREADS": "1"})
    with open(log, "wb") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _kill_tree(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and what it started (only those: by pid)."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        for process in [*psutil.Process(agent.pid).children(recursive=True), psutil.Process(agent.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    agent.wait(10)


def _torchrun(words: list[str]) -> list[str]:
    """A %ranks_connect line (or one made like it) for one node of one rank, run with this interpreter."""
    from workbench.run.launcher import _free_port

    values = {"NNODES": "1", "NPROC": "1", "HOST:29400": f"127.0.0.1:{_free_port()}"}
    return [sys.executable, "-m", "torch.distributed.run", "--start-method", "spawn",
            *(values.get(w, w) for w in words[1:])]


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_a_rank_outlives_a_long_cell_then_exits_once_its_kernel_is_killed(tmp_path: Path) -> None:
    from jupyter_client.manager import start_new_kernel

    install_kernel(nprocs=0, backend="gloo", name="wb-silence", prefix=str(tmp_path), listen="127.0.0.1:0",
                   join_timeout=90)
    with jupyter_path(tmp_path):
        manager, client = start_new_kernel(kernel_name="wb-silence", startup_timeout=60)
    agent = None
    try:
        help_text = execute(client, "%ranks_connect", timeout=30).streams["stdout"]
        [line] = [s.strip() for s in help_text.splitlines() if s.strip().startswith("torchrun ")]
        log = tmp_path / "agent.log"
        agent = _agent(_torchrun(shlex.split(line)), log, SILENCE)
        first = execute(client, "import os, time\nos.getpid()", timeout=120)
        assert first.reply["status"] == "ok", (first.error_text, log.read_text())
        rank_pid = int(first.result)
        # the rank's main thread sleeps twice its limit: the kernel pings all the while, its I/O thread answers
        busy = execute(client, f"time.sleep({2 * SILENCE})\n'still here'", timeout=60)
        assert busy.reply["status"] == "ok", busy.error_text
        assert busy.result == "'still here'" and agent.poll() is None and not _gone(rank_pid)
        os.kill(manager.provisioner.process.pid, signal.SIGKILL)  # as the OOM killer does
        killed = time.monotonic()
        code = agent.wait(timeout=SILENCE + 30)
        took = time.monotonic() - killed
        print(f"\nkernel SIGKILLed -> rank's agent exited {took:.1f} s later (limit {SILENCE} s)")
    finally:
        client.stop_channels()
        with contextlib.suppress(Exception):
            manager.shutdown_kernel(now=True)
        if agent is not None and agent.poll() is None:
            _kill_tree(agent)
    text = log.read_text(errors="replace")
    assert code != 0, text
    assert _gone(rank_pid)
    assert took < SILENCE + 6, (took, text)
    assert re.search(rf"workbench rank 0: no word from the kernel at tcp://127\.0\.0\.1:\d+ for [5-9] s \(it died, or "
                     rf"the network is down\); exiting with code {LOST_EXIT_CODE}", text), text
    assert re.search(rf"exitcode\s*: {LOST_EXIT_CODE} ", text), text  # torch's agent names the rank's exit code


@pytest.mark.slow
def test_a_rank_waiting_on_a_connected_kernel_stays_and_leaves_once_the_connection_goes(tmp_path: Path) -> None:
    """A fake kernel that takes the rank's hello and never answers: while its socket is open (a kernel admitting
    ranks, or busy in a wait that does not ping) the rank stays; once it closes, the rank exits within the limit."""
    silence = 3.0
    token = "t" * 64
    context = zmq.Context()
    kernel, _, agent, log = _fake_kernel_and_rank(context, tmp_path, token, silence)
    try:
        hello = _hello(kernel, token, timeout=90)
        assert hello["op"] == "hello" and agent.poll() is None, log.read_text()
        time.sleep(2.5 * silence)  # never heard from, connected: the kernel may be busy; the rank waits
        assert agent.poll() is None, log.read_text()
        kernel.close(0)  # the kernel is gone
        closed = time.monotonic()
        code = agent.wait(timeout=silence + 30)
        took = time.monotonic() - closed
    finally:
        if agent.poll() is None:
            _kill_tree(agent)
        context.destroy(linger=0)
    text = log.read_text(errors="replace")
    assert code != 0 and f"exiting with code {LOST_EXIT_CODE}" in text, text
    assert took < silence + 4, (took, text)


def _fake_kernel_and_rank(context: Any, tmp_path: Path, token: str, silence: float
                          ) -> tuple[Any, int, subprocess.Popen, Path]:
    """A ROUTER socket on a loopback port standing in for a kernel, and a one-rank torchrun job of the worker told to
    join it (the token in a file): the socket, its port, the agent and the agent's log."""
    token_file = write_token_file(tmp_path / "token", token)
    kernel = context.socket(zmq.ROUTER)
    kernel.setsockopt(zmq.LINGER, 0)
    port = kernel.bind_to_random_port("tcp://127.0.0.1")
    log = tmp_path / "agent.log"
    agent = _agent(_torchrun(["torchrun", "--nnodes", "NNODES", "--nproc-per-node", "NPROC", "--rdzv-backend", "c10d",
                              "--rdzv-endpoint", "HOST:29400", "-m", "workbench.kernel.worker", "--backend", "gloo",
                              "--connect", f"tcp://127.0.0.1:{port}", "--token-file", str(token_file)]),
                   log, silence)
    return kernel, port, agent, log


def _hello(kernel: Any, token: str, timeout: float) -> dict[str, Any]:
    """The first signed message a rank sends the fake kernel."""
    return _hello_from(kernel, token, timeout)[1]


def _hello_from(kernel: Any, token: str, timeout: float) -> tuple[bytes, dict[str, Any]]:
    """The first signed message a rank sends the fake kernel, and the rank's ZMQ identity."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if kernel.poll(500):
            identity, *frames = kernel.recv_multipart()
            link = Link(token.encode(), me="kernel", rank=None, identity=identity.decode())
            with contextlib.suppress(Rejected):
                return identity, link.open(frames)
    raise AssertionError(f"no hello within {timeout} s")


def test_the_watch_counts_silence_only_while_the_connection_does_not_hold() -> None:
    watch = _KernelWatch(5.0, now=0.0)
    assert watch.gone_for(10.0) == 10.0  # never connected: no kernel there
    watch.event(zmq.EVENT_CONNECTED, now=1.0)
    assert watch.gone_for(100.0) is None  # connected, never dropped: a kernel admitting ranks or busy
    watch.heard(now=100.0)
    watch.event(zmq.EVENT_DISCONNECTED, now=130.0)  # silent 30 s, then the connection drops
    assert watch.gone_for(134.0) is None  # the limit counts from the drop too: a blip is forgiven
    watch.event(zmq.EVENT_CONNECTED, now=135.0)  # a connection again, but to whom? (a new kernel on the port)
    watch.event(zmq.EVENT_DISCONNECTED, now=136.0)  # drops that repeat do not push the limit further
    assert watch.gone_for(136.0) == 36.0
    watch.heard(now=140.0)  # a signed message: the kernel is back
    assert watch.gone_for(1000.0) is None
    assert _KernelWatch(None, now=0.0).gone_for(1e9) is None  # off


def test_the_limit_parses_seconds_or_off_and_refuses_less_than_a_few_pings() -> None:
    assert _silence_limit("60") == 60.0 and _silence_limit("7.5") == 7.5
    assert _silence_limit("off") is None and _silence_limit("0") is None
    for bad in ("1", "-5", "soon"):
        with pytest.raises(Exception, match="WORKBENCH_KERNEL_SILENCE_S"):
            _silence_limit(bad)


@pytest.mark.slow
def test_a_rank_the_kernel_refuses_says_why_and_exits(tmp_path: Path) -> None:
    """A fake kernel refuses the rank's hello (as a kernel of another world size does): the rank used to wait for it
    forever, connected; it now prints the kernel's reason and exits with REFUSED_EXIT_CODE at once."""
    token = "t" * 64
    context = zmq.Context()
    kernel, port, agent, log = _fake_kernel_and_rank(context, tmp_path, token, 60)
    try:
        identity, hello = _hello_from(kernel, token, timeout=90)
        assert hello["op"] == "hello" and agent.poll() is None, log.read_text()
        link = Link(token.encode(), me="kernel", rank=0, identity=identity.decode())
        reason = "hello of rank 0 says world size 1, this kernel's world size is 2"
        kernel.send_multipart([identity, *link.seal(encode({"op": "refused", "reason": reason}))])
        code = agent.wait(timeout=30)
    finally:
        if agent.poll() is None:
            _kill_tree(agent)
        context.destroy(linger=0)
    text = log.read_text(errors="replace")
    assert code != 0, text
    assert (f"workbench rank 0: the kernel at tcp://127.0.0.1:{port} refused this rank: {reason}; exiting with code "
            f"{REFUSED_EXIT_CODE}") in text, text
