"""The kernel's side of the ranks: start them with torch's elastic agent, and talk to them over one ROUTER socket.

``RankSet`` binds the socket, starts ``torchrun ... -m workbench.run.kernel.worker --connect ...`` for local ranks
(in its own session, so a Jupyter interrupt aimed at the kernel's process group never reaches torch's agent),
admits ranks that present the kernel's token, and sends/receives JSON messages. It never blocks the caller for
longer than the timeout given to ``recv``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.run.kernel.protocol import ENV_CONNECT, ENV_KERNEL_PID, Connection, decode, encode

__all__ = ["RankInfo", "RankSet", "RanksStopped"]


class RanksStopped(RuntimeError):
    """The local ranks' elastic agent exited (a rank crashed, or was killed): the ranks are gone."""


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What a rank told the kernel when it joined."""

    rank: int
    world_size: int
    local_rank: int
    host: str
    pid: int
    backend: str


class RankSet:
    """The ranks of one kernel: local ones it started itself, or ones a scheduler started (``listen``)."""

    def __init__(self, *, nprocs: int, backend: str, listen: str | None = None) -> None:
        import zmq

        self.nprocs = nprocs
        self.backend = backend
        self.ranks: dict[int, RankInfo] = {}
        self.world_size: int | None = nprocs or None
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._socket.setsockopt(zmq.LINGER, 0)
        token = secrets.token_hex(16)
        if listen:
            host, _, port = listen.rpartition(":")
            host = host or "0.0.0.0"
            if port in ("", "0"):
                port_number = self._socket.bind_to_random_port(f"tcp://{host}")
            else:
                port_number = int(port)
                self._socket.bind(f"tcp://{host}:{port_number}")
            advertised = socket.getfqdn() if host in ("", "0.0.0.0", "*") else host
            self.connection = Connection(f"tcp://{advertised}:{port_number}", token)
        else:
            port_number = self._socket.bind_to_random_port("tcp://127.0.0.1")
            self.connection = Connection(f"tcp://127.0.0.1:{port_number}", token)
        self.log_path: Path | None = None
        self._agent: subprocess.Popen[bytes] | None = None
        if nprocs:
            self._start_local()

    # -- local ranks ------------------------------------------------------------------------------------------
    def _start_local(self) -> None:
        from workbench.run.launcher import _free_port

        log_dir = Path(tempfile.mkdtemp(prefix="workbench-kernel-"))
        self.log_path = log_dir / "ranks.log"
        env = {**os.environ, ENV_CONNECT: str(self.connection), ENV_KERNEL_PID: str(os.getpid()),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(self.nprocs),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--max-restarts", "0",
            "--monitor-interval", "0.1", "--start-method", "spawn",
            "-m", "workbench.run.kernel.worker", "--backend", self.backend,
        ]
        with open(self.log_path, "wb") as log:
            self._agent = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True)

    def agent_exit_code(self) -> int | None:
        """The local agent's exit code once it has exited, else None (None too when ranks are remote)."""
        return None if self._agent is None else self._agent.poll()

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the local ranks' log (torch's agent and anything ranks wrote outside cells)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, grace: float = 3.0) -> None:
        """Stop the local ranks (and their agent), politely first; remote ranks just get ``exit``."""
        with contextlib.suppress(Exception):
            for rank in self.ranks:
                self.send(rank, {"op": "exit"})
        if self._agent is not None and self._agent.poll() is None:
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and self._agent.poll() is None:
                time.sleep(0.05)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if self._agent.poll() is not None:
                    break
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self._agent.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._agent.wait(grace)
        self.ranks.clear()

    def signal_local(self, rank: int, sig: int) -> bool:
        """Send a signal to a local rank's process (e.g. SIGUSR1: native stacks into the log)."""
        info = self.ranks.get(rank)
        if info is None or self._agent is None:
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(info.pid, sig)
            return True
        return False

    # -- messages ---------------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Every rank of the world has joined."""
        return self.world_size is not None and len(self.ranks) == self.world_size

    def send(self, rank: int, message: dict[str, Any]) -> None:
        """Send one message to one rank (dropped by ZMQ if the rank is gone)."""
        import zmq

        with contextlib.suppress(zmq.ZMQError):
            self._socket.send_multipart([f"rank{rank}".encode(), encode(message)], flags=zmq.NOBLOCK)

    def broadcast(self, message: dict[str, Any], ranks: Any = None) -> None:
        """Send one message to several ranks (default: every rank that joined)."""
        for rank in sorted(self.ranks) if ranks is None else ranks:
            self.send(rank, message)

    def recv(self, timeout: float) -> tuple[int, dict[str, Any]] | None:
        """The next message from an admitted rank, or None after ``timeout`` seconds; hellos are handled here."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            if not self._socket.poll(int(left * 1000)):
                return None
            identity, frame = self._socket.recv_multipart()[:2]
            try:
                message = decode(frame)
                rank = int(identity.decode().removeprefix("rank"))
            except ValueError:
                continue
            if message["op"] == "hello":
                self._admit(rank, message)
                return rank, message
            if rank in self.ranks:
                return rank, message

    def _admit(self, rank: int, hello: dict[str, Any]) -> None:
        if not secrets.compare_digest(str(hello.get("token", "")), self.connection.token):
            return
        world = int(hello["world_size"])
        if self.world_size is None:
            self.world_size = world
        self.ranks[rank] = RankInfo(rank=rank, world_size=world, local_rank=int(hello["local_rank"]),
                                    host=str(hello["host"]), pid=int(hello["pid"]), backend=str(hello["backend"]))

    def torchrun_command(self) -> str:
        """The command that starts ranks joining this kernel from a cluster's scheduler."""
        return ("torchrun --nnodes NNODES --nproc-per-node NPROC --rdzv-backend c10d --rdzv-endpoint HOST:29400 "
                f"-m workbench.run.kernel.worker --backend {self.backend} --connect '{self.connection}'")

    def close(self) -> None:
        """Stop local ranks and close the socket."""
        self.stop()
        self._socket.close(0)
        self._context.term()
