"""The launcher kernel: a Jupyter kernel whose every cell runs on every rank of a torch.distributed job.

Jupyter talks to ``SPMDKernel`` (an ipykernel wrapper kernel) exactly as to a Python kernel; the kernel sends each
cell to its ranks (``RankSet``) and turns what they send back into one cell's output:

* text from all ranks is folded (``fold.Folder``): a line every rank printed appears once, other lines carry the
  ranks that printed them, ``[1,3] ...``; ``%rank_output 0|all|folded`` changes that; what ranks print after the
  cell ended (a thread it started) is shown under it alike, as ipykernel does;
* rank 0's rich output (figures, HTML, widgets) and its ``execute_result`` are shown (the lowest rank of a
  ``%%ranks`` subset when rank 0 is not in it; widgets live on rank 0 only, and another rank's says so);
* an exception on any rank fails the cell with that rank's own traceback first, labelled with its rank;
* a cell running longer than a second shows a live view (``live``), updated in place twice a second: which ranks
  are done, which run user code (at which line) and which wait in which collective of which group, for how long;
  when the cell ends it becomes one line (how long it ran, which rank finished last); ``%live off`` turns it off;
* a cell running longer than the hang timeout is reported with every rank's Python stack, ranks outside any
  collective first (they are the ones the others wait for), and, with ``%flight_recorder on``, every rank's last
  collectives from torch's flight recorder (group, op, sequence number, state);
* an interrupt reaches every rank; ranks left waiting in a collective that the other ranks left (they failed,
  were interrupted or finished the cell) are released: every rank closes its process groups' gloo connections
  (``sever``: live device meshes, FSDP modules and DTensors hold the groups, so destroying them is not enough)
  and destroys its groups, then new ones are created, so the next cell works and every rank's state is kept;
* if a stuck rank still does not return, the cell ends with an error naming it (the kernel never goes silent),
  later cells are refused until it returns, and restart restarts every rank.

Configuration comes from the kernelspec's environment (``workbench kernel install`` writes it): see ``_Config``.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ipykernel.kernelbase import Kernel

from workbench.kernel.fold import Folder, format_ranks
from workbench.kernel.ledger import member_ranks, read_ledger
from workbench.kernel.magics import MagicError, check_ranks, parse_cell
from workbench.kernel.protocol import ENV_TOKEN, ENV_TOKEN_FILE
from workbench.kernel.ranks import RankSet
from workbench.pid_space import PidSpace

__all__ = ["SPMDKernel"]

_GRACE = 2.0  # seconds a rank may take to return after an interrupt or a peer's error before we look at stacks
_LIVE_AFTER = 1.0  # seconds a cell runs before its live view appears
_LIVE_PERIOD = 0.5  # seconds between live view updates (and between asking ranks outside a collective where they are)
_POLL_PERIOD = 2.0  # seconds between asking running ranks where they are, with the live view off
_SILENT_AFTER = 1.0  # seconds without an answer to those questions before the live view calls a rank silent
_SHUTDOWN_GRACE = 60.0  # seconds a shutdown waits for the ranks to leave; the client's SIGTERM ends it sooner
_RECORDER_ENTRIES = 3  # each rank's newest flight recorder entries in a hang report


@dataclass(frozen=True, slots=True, kw_only=True)
class _Config:
    """Kernel settings, read from WORKBENCH_KERNEL_* environment variables set by the kernelspec."""

    nprocs: int
    backend: str
    listen: str | None
    hang_timeout: float | None
    hang_action: str
    join_timeout: float
    dead_after: float
    close_sockets: bool
    token_file: str | None
    live: bool
    flight_recorder: bool

    @classmethod
    def from_env(cls) -> _Config:
        env = os.environ
        timeout = env.get("WORKBENCH_KERNEL_HANG_TIMEOUT", "")
        return cls(nprocs=int(env.get("WORKBENCH_KERNEL_NPROCS", "2")),
                   backend=env.get("WORKBENCH_KERNEL_BACKEND", "gloo"),
                   listen=env.get("WORKBENCH_KERNEL_LISTEN") or None,
                   hang_timeout=float(timeout) if timeout not in ("", "off") else None,
                   hang_action=env.get("WORKBENCH_KERNEL_HANG_ACTION", "report"),
                   join_timeout=float(env.get("WORKBENCH_KERNEL_JOIN_TIMEOUT")
                                      or env.get("WORKBENCH_KERNEL_STARTUP_TIMEOUT") or "300"),
                   dead_after=float(env.get("WORKBENCH_KERNEL_DEAD_AFTER") or "30"),
                   close_sockets=env.get("WORKBENCH_KERNEL_CLOSE_SOCKETS", "1") not in ("0", "off", "false"),
                   token_file=env.get(ENV_TOKEN_FILE) or None,
                   live=env.get("WORKBENCH_KERNEL_LIVE", "on") not in ("0", "off", "false"),
                   flight_recorder=_flight_recorder_default(env))


def _flight_recorder_default(env: Any) -> bool:
    """Hang reports read the flight recorder when the kernelspec says so, else when the environment sizes it."""
    chosen = env.get("WORKBENCH_KERNEL_FLIGHT_RECORDER", "")
    if chosen:
        return chosen not in ("0", "off", "false")
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        value = env.get(name, "").strip()
        if value:
            return value.isdigit() and int(value) > 0
    return False


@dataclass(eq=False)
class _Cell:
    """The state of one cell while it runs on the ranks (and the folding of what they print after it ended)."""

    id: str
    ranks: tuple[int, ...]
    primary: int
    mode: str
    silent: bool
    parent: dict[str, Any] = field(default_factory=dict)  # its execute_request: the output's parent header
    start: float = field(default_factory=time.monotonic)
    pending: set[int] = field(default_factory=set)
    done: dict[int, dict[str, Any]] = field(default_factory=dict)
    folders: dict[str, Folder] = field(default_factory=dict)
    partial: dict[tuple[int, str], str] = field(default_factory=dict)
    interrupted_at: float | None = None
    first_error_at: float | None = None
    hang_reported: bool = False
    check_at: float | None = None  # when to look again for ranks left in a collective (None: the grace after trouble)
    told_outside: bool = False  # the ranks outside any collective after a rank's error were named once
    last_calls: dict[int, tuple] = field(default_factory=dict)  # rank -> the collective it was in at the last look
    release: bool = False
    released_at: float | None = None
    stuck: tuple[int, ...] = ()
    freed: tuple[int, ...] = ()  # ranks released from a collective (their results of this cell are not valid)
    lost: str = ""  # why the cell ended early: ranks of the job were lost (see SPMDKernel._lose)
    polled_at: float = 0.0  # when the running ranks were last asked where they are
    poll_id: str = ""
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> its last answer to those questions
    unanswered: dict[int, float] = field(default_factory=dict)  # rank -> since when it has not answered them
    where_since: dict[int, tuple[str, float]] = field(default_factory=dict)  # rank -> (its line, seen there since)
    finished: dict[int, float] = field(default_factory=dict)  # rank -> seconds from the start to its "done"
    live_id: str = ""  # the live view's display_id once shown
    live_at: float = 0.0  # when it was last drawn


def _call_key(report: dict[str, Any]) -> tuple:
    """What a rank was doing at a look: its line and the ledger's call (group and call number)."""
    call = report.get("call") or {}
    return (report.get("where"), call.get("group"), call.get("seq"))


class SPMDKernel(Kernel):
    """A Jupyter kernel that runs every cell on every rank (see the module docstring)."""

    implementation = "workbench-spmd"
    implementation_version = "0.1"
    language = "python"
    language_version = sys.version.split()[0]
    language_info = {  # noqa: RUF012 (ipykernel reads a class attribute)
        "name": "python", "version": sys.version.split()[0], "mimetype": "text/x-python",
        "codemirror_mode": {"name": "ipython", "version": 3}, "pygments_lexer": "ipython3",
        "nbconvert_exporter": "python", "file_extension": ".py",
    }
    banner = "workbench SPMD kernel: every cell runs on every rank (torch.distributed initialized)"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config_ = _Config.from_env()
        self.output_mode = "folded"
        self.hang_timeout = self.config_.hang_timeout
        self.hang_action = self.config_.hang_action
        self.join_timeout = self.config_.join_timeout
        self.dead_after = self.config_.dead_after
        self.live = self.config_.live
        self.flight_recorder = self.config_.flight_recorder
        self._last_where: dict[int, str] = {}  # rank -> the last line it was seen on (stack polls while cells run)
        self._lost_note: str | None = None  # ranks lost between cells: the next cell says so
        self._job_ended: str | None = None  # why the kernel ended its local ranks' job (see _lose), until a restart
        self.generation = 0
        self.rankset = RankSet(nprocs=self.config_.nprocs, backend=self.config_.backend, listen=self.config_.listen,
                               token_file=self.config_.token_file, log=self.log)
        self._warnings = list(self.rankset.warnings)  # shown once more, in the first cell that runs
        for msg_type in ("comm_open", "comm_msg", "comm_close"):
            self.shell_handlers[msg_type] = self._forward_comm
        self._last_ping = 0.0
        self._released: set[int] = set()
        self._abandoned: tuple[str, set[int]] | None = None  # (cell id, ranks still in it) after giving up
        self._pump_callback: Any = None
        self._cell_code: dict[int, str] = {}  # execution count -> the code the ranks ran (native stacks' lines)
        self._last_cells: dict[int, _Cell] = {}  # rank -> the last cell it finished (its later output goes there)

    help_links = (  # what JupyterLab's Help menu lists for this kernel
        {"text": "Python Reference", "url": "https://docs.python.org/{}.{}".format(*sys.version_info[:2])},
        {"text": "IPython Reference", "url": "https://ipython.readthedocs.io/en/stable/"},
        {"text": "PyTorch Distributed", "url": "https://docs.pytorch.org/docs/stable/distributed.html"},
    )

    @property
    def kernel_info(self) -> dict:
        """ipykernel's kernel_info, without debugger or subshells (cells reach the ranks one at a time)."""
        info = dict(super().kernel_info)
        info.update(supported_features=[], debugger=False, help_links=[dict(link) for link in self.help_links])
        return info

    # -- Jupyter handlers ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start serving Jupyter, plus a pump that shows rank messages arriving between cells (widgets). The ranks
        stop with this process however it ends: shutdown, SIGTERM (what jupyter_client sends a kernel whose shutdown
        takes longer than 2.5 s) or exit."""
        super().start()
        from tornado.ioloop import PeriodicCallback

        self._pump_callback = PeriodicCallback(self._pump, 200)
        self._pump_callback.start()
        atexit.register(self.rankset.stop)
        if threading.current_thread() is threading.main_thread():  # where Python runs signal handlers
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM: stop the ranks (at once if a shutdown is stopping them already), then end as SIGTERM ends a
        process: neither the agent, nor its ranks, nor the private store outlive the kernel."""
        try:
            self.rankset.stop()
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    async def do_execute(self, code: str, silent: bool, store_history: bool = True,
                         user_expressions: dict | None = None, allow_stdin: bool = False, **_: Any) -> dict:
        """Run the cell on the ranks; fold their output; report errors and hangs (see module docstring)."""
        try:
            return self._execute(code, silent, store_history)
        except KeyboardInterrupt:  # outside the wait for a cell's ranks (joining, say): a reply all the same
            message = ("interrupted before the cell reached the ranks (while the kernel waited for them to join, or "
                       "checked on a cell given up before); nothing ran")
            return self._fail("KeyboardInterrupt", message, [f"KeyboardInterrupt: {message}"], silent)
        except MagicError as exc:
            return self._fail("MagicError", str(exc), [f"MagicError: {exc}"], silent)
        except _RanksGone as exc:
            cause = self.rankset.root_cause()
            what = (f"rank {cause[0]} {cause[1]}, and torch's elastic agent stopped the others (its exit code "
                    f"{exc.args[0]})" if cause else f"torch's elastic agent exited with code {exc.args[0]} (a rank "
                    "crashed or was killed, and the agent stopped the others)")
            message = (f"the ranks stopped: {what}. Restart the kernel. Their log ({self.rankset.log_path}) "
                       f"ends:\n{self.rankset.log_tail()}")
            return self._fail("RanksStopped", message, [message], silent)

    def _execute(self, code: str, silent: bool, store_history: bool) -> dict:
        if self._warnings:
            self._stream("stderr", self._warnings, silent)
            self._warnings = []
        # a cluster kernel learns its world size when its first rank joins: %%ranks is checked once they joined
        directives = parse_cell(code, self.rankset.world_size)
        if directives.output is not None:
            self.output_mode = directives.output
            self._stream("stdout", f"rank output: {self.output_mode}\n", silent)
        if directives.timeout_given:
            self.hang_timeout = directives.hang_timeout
            self.hang_action = directives.hang_action or self.hang_action
            when = "off" if self.hang_timeout is None else f"{self.hang_timeout:g} s, then {self.hang_action}"
            self._stream("stdout", f"hang timeout: {when}\n", silent)
        if directives.join_timeout is not None:
            self.join_timeout = directives.join_timeout
            self._stream("stdout", f"join timeout: {self.join_timeout:g} s\n", silent)
        if directives.dead_after is not None:
            self.dead_after = directives.dead_after
            self._stream("stdout", f"a rank silent for {self.dead_after:g} s whose connection is gone is lost\n",
                         silent)
        if directives.live is not None:
            self.live = directives.live
            self._stream("stdout", f"live view of running cells: {'on' if self.live else 'off'}\n", silent)
        if directives.flight_recorder is not None:
            self.flight_recorder = directives.flight_recorder
            self._stream("stdout", "hang reports " + ("add each rank's last collectives from torch's flight recorder"
                                                      if self.flight_recorder else "leave torch's flight recorder out")
                         + "\n", silent)
        body = directives.code
        if body.strip() == "%ranks_connect":
            self._stream("stdout", self._connect_help(), silent)
            return self._ok()
        if not body.strip():
            return self._ok()
        self._pump_messages()
        if self._lost_note is not None:
            note, self._lost_note = self._lost_note, None
            return self._fail("RanksLost", note.splitlines()[0], note.splitlines(), silent)
        problem = self._wait_for_ranks(silent) or self._check_abandoned()
        if problem:
            return self._fail("RanksNotReady", problem, [problem], silent)
        ranks = (check_ranks(directives.ranks, self.rankset.world_size) if directives.ranks
                 else tuple(range(self.rankset.world_size or 0)))
        self._cell_code[self.execution_count] = body
        self._cell_code.pop(self.execution_count - 100, None)
        cell = _Cell(id=uuid.uuid4().hex, ranks=ranks, primary=min(ranks), mode=self.output_mode, silent=silent,
                     parent=self.get_parent("shell"))
        cell.pending = set(ranks)
        cell.folders = {name: Folder(ranks) for name in ("stdout", "stderr")}
        for rank in ranks:
            self._last_where[rank] = f"running cell {self.execution_count} (no stack seen yet)"
            self.rankset.send(rank, {
                "op": "execute", "id": cell.id, "code": body, "execution_count": self.execution_count,
                "silent": silent, "store_history": store_history,
                "streams": cell.mode != "0" or rank == cell.primary,
                "display": rank == cell.primary or cell.mode == "all",
            })
        self._wait(cell)
        return self._finish(cell)

    async def do_complete(self, code: str, cursor_pos: int | None) -> dict:
        """Tab completion from rank 0's namespace (IPython's completer, with jedi, as ipykernel)."""
        pos = len(code) if cursor_pos is None else cursor_pos
        empty = {"matches": [], "cursor_start": pos, "cursor_end": pos, "metadata": {}}
        answer = self._query("complete", {"code": code, "cursor_pos": pos}) or empty
        return {"status": "ok", **answer}

    async def do_inspect(self, code: str, cursor_pos: int, detail_level: int = 0, omit_sections: Any = ()) -> dict:
        """Shift+Tab / ``obj?`` in the inspector: IPython's object info from rank 0's namespace."""
        answer = self._query("inspect", {"code": code, "cursor_pos": cursor_pos, "detail_level": detail_level,
                                         "omit_sections": list(omit_sections)})
        return {"status": "ok", **(answer or {"found": False, "data": {}, "metadata": {}})}

    async def do_history(self, hist_access_type: str, output: bool, raw: bool, session: int = 0, start: int = 0,
                         stop: int | None = None, n: int | None = None, pattern: str | None = None,
                         unique: bool = False, **_: Any) -> dict:
        """Rank 0's input history (the ranks run the same cells; ``%%ranks`` cells without rank 0 are not in it)."""
        answer = self._query("history", {"hist_access_type": hist_access_type, "output": output, "raw": raw,
                                         "session": session, "start": start, "stop": stop, "n": n,
                                         "pattern": pattern, "unique": unique})
        return {"status": "ok", "history": (answer or {"history": []})["history"]}

    async def do_is_complete(self, code: str) -> dict:
        """Whether ``code`` is a whole cell yet (a console's Enter), by IPython's own rules; no rank is asked."""
        from IPython.core.inputtransformer2 import TransformerManager

        status, indent = TransformerManager().check_complete(code)
        return {"status": status, **({"indent": " " * (indent or 0)} if status == "incomplete" else {})}

    async def comm_info_request(self, stream: Any, ident: Any, parent: dict) -> None:
        """The comms open on rank 0, where widgets live (JupyterLab restores widgets from this after a reload)."""
        target = parent["content"].get("target_name")
        answer = self._query("comm_info", {"target_name": target}) or {"comms": {}}
        self.session.send(stream, "comm_info_reply", {"status": "ok", "comms": answer["comms"]}, parent, ident)

    def _query(self, what: str, args: dict[str, Any], timeout: float = 10.0) -> dict[str, Any] | None:
        """Ask rank 0 about its shell (between cells); None when no answer came within ``timeout`` seconds.

        Other messages that arrive meanwhile (widget updates, late output) are routed as usual, never dropped.
        """
        if 0 not in self.rankset.ranks:
            return None
        request = uuid.uuid4().hex
        self.rankset.send(0, {"op": "query", "id": request, "what": what, "args": args})
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            got = self.rankset.recv(left)
            if got is None:
                break
            rank, message = got
            if message["op"] == "answer" and message.get("id") == request:
                if message.get("error"):
                    self.log.warning("workbench kernel: rank 0 could not answer %s: %s", what, message["error"])
                return message.get("content")
            self._route(None, rank, message)
        self.log.warning("workbench kernel: rank 0 did not answer a %s request within %g s", what, timeout)
        return None

    async def do_shutdown(self, restart: bool) -> dict:
        """Stop every rank (a restart starts a new kernel process, hence new ranks). Ranks that leave on a busy host
        may take seconds: this waits for them until the client's patience ends (jupyter_client SIGTERMs a kernel after
        half its ``shutdown_wait_time``, 2.5 s by default), when ``_on_sigterm`` ends them at once (``RankSet.stop``).
        """
        if self._pump_callback is not None:
            self._pump_callback.stop()
        self.rankset.stop(grace=_SHUTDOWN_GRACE)
        return {"status": "ok", "restart": restart}

    def _forward_comm(self, stream: Any, ident: Any, parent: dict) -> None:
        """Widget messages from the frontend go to rank 0, where the widgets live."""
        import base64

        if 0 in self.rankset.ranks:
            self.rankset.send(0, {"op": "comm", "msg_type": parent["header"]["msg_type"], "content": parent["content"],
                                  "metadata": parent.get("metadata", {}),
                                  "buffers": [base64.b64encode(bytes(b)).decode() for b in parent.get("buffers", [])]})

    # -- waiting for ranks ----------------------------------------------------------------------------------------
    def _wait_for_ranks(self, silent: bool = False) -> str | None:
        """Wait up to the join timeout for every rank of the job (its size comes from the ranks' WORLD_SIZE),
        showing who has joined from which host; None once all are there, else what is missing."""
        if self.rankset.ready:
            return None
        local = self.config_.nprocs > 0
        if local and self._job_ended is not None:  # only a restart starts new local ranks
            return (f"this kernel's ranks are gone: it ended their job after {self._job_ended}; an earlier cell "
                    "said so. Restart the kernel (Kernel > Restart Kernel) to start new ranks.")
        deadline = time.monotonic() + self.join_timeout
        shown = None
        while not self.rankset.ready and time.monotonic() < deadline:
            code = self.rankset.agent_exit_code()
            if code is not None:
                return (f"the local ranks exited (torch elastic agent exit code {code}) before joining; "
                        f"their log ({self.rankset.log_path}) ends:\n{self.rankset.log_tail()}")
            got = self.rankset.recv(0.2)
            if got:
                self._route(None, *got)
            summary = self._joined()
            if not local and summary != shown:
                self._stream("stdout", f"waiting up to {self.join_timeout:g} s for the job's ranks: {summary}\n",
                             silent)
                shown = summary
        if self.rankset.ready:
            if shown is not None:
                self._stream("stdout", f"all {self.rankset.world_size} ranks joined\n", silent)
            return None
        world = self.rankset.world_size
        missing = [r for r in range(world or 0) if r not in self.rankset.ranks]
        if local:
            return (f"rank(s) {format_ranks(missing)} of {self.config_.nprocs} did not join within "
                    f"{self.join_timeout:g} s ({self._joined()}); log: {self.rankset.log_path}")
        what = (f"rank(s) {format_ranks(missing)} of {world} did not join within {self.join_timeout:g} s "
                f"({self._joined()})" if world else f"no rank joined within {self.join_timeout:g} s")
        return (f"{what}. Run the cell again to wait longer (%join_timeout SECONDS sets how long), or start the "
                f"missing ranks.\n" + self._connect_help())

    def _joined(self) -> str:
        """Who has joined so far, by host: "2 of 4 joined: node0 ranks 0,1; node1 rank 2"."""
        ranks = self.rankset.ranks
        if not ranks:
            return "none joined yet"
        hosts: dict[str, list[int]] = {}
        for rank in sorted(ranks):
            hosts.setdefault(ranks[rank].host, []).append(rank)
        where = "; ".join(f"{host} rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)}" for host, rs in hosts.items())
        return f"{len(ranks)} of {self.rankset.world_size} joined: {where}"

    def _check_abandoned(self) -> str | None:
        """After a cell was given up on: None once its stuck ranks came back (groups re-created), else why not."""
        if self._abandoned is None:
            return None
        for _ in range(50):  # take what arrived since (a stuck rank's late "done")
            got = self.rankset.recv(0)
            if not got:
                break
            self._route(None, *got)
        stuck = self._abandoned[1]
        if stuck:
            return (f"rank(s) {format_ranks(sorted(stuck))} are still stuck in a collective of an earlier cell "
                    "and cannot run this one: restart the kernel (Kernel > Restart Kernel)")
        self._abandoned = None
        note = self._reinit()
        self._stream("stderr", note, False)
        return None if "re-created" in note else note

    def _connect_help(self) -> str:
        joined = sorted(self.rankset.ranks)
        lines = [f"ranks joined: {format_ranks(joined) if joined else 'none'} (world size "
                 f"{self.rankset.world_size or 'not known yet'})." + (f" By host: {self._joined().split(': ', 1)[1]}"
                                                                     if joined else "")]
        if self.rankset.token_file is None:
            lines.append(f"This kernel starts its {self.config_.nprocs} rank(s) itself; for ranks a scheduler "
                         "starts, install one with: workbench kernel install --nprocs 0 --listen HOST:PORT")
        else:
            lines += ["Start ranks that join this kernel with:", f"  {self.rankset.torchrun_command()}",
                      f"The token file (mode 0600, new at every kernel start) must be readable where the ranks run "
                      f"(a shared home directory); or put its contents in ${ENV_TOKEN} (or a copy's path in "
                      f"${ENV_TOKEN_FILE}) in the job's environment instead of --token-file.",
                      *self.rankset.warnings]
        return "\n".join(lines) + "\n"

    # -- one cell ---------------------------------------------------------------------------------------------------
    def _wait(self, cell: _Cell) -> None:
        while cell.pending:
            try:
                self._wait_step(cell)
            except KeyboardInterrupt:  # Jupyter's interrupt (SIGINT to the kernel): pass it to every rank
                if cell.interrupted_at is None:
                    cell.interrupted_at = time.monotonic()
                self.rankset.broadcast({"op": "interrupt", "cell": cell.id}, sorted(cell.pending))

    def _wait_step(self, cell: _Cell) -> None:
        now = time.monotonic()
        self._ping(now)
        code = self.rankset.agent_exit_code()
        if code is not None:
            raise _RanksGone(code)
        lost = self.rankset.lost(self.dead_after)
        exited = [] if lost else self.rankset.exited(sorted(cell.pending))
        if lost or exited:
            why = ("their process ended during the cell without finishing it (an exit, os._exit or a signal)"
                   if exited else None)
            cell.lost = self._lose(cell, lost or exited, why)
            cell.pending.clear()
            return
        live = self.live and not cell.silent
        period, begin = (_LIVE_PERIOD, _LIVE_AFTER - _LIVE_PERIOD) if live else (_POLL_PERIOD, 1.0)
        if now - cell.start > begin and now - cell.polled_at > period and cell.pending:
            self._poll_where(cell, now)
        got = self.rankset.recv(0.1)
        if got:
            self._route(cell, *got)
        if live:
            self._live_tick(cell)
        for name, folder in cell.folders.items():
            self._stream(name, folder.flush_stale(), cell.silent)
        self._flush_late()
        elapsed = time.monotonic() - cell.start
        if self.hang_timeout is not None and not cell.hang_reported and elapsed > self.hang_timeout and cell.pending:
            cell.hang_reported = True
            self._report_hang(cell, elapsed)
            if self.hang_action == "interrupt" and cell.interrupted_at is None:
                self._stream("stderr", "hang timeout: interrupting every rank\n", cell.silent)
                raise KeyboardInterrupt
        if cell.released_at is not None and cell.pending and time.monotonic() - cell.released_at > 3 * _GRACE:
            self._give_up(cell)
            return
        trouble = min((t for t in (cell.interrupted_at, cell.first_error_at) if t is not None), default=None)
        now = time.monotonic()
        due = None if trouble is None else cell.check_at if cell.check_at is not None else trouble + _GRACE
        if due is not None and now >= due and cell.pending and cell.released_at is None and not cell.release:
            cell.check_at = now + _GRACE  # while a rank has failed, look again until the others are free
            self._release_if_stuck(cell)

    def _route(self, cell: _Cell | None, rank: int, message: dict[str, Any]) -> None:
        op = message["op"]
        current = cell is not None and message.get("id") == cell.id
        if op == "comm" and rank == 0:
            import base64

            buffers = [base64.b64decode(b) for b in message.get("buffers", [])]
            self.session.send(self.iopub_socket, message["msg_type"], message["content"],
                              parent=self.get_parent("shell"), metadata=message.get("metadata"), buffers=buffers)
        elif op == "released":
            self._released.add(rank)
        elif op == "stacks" and cell is not None and message.get("id") == cell.poll_id:
            where = _where_text(message)
            self._last_where[rank] = where
            cell.reports[rank] = message
            cell.unanswered.pop(rank, None)
            if cell.where_since.get(rank, ("",))[0] != where:
                cell.where_since[rank] = (where, time.time())
        elif op == "done" and self._abandoned is not None and message.get("id") == self._abandoned[0]:
            self._abandoned[1].discard(rank)
        elif op == "stream" and not current:
            self._late_stream(rank, message)
        elif not current or cell is None:
            return  # late output of an earlier cell, or a hello/reply we do not wait for
        elif op == "stream":
            self._on_stream(cell, rank, message["name"], message["text"])
        elif op == "display" and not cell.silent:
            if cell.mode == "all" and rank != cell.primary:
                self._stream("stdout", f"[{rank}] display:\n", False)
            msg_type = "update_display_data" if message.get("update") else "display_data"
            self.send_response(self.iopub_socket, msg_type, {"data": message["data"], "metadata": message["metadata"],
                                                            "transient": message.get("transient", {})})
        elif op == "clear_output" and not cell.silent:
            self.send_response(self.iopub_socket, "clear_output", {"wait": message.get("wait", False)})
        elif op == "done":
            cell.done[rank] = message
            cell.finished[rank] = time.monotonic() - cell.start
            cell.pending.discard(rank)
            if message["status"] == "error" and cell.first_error_at is None:
                cell.first_error_at = time.monotonic()
            for name, folder in cell.folders.items():
                self._stream(name, folder.finish(rank), cell.silent)
            for (r, name), text in list(cell.partial.items()):
                if r == rank and text:
                    self._stream(name, [f"[{rank}] {text}"], cell.silent)
                    cell.partial[(r, name)] = ""

    def _on_stream(self, cell: _Cell, rank: int, name: str, text: str) -> None:
        if cell.mode == "folded":
            self._cell_stream(cell, name, cell.folders[name].push(rank, text))
        elif cell.mode == "0":
            if rank == cell.primary:
                self._cell_stream(cell, name, text)
        else:
            buffered = cell.partial.get((rank, name), "") + text
            *lines, cell.partial[(rank, name)] = buffered.split("\n")
            self._cell_stream(cell, name, [f"[{rank}] {line}" for line in lines])

    def _late_stream(self, rank: int, message: dict[str, Any]) -> None:
        """What a rank printed after its last cell ended (a thread the cell started, native code): shown under that
        cell, as ipykernel shows a thread's output under the last cell. Output of an older cell is dropped."""
        cell = self._last_cells.get(rank)
        if cell is not None and message.get("id") == cell.id:
            self._on_stream(cell, rank, message["name"], message["text"])

    def _keep_for_late_output(self, cell: _Cell) -> None:
        """The cell ended: fold what its ranks print until their next cell afresh, as while it ran; a cell no rank
        prints under any more gives out what it still holds."""
        cell.folders = {name: Folder(cell.ranks) for name in cell.folders}
        replaced = {id(old): old for rank, old in self._last_cells.items() if rank in cell.done and old is not cell}
        self._last_cells.update(dict.fromkeys(cell.done, cell))
        for old in replaced.values():
            if all(kept is not old for kept in self._last_cells.values()):
                self._drain(old)

    def _flush_late(self) -> None:
        """Let through lines printed after their cell ended that waited long enough for the other ranks."""
        for cell in {id(c): c for c in self._last_cells.values()}.values():
            for name, folder in cell.folders.items():
                self._cell_stream(cell, name, folder.flush_stale())

    def _drain(self, cell: _Cell) -> None:
        """Show everything of the cell's output still held back (folded lines, unterminated lines)."""
        for name, folder in cell.folders.items():
            self._cell_stream(cell, name, folder.drain())
        for (rank, name), text in cell.partial.items():
            if text:
                self._cell_stream(cell, name, [f"[{rank}] {text}"])
        cell.partial.clear()

    def _cell_stream(self, cell: _Cell, name: str, text: str | list[str]) -> None:
        """Text of the ranks' output of ``cell``, under that cell (also once later cells ran)."""
        self._stream(name, text, cell.silent, cell.parent)

    def _stream(self, name: str, text: str | list[str], silent: bool, parent: dict[str, Any] | None = None) -> None:
        if isinstance(text, list):
            if not text:
                return
            text = "\n".join(text) + "\n"
        if text and not silent:
            content = {"name": name, "text": text}
            if parent is None:  # the request being handled
                self.send_response(self.iopub_socket, "stream", content)
            else:
                self.session.send(self.iopub_socket, "stream", content, parent)

    def _ping(self, now: float) -> None:
        if now - self._last_ping > 1.0:
            self._last_ping = now
            self.rankset.broadcast({"op": "ping"})

    def _pump(self) -> None:
        """Between cells: deliver widget messages from rank 0 and output of the last cell, keep remote ranks'
        heartbeat, notice lost ranks."""
        self._ping(time.monotonic())
        self._pump_messages()
        self._flush_late()
        lost = self.rankset.lost(self.dead_after)
        if lost and self._lost_note is None:
            self._lost_note = self._lose(None, lost)
            self.log.warning("%s", self._lost_note)

    def _pump_messages(self) -> None:
        while True:
            got = self.rankset.recv(0)
            if not got:
                return
            self._route(None, *got)

    # -- the live view --------------------------------------------------------------------------------------------
    def _poll_where(self, cell: _Cell, now: float) -> None:
        """Ask running ranks where they are (their I/O thread answers from ``sys._current_frames``, never the main
        thread). With the live view on, ranks of this host that their ledger shows inside a collective are not asked:
        the ledger, read here, says all the view needs."""
        cell.polled_at = now
        cell.poll_id = cell.poll_id or uuid.uuid4().hex  # one id per cell: a late answer still counts
        ask = [r for r in sorted(cell.pending)
               if not (self.live and (self._local_ledger(r) or {}).get("state") == "in")]
        for rank in cell.pending:
            if rank in ask:
                cell.unanswered.setdefault(rank, now)
            else:
                cell.unanswered.pop(rank, None)
        self.rankset.broadcast({"op": "stacks", "id": cell.poll_id}, ask)

    def _local_ledger(self, rank: int) -> dict[str, Any] | None:
        """The collective a rank of this host is in, read from its ledger file (no message, nothing asked of it)."""
        info = self.rankset.ranks.get(rank)
        if info is None or not info.ledger_file or not self.rankset.on_this_host(rank):
            return None
        return read_ledger(info.ledger_file, tries=5)

    def _live_states(self, cell: _Cell) -> dict[int, Any]:
        """What each rank of the cell is doing, from its "done", its ledger and its last answer about its stack."""
        from workbench.kernel.live import RankState, where_label

        states: dict[int, RankState] = {}
        now = time.monotonic()
        for rank in cell.ranks:
            done = cell.done.get(rank)
            if done is not None:
                error = (done.get("error") or {}).get("ename", "an error")
                states[rank] = RankState("failed", error) if done["status"] == "error" else RankState("done")
                continue
            report = cell.reports.get(rank)
            record = self._local_ledger(rank) or (report or {}).get("collective") or {}
            if record.get("state") == "in":
                states[rank] = RankState("collective", _call_text(record), float(record.get("since") or 0) or None)
                continue
            asked = cell.unanswered.get(rank)
            silent = asked is not None and now - asked > _SILENT_AFTER  # its I/O thread cannot get the GIL
            if report is None:
                states[rank] = (RankState("silent", "(its main thread may hold the GIL in native code)",
                                          time.time() - (now - asked)) if silent and asked is not None
                                else RankState("starting"))
                continue
            where, since = cell.where_since.get(rank, (_where_text(report), None))
            label = where_label(where)
            if silent and asked is not None:
                states[rank] = RankState("silent", f"last seen at {label}", time.time() - (now - asked))
            elif report.get("pending"):
                waits = "; ".join(_call_text(p) for p in report["pending"])
                states[rank] = RankState("gpu", f"{label} (the GPU has not finished its {waits})", since)
            elif report.get("in_collective"):
                states[rank] = RankState("collective", f"torch.distributed at {label}", since)
            else:
                states[rank] = RankState("code", label, since)
        return states

    def _live_tick(self, cell: _Cell) -> None:
        """Draw or redraw the live view: once the cell ran ``_LIVE_AFTER`` s, then every ``_LIVE_PERIOD`` s."""
        from workbench.kernel import live

        now = time.monotonic()
        if not cell.pending or now - cell.start < _LIVE_AFTER or now - cell.live_at < _LIVE_PERIOD:
            return
        cell.live_at = now
        data = live.bundle(self._live_states(cell), now - cell.start, time.time())
        self._show_live(cell, data)

    def _show_live(self, cell: _Cell, data: dict[str, str]) -> None:
        first = not cell.live_id
        cell.live_id = cell.live_id or f"workbench-live-{cell.id}"
        self.send_response(self.iopub_socket, "display_data" if first else "update_display_data",
                           {"data": data, "metadata": {}, "transient": {"display_id": cell.live_id}})

    def _end_live(self, cell: _Cell) -> None:
        """The cell ended: its live view becomes one line (how long, which rank finished last, which failed)."""
        from workbench.kernel import live

        if not cell.live_id:
            return
        failed = {r: (d.get("error") or {}).get("ename", "an error") for r, d in cell.done.items()
                  if d["status"] == "error"}
        unfinished = [r for r in cell.ranks if r not in cell.finished]
        data = live.summary(cell.finished, failed, time.monotonic() - cell.start)
        if unfinished:
            tail = f"; rank(s) {format_ranks(unfinished)} did not finish"
            data = {"text/plain": data["text/plain"] + tail,
                    "text/html": data["text/html"].replace("</div>", f"{tail}</div>")}
        self._show_live(cell, data)

    # -- forensics ------------------------------------------------------------------------------------------------
    def _stacks(self, cell: _Cell | None, ranks: list[int], timeout: float = 1.5) -> dict[int, dict[str, Any]]:
        """Every rank's main-thread stack and collective: asked of the rank's I/O thread first; for ranks that do not
        answer within ``timeout`` (their main thread holds the GIL in native code), faulthandler's dump in C, read
        here for ranks on this host and by a rank of the same host for the others (``_native_stacks``)."""
        request = uuid.uuid4().hex
        self.rankset.broadcast({"op": "stacks", "id": request}, ranks)
        answers: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < len(ranks) and time.monotonic() < deadline:
            got = self.rankset.recv(deadline - time.monotonic())
            if not got:
                break
            rank, message = got
            if message["op"] == "stacks" and message.get("id") == request:
                answers[rank] = self._with_ledger(message)
            else:
                self._route(cell, rank, message)
        silent = [r for r in ranks if r not in answers]
        if silent:
            answers.update(self._native_stacks(cell, silent, answered=sorted(answers)))
        return answers

    def _native_stacks(self, cell: _Cell | None, ranks: list[int], answered: list[int]) -> dict[int, dict[str, Any]]:
        from workbench.kernel.stackdump import Frame, dump_all, parse

        infos = {r: self.rankset.ranks[r] for r in ranks if r in self.rankset.ranks}
        here = {r: (i.pid, i.stack_file) for r, i in infos.items() if i.stack_file and self.rankset.on_this_host(r)}
        frames: dict[int, list[Any] | None] = {}
        ledgers: dict[int, Any] = {}
        for rank, text in dump_all(here).items():
            frames[rank] = parse(text, infos[rank].thread) if text else None
            ledgers[rank] = read_ledger(infos[rank].ledger_file)
        by_place: dict[tuple[str, PidSpace], list[int]] = {}  # a helper signals only a peer its pid names
        for r in answered:
            if r in self.rankset.ranks and (peer := self.rankset.ranks[r]).pid_space.known:
                by_place.setdefault((peer.host, peer.pid_space), []).append(r)
        asked: dict[str, int] = {}
        for rank, info in infos.items():
            helpers = by_place.get((info.host, info.pid_space))
            if rank in here or not info.stack_file or not helpers:
                continue
            request = uuid.uuid4().hex
            asked[request] = rank
            self.rankset.send(helpers[0], {"op": "dump_peer", "id": request, "rank": rank, "pid": info.pid,
                                           "stack_file": info.stack_file, "ledger_file": info.ledger_file,
                                           "thread": info.thread})
        deadline = time.monotonic() + 3.0
        while asked and time.monotonic() < deadline:
            got = self.rankset.recv(deadline - time.monotonic())
            if not got:
                break
            sender, message = got
            if message["op"] == "peer_dump" and message.get("id") in asked:
                rank = asked.pop(message["id"])
                found = message.get("frames")
                frames[rank] = None if found is None else [(Frame(f[0], int(f[1]), f[2]), f[3]) for f in found]
                ledgers[rank] = message.get("collective")
            else:
                self._route(cell, sender, message)
        out = {}
        for rank in ranks:
            stack = frames.get(rank)
            if stack is None:
                continue
            entries = [(f, "") if not isinstance(f, tuple) else f for f in stack]
            out[rank] = self._with_ledger({"native": True, "collective": ledgers.get(rank), "pending": [],
                                           **self._summarize_native(entries)})
        return out

    def _summarize_native(self, entries: list[tuple[Any, str]]) -> dict[str, Any]:
        from workbench.kernel.stackdump import file_source, format_frames, summarize

        texts = {(f.file, f.line): text for f, text in entries}

        def source(file: str, line: int) -> str:
            cell = _CELL_FILE.match(file)
            if cell:
                lines = self._cell_code.get(int(cell.group(1)), "").splitlines()
                return lines[line - 1] if 0 < line <= len(lines) else ""
            return texts.get((file, line)) or file_source(file, line)

        return summarize(format_frames([f for f, _ in entries], source))

    @staticmethod
    def _with_ledger(report: dict[str, Any]) -> dict[str, Any]:
        """A stack report plus what the rank's ledger says: in a collective (which), or waiting on the GPU."""
        record = report.get("collective") or {}
        inside = record.get("state") == "in"
        return {**report, "in_collective": bool(report.get("in_collective")) or inside or bool(report.get("pending")),
                "call": record if inside else None}

    def _state_line(self, rank: int, s: dict[str, Any] | None) -> str:
        """One line saying what a rank is doing, for hang reports and give-ups."""
        if s is None:
            info = self.rankset.ranks.get(rank)
            host = f" on host {info.host}" if info else ""
            return (f"rank {rank}: did not answer, and its stack could not be read{host} (no rank there answered "
                    f"to read it for the kernel)")
        native = " (holding the GIL in native code: no answer; stack from faulthandler)" if s.get("native") else ""
        now = time.time()
        if s["in_collective"]:
            line = f"rank {rank}: waiting in a collective, called at {s['where']}{native}"
            call = s.get("call")
            if call:
                line += f": {_call_text(call)}, for {now - float(call['since']):.0f} s"
        else:
            line = f"rank {rank}: busy outside any collective at {s['where']}{native}"
        for p in s.get("pending") or []:
            line += (f"; the GPU has not finished its {_call_text(p)} (called {now - float(p['since']):.0f} s "
                     "ago)")
        return line

    def _report_hang(self, cell: _Cell, elapsed: float) -> None:
        running = sorted(cell.pending)
        stacks = self._stacks(cell, running)
        finished = sorted(set(cell.ranks) - set(running))
        lines = [f"workbench kernel: the cell is still running after {elapsed:.0f} s on rank(s) "
                 f"{format_ranks(running)}" + (f" (rank(s) {format_ranks(finished)} finished it)" if finished else "")
                 + "; ranks outside any collective first (the others are waiting for them):"]
        order = sorted(running, key=lambda r: (r in stacks and stacks[r]["in_collective"], r))
        lines += [f"  {self._state_line(rank, stacks.get(rank))}" for rank in order]
        for rank in order:
            if rank in stacks:
                how = " (faulthandler)" if stacks[rank].get("native") else ""
                lines.append(f"--- rank {rank} Python stack{how} (innermost last):")
                lines.extend(entry.rstrip() for entry in stacks[rank]["stack"])
        if self.flight_recorder:
            lines += self._recorder(cell)
        action = ("interrupt (Kernel > Interrupt) to stop every rank" if self.hang_action == "report"
                  else "interrupting now")
        lines.append(f"(hang timeout {self.hang_timeout:g} s; {action})")
        self._stream("stderr", lines, cell.silent)

    def _recorder(self, cell: _Cell, timeout: float = 3.0) -> list[str]:
        """Every rank's newest flight recorder entries (each reads its own, on a helper thread), as report lines."""
        from workbench.kernel.recorder import recorder_lines

        request = uuid.uuid4().hex
        ranks = sorted(cell.ranks)
        self.rankset.broadcast({"op": "recorder", "id": request, "last": _RECORDER_ENTRIES}, ranks)
        answers: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < len(ranks) and (left := deadline - time.monotonic()) > 0:
            got = self.rankset.recv(left)
            if not got:
                break
            rank, message = got
            if message["op"] == "recorder" and message.get("id") == request:
                answers[rank] = message
            else:
                self._route(cell, rank, message)
        return recorder_lines(answers, ranks)

    def _release_if_stuck(self, cell: _Cell) -> None:
        """After an interrupt or a rank's error: free ranks left waiting in a collective for a rank that left it."""
        running = sorted(cell.pending)
        stacks = self._stacks(cell, running)
        inside = [r for r in running if r in stacks and stacks[r]["in_collective"]]
        # after an interrupt every collective is to be left; after a rank's error only those that wait for it
        stuck = inside if cell.interrupted_at is not None else [
            r for r in inside if self._waits_for_a_rank_that_left(cell, r, stacks[r])]
        cell.last_calls = {r: _call_key(stacks[r]) for r in inside}
        if len(stuck) < len(inside):  # collectives among ranks still in the cell: they go on, and so do we
            return
        elsewhere = [r for r in running if r not in stuck]
        if elsewhere:
            where = "; ".join(
                f"rank {r} (no answer, stack unreadable)" if r not in stacks else f"rank {r} at {stacks[r]['where']}"
                + (" (holding the GIL in native code: the interrupt reaches it when that call returns)"
                   if stacks[r].get("native") else "") for r in elsewhere)
            if cell.interrupted_at is not None:  # the user's interrupt has not reached them: say so, every time
                self._stream("stderr", f"workbench kernel: still running outside any collective after "
                             f"{_GRACE:g} s: {where}; interrupt again, or restart the kernel\n", cell.silent)
                cell.interrupted_at = None
                if cell.first_error_at is None:
                    cell.check_at = None  # nothing failed: look again after the next interrupt
            elif not cell.told_outside:  # a rank failed: its peers are watched until they finish or wait for it
                failed = format_ranks(sorted(r for r, d in cell.done.items() if d["status"] == "error"))
                self._stream("stderr", f"workbench kernel: rank(s) {failed} failed; still running outside any "
                             f"collective: {where}. If they enter a collective the failed rank(s) left, the kernel "
                             "frees them; interrupt to stop them now\n", cell.silent)
                cell.told_outside = True
        if stuck and not elsewhere:
            cell.release = True
            by_how: dict[str, list[int]] = {}
            for r in sorted(cell.done):
                by_how.setdefault(self._left_how(cell, r), []).append(r)
            left = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)} {how}" for how, rs in by_how.items())
            sever = self.config_.close_sockets and self.config_.backend == "gloo"
            how = ("closing every rank's process-group connections and destroying the groups" if sever
                   else "aborting every rank's NCCL communicators" if self.config_.backend == "nccl"
                   else "destroying the process groups")
            cell.freed = tuple(stuck)
            self._stream("stderr", f"workbench kernel: rank(s) {format_ranks(stuck)} wait in a collective that the "
                         f"other ranks left ({left or 'none finished'}); {how} so they return (new ones follow)\n",
                         cell.silent)
            self._released.clear()
            cell.released_at = time.monotonic()
            self.rankset.broadcast({"op": "release", "close_sockets": self.config_.close_sockets})

    @staticmethod
    def _waits_for_a_rank_that_left(cell: _Cell, rank: int, report: dict[str, Any]) -> bool:
        """Whether ``rank``'s collective cannot end: its group (from the ledger) holds a rank that left the cell; where
        the group is not known, whether it is the very call it was in at the last look (no progress), or the first
        look."""
        members = member_ranks(report.get("call"))
        if members is not None:
            return bool(members & set(cell.done))
        previous = cell.last_calls.get(rank)
        return previous is None or previous == _call_key(report)

    @staticmethod
    def _left_how(cell: _Cell, rank: int) -> str:
        done = cell.done[rank]
        if done["status"] != "error":
            return "finished the cell"
        return "was interrupted" if (done.get("error") or {}).get("ename") == "KeyboardInterrupt" else "failed"

    def _give_up(self, cell: _Cell) -> None:
        """Released ranks that still do not return: end the cell (never leave the client without an answer)."""
        stacks = self._stacks(cell, sorted(cell.pending))
        cell.stuck = tuple(sorted(cell.pending))
        lines = [f"workbench kernel: rank(s) {format_ranks(list(cell.stuck))} still wait in a collective "
                 f"{3 * _GRACE:g} s after their peers' connections were closed; giving up on this cell."]
        lines += [f"  {self._state_line(rank, stacks.get(rank))}" for rank in cell.stuck]
        lines.append("The kernel refuses new cells until they return: restart it (Kernel > Restart Kernel).")
        self._stream("stderr", lines, cell.silent)
        self._abandoned = (cell.id, set(cell.stuck))
        cell.pending.clear()
        cell.release = False

    def _lose(self, cell: _Cell | None, lost: list[int], why: str | None = None) -> str:
        """Ranks of the job are gone: free the others from what they wait in, end the job (every other rank exits,
        so its agent stops without waiting for the lost ones) and say how to go on. The kernel keeps running: a
        new set of ranks can join."""
        ranks = self.rankset.ranks
        why = why or (f"nothing heard for {self.dead_after:g} s or more and their connection is closed (the process "
                      "exited, or its host is unreachable)")
        lines = [f"rank(s) {format_ranks(lost)} of the job are gone: {why}:"]
        for rank in lost:
            info = ranks.get(rank)
            lines.append(f"  rank {rank} on host {info.host if info else '?'}: last seen "
                         f"{self._last_where.get(rank) or 'nowhere yet (no stack seen in this cell)'}")
        survivors = sorted(set(ranks) - set(lost))
        failed = sorted(r for r in survivors if cell is not None and (cell.done.get(r) or {}).get("status") == "error")
        for rank in failed:
            error = cell.done[rank].get("error") or {}
            evalue = (error.get("evalue") or "").strip().splitlines()
            lines.append(f"  rank {rank} left the cell with {error.get('ename', 'an error')}"
                         + (f": {evalue[0][:200]}" if evalue else ""))
        if cell is not None and cell.pending - set(lost):
            waiting = sorted(cell.pending - set(lost))
            self.rankset.broadcast({"op": "release", "close_sockets": self.config_.close_sockets}, waiting)
            deadline = time.monotonic() + 3 * _GRACE
            while set(waiting) - set(cell.done) and time.monotonic() < deadline:
                got = self.rankset.recv(0.1)
                if got:
                    self._route(cell, *got)
            back = sorted(set(waiting) & set(cell.done))
            lines.append(f"Rank(s) {format_ranks(waiting)} were released from what they waited in"
                         + (f" (rank(s) {format_ranks(back)} came back)" if back else ""))
        command = self.rankset.torchrun_command() if self.rankset.token_file is not None else None
        self.rankset.end_job()
        if self.rankset.nprocs:
            self._job_ended = f"rank(s) {format_ranks(lost)} were lost: {why}"
        self._abandoned, self.generation = None, 0
        self._released.clear()
        self._last_where.clear()
        lines.append(f"The job cannot go on without them (its world size is fixed): rank(s) "
                     f"{format_ranks(survivors) if survivors else 'none'} were told to exit (their agents stop "
                     "without waiting for the lost ones), and every variable of the job is gone.")
        if self.rankset.nprocs:  # ranks this kernel started: only a restart starts new ones
            lines.append("Restart the kernel (Kernel > Restart Kernel) to start new ranks.")
        else:
            lines.append("Restart the job's ranks" + (f", e.g. with:\n  {command}" if command else "")
                         + "\nThis kernel keeps running: the next cell waits for the new ranks to join.")
        text = "\n".join(lines) + "\n"
        if cell is not None:
            self._stream("stderr", text, cell.silent)
        return text

    # -- after the cell ------------------------------------------------------------------------------------------
    def _finish(self, cell: _Cell) -> dict:
        self._end_live(cell)
        self._drain(cell)
        self._keep_for_late_output(cell)
        for rank in cell.done:
            self._last_where[rank] = "idle, between cells"
        if cell.lost:
            return self._fail("RanksLost", cell.lost.splitlines()[0], cell.lost.splitlines(), cell.silent)
        note = self._reinit() if cell.release else None
        errors = {r: d["error"] or {"ename": "Error", "evalue": "", "traceback": [], "time": 0.0}
                  for r, d in cell.done.items() if d["status"] == "error"}
        for rank in cell.freed:  # NCCL: an aborted collective (or the CUDA sync after it) may return as if done
            if rank not in errors and rank in cell.done:
                errors[rank] = {"ename": "CollectiveAborted", "evalue": f"rank {rank} was released from a collective "
                                "its peers had left, by aborting its communicators: what it computed in this cell "
                                "after that call is not valid", "traceback": [], "time": float("inf")}
        for rank in cell.stuck:
            errors[rank] = {"ename": "RankStuck", "evalue": f"rank {rank} is stuck in a collective; restart the "
                            "kernel", "traceback": [f"rank {rank} did not return from a collective"],
                            "time": float("inf")}
        if note:
            self._stream("stderr", note, cell.silent)
        if errors:
            return self._error_reply(cell, errors)
        result = cell.done.get(cell.primary, {}).get("result")
        if result and not cell.silent:
            self.send_response(self.iopub_socket, "execute_result", {
                "execution_count": self.execution_count, "data": result["data"], "metadata": result["metadata"]})
        return {**self._ok(), "payload": cell.done.get(cell.primary, {}).get("payload") or []}

    def _reinit(self) -> str:
        """Every rank destroyed its process groups (release); build the next generation everywhere. An interrupt
        meanwhile waits until it is done: stopped half way, the ranks would be left without process groups."""
        held: list[bool] = []
        world = sorted(self.rankset.ranks)
        deadline = time.monotonic() + 30
        while not self._released.issuperset(world) and time.monotonic() < deadline:
            got = self._recv_holding_interrupts(0.2, held)
            if got:
                self._route(None, *got)
        self._released.clear()
        self.generation += 1
        self.rankset.broadcast({"op": "reinit", "generation": self.generation})
        done: dict[int, Any] = {}
        deadline = time.monotonic() + 120
        while len(done) < len(world) and time.monotonic() < deadline:
            got = self._recv_holding_interrupts(0.2, held)
            if got and got[1]["op"] == "reinit_done":
                done[got[0]] = got[1]["error"]
        failed = {r: e for r, e in done.items() if e} | {r: "no answer" for r in world if r not in done}
        note = " (an interrupt meanwhile was held until they were)" if held else ""
        if failed:
            return f"workbench kernel: could not re-create the process groups ({failed}); restart the kernel{note}\n"
        return ("workbench kernel: process groups re-created on every rank (generation "
                f"{self.generation}){note}; meshes and groups made before are gone, build them again\n")

    def _recv_holding_interrupts(self, timeout: float, held: list[bool]) -> tuple[int, dict[str, Any]] | None:
        """``rankset.recv``; an interrupt meanwhile is noted in ``held`` instead of raised."""
        try:
            return self.rankset.recv(timeout)
        except KeyboardInterrupt:
            held.append(True)
            return None

    def _error_reply(self, cell: _Cell, errors: dict[int, dict[str, Any]]) -> dict:
        from workbench.run.launcher import _PEER_FAILURE

        def rank_key(rank: int) -> tuple:
            e = errors[rank]
            symptom = any(s in e["evalue"] for s in _PEER_FAILURE) or "Connection closed by peer" in e["evalue"]
            return (symptom, e["ename"] == "KeyboardInterrupt", e.get("time", 0.0), rank)

        order = sorted(errors, key=rank_key)
        root = order[0]
        first = errors[root]
        ok = sorted(r for r in cell.ranks if r not in errors)
        header = f"\x1b[1;31m[rank {root}]\x1b[0m {first['ename']} on rank {root} (its own traceback):"
        tail = [f"[rank {r}] {errors[r]['ename']}: {errors[r]['evalue']}" for r in order[1:]]
        if ok:
            tail.append(f"rank(s) {format_ranks(ok)} finished the cell; every rank's state is kept")
        traceback = [header, *first["traceback"], *(["other ranks:", *tail] if tail else [])]
        content = {"ename": first["ename"], "evalue": f"[rank {root}] {first['evalue']}", "traceback": traceback}
        if not cell.silent:
            self.send_response(self.iopub_socket, "error", content)
        return {"status": "error", "execution_count": self.execution_count, **content}

    def _ok(self) -> dict:
        return {"status": "ok", "execution_count": self.execution_count, "payload": [], "user_expressions": {}}

    def _fail(self, ename: str, evalue: str, traceback: list[str], silent: bool) -> dict:
        content = {"ename": ename, "evalue": evalue, "traceback": traceback}
        if not silent:
            self.send_response(self.iopub_socket, "error", content)
        return {"status": "error", "execution_count": self.execution_count, **content}


class _RanksGone(RuntimeError):
    pass


_CELL_FILE = re.compile(r"^<ipython-input-(\d+)-[0-9a-f]+>$")  # how IPython names a cell's code


def _where_text(report: dict[str, Any]) -> str:
    """A stack report as its innermost line of user code: 'File "x.py", line 3, in f: code'."""
    where = report.get("where") or "outside user code"
    return f"{where}: {report['code']}" if report.get("code") else where


def _call_text(call: dict[str, Any]) -> str:
    """A ledger record as words: "all_reduce #3 on group default (ranks 0-1)"."""
    within = f" (inside {call['within']})" if call.get("within") else ""
    return f"{call.get('op')} #{call.get('seq')} on group {call.get('group')}{within}"

