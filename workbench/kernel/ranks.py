"""The kernel's side of the ranks: start them with torch's elastic agent, and talk to them over one ROUTER socket.

``RankSet`` binds the socket (loopback unless ``listen`` names another host), starts ``torchrun ... -m
workbench.kernel.worker --connect ...`` for local ranks (in its own session, so a Jupyter interrupt aimed at the
kernel's process group never reaches torch's agent), admits ranks whose signed hello proves they hold the kernel's
token, and sends/receives signed JSON messages (``protocol``). It never blocks the caller for longer than the
timeout given to ``recv``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.kernel.protocol import (
    ENV_CONNECT,
    ENV_KERNEL_PID,
    ENV_RUN_DIR,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    WILDCARD_HOSTS,
    Link,
    Rejected,
    encode,
    new_token,
    parse_listen,
    write_token_file,
)
from workbench.pid_space import PidSpace, in_this_pid_space
from workbench.run.private_store import PrivateStore

__all__ = ["LOST_EXIT_CODE", "REFUSED_EXIT_CODE", "RankInfo", "RankSet", "RanksStopped"]

_ALIVE = 10.0  # seconds: a rank heard from more recently than this keeps its place against a second hello
_HEARTBEAT_IVL_MS = 1000  # ZMTP heartbeats on every rank connection, answered by libzmq's own thread (no GIL):
_HEARTBEAT_TIMEOUT_MS = 5000  # a connection whose peer answers none for this long is closed
_QUIET_AT_SHUTDOWN = 5.0  # seconds: a rank silent this long at shutdown may be gone (see stop)
_EXITED_AFTER = 3.0  # seconds a local rank's process has ended before the kernel calls it gone (see exited)
_LOG_TAIL_BYTES = 1 << 16  # how much of the ranks' log's end agent_is_stopping reads
_AGENT_STOPS_WITHIN = 60.0  # seconds torch's agent may take to stop the others once it began (30 s SIGTERM wait)
# what torch's agent logs as it stops its ranks because one failed: the others signalled, then the failure named
_AGENT_STOPPING = (b"closing signal", b"failed (exitcode:")
_AGENT_GRACE = 1.0  # seconds stop waits for the local ranks to leave when told: jupyter_client SIGTERMs a kernel 2.5 s
# into its shutdown and ipykernel takes most of a second to exit after replying: stop ends within 1.5 s
_KILL_WAIT = 0.2  # seconds after SIGTERM to the agent's process group before SIGKILL
LOST_EXIT_CODE = 3  # ranks told to exit because their job lost ranks exit with this (torch's agent then stops)
REFUSED_EXIT_CODE = 4  # a rank whose hello the kernel refused for good (another world size, a rank out of range)
_LOGGED_DROPS = 20  # log every dropped message up to this many, then every 100th


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
    stack_file: str = ""  # faulthandler writes its stacks here on SIGUSR2 (stackdump)
    ledger_file: str = ""  # the collective it is in (ledger)
    thread: int = 0  # its main thread's ident, as faulthandler's dump names it
    pid_space: PidSpace = field(default_factory=PidSpace)  # where its pid names it (signalled only from there)


@dataclass(frozen=True)
class _Refusal:
    """Why a signed hello was not admitted; ``retry``: the same hello may pass later (its rank's place frees up);
    ``tell``: the sender is told (not when it is the admitted rank itself: it must not leave)."""

    reason: str
    retry: bool = False
    tell: bool = True


class RankSet:
    """The ranks of one kernel: local ones it started itself, or ones a scheduler started (``listen``).

    Every message is signed and checked (``protocol.Link``); a rank is admitted by a valid hello and from then on
    bound to the ZMQ identity that sent it: ZMQ refuses a second connection with that identity (no handover),
    messages from identities that never passed hello are dropped, and a second hello for an admitted rank is
    refused while the first one is alive (heard from within ``_ALIVE`` seconds; ranks answer the kernel's pings).
    Whatever is dropped is logged on ``log`` (the kernel's log), never acted on.
    """

    def __init__(self, *, nprocs: int, backend: str, listen: str | None = None, token_file: str | None = None,
                 log: logging.Logger | None = None) -> None:
        import zmq

        self.nprocs = nprocs
        self.backend = backend
        self.ranks: dict[int, RankInfo] = {}
        self.world_size: int | None = nprocs or None
        self.warnings: list[str] = []  # shown to the user once (kernel log and the first cell)
        self.dropped = 0  # messages dropped so far (see _drop)
        self._log = log or logging.getLogger(__name__)
        self._token = new_token()
        self._key = self._token.encode()
        self._links: dict[bytes, Link] = {}  # identity -> link, kept after a rank leaves (its sequence numbers)
        self._refusals: dict[bytes, Link] = {}  # identity whose hello was refused -> the link its refusals went on
        self._identity: dict[int, bytes] = {}  # admitted rank -> its identity
        self._heard: dict[int, float] = {}  # admitted rank -> when a valid message of it last arrived
        self._unreachable: dict[int, float] = {}  # rank -> since when ZMQ says its connection is gone
        self._ended: dict[int, float] = {}  # local rank -> when its process was first seen ended
        self._tombstones: set[bytes] = set()  # identities of ranks of a job the kernel ended (told to exit)
        self._lock = threading.RLock()  # the socket is used by the shell thread and the control thread (shutdown)
        self._stopping = threading.Lock()  # held while stop runs: a second stop (a signal handler's) does not wait
        self._stopped = False
        self._cut_short = False  # a SIGTERM ended the agent while stop waited for the ranks (see _stop_now)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 0)  # an identity stays with its first connection
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a rank whose connection is gone says so
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.token_file: Path | None = None
        if listen:
            host, port = parse_listen(listen)
            if ":" in host:
                self._socket.setsockopt(zmq.IPV6, 1)
            bind = f"tcp://[{host}]" if ":" in host else f"tcp://{host}"
            if port == 0:
                port = self._socket.bind_to_random_port(bind)
            else:
                self._socket.bind(f"{bind}:{port}")
            if host in WILDCARD_HOSTS:
                self.warnings.append(
                    f"workbench kernel: listening for ranks on every interface ({listen}, port {port}): any host that "
                    "reaches this port can knock; only ranks holding the token are admitted, but cell code and "
                    "output cross the network unencrypted. Give --listen HOST:PORT with an interface the ranks use "
                    "to narrow it.")
            advertised = socket.getfqdn() if host in WILDCARD_HOSTS else host
            self.address = f"tcp://[{advertised}]:{port}" if ":" in advertised else f"tcp://{advertised}:{port}"
            self.token_file = write_token_file(token_file or _default_token_path(), self._token)
            self._log.info("workbench kernel: ranks join at %s with the token in %s (mode 0600)", self.address,
                           self.token_file)
        else:
            port = self._socket.bind_to_random_port("tcp://127.0.0.1")
            self.address = f"tcp://127.0.0.1:{port}"
        for warning in self.warnings:
            self._log.warning(warning)
        self.log_path: Path | None = None
        self._run_dir: Path | None = None  # the local ranks' log, stack dump and ledger files
        self._agent: subprocess.Popen[bytes] | None = None
        self._store: PrivateStore | None = None
        if nprocs:
            self._start_local()

    # -- local ranks ------------------------------------------------------------------------------------------
    def _start_local(self) -> None:
        log_dir = self._run_dir = Path(tempfile.mkdtemp(prefix="workbench-kernel-"))
        self.log_path = log_dir / "ranks.log"
        # the agent and the ranks meet through files only this user can open: the agent's own stores would listen
        # on every interface, and unpickle what anyone writes there
        self._store = PrivateStore()
        env = {**os.environ, ENV_CONNECT: self.address, ENV_TOKEN: self._token, ENV_KERNEL_PID: str(os.getpid()),
               ENV_RUN_DIR: str(log_dir),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
        env.update(self._store.agent_environment(env))
        env.pop(ENV_TOKEN_FILE, None)  # the token comes from the environment, not from a file the kernel may own
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(self.nprocs),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", self._store.rendezvous,
            "--rdzv-conf", ",".join(f"{k}={str(v).lower()}" for k, v in self._store.agent_rendezvous().items()),
            "--max-restarts", "0",
            "--log-dir", os.path.join(self._store.directory, "agent"),  # else a torchelastic_* folder in /tmp, forever
            "--monitor-interval", "0.1", "--start-method", "spawn",
            "-m", "workbench.kernel.worker", "--backend", self.backend,
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

    def root_cause(self) -> tuple[int, str] | None:
        """The local rank whose failure stopped the agent, and how it ended ("exit code 3", "signal SIGKILL"), from
        the "Root Cause (first observed failure)" torch's agent writes to the ranks' log; None where it says none."""
        text = self.log_tail(200)
        _, found, cause = text.rpartition("Root Cause (first observed failure):")
        rank = re.search(r"^\s*rank\s*:\s*(\d+)", cause, re.MULTILINE) if found else None
        if rank is None:
            return None
        code = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", cause, re.MULTILINE)
        how = "ended"
        if code is not None:
            value = int(code.group(1))
            how = f"exited with code {value}"
            if value < 0:
                try:
                    how = f"was killed by signal {signal.Signals(-value).name}"
                except ValueError:
                    how = f"was killed by signal {-value}"
        return int(rank.group(1)), how

    def stop(self, grace: float = _AGENT_GRACE) -> None:
        """Stop the local ranks (and their agent), politely first; remote ranks get ``exit``. The token file
        goes too: no rank can join a kernel that is stopping; so does the private store folder, always, and the local
        ranks' folder (their log) once they left cleanly (``_stop_agent``). It takes ``grace`` seconds and a little
        more at most; a second call, or one while another thread stops, does not wait (a SIGTERM handler: see
        ``_stop_now``).

        Remote ranks exit with code 0 only while every rank of their job is heard from: torch's agent waits (up to
        300 s) at its exit barrier for every other agent of a job whose ranks succeeded, so when a rank may be gone
        they exit with ``LOST_EXIT_CODE`` and their agents stop at once."""
        if not self._stopping.acquire(blocking=False):
            self._stop_now()
            return
        try:
            if not self._stopped:
                self._stop_politely(grace)
        finally:
            self._stopped = True
            self._stopping.release()

    def _stop_politely(self, grace: float) -> None:
        if self.token_file is not None:
            self.token_file.unlink(missing_ok=True)
        self._ping_all()
        code = LOST_EXIT_CODE if self._agent is None and self.quiet_ranks(_QUIET_AT_SHUTDOWN) else 0
        ran_until_now = self._agent is not None and self._agent.poll() is None  # else its end was news: see below
        with contextlib.suppress(Exception):
            for rank in self.ranks:
                self.send(rank, {"op": "exit", "code": code})
        clean = self._stop_agent(grace)
        self._remove_store()
        if self._run_dir is not None and ran_until_now and clean and not self._cut_short:
            # the ranks left cleanly when told to: nothing to look at. An agent that failed, ranks that had to be
            # killed, or an agent that had ended before (ranks that exited on their own: the kernel's error named this
            # log) keep their log
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None
        self.ranks.clear()
        self._identity.clear()

    def _stop_agent(self, grace: float) -> bool:
        """Wait up to ``grace`` seconds for the local agent to exit, or for every local rank to leave; then end its
        process group. Whether the ranks left cleanly: the agent exited with code 0, or every rank had left before
        its agent was ended (torch's agent outlives its ranks for a while: ended then, it is no failure)."""
        if self._agent is None:
            return False
        deadline = time.monotonic() + grace
        left = False
        while self._agent.poll() is None and time.monotonic() < deadline and not left:
            time.sleep(0.05)
            left = self._all_left()
        if self._agent.poll() is None:
            left = self._all_left()
            self._kill_agent()
        return left or self._agent.poll() == 0

    def _all_left(self) -> bool:
        """Every rank of the local job joined and has left: its process ended, or the stack dump file it removes as
        it exits (having left its loop and destroyed its process groups: ``worker.main``) is gone."""
        if not self.ready:
            return False
        for info in list(self.ranks.values()):  # the shell thread may admit a rank meanwhile
            ended = not _process_runs(info.pid)
            if not ended and not (info.stack_file and not os.path.exists(info.stack_file)):
                return False
        return True

    def _kill_agent(self) -> None:
        """End the local agent's process group (the agent and its ranks) now: SIGTERM, then SIGKILL shortly after,
        whether or not the agent is gone by then (a rank whose SIGTERM handler cannot run, its main thread holding
        the GIL in native code, outlives its agent)."""
        if self._agent is None or self._agent.returncode is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):  # none of the group is left
                os.killpg(self._agent.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._agent.wait(_KILL_WAIT)

    def _remove_store(self) -> None:
        """Remove the private store folder. A stop and a SIGTERM handler's ``_stop_now`` may both run it at once: each
        removes all of it (``rmtree`` skips what the other removed), so it is gone before the process dies, whichever
        thread gets there first (the handler's used to find it taken and skip it, and the process died mid-removal)."""
        store = self._store
        if store is not None:
            store.close()
            self._store = None

    def _stop_now(self) -> None:
        """Another thread is stopping the ranks (a SIGTERM came during ``stop``): end the agent and remove the
        private store at once, before this process dies; the ranks' folder stays (whether they left is not known:
        the stop it cut short must not take the killed ranks' ended processes for ranks that left)."""
        self._cut_short = True
        self._kill_agent()
        self._remove_store()

    def _ping_all(self) -> None:
        """Send every rank a ping now (a send to a rank whose connection is gone marks it unreachable)."""
        for rank in list(self.ranks):
            self.send(rank, {"op": "ping"})

    # -- liveness ---------------------------------------------------------------------------------------------
    def silent_for(self, rank: int) -> float:
        """Seconds since a valid message of ``rank`` arrived (pongs included)."""
        return time.monotonic() - self._heard.get(rank, time.monotonic())

    def quiet_ranks(self, seconds: float) -> list[int]:
        """Ranks silent for ``seconds`` or whose connection ZMQ reports gone."""
        return sorted(r for r in self.ranks if r in self._unreachable or self.silent_for(r) >= seconds)

    def exited(self, ranks: list[int], after: float = _EXITED_AFTER) -> list[int]:
        """Those of ``ranks`` the kernel started itself whose process ended ``after`` seconds ago or more (gone, or a
        zombie its agent has not reaped). torch's agent goes on while a worker that exited with code 0 leaves the
        others running, so its exit code never says so; a worker that failed makes the agent signal the others
        within ``after`` and then exit, which says more (its log): while its log says it is stopping them, a rank is
        not called gone for up to ``_AGENT_STOPS_WITHIN`` seconds. A remote rank is judged by ``lost``."""
        if self._agent is None:
            return []
        now = time.monotonic()
        for r in ranks:
            if r not in self._ended and self.on_this_host(r) and not _process_runs(self.ranks[r].pid):
                self._ended[r] = now
        gone = [r for r in ranks if now - self._ended.get(r, now) >= after]
        if gone and self.agent_is_stopping():  # a rank failed: the agent's exit, soon, says which and how
            gone = [r for r in gone if now - self._ended[r] >= _AGENT_STOPS_WITHIN]
        return gone

    def agent_is_stopping(self) -> bool:
        """Whether torch's local agent has begun stopping its ranks (its log says it signalled them): a rank failed,
        and the agent exits once the others are gone, which on a busy host takes seconds."""
        if self.log_path is None or self._agent is None or self._agent.poll() is not None:
            return False
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
                tail = log.read()
        except OSError:
            return False
        return any(line in tail for line in _AGENT_STOPPING)

    def lost(self, dead_after: float) -> list[int]:
        """Ranks that are gone: silent for ``dead_after`` seconds *and* without a connection.

        The connection is kept alive by ZMTP heartbeats that libzmq's I/O thread answers without the GIL, so a
        rank that only holds the GIL (a long C call) keeps it and is never called lost; a process that exited
        loses it at once, a host that vanished after the heartbeat timeout (5 s). Local ranks are never lost here:
        their agent's exit says so."""
        if self._agent is not None:
            return []
        return sorted(r for r in self.ranks if r in self._unreachable and self.silent_for(r) >= dead_after)

    def end_job(self, code: int = LOST_EXIT_CODE) -> None:
        """The job cannot go on (it lost ranks): tell every rank still there to exit with ``code`` and forget the
        job, so that a new set of ranks can join. A rank of the ended job that speaks again is told to exit."""
        for rank in list(self.ranks):
            self.send(rank, {"op": "exit", "code": code})
        self._tombstones.update(self._identity.values())
        self.ranks.clear()
        self._identity.clear()
        self._heard.clear()
        self._unreachable.clear()
        self._ended.clear()
        if not self.nprocs:
            self.world_size = None

    def on_this_host(self, rank: int) -> bool:
        """Whether the rank runs beside the kernel: the same host name, boot and PID namespace, so its pid names it
        here and its files can be read here. A rank in another container on a host of the same name is not."""
        info = self.ranks.get(rank)
        return info is not None and in_this_pid_space(info.host, info.pid_space)

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
        """Send one signed message to one admitted rank (nothing if unknown; a rank whose connection is gone is
        marked unreachable, see ``lost``)."""
        identity = self._identity.get(rank)
        if identity is None:
            return
        self._send_to(identity, message, rank)

    def _send_to(self, identity: bytes, message: dict[str, Any], rank: int | None = None) -> None:
        import zmq

        body = encode(message)
        with self._lock:
            frames = self._links[identity].seal(body)
            try:
                self._socket.send_multipart([identity, *frames], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: no connection with that identity; EAGAIN: queue full
                if rank is not None and exc.errno == zmq.EHOSTUNREACH:
                    self._unreachable.setdefault(rank, time.monotonic())
            else:
                if rank is not None:
                    self._unreachable.pop(rank, None)

    def broadcast(self, message: dict[str, Any], ranks: Any = None) -> None:
        """Send one message to several ranks (default: every rank that joined)."""
        for rank in sorted(self.ranks) if ranks is None else ranks:
            self.send(rank, message)

    def recv(self, timeout: float) -> tuple[int, dict[str, Any]] | None:
        """The next valid message from an admitted rank, or None after ``timeout`` seconds; hellos are handled here
        (an admitted one is returned too), pongs only mark the rank alive, anything invalid is dropped and logged."""
        import zmq

        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            with self._lock:  # ZMQ sockets are not thread-safe: short polls, so a send from another thread waits
                if not self._socket.poll(int(min(left, 0.05) * 1000)):  # at most 50 ms
                    frames = None
                else:
                    identity, *frames = self._socket.recv_multipart(zmq.NOBLOCK)
            if frames is None:
                if left <= 0.05:
                    return None
                continue
            got = self._accept(identity, frames)
            if got is not None:
                return got

    def _accept(self, identity: bytes, frames: list[bytes]) -> tuple[int, dict[str, Any]] | None:
        link = self._links.get(identity)
        known = link is not None
        if link is None:
            link = Link(self._key, me="kernel", rank=None, identity=identity.decode(errors="replace"))
        seq_before, rank_before = link.seq_in, link.rank
        try:
            message = link.open(frames)
        except Rejected as exc:
            return self._drop(identity, str(exc))
        rank = link.rank
        assert rank is not None  # open() took it from the header
        op = message["op"]
        if identity in self._tombstones:  # a rank of a job the kernel ended (a frozen host that came back)
            self._send_to(identity, {"op": "exit", "code": LOST_EXIT_CODE})
            return self._drop(identity, f"rank {rank} belongs to a job this kernel ended; told it to exit")
        refusal = self._admit(identity, rank, message) if op == "hello" else None
        if refusal is not None:
            link.seq_in, link.rank = seq_before, rank_before  # nothing of a refused message sticks
            if refusal.tell:  # it holds the token: told, it does not wait for the kernel forever
                self._refuse(identity, rank, refusal)
            return self._drop(identity, refusal.reason)
        if op != "hello" and self._identity.get(rank) != identity:
            link.seq_in, link.rank = seq_before, rank_before
            return self._drop(identity, "from a connection that never passed hello (or left)")
        if not known:
            refused = self._refusals.pop(identity, None)
            if refused is not None:  # the rank has seen the refusals' sequence numbers: go on above them
                link.seq_out = refused.seq_out
            self._links[identity] = link
        self._heard[rank] = time.monotonic()
        return None if op == "pong" else (rank, message)

    def _refuse(self, identity: bytes, rank: int, refusal: _Refusal) -> None:
        """Tell a rank whose signed hello was refused why: it exits (``REFUSED_EXIT_CODE``), or says hello again
        after ``retry_after`` seconds when its place may free up (another connection of its rank fell silent)."""
        link = self._links.get(identity) or self._refusals.get(identity)
        if link is None:
            if len(self._refusals) >= 1024:  # a flood of refused connections keeps no more than this
                self._refusals.clear()
            link = self._refusals[identity] = Link(self._key, me="kernel", rank=rank,
                                                   identity=identity.decode(errors="replace"))
        message: dict[str, Any] = {"op": "refused", "reason": refusal.reason}
        if refusal.retry:
            message["retry_after"] = _ALIVE / 2
        import zmq

        with self._lock, contextlib.suppress(zmq.ZMQError):  # its connection is gone already: nobody waits
            self._socket.send_multipart([identity, *link.seal(encode(message))], flags=zmq.NOBLOCK)

    def _admit(self, identity: bytes, rank: int, hello: dict[str, Any]) -> _Refusal | None:
        """Admit a rank whose hello verified; say why not otherwise."""
        if hello.get("rank") != rank:
            return _Refusal(f"hello names rank {hello.get('rank')!r} but is signed for rank {rank}")
        try:
            world = int(hello["world_size"])
            info = RankInfo(rank=rank, world_size=world, local_rank=int(hello["local_rank"]),
                            host=str(hello["host"]), pid=int(hello["pid"]), backend=str(hello["backend"]),
                            stack_file=str(hello.get("stack_file", "")), ledger_file=str(hello.get("ledger_file", "")),
                            thread=int(hello.get("thread", 0)),
                            pid_space=PidSpace(str(hello.get("boot", "")), str(hello.get("pid_namespace", ""))))
        except (KeyError, TypeError, ValueError) as exc:
            return _Refusal(f"hello of rank {rank} lacks {exc}")
        if self.world_size is not None and world != self.world_size:
            return _Refusal(f"hello of rank {rank} says world size {world}, this kernel's world size is "
                            f"{self.world_size}")
        if not 0 <= rank < world:
            return _Refusal(f"hello names rank {rank}, outside world size {world}")
        current = self._identity.get(rank)
        if current == identity:
            return _Refusal(f"rank {rank} said hello twice on one connection", tell=False)
        if current is not None:
            quiet = time.monotonic() - self._heard.get(rank, 0.0)
            if quiet < _ALIVE:
                return _Refusal(f"rank {rank} is already admitted on another connection, heard {quiet:.1f} s ago "
                                f"(a second rank {rank}? a new hello is accepted once it is silent for {_ALIVE:g} s)",
                                retry=True)
            self._log.warning("workbench kernel: rank %d rejoins on a new connection (the old one was silent for "
                              "%.0f s)", rank, quiet)
        if self.world_size is None:
            self.world_size = world
        self.ranks[rank] = info
        self._identity[rank] = identity
        self._unreachable.pop(rank, None)
        return None

    def _drop(self, identity: bytes, reason: str) -> None:
        """Count and log a message that is not acted on (the first ones, then every 100th: a flood stays short)."""
        self.dropped += 1
        if self.dropped <= _LOGGED_DROPS or self.dropped % 100 == 0:
            self._log.warning("workbench kernel: dropped a rank-channel message from ZMQ identity %r: %s "
                              "(%d dropped so far)", identity[:80], reason, self.dropped)
        return None

    def torchrun_command(self) -> str:
        """The command that starts ranks joining this kernel from a cluster's scheduler (a listening kernel's).

        It names the token file, never the token: the command is shown in notebook output, which is saved.
        """
        if self.token_file is None:
            raise RuntimeError("this kernel does not listen for ranks (install it with --listen HOST:PORT)")
        return ("torchrun --nnodes NNODES --nproc-per-node NPROC --rdzv-backend c10d --rdzv-endpoint HOST:29400 "
                f"-m workbench.kernel.worker --backend {self.backend} --connect {self.address} "
                f"--token-file {shlex.quote(str(self.token_file))}")

    def close(self) -> None:
        """Stop local ranks and close the socket."""
        self.stop()
        self._socket.close(0)
        self._context.term()


def _default_token_path() -> Path:
    """Where a listening kernel writes its token by default: Jupyter's runtime directory (beside the kernel's own
    connection file, which holds Jupyter's key), named after this host and process."""
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / f"workbench-kernel-{socket.gethostname()}-{os.getpid()}.token"


def _process_runs(pid: int) -> bool:
    """Whether ``pid`` (of this PID space) is a process that has not ended: running, or not yet a zombie."""
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[:1]
        except FileNotFoundError:
            return False
        except OSError:
            return True
        return state not in ([b"Z"], [b"X"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
