"""One rank of the launcher kernel: run the kernel's cells in an IPython shell and send back what happened.

Started by torch's elastic agent, never by hand::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m workbench.kernel.worker --connect tcp://KERNEL_HOST:PORT --token-file PATH

(the kernel starts its local ranks the same way, with the address and the token in their environment). Every rank
initializes the default process group, then serves the kernel: a background thread owns the ZMQ socket (signs what
the rank sends, drops any kernel message whose signature, connection or sequence number is wrong, answers stack
requests, pings and interrupts at once, even while a cell hangs) and hands cells to the main thread, which runs
them in an IPython shell whose namespace holds ``dist``, ``rank``, ``world_size``, ``local_rank`` and ``device``.

A rank does not outlive its kernel: a local rank exits when the kernel's process is gone; any rank exits with
``LOST_EXIT_CODE`` (so torch's agent stops) once no valid kernel message came for ``--kernel-silence`` seconds
(``$WORKBENCH_KERNEL_SILENCE_S``, 30) while its connection did not hold (``_KernelWatch``). A rank whose hello the
kernel refuses (another world size, a rank number already taken by a live rank) says why on stderr and exits with
``REFUSED_EXIT_CODE``; while its rank's place is taken it says hello again for up to ``REFUSED_RETRY_S`` first.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

from workbench.kernel.protocol import (
    ENV_CONNECT,
    ENV_HOST,
    ENV_KERNEL_PID,
    ENV_RUN_DIR,
    ENV_SILENCE,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    Link,
    Rejected,
    check_address,
    encode,
    new_identity,
    read_token,
)
from workbench.kernel.ranks import LOST_EXIT_CODE, REFUSED_EXIT_CODE
from workbench.pid_space import this_pid_space
from workbench.run.private_store import connect_store, store_path

__all__ = ["main", "private_folder", "stack_report"]

SILENCE_DEFAULT = 30.0  # seconds without a word from a kernel whose connection went before a rank exits (as
# the kernel's --dead-after for ranks: both sides give up on a network partition alike)
_SILENCE_MIN = 3.0  # the kernel pings every second: a shorter limit would mistake a slow kernel for a gone one
REFUSED_RETRY_S = 60.0  # seconds a rank refused while its place is taken says hello again before it exits
_HEARTBEAT_IVL_MS = 1000  # ZMTP heartbeats from the rank too: a kernel host that vanished drops the connection
_HEARTBEAT_TIMEOUT_MS = 5000  # after this long without an answer (as the kernel's side does)


def stack_report(frame: Any) -> dict[str, Any]:
    """A main-thread stack as the kernel shows it: the frames from the cell in, and whether it is in a collective."""
    from workbench.kernel.stackdump import summarize

    return summarize(traceback.format_stack(frame))


class _KernelWatch:
    """Whether the kernel is gone, as the rank's I/O thread sees it: when its last valid message came, and whether
    the ZMQ connection has held since. libzmq answers heartbeats without the GIL, so a kernel busy in a wait that
    sends no pings keeps its connection; a killed one loses it at once, a vanished host after the heartbeat timeout.
    """

    def __init__(self, limit: float | None, now: float) -> None:
        self.limit = limit
        self.heard_at = now
        self.broken_at = now
        self.state = "waiting"  # never connected; "up": connected with no drop since the last word; "broken"

    def heard(self, now: float) -> None:
        """A valid kernel message (any op) arrived."""
        self.heard_at, self.state = now, "up"

    def event(self, event: int, now: float) -> None:
        """A ZMQ monitor event of the kernel connection. A connection made after a drop proves nothing (the kernel's
        port may have a new kernel, with another token) until a valid message comes on it."""
        import zmq

        if event == zmq.EVENT_DISCONNECTED and self.state != "broken":
            self.state, self.broken_at = "broken", now
        elif event == zmq.EVENT_CONNECTED and self.state == "waiting":
            self.state = "up"

    def gone_for(self, now: float) -> float | None:
        """Seconds since the kernel's last word once the limit has passed since that word and since the connection
        first dropped (a network blip is forgiven), while the connection does not hold; else None."""
        if self.limit is None or self.state == "up" or now - max(self.heard_at, self.broken_at) < self.limit:
            return None
        return now - self.heard_at


class _Worker:
    """The rank's side of the kernel connection (one per process)."""

    def __init__(self, address: str, token: str, backend: str, silence: float | None = SILENCE_DEFAULT) -> None:
        import zmq

        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.backend = backend
        self.address = address
        self.identity = new_identity(self.rank)
        self._link = Link(token.encode(), me="rank", rank=self.rank, identity=self.identity)
        self.dropped = 0
        self._hello: dict[str, Any] = {}  # what this rank told the kernel when it joined (said again after a refusal)
        self._first_refusal: float | None = None
        self.generation = 0
        self.main_ident = threading.main_thread().ident
        self.busy = False
        self.cell: str | None = None
        self.send_streams = True
        self.send_display = self.rank == 0
        self.error: dict[str, Any] | None = None
        self.result: dict[str, Any] | None = None
        self.tasks: queue.Queue[dict[str, Any]] = queue.Queue()
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, self.identity.encode())
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        # made before connect, so that the first connection's event is seen (_KernelWatch)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._socket.connect(address)
        self.silence = silence
        self._store: Any = None
        self._store_port = 0  # the TCP store's connection is one socket that severing the groups must keep (none
        # for a file store)
        self._streams: dict[str, _RankStream] = {}
        self._capture: Any = None  # descriptors 1 and 2 read through pipes while serving (fd_capture.FdCapture)
        self.log: Any = sys.__stderr__  # the ranks' log, for what must reach it even at os._exit
        self.ledger: Any = None  # the collective it is in, readable without it (ledger.Ledger)
        self._aborting: threading.Thread | None = None  # NCCL: the thread aborting the communicators
        self.exit_code = 0  # what the kernel's exit asked for (nonzero: the job lost ranks; see main)
        self.stack_file = ""  # where SIGUSR2 makes faulthandler write its stacks (stackdump.register)
        self.groups_since = 0.0  # when this generation's process groups were made (wall clock)

    def start_forensics(self) -> None:
        """Files through which the rank's stack and collective can be read while it cannot answer: its Python
        stacks on SIGUSR2 (faulthandler, in C) and a ledger of the collective it is in (shared memory)."""
        import atexit
        import tempfile

        from workbench.kernel.ledger import Ledger, track
        from workbench.kernel.stackdump import register

        folder = os.environ.get(ENV_RUN_DIR) or os.path.join(tempfile.gettempdir(), f"workbench-kernel-{os.getuid()}")
        base = os.path.join(private_folder(folder), f"rank{self.rank}-{os.getpid()}")
        self.stack_file = base + ".stacks"
        self._stack_out = register(self.stack_file)
        self.ledger = Ledger(base + ".ledger")
        track(self.ledger, cuda_events=self.backend == "nccl")
        atexit.register(_remove, self.stack_file, self.ledger.path)

    # -- outbound (any thread) --------------------------------------------------------------------------
    def send(self, message: dict[str, Any]) -> None:
        """Queue a message for the kernel; the I/O thread sends it (ZMQ sockets stay on one thread)."""
        self._outbox.put(encode(message))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # -- process group ----------------------------------------------------------------------------------
    def init_process_group(self) -> None:
        """Join the default process group of this generation (a fresh store prefix each time)."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        device = None
        if self.backend == "nccl":
            torch.cuda.set_device(self.local_rank)
            # bound to its GPU, the group makes its communicators now, with every rank (and new groups split from
            # it at new_group): no rank can be left alone in a communicator's set-up, which no abort frees
            device = torch.device("cuda", self.local_rank)
        if self._store is None:
            path = store_path()
            if path is None:  # ranks of several hosts: they meet through the agent's store
                self._store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(minutes=10)))
                self._store_port = int(os.environ.get("MASTER_PORT", "0"))
            else:  # a kernel's local ranks: through the file store the kernel made
                self._store = connect_store(path)
        store = dist.PrefixStore(f"workbench-kernel/gen{self.generation}", self._store)
        self.groups_since = time.time()  # the flight recorder's entries before this belong to destroyed groups
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size,
                                device_id=device)

    def destroy_process_groups(self) -> None:
        """Destroy every process group so that peers blocked in a collective with this rank get an error."""
        import gc

        import torch.distributed as dist

        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
        gc.collect()

    # -- threads ----------------------------------------------------------------------------------------
    def io_loop(self) -> None:
        """Own the socket: send queued messages, answer stacks/interrupts at once, queue cells for main; exit when
        the kernel is gone."""
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        watch = _KernelWatch(self.silence, time.monotonic())
        kernel_pid = int(os.environ.get(ENV_KERNEL_PID, "0"))
        last_check = time.monotonic()
        while True:
            events = dict(poller.poll(1000))
            if self._wake_r.fileno() in events or self._wake_r in events:
                with contextlib.suppress(BlockingIOError, OSError):
                    while self._wake_r.recv(4096):
                        pass
            while True:
                try:
                    frame = self._outbox.get_nowait()
                except queue.Empty:
                    break
                self._socket.send_multipart(self._link.seal(frame))
            self._read_monitor(watch)  # before the messages: a drop is seen before a word on a new connection
            if self._socket in events:
                while self._socket.poll(0):
                    frames = self._socket.recv_multipart()
                    try:
                        message = self._link.open(frames)
                    except Rejected as exc:
                        self._drop(str(exc))
                        continue
                    watch.heard(time.monotonic())
                    if self._handle_now(message):
                        return
            quiet = watch.gone_for(time.monotonic())
            if quiet is not None:
                self._leave_gone_kernel(quiet)
            if kernel_pid and time.monotonic() - last_check > 1.0:
                last_check = time.monotonic()
                try:
                    os.kill(kernel_pid, 0)
                except ProcessLookupError:  # the kernel died without telling us: do not linger
                    print(f"workbench rank {self.rank}: the kernel (pid {kernel_pid}) is gone; exiting",
                          file=self.log, flush=True)
                    self.cleanup()
                    os._exit(0)
                except PermissionError:
                    pass

    def _read_monitor(self, watch: _KernelWatch) -> None:
        """I/O thread: pass the kernel connection's monitor events (connected, disconnected) to ``watch``."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            watch.event(int(event["event"]), time.monotonic())

    def _leave_gone_kernel(self, quiet: float) -> None:
        """I/O thread: the kernel is gone (killed, its host or the network down); end the rank so that torch's agent
        stops instead of keeping it forever."""
        print(f"workbench rank {self.rank}: no word from the kernel at {self.address} for {quiet:.0f} s (it died, or "
              f"the network is down); exiting with code {LOST_EXIT_CODE} so that torch's agent stops",
              file=self.log, flush=True)
        self.cleanup()
        os._exit(LOST_EXIT_CODE)

    def _handle_now(self, message: dict[str, Any]) -> bool:
        op = message["op"]
        if op == "stacks":
            frame = sys._current_frames().get(self.main_ident)
            report = stack_report(frame) if frame is not None else {"stack": [], "in_collective": False, "where": ""}
            ledger = self._ledger_now()
            self._send_now({"op": "stacks", "id": message.get("id"), "rank": self.rank, "busy": self.busy,
                            "cell": self.cell, **report, **ledger})
        elif op == "dump_peer":  # a rank of this host that cannot answer: read its stack for the kernel
            threading.Thread(target=self._dump_peer, args=(message,), daemon=True).start()
        elif op == "recorder":  # torch's flight recorder, read on a helper thread: the I/O thread never waits on it
            threading.Thread(target=self._send_recorder, args=(message,), daemon=True).start()
        elif op == "ping":
            self._send_now({"op": "pong"})
        elif op == "interrupt":
            if self.busy and message.get("cell") in (None, self.cell):
                signal.pthread_kill(self.main_ident, signal.SIGINT)
        elif op == "release":
            self._release_now(message)
            self.tasks.put(message)
        elif op == "refused":
            self._refused(message)
        elif op == "exit":
            self.exit_code = int(message.get("code", 0))
            self.tasks.put(message)
            threading.Thread(target=self._exit_later, daemon=True).start()  # a main thread stuck in a collective
            return True
        else:
            self.tasks.put(message)
        return False

    def _refused(self, message: dict[str, Any]) -> None:
        """I/O thread: the kernel refused this rank's hello. Say hello again once its place may be free (the kernel
        says when), for up to ``REFUSED_RETRY_S`` after the first refusal; else say why and exit: a refused rank never
        waits for the kernel forever."""
        now = time.monotonic()
        if self._first_refusal is None:
            self._first_refusal = now
        retry = message.get("retry_after")
        if isinstance(retry, int | float) and now + retry - self._first_refusal <= REFUSED_RETRY_S:
            again = threading.Timer(float(retry), self.send, args=(self._hello,))
            again.daemon = True
            again.start()
            return
        print(f"workbench rank {self.rank}: the kernel at {self.address} refused this rank: {message.get('reason')}; "
              f"exiting with code {REFUSED_EXIT_CODE}", file=self.log, flush=True)
        self.cleanup()
        os._exit(REFUSED_EXIT_CODE)

    def _exit_later(self, grace: float = 10.0) -> None:
        """After ``exit``: a main thread that has not ended within ``grace`` seconds (stuck in a collective whose
        peers are gone) does not keep the process, nor torch's agent, waiting."""
        time.sleep(grace)
        print(f"workbench rank {self.rank}: still busy {grace:g} s after the kernel said exit; exiting with code "
              f"{self.exit_code}", file=self.log, flush=True)
        self.cleanup()
        os._exit(self.exit_code)

    def cleanup(self) -> None:
        """Remove the rank's stack dump and ledger files."""
        _remove(self.stack_file, self.ledger.path if self.ledger is not None else "")

    def _ledger_now(self) -> dict[str, Any]:
        """The collective this rank is in (or was in last) and, on NCCL, those the GPU has not finished."""
        from workbench.kernel.ledger import read_ledger

        if self.ledger is None:
            return {}
        return {"collective": read_ledger(self.ledger.path), "pending": self.ledger.pending()}

    def _dump_peer(self, message: dict[str, Any]) -> None:
        """Helper thread: faulthandler's dump of another rank process of this host, with this host's source lines."""
        from workbench.kernel.ledger import read_ledger
        from workbench.kernel.stackdump import dump, file_source, parse

        text = dump(int(message["pid"]), str(message["stack_file"]))
        frames = parse(text, int(message["thread"])) if text else None
        self.send({"op": "peer_dump", "id": message.get("id"), "rank": int(message["rank"]),
                   "frames": None if frames is None else [[f.file, f.line, f.function, file_source(f.file, f.line)]
                                                          for f in frames],
                   "collective": read_ledger(str(message.get("ledger_file", "")))})

    def _send_recorder(self, message: dict[str, Any]) -> None:
        """Helper thread: the last collectives torch's flight recorder holds for this rank (all its groups)."""
        from workbench._compat import dump_fr_trace, dump_nccl_trace
        from workbench.kernel.recorder import last_entries

        try:
            trace = dump_nccl_trace() if self.backend == "nccl" else dump_fr_trace()
            entries, error = last_entries(trace, int(message.get("last", 3)), since=self.groups_since), None
            if trace is None:
                error = f"this torch ({_torch_version()}) has no flight recorder for {self.backend}"
        except Exception as exc:
            entries, error = [], f"{type(exc).__name__}: {exc}"
        self.send({"op": "recorder", "id": message.get("id"), "rank": self.rank, "entries": entries, "error": error})

    def _send_now(self, message: dict[str, Any]) -> None:
        """I/O thread: sign and send one message at once."""
        self._socket.send_multipart(self._link.seal(encode(message)))

    def _drop(self, reason: str) -> None:
        """I/O thread: a message from the kernel's port that is not acted on goes to the rank's log."""
        self.dropped += 1
        if self.dropped <= 20 or self.dropped % 100 == 0:
            print(f"workbench rank {self.rank}: dropped a message on the kernel channel: {reason} "
                  f"({self.dropped} dropped so far)", file=self.log, flush=True)

    def _release_now(self, message: dict[str, Any]) -> None:
        """I/O thread, at once: free ranks (this one included) blocked in a collective whose peers left it."""
        if self.backend == "nccl":  # abort every NCCL communicator: a rank in a collective (or in a CUDA sync
            self._aborting = threading.Thread(target=self._abort_nccl, name="workbench-nccl-abort", daemon=True)
            self._aborting.start()  # on one) returns
        elif message.get("close_sockets", True):
            from workbench.kernel.sever import sever

            keep = {self._store_port, int(self.address.rsplit(":", 1)[1])}
            sever(keep)

    def _abort_nccl(self) -> None:
        """Helper thread (the I/O thread keeps answering meanwhile): abort this rank's NCCL communicators, so a
        collective or a CUDA sync waiting on one returns; the main thread then destroys the groups."""
        from workbench._compat import abort_nccl_communicators

        start = time.monotonic()
        try:
            count = abort_nccl_communicators()
            note = f"aborted the NCCL communicators of {count} process group(s)"
        except Exception as exc:
            note = f"aborting the NCCL communicators failed: {exc!r}"
        print(f"workbench rank {self.rank}: {note} in {time.monotonic() - start:.2f} s", file=self.log,
              flush=True)

    def serve(self) -> None:
        """Main thread: run what the kernel sends until it says exit."""
        self.last_cell: str | None = None  # the last cell run: what is printed between cells is shown under it
        self._capture_native_output()
        sys.stdout, sys.stderr = self._streams["stdout"], self._streams["stderr"]
        shell = _make_shell(self)
        self.shell = shell
        self._refresh_namespace()
        threading.Thread(target=self.io_loop, name="workbench-kernel-io", daemon=True).start()
        import torch

        space = this_pid_space()
        self._hello = {"op": "hello", "rank": self.rank, "world_size": self.world_size,
                       "local_rank": self.local_rank, "host": os.environ.get(ENV_HOST) or socket.gethostname(),
                       "pid": os.getpid(), "boot": space.boot, "pid_namespace": space.namespace,
                       "backend": self.backend, "torch": torch.__version__, "generation": self.generation,
                       "stack_file": self.stack_file, "ledger_file": self.ledger.path if self.ledger else "",
                       "thread": self.main_ident}
        self.send(self._hello)
        while True:
            try:
                message = self.tasks.get()
                op = message["op"]
                if op == "exit":
                    break
                if op == "execute":
                    self._execute(message)
                elif op == "release":
                    if self._aborting is not None:  # NCCL: the communicators are aborted before the groups go
                        self._aborting.join(60)
                        self._aborting = None
                    self.destroy_process_groups()
                    self.send({"op": "released", "rank": self.rank})
                elif op == "reinit":
                    self._reinit(int(message["generation"]))
                elif op == "query":
                    self._query(message)
                elif op == "comm":
                    self._comm_in(message)
            except KeyboardInterrupt:  # an interrupt that arrived just after its cell ended
                continue
        self.last_cell = None  # leaving: no message reaches the kernel any more, what is printed goes to the log
        self._flush_streams()
        self.send({"op": "bye", "rank": self.rank})
        time.sleep(0.2)
        if self._capture is not None:  # what the groups' destruction prints goes straight to the log
            self._capture.stop()

    def _capture_native_output(self) -> None:
        """Main thread, before serving: ``sys.stdout`` / ``sys.stderr`` become the rank's streams, and what native
        code and child processes write to descriptor 1 joins the first (``FdCapture``). Descriptor 2 stays the log:
        a native crash's last words (written just before ``abort``) and faulthandler's dumps must reach it, and a
        pipe's reader may never run again."""
        from workbench.kernel.fd_capture import FdCapture

        try:
            capture = FdCapture((("stdout", 1),))
        except OSError as exc:  # no descriptors to spare: Python's own output still reaches the kernel
            print(f"workbench rank {self.rank}: native output stays in the log ({exc})", file=self.log, flush=True)
            capture = None
        logs = {"stdout": sys.stdout if capture is None else capture.logs["stdout"], "stderr": sys.stderr}
        self._streams = {name: _RankStream(self, name, logs[name], fd) for name, fd in (("stdout", 1), ("stderr", 2))}
        if capture is not None:
            self._capture = capture
            capture.start(lambda name, text: self._streams[name].write(text))

    # -- work on the main thread --------------------------------------------------------------------------
    def _execute(self, message: dict[str, Any]) -> None:
        self.cell, self.error, self.result = message["id"], None, None
        self.send_streams = bool(message.get("streams", True))
        self.send_display = bool(message.get("display", self.rank == 0))
        status = "ok"
        if message.get("execution_count"):
            self.shell.execution_count = int(message["execution_count"])
        try:
            try:
                self.busy = True
                outcome = self.shell.run_cell(message["code"], store_history=bool(message.get("store_history", True)),
                                              silent=bool(message.get("silent", False)))
            finally:
                self.busy = False
            if not outcome.success:
                status = "error"
        except KeyboardInterrupt:
            status = "error"
            self.error = self.error or {"ename": "KeyboardInterrupt", "evalue": "", "time": time.time(),
                                        "traceback": ["KeyboardInterrupt (between cells)"]}
        if self._capture is not None:  # the cell's native output is shown with the cell
            self._capture.sync()
        self._flush_streams()
        payload = self.shell.payload_manager.read_payload()  # the pager's text (``zip?``), set_next_input, ...
        self.shell.payload_manager.clear_payload()
        self.send({"op": "done", "id": self.cell, "rank": self.rank, "status": status, "error": self.error,
                   "result": self.result if self.send_display else None, "time": time.time(),
                   "payload": payload if self.send_display else []})
        self.last_cell, self.cell = self.cell, None

    def _reinit(self, generation: int) -> None:
        error = None
        try:
            self.destroy_process_groups()
            if self.ledger is not None:
                self.ledger.forget_groups()
            self.generation = generation
            self.init_process_group()
            self._refresh_namespace()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        self.send({"op": "reinit_done", "rank": self.rank, "generation": generation, "error": error})

    def _refresh_namespace(self) -> None:
        import torch
        import torch.distributed as dist

        device = torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        self.shell.user_ns.update(dist=dist, torch=torch, rank=self.rank, world_size=self.world_size,
                                  local_rank=self.local_rank, device=device)

    def _query(self, message: dict[str, Any]) -> None:
        """Answer a question about this rank's shell (completion, inspection, history, comms): never raises."""
        what = message.get("what")
        handler = _QUERIES.get(what)
        try:
            if handler is None:
                raise ValueError(f"unknown query {what!r}")
            content, error = handler(self.shell, message.get("args") or {}), None
        except Exception as exc:
            content, error = None, f"{type(exc).__name__}: {exc}"
        self.send({"op": "answer", "id": message["id"], "what": what, "content": content, "error": error})

    def _comm_in(self, message: dict[str, Any]) -> None:
        import comm

        manager = comm.get_comm_manager()
        msg = {"content": message["content"], "metadata": message.get("metadata", {}),
               "buffers": [base64.b64decode(b) for b in message.get("buffers", [])],
               "header": {"msg_type": message["msg_type"]}}
        handler = getattr(manager, message["msg_type"], None)
        if handler is not None:
            with contextlib.suppress(Exception):
                handler(None, None, msg)
        self._flush_streams()

    def _flush_streams(self) -> None:
        for stream in self._streams.values():
            stream.flush()

    def record_error(self, etype: type, evalue: BaseException, stb: Sequence[str]) -> None:
        """Called by the shell when a cell raised: keep the rank's own traceback for the kernel."""
        self.error = {"ename": getattr(etype, "__name__", str(etype)), "evalue": str(evalue),
                      "traceback": list(stb), "time": time.time()}


class _RankStream(io.TextIOBase):
    """sys.stdout / sys.stderr of a rank: whole lines go to the kernel, under the running cell, or between cells under
    the last one (a thread it started, native code: as ipykernel shows them); before the first cell, to the log."""

    def __init__(self, worker: _Worker, name: str, original: Any, fd: int) -> None:
        self._worker, self._name, self._original, self._fd = worker, name, original, fd
        self._buffer = ""
        self._lock = threading.Lock()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def fileno(self) -> int:  # a child given sys.stdout writes to descriptor 1, whose output the rank reads
        return self._fd

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self._cell() is None:
            self._original.write(text)
            return len(text)
        with self._lock:
            self._buffer += text
            head, sep, tail = self._buffer.rpartition("\n")
            if sep:
                self._buffer = tail
                self._emit(head + "\n")
        return len(text)

    def flush(self) -> None:
        with self._lock:
            text, self._buffer = self._buffer, ""
        if text:
            self._emit(text)
        with contextlib.suppress(Exception):
            self._original.flush()

    def _emit(self, text: str) -> None:
        cell = self._cell()
        if cell is None:
            self._original.write(text)
        elif self._worker.send_streams:  # the cell's %rank_output: shown
            self._worker.send({"op": "stream", "id": cell, "rank": self._worker.rank, "name": self._name,
                               "text": text})
        elif self._worker.cell is None:  # not shown: after its cell, it is kept in the log (a watchdog's report)
            self._original.write(text)

    def _cell(self) -> str | None:
        """The cell this output goes with: the running one, else the last one; None before the first."""
        return self._worker.cell or self._worker.last_cell


def _make_shell(worker: _Worker) -> Any:
    """An IPython shell whose results, displays, tracebacks and comms go to the kernel."""
    import comm
    from comm.base_comm import BaseComm
    from IPython.core.autocall import ExitAutocall
    from IPython.core.displayhook import DisplayHook
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets import default

    class Publisher(DisplayPublisher):
        def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs) -> None:
            worker._flush_streams()
            if worker.send_display and worker.cell is not None:
                worker.send({"op": "display", "id": worker.cell, "rank": worker.rank, "data": _shown(data),
                             "metadata": metadata or {}, "transient": transient or {}, "update": update})

        def clear_output(self, wait: bool = False) -> None:
            if worker.send_display and worker.cell is not None:
                worker.send({"op": "clear_output", "id": worker.cell, "wait": wait})

    class Hook(DisplayHook):
        def write_output_prompt(self) -> None:
            pass

        def write_format_data(self, format_dict, md_dict=None) -> None:
            worker.result = {"data": _shown(format_dict), "metadata": md_dict or {}}

        def finish_displayhook(self) -> None:
            worker._flush_streams()

    class Exit(ExitAutocall):  # ``exit()`` / ``quit()``, as ipykernel's: ask the frontend, keep every rank running
        def __call__(self, keep_kernel: bool = False) -> None:
            self._ip.keepkernel_on_exit = keep_kernel
            self._ip.ask_exit()

    class Shell(InteractiveShell):
        keepkernel_on_exit = False

        @default("exiter")
        def _exiter_default(self) -> Exit:
            return Exit(self)

        def ask_exit(self) -> None:
            """The ``ask_exit`` payload ipykernel sends (the cell's primary rank's reaches the frontend, which may
            close the session); no rank exits: the job's world size is fixed, and a restart starts new ranks."""
            self.exit_now = not self.keepkernel_on_exit
            self.payload_manager.write_payload({"source": "ask_exit", "keepkernel": self.keepkernel_on_exit})

        def _showtraceback(self, etype, evalue, stb) -> None:
            worker.record_error(etype, evalue, stb)

        def enable_gui(self, gui=None) -> None:
            pass

    class Comm(BaseComm):
        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys) -> None:
            if worker.rank != 0:  # widgets live on rank 0, the rank whose displays are shown
                return
            content = {"data": data or {}, "comm_id": self.comm_id, **keys}
            worker.send({"op": "comm", "msg_type": msg_type, "content": content, "metadata": metadata or {},
                         "buffers": [base64.b64encode(bytes(b)).decode() for b in buffers or []]})

    comm.create_comm = lambda *args, **kwargs: Comm(*args, **kwargs)

    def _shown(data: dict[str, Any]) -> dict[str, Any]:
        """What a display shows: a widget's view only from rank 0, whose comms alone reach the notebook; another
        rank's (a ``%%ranks`` cell without rank 0) says so instead of pointing at a model the notebook never got."""
        if worker.rank == 0 or _WIDGET_VIEW not in data:
            return data
        return {"text/plain": f"(a widget made on rank {worker.rank}: widgets live on rank 0, the only rank whose "
                              "widgets reach the notebook; run this cell with rank 0 in its %%ranks to see it)"}
    from traitlets.config import Config

    # the notebook's history is rank 0's (history requests go there, and write what is cached first): no sqlite
    # on the other ranks, and on rank 0 a write every 20 cells, not one per cell (2-3 ms of a no-op cell)
    config = Config({"HistoryManager": {"enabled": worker.rank == 0, "db_cache_size": 20}})
    shell = Shell.instance(displayhook_class=Hook, display_pub_class=Publisher, colors="linux", config=config)
    shell.displayhook.shell = shell
    from IPython.core import page, payloadpage

    shell.set_hook("show_in_pager", page.as_hook(payloadpage.page), 99)  # ``zip?``: a pager payload, as ipykernel
    return shell


_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _complete(shell: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Completions from IPython's current completer API (jedi where installed), as ipykernel answers them."""
    from IPython.core.completer import provisionalcompleter, rectify_completions

    code = str(args.get("code", ""))
    pos = len(code) if args.get("cursor_pos") is None else int(args["cursor_pos"])
    with provisionalcompleter():
        found = list(rectify_completions(code, shell.Completer.completions(code, pos)))
        types = [{"start": c.start, "end": c.end, "text": c.text, "type": c.type, "signature": c.signature}
                 for c in found]
    start, end = (found[0].start, found[0].end) if found else (pos, pos)
    return {"matches": [c.text for c in found], "cursor_start": start, "cursor_end": end,
            "metadata": {"_jupyter_types_experimental": types}}


def _inspect(shell: Any, args: dict[str, Any]) -> dict[str, Any]:
    """What Shift+Tab shows: IPython's object info for the name at the cursor, as a mime bundle."""
    from IPython.utils.tokenutil import token_at_cursor

    code = str(args.get("code", ""))
    name = token_at_cursor(code, len(code) if args.get("cursor_pos") is None else int(args["cursor_pos"]))
    try:
        bundle = shell.object_inspect_mime(name, detail_level=int(args.get("detail_level", 0)),
                                           omit_sections=tuple(args.get("omit_sections", ())))
    except KeyError:
        return {"found": False, "data": {}, "metadata": {}}
    if not shell.enable_html_pager:
        bundle.pop("text/html", None)
    return {"found": True, "data": bundle, "metadata": {}}


def _history(shell: Any, args: dict[str, Any]) -> dict[str, Any]:
    """This rank's input history (tail, range or search), as ipykernel's history_reply gives it."""
    manager = shell.history_manager
    raw, output, kind = bool(args.get("raw", True)), bool(args.get("output", False)), args.get("hist_access_type")
    manager.writeout_cache()  # searches read the database: the last cells must be in it
    if kind == "tail":
        found = manager.get_tail(args.get("n") or 10, raw=raw, output=output, include_latest=True)
    elif kind == "range":
        found = manager.get_range(args.get("session") or 0, args.get("start") or 0, args.get("stop"), raw=raw,
                                  output=output)
    elif kind == "search":
        found = manager.search(args.get("pattern") or "*", raw=raw, output=output, n=args.get("n"),
                               unique=bool(args.get("unique", False)))
    else:
        raise ValueError(f"hist_access_type {kind!r}: use tail, range or search")
    return {"history": [list(entry) for entry in found]}


def _comm_info(shell: Any, args: dict[str, Any]) -> dict[str, Any]:
    """The comms open on this rank (widgets), optionally only those of one target."""
    import comm

    target = args.get("target_name")
    comms = comm.get_comm_manager().comms
    return {"comms": {cid: {"target_name": c.target_name} for cid, c in comms.items()
                      if target is None or c.target_name == target}}


_QUERIES = {"complete": _complete, "inspect": _inspect, "history": _history, "comm_info": _comm_info}


def _torch_version() -> str:
    import torch

    return torch.__version__


def _remove(*paths: str) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def private_folder(path: str) -> str:
    """``path`` as a directory only this user can open, returned: made with mode 0700, or, where it exists, a real
    directory (not a symbolic link) this user owns, its mode narrowed to 0700. In a shared ``/tmp`` another user could
    have made it first, to plant links that make a rank overwrite this user's files, or to read its stacks.

    Raises:
        RuntimeError: it is not a directory, or another user owns it (naming the path, its owner and the fix).
    """
    import stat

    with contextlib.suppress(FileExistsError):  # a dangling link there: the checks below name it
        os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise RuntimeError(f"workbench rank: {path} is not a directory (a symbolic link?): its files would land "
                           f"elsewhere; remove it, or set {ENV_RUN_DIR} to a directory of your own")
    if info.st_uid != os.getuid():
        raise RuntimeError(f"workbench rank: {path} belongs to uid {info.st_uid}, not to this user (uid "
                           f"{os.getuid()}): another user may have made it to read or replace this rank's files; "
                           f"remove it, or set {ENV_RUN_DIR} to a directory of your own")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def _silence_limit(text: str) -> float | None:
    """``--kernel-silence`` / ``$WORKBENCH_KERNEL_SILENCE_S``: seconds, or ``off`` (or 0) for never."""
    value = text.strip().lower()
    if value in ("off", "0"):
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds >= _SILENCE_MIN:
        raise argparse.ArgumentTypeError(
            f"kernel silence {text!r} (--kernel-silence or {ENV_SILENCE}): give seconds, at least {_SILENCE_MIN:g} "
            f"(the kernel pings every second), or off")
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m workbench.kernel.worker`` (under torchrun)."""
    parser = argparse.ArgumentParser(
        prog="python -m workbench.kernel.worker",
        description="Join a running workbench kernel as one rank; start it with torchrun, e.g.\n"
        "  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29400 \\\n"
        "      -m workbench.kernel.worker --connect tcp://login-node:5555 --token-file PATH\n"
        "(the token: --token-file, else $WORKBENCH_KERNEL_TOKEN, else the file $WORKBENCH_KERNEL_TOKEN_FILE names)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--connect", default=os.environ.get(ENV_CONNECT),
                        help="the kernel's address tcp://HOST:PORT (%%ranks_connect prints it)")
    parser.add_argument("--token-file", default=None, metavar="PATH",
                        help=f"file holding the kernel's token, mode 0600 (%%ranks_connect names it; default: "
                        f"${ENV_TOKEN}, else the file ${ENV_TOKEN_FILE} names)")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="process group backend (auto: nccl when CUDA is available, else gloo)")
    parser.add_argument("--kernel-silence", type=_silence_limit, metavar="SECONDS",
                        default=os.environ.get(ENV_SILENCE) or f"{SILENCE_DEFAULT:g}",
                        help=f"exit with code {LOST_EXIT_CODE} (torch's agent then stops) after this many seconds "
                        f"without a word from the kernel while the connection to it is gone (it died, or the network "
                        f"is down); off: never (default: ${ENV_SILENCE}, else {SILENCE_DEFAULT:g})")
    args = parser.parse_args(argv)
    if not args.connect:
        parser.error("--connect is required (the kernel's tcp://HOST:PORT, as %ranks_connect prints it)")
    try:
        address = check_address(args.connect)
        token = read_token(args.token_file)
    except ValueError as exc:
        parser.error(str(exc))
    os.environ.pop(ENV_TOKEN, None)  # held in memory only: a cell printing os.environ must not show it
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        parser.error(f"environment variable(s) {', '.join(missing)} not set: start this module with torchrun "
                     "(torch's elastic agent), which sets them for every rank")
    backend = args.backend
    if backend == "auto":
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # native stacks on demand, into the rank's log
    worker = _Worker(address, token, backend, silence=args.kernel_silence)
    worker.start_forensics()
    worker.init_process_group()
    worker.serve()
    if worker.exit_code:  # the job lost ranks: no clean-up that could wait for them; torch's agent stops at once
        print(f"workbench rank {worker.rank}: the kernel ended this job (ranks of it were lost); exiting with code "
              f"{worker.exit_code} so that torch's agent does not wait for the lost ones", file=worker.log,
              flush=True)
        worker.cleanup()
        os._exit(worker.exit_code)
    worker.destroy_process_groups()
    return 0


if __name__ == "__main__":
    sys.exit(main())
