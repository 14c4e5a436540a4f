"""Ranks started by a "scheduler" join a kernel that starts none: ``workbench kernel install --nprocs 0 --listen``,
then the command ``%ranks_connect`` prints (here a local 2-rank torchrun). The command names the token's file,
never the token (notebook output is saved); peers without the token, or with a joined rank's ZMQ identity, get
nothing from the kernel and put nothing into the notebook."""

from __future__ import annotations

import ast
import os
import queue
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.support import CellOutput, execute, jupyter_path
from workbench.kernel.protocol import Link, encode, new_identity
from workbench.kernel.spec import install_kernel

pytestmark = pytest.mark.slow

MARK = "INJECTED-BY-AN-INTRUDER"


@dataclass
class Joined:
    client: Any
    early: CellOutput  # a cell run before any rank joined
    early_subset: CellOutput  # a %%ranks cell run then (the world size is not known yet)
    help_text: str  # what %ranks_connect printed then
    joined: str  # what it printed once both ranks joined


def _scheduler_command(help_text: str) -> list[str]:
    """The torchrun line %ranks_connect printed, as a scheduler would run it on one node of 2 ranks."""
    from workbench.run.launcher import _free_port

    [line] = [s.strip() for s in help_text.splitlines() if s.strip().startswith("torchrun ")]
    words = shlex.split(line)
    assert words[words.index("--connect") + 2] == "--token-file", line  # nothing else carries the secret
    values = {"NNODES": "1", "NPROC": "2", "HOST:29400": f"127.0.0.1:{_free_port()}"}
    return [sys.executable, "-m", "torch.distributed.run", "--start-method", "spawn",
            *(values.get(w, w) for w in words[1:])]


@pytest.fixture(scope="module")
def joined(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Joined]:
    from jupyter_client.manager import start_new_kernel

    prefix = tmp_path_factory.mktemp("jupyter-prefix")
    install_kernel(nprocs=0, backend="gloo", name="wb-listen", prefix=str(prefix), listen="127.0.0.1:0",
                   join_timeout=2)
    with jupyter_path(prefix):
        manager, client = start_new_kernel(kernel_name="wb-listen", startup_timeout=60)
    agent = None
    token_file = None
    try:
        early = execute(client, "1 + 1", timeout=30)  # no ranks yet: a clear answer, not a hang
        early_subset = execute(client, "%%ranks 1\nrank", timeout=30)
        help_text = execute(client, "%ranks_connect").streams["stdout"]
        token_file = Path(re.search(r"--token-file (\S+)", help_text).group(1))
        log = prefix / "torchrun.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("WORKBENCH_KERNEL_")}
        with open(log, "wb") as out:
            agent = subprocess.Popen(_scheduler_command(help_text), stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**env, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 90
        now = ""
        while time.monotonic() < deadline and "ranks joined: 0,1 " not in now:
            assert agent.poll() is None, log.read_text()
            now = execute(client, "%ranks_connect").streams["stdout"]
            time.sleep(0.5)
        assert "ranks joined: 0,1 (world size 2)" in now, log.read_text()
        yield Joined(client, early, early_subset, help_text, now)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)  # tells the ranks to exit
        if agent is not None:
            try:
                assert agent.wait(timeout=30) == 0  # the ranks left cleanly, so torchrun did too
            finally:
                if agent.poll() is None:
                    os.killpg(agent.pid, 9)
        assert token_file is None or not token_file.exists()  # a stopped kernel leaves no token behind


def test_ranks_connect_prints_a_command_without_the_token(joined: Joined) -> None:
    assert joined.early.reply["ename"] == "RanksNotReady"
    assert "no rank joined within 2 s" in joined.early.reply["evalue"]
    assert "Start ranks that join this kernel with:\n  torchrun " in joined.early.reply["evalue"]
    # %%ranks 1 waits for the ranks like any cell: it was refused, checked against a world size of 1
    assert joined.early_subset.reply["ename"] == "RanksNotReady", joined.early_subset.reply
    token_file = Path(re.search(r"--token-file (\S+)", joined.help_text).group(1))
    assert token_file.stat().st_mode & 0o777 == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32
    for text in (joined.help_text, joined.joined, joined.early.reply["evalue"]):
        assert token not in text and "#" not in text


def test_ranks_joined_with_the_printed_command_run_a_collective(joined: Joined) -> None:
    out = execute(joined.client, "import os\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\n"
                                 "print('rank', rank, 'of', world_size, 'started by torchrun:',\n"
                                 "      'TORCHELASTIC_RUN_ID' in os.environ)\n"
                                 "t.item()")
    assert out.reply["status"] == "ok", out.error_text
    assert out.streams["stdout"] == ("[0] rank 0 of 2 started by torchrun: True\n"
                                     "[1] rank 1 of 2 started by torchrun: True\n")
    assert out.result == "3.0"  # 1 + 2: the collective ran across the joined ranks
    assert execute(joined.client, "%%ranks 1\nrank").result == "1"
    out = execute(joined.client, "%%ranks 1-2\nrank")
    assert out.reply["ename"] == "MagicError" and "rank(s) [2] out of range; this kernel has world_size 2" in (
        out.reply["evalue"]), out.reply


def _iopub(client: Any, seconds: float) -> list[dict[str, Any]]:
    got = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            got.append(client.get_iopub_msg(timeout=left))
        except queue.Empty:
            break
    return got


def test_intruders_get_nothing_and_put_nothing_into_the_notebook(joined: Joined) -> None:
    import zmq

    client = joined.client
    address = re.search(r"--connect (\S+)", joined.help_text).group(1)
    found = execute(client, "%%ranks 0\nimport gc, zmq\n[o for o in gc.get_objects() if type(o).__name__ == "
                            "'_Worker'][0]._socket.getsockopt(zmq.IDENTITY).decode()")
    identity = ast.literal_eval(found.result)  # rank 0's ZMQ identity, as someone watching the wire would see it
    context = zmq.Context()
    try:
        intruders = {}
        for name, ident in (("stolen identity", identity), ("guessed identity", "rank1"),
                            ("own identity", new_identity(0))):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, ident.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            intruders[name] = sock
        time.sleep(0.5)
        forged = [{"op": "hello", "token": "0" * 64, "rank": 0, "world_size": 2, "local_rank": 0, "host": "x",
                   "pid": 1, "backend": "gloo", "torch": "x", "generation": 0},
                  {"op": "comm", "msg_type": "comm_open", "content": {"comm_id": MARK, "target_name": "jupyter.widget",
                                                                      "data": {"state": {}}}, "metadata": {},
                   "buffers": []},
                  {"op": "display", "id": "", "rank": 0, "data": {"text/plain": MARK}, "metadata": {}}]
        for sock in intruders.values():
            ident = sock.getsockopt(zmq.IDENTITY).decode()
            wrong_key = Link(b"0" * 64, me="rank", rank=0, identity=ident)
            for message in forged:
                sock.send(encode(message))  # unsigned
                sock.send_multipart(wrong_key.seal(encode(message)))  # signed without the token
        seen = _iopub(client, 1.5)  # the kernel's pump handles rank messages between cells
        cell = "print('after', rank)"
        try:
            out = execute(client, cell, timeout=30, on_output=seen.append)
        except queue.Empty:
            out = None
        seen += _iopub(client, 0.5)
        received = {name: sock.recv_multipart() for name, sock in intruders.items() if sock.poll(500)}
    finally:
        context.destroy(linger=0)
    assert received == {}  # none of them got the cell's code (or anything else)
    assert not [m for m in seen if MARK in repr(m["content"])]  # none of their messages reached the notebook
    assert out is not None and out.reply["status"] == "ok", out and out.error_text
    assert out.streams["stdout"] == "[0] after 0\n[1] after 1\n" and not out.displays


def test_listening_on_every_interface_warns_in_the_notebook(tmp_path: Path) -> None:
    from jupyter_client.manager import start_new_kernel

    install_kernel(nprocs=0, backend="gloo", name="wb-open", prefix=str(tmp_path), listen="0.0.0.0:0")
    token_file = tmp_path / "kernel.token"
    with jupyter_path(tmp_path):
        manager, client = start_new_kernel(kernel_name="wb-open", startup_timeout=60,
                                           env={**os.environ, "WORKBENCH_KERNEL_TOKEN_FILE": str(token_file)})
    try:
        first = execute(client, "%ranks_connect", timeout=30)
        again = execute(client, "%ranks_connect", timeout=30)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
    warning = "listening for ranks on every interface (0.0.0.0:0"
    assert warning in first.streams["stderr"]  # the first cell shows it, whatever the cell is
    assert warning in first.streams["stdout"] and warning in again.streams["stdout"]  # and every %ranks_connect
    assert warning not in again.streams["stderr"]
    assert f"--token-file {token_file}" in first.streams["stdout"]  # the file the environment names
    assert not token_file.exists()
