"""Launch SPMD functions on local ranks from a notebook or a script, on torch's elastic launcher.

``wb.launch(fn, nprocs=4)`` starts ``nprocs`` processes (spawn, never fork: safe after CUDA or threads),
initializes the default process group in each, runs ``fn(*args)`` and returns ``{rank: result}``.

* Functions defined in a notebook cell work: ``fn`` travels by value (cloudpickle), not by import path.
* Output comes back prefixed with the rank (``[rank3]: ...``), in the notebook cell too.
* A rank that raises stops the others at once (no collective hang); ``LaunchError`` names the rank and
  carries its traceback. So does a rank that fails before ``fn`` runs (its module cannot be imported in the
  rank, the pickled function cannot be loaded, the process group cannot be initialized): its bootstrap names
  the step that failed and writes the traceback into the rank's log too.
* ``timeout``: a watchdog in every rank prints all of that rank's Python stacks and stops it; the error names
  each rank with the frame it was stuck in, so a rank blocked in user code stands out from ranks waiting for it
  in a collective. A rank that outlives its own watchdogs is stopped by the launching process.
* A rank whose process ends with code 0 without returning a result (``os._exit(0)``, ``sys.exit(0)``) is a failure
  too: torch's agent alone waited for its result forever.
* A result that does not pickle (a lock; an instance of a class a notebook cell defined) fails its rank with an error
  naming the result's type and the pickling error: torch pickled it after the rank's log closed, and said nothing.
* Multi-node: pass ``nnodes``, ``node_rank`` and ``rdzv_endpoint`` like torchrun.
"""

from __future__ import annotations

import contextlib
import operator
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, NoReturn

from workbench.run.private_store import PrivateStore, connect_store, inherited_variables, store_path
from workbench.run.rank_watch import RankWatch, mark

__all__ = ["LaunchError", "RankFailure", "launch"]

_TIMEOUT_EXIT = 124
_NATIVE_GRACE = 10.0  # seconds after the timeout before the C backstop exits a rank the Python watchdog could not
_WATCH_MARGIN = 15.0  # seconds after the C backstop before the launching process stops a rank that outlived both
_NO_RESULT_EXIT = 1  # the exit code of a rank that called sys.exit(0): one torch's agent counts as a failure
_RECORDS_ENV = "WORKBENCH_LAUNCH_DIR"
# errors a rank gets because a peer died: reported after the root cause
_PEER_FAILURE = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
    "ProcessGroupNCCL is aborted", "Socket Timeout",
)


@dataclass(frozen=True, slots=True)
class RankFailure:
    """How one rank ended badly: its exit code and the error or stacks it reported."""

    rank: int
    exitcode: int
    message: str
    timed_out: bool

    def __str__(self) -> str:
        what = "timed out" if self.timed_out else f"failed (exit code {self.exitcode})"
        return f"rank {self.rank} {what}:\n{self.message.rstrip()}"


class LaunchError(RuntimeError):
    """One or more ranks failed or timed out; ``failures`` holds each rank's story (first failure first)."""

    def __init__(self, failures: Sequence[RankFailure], log_dir: str) -> None:
        self.failures = tuple(failures)
        self.log_dir = log_dir
        first = self.failures[0] if self.failures else None
        head = (
            f"{len(self.failures)} rank(s) did not finish: "
            + ", ".join(f"rank {f.rank} ({'timed out' if f.timed_out else 'error'})" for f in self.failures)
        )
        super().__init__(head + (f"\n\n{first}" if first else "") + f"\n(logs: {log_dir})")


def launch(
    fn: Callable[..., Any],
    *,
    nprocs: int,
    backend: str = "gloo",
    args: Sequence[Any] = (),
    timeout: float | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    env: dict[str, str] | None = None,
) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nprocs`` local ranks (times ``nnodes``) and return ``{global rank: result}``.

    Every rank has the default process group initialized with ``backend`` ("gloo" on CPU, "nccl" on GPU,
    each rank on ``cuda:local_rank``) before ``fn`` runs, and destroyed after.

    Raises:
        LaunchError: a rank raised, hung, or exited without returning a result; names the rank(s), with the
            traceback or stacks. Its ``log_dir`` (the ranks' logs) is kept; a launch that ends any other way removes it.
        TypeError: ``nprocs`` is not an int (``2.0``, ``True``).
        KeyboardInterrupt: a SIGINT (a notebook's stop button) during the launch, after the ranks were stopped.
    """
    import cloudpickle
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    nprocs = _whole("nprocs", nprocs, "the number of ranks on this host", 1)
    nnodes = _whole("nnodes", nnodes, "the number of hosts", 1)
    node_rank = _whole("node_rank", node_rank, "this host's index among them", 0)
    if node_rank >= nnodes:
        raise ValueError(f"launch: node_rank must be below nnodes ({nnodes}), got {node_rank}")
    _refuse_in_a_rank_importing_main(_name_of(fn))
    _refuse_a_script_spawn_cannot_import()
    payload = cloudpickle.dumps((fn, tuple(args)))
    # ranks of this host meet through files only this user can open (the agent's own stores would listen on
    # every interface, and unpickle what anyone writes there)
    store = PrivateStore() if nnodes == 1 and rdzv_endpoint is None else None
    log_dir = tempfile.mkdtemp(prefix="workbench-launch-")
    try:  # nothing made here outlives a failure before the launch (the store's folder holds a live rendezvous)
        config = LaunchConfig(
            min_nodes=nnodes,
            max_nodes=nnodes,
            nproc_per_node=nprocs,
            run_id=f"workbench-{uuid.uuid4().hex[:8]}",
            rdzv_backend="c10d",
            rdzv_endpoint=store.rendezvous if store else rdzv_endpoint or f"127.0.0.1:{_free_port()}",
            rdzv_configs=store.agent_rendezvous() if store else {"rank": node_rank} if nnodes > 1 else {},
            max_restarts=0,
            monitor_interval=0.1,
            start_method="spawn",
            log_line_prefix_template="[rank${rank}]: ",
            logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL, tee=Std.ALL),
        )
        saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        extra = {**(env or {}), _RECORDS_ENV: log_dir}
        if store:
            extra = {**store.agent_environment({**os.environ, **extra}), **extra}
        # no store hosted here: nothing of one hosted for this process's own ranks (a kernel's) reaches these
        dropped = [] if store else [n for n in inherited_variables() if n not in extra]
    except BaseException:
        if store:
            store.close()
        shutil.rmtree(log_dir, ignore_errors=True)
        raise
    old_env = {k: os.environ.get(k) for k in [*extra, *dropped]}
    os.environ.update(extra)
    for name in dropped:
        del os.environ[name]
    import logging

    # torch's elastic agent logs the first process it sees die, often a peer of the real culprit; our
    # LaunchError names the right rank, so keep its logs to ERROR+ tracebacks out of the way
    quiet = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    # torch's agent waits for every rank's result and sees only non-zero exits: the watch stops it when a rank ended
    # without a result, or outlived its watchdogs
    watch = RankWatch(log_dir, None if timeout is None else timeout + _NATIVE_GRACE + _WATCH_MARGIN)
    keep_logs = False  # only a LaunchError, which points at them
    try:
        results = watch.run(lambda: elastic_launch(config, _worker)(payload, backend, timeout, _name_of(fn)))
        if watch.stopped is not None:
            watch.reap()
            failures = _failures({}, log_dir, _watched(watch, log_dir, nprocs, timeout, _name_of(fn)))
            keep_logs = True
            raise LaunchError(failures, log_dir)
    except ChildFailedError as exc:
        failures = _failures(exc.failures, log_dir, _watched(watch, log_dir, nprocs, timeout, _name_of(fn)))
        keep_logs = True
        raise LaunchError(failures, log_dir) from None
    except SignalException as exc:  # the agent's handler turned a SIGINT (a notebook's stop button) into its own
        if exc.sigval != signal.SIGINT:  # exception, after it stopped the ranks: raise what Python raises for one
            raise
        raise KeyboardInterrupt from None
    finally:
        watch.reap()
        for q, level in zip(quiet, levels):
            q.setLevel(level)
        for s, handler in saved.items():  # the elastic agent installs its own handlers; give ours back
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(s, handler)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if store:
            store.close()
        _flush()
        if not keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
    return dict(sorted(results.items()))


def _refuse_a_script_spawn_cannot_import() -> None:
    """Raise where spawn would run the launching script again from a path that is no file: ``python - <
    script.py`` gives ``__file__ = "<stdin>"``, and every rank died with an empty log. Spawn's own rule
    (``multiprocessing.spawn.get_preparation_data``): a ``__main__`` with a module name (``python -m``, a zip app)
    is imported by that name, one with a ``__file__`` runs from that path (a relative one from the directory the
    process started in), and one with neither (a notebook, ``python -c``) is not run again."""
    from multiprocessing import process

    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return
    path = getattr(main, "__file__", None)
    if path is None:
        return
    if not os.path.isabs(path) and process.ORIGINAL_DIR is not None:
        path = os.path.join(process.ORIGINAL_DIR, path)
    if not os.path.exists(path):
        raise ValueError(
            f"wb.launch starts its ranks with spawn, which runs the launching script again in every rank, but this "
            f"one came from {getattr(main, '__file__', None)!r}, not from a file it can run: save the script to a "
            f"file and run that file"
        )


def _refuse_in_a_rank_importing_main(name: str) -> None:
    """Raise, and record for the launching process, when this process is a rank that spawn is still starting and
    ``launch`` runs because spawn imports the caller's script again in every rank: a script that launches at its top
    level, outside ``if __name__ == "__main__":``. Left alone the rank exited with code 1 and an empty log."""
    import multiprocessing

    if _RECORDS_ENV not in os.environ or not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    script = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the main module"
    step = f"importing {script}, which spawn runs again in every rank"
    message = f"{script} calls wb.launch when it is imported, so every rank it starts launches again"
    hint = ('\n(put the launch under `if __name__ == "__main__":`, as for any spawned process; a notebook cell '
            "needs nothing)")
    # torch sets a rank's RANK only after spawn has imported the script: the record names this process, and the
    # launching process gives it the rank torch knows that process by
    _write_record(None, {"kind": "bootstrap", "step": step, "name": name, "message": f"RuntimeError: {message}",
                         "hint": hint, "traceback": "".join(traceback.format_stack())})
    print(f"a rank (pid {os.getpid()}) failed before running {name}, while {step}:\nRuntimeError: {message}{hint}",
          file=sys.stderr, flush=True)
    raise RuntimeError(f"{message}{hint}")


def _worker(payload: bytes, backend: str, timeout: float | None, name: str = "the function") -> Any:
    """Entry point of every rank (module level, so spawn can import it)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    mark(os.environ.get(_RECORDS_ENV), int(os.environ.get("RANK", "0")), "started")
    return record(_run)(payload, backend, timeout, name)


def _run(payload: bytes, backend: str, timeout: float | None, name: str = "the function") -> Any:
    """Run the function; mark the rank as returned, or make sys.exit(0) a failure (torch's ``record`` would turn it
    into a None result)."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = _call(payload, backend, timeout, name, rank)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
        _exit_without_result(rank, name, exc)
    _refuse_a_result_that_does_not_pickle(rank, name, result)
    mark(os.environ.get(_RECORDS_ENV), rank, "returned")
    return result


def _refuse_a_result_that_does_not_pickle(rank: int, name: str, result: Any) -> None:
    """Pickle the result as torch's agent will, while the rank's log is still open: torch pickles it after its
    redirect ends, so a result that does not pickle (a lock, an instance of a class a notebook defined) left the rank
    with exit code 1, no record and an empty log. Record and raise what failed instead."""
    try:
        _ProbePickler(_Discard()).dump(result)
    except Exception as exc:
        kind = type(result)
        what = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        cause = f"{type(exc).__name__}: {exc}"
        message = (f"rank {rank} returned a {what} from {name}, which cannot be sent back to the launching process "
                   f"(results travel by pickle): {cause}")
        notebook = "__main__" in f"{what} {exc}" or "__mp_main__" in f"{what} {exc}"
        plain = "return plain types (dicts, lists, numbers, strings, tensors)"
        hint = (f"\n(a class defined in a notebook or in the launching script (its __main__) reaches the ranks by "
                f"value, inside the function, and its instances cannot be pickled back by its name: {plain}, or "
                f"define the class in an importable module)" if notebook else f"\n({plain})")
        text = traceback.format_exc()
        _write_record(rank, {"kind": "error", "message": f"{message}{hint}", "traceback": text})
        print(f"{message}{hint}\n{text.rstrip()}", file=sys.stderr, flush=True)
        raise TypeError(f"{message}{hint}") from exc


def _whole(name: str, value: Any, what: str, least: int) -> int:
    """``value`` as an int of at least ``least``, or an error naming the argument (a bool or a float is no count)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"launch: {name} must be an int ({what}), got {value!r} ({type(value).__name__})")
    value = operator.index(value)
    if value < least:
        raise ValueError(f"launch: {name} must be >= {least}, got {value}")
    return value


class _Discard:
    """A file that keeps nothing: the probe pickles a result only to see that it can."""

    def write(self, data: Any) -> int:
        return len(data)


class _ProbePickler(ForkingPickler):
    """Pickles as torch's agent does (multiprocessing's pickler), but takes tensors, storages and CUDA events as
    they are: pickling those shares them with the receiving process (shared memory, a CUDA IPC reference the receiver
    must release), so the probe leaves them to the one real pickling."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._shared = _shared_by_torch()

    def reducer_override(self, obj: Any) -> Any:  # not called for plain ints, strs, lists, dicts: cheap
        if not isinstance(obj, self._shared):
            return NotImplemented
        if getattr(obj, "requires_grad", False) and not getattr(obj, "is_leaf", True):  # what torch's reducer refuses
            raise RuntimeError("a tensor that requires grad and is not a leaf (the output of an operation on "
                               "parameters) cannot cross processes; return it .detach()ed")
        return (int, ())


def _shared_by_torch() -> tuple[type, ...]:
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    kinds: list[type] = [torch.Tensor, torch.UntypedStorage, torch.storage.TypedStorage]
    with contextlib.suppress(AttributeError):
        kinds.append(torch.cuda.Event)
    return tuple(kinds)


def _exit_without_result(rank: int, name: str, exc: SystemExit) -> NoReturn:
    """Record a rank that called ``sys.exit(0)`` as one that exited without a result, and exit with a failing code."""
    call = "sys.exit()" if exc.code is None else f"sys.exit({exc.code!r})"
    message = f"rank {rank} (pid {os.getpid()}) exited with code 0 without returning a result: {name} called {call}"
    text = "".join(traceback.format_exception(exc))
    _write_record(rank, {"kind": "exit", "exitcode": 0, "message": message, "traceback": text})
    print(f"{message}\n{text.rstrip()}", file=sys.stderr, flush=True)
    raise SystemExit(_NO_RESULT_EXIT) from None


def _call(payload: bytes, backend: str, timeout: float | None, name: str, rank: int) -> Any:
    fn, args = _bootstrap(payload, backend, rank, name)
    import torch.distributed as dist

    mark(os.environ.get(_RECORDS_ENV), rank, "running")
    stop = threading.Event()
    if timeout is not None:  # started after the rendezvous, so every rank's clock starts together
        threading.Thread(target=_watchdog, args=(rank, timeout, stop), daemon=True).start()
        _arm_native_watchdog(timeout + _NATIVE_GRACE)
    try:
        return fn(*args)
    except BaseException as exc:
        _write_record(rank, {"kind": "error", "message": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()})
        raise
    finally:
        stop.set()
        if timeout is not None:
            _disarm_native_watchdog()
        _flush()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        from workbench.run.torch_comm import forget_groups

        forget_groups()


def _bootstrap(payload: bytes, backend: str, rank: int, name: str) -> tuple[Callable[..., Any], tuple]:
    """Load the function and join the process group. Whatever fails here (an import inside the unpickling, a bad
    device, ``init_process_group``) is recorded with the step and its traceback, and printed to the rank's stderr
    (its log), before the rank exits; a crash in native code prints the rank's Python stack there too."""
    import faulthandler

    with contextlib.suppress(Exception):  # stderr may be a stream without a file descriptor
        faulthandler.enable()
    step = "loading it in the rank (unpickling imports its module)"
    try:
        import cloudpickle
        import torch
        import torch.distributed as dist

        fn, args = cloudpickle.loads(payload)
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            step = f"selecting its GPU (cuda:{local})"
            torch.cuda.set_device(local)
        step = f"initializing the {backend!r} process group"
        path = store_path()
        if path is None:  # ranks of several hosts: torch's agent set MASTER_ADDR/MASTER_PORT
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=connect_store(path), rank=rank,
                                    world_size=int(os.environ["WORLD_SIZE"]))
    except BaseException as exc:
        text = traceback.format_exc()
        cause = f"{type(exc).__name__}: {exc}"
        hint = _HINT if isinstance(exc, ImportError) and step.startswith("loading") else ""
        _write_record(rank, {"kind": "bootstrap", "step": step, "name": name, "message": cause,
                             "hint": hint, "traceback": text})
        print(f"rank {rank} failed before running {name}, while {step}:\n{text.rstrip()}{hint}", file=sys.stderr,
              flush=True)
        raise
    return fn, args


_HINT = (
    "\n(a function from an importable module travels by reference: every rank imports its module, so the module "
    "must be importable there too, e.g. on PYTHONPATH; or send it by value with "
    "cloudpickle.register_pickle_by_value(module))"
)


def _name_of(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{qualname}" if module and module not in ("__main__", "__mp_main__") else qualname


def _arm_native_watchdog(seconds: float) -> None:
    """The watchdog's backstop, in C: a rank whose main thread never gives up the GIL (a long regex, a C extension's
    loop) keeps the Python watchdog from running, so ``faulthandler`` dumps every thread's stack into the rank's log
    and exits the rank ``seconds`` after the start (the launcher then reports it with the end of that log)."""
    import faulthandler

    with contextlib.suppress(Exception):  # stderr may be a stream without a file descriptor
        faulthandler.dump_traceback_later(seconds, exit=True)


def _disarm_native_watchdog() -> None:
    import faulthandler

    with contextlib.suppress(Exception):
        faulthandler.cancel_dump_traceback_later()


def _watchdog(rank: int, timeout: float, stop: threading.Event) -> None:
    if stop.wait(timeout):
        return
    frames = sys._current_frames()
    main = threading.main_thread().ident
    lines = [f"[watchdog] rank {rank}: no result after {timeout:g} s; Python stacks (main thread first):"]
    for ident in sorted(frames, key=lambda i: i != main):
        name = next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))
        lines.append(f"--- thread {name}")
        lines.extend(line.rstrip() for line in traceback.format_stack(frames[ident]))
    report = "\n".join(lines)
    print(report, file=sys.stderr, flush=True)
    stack = traceback.format_stack(frames[main]) if main in frames else []
    waiting = bool(stack) and "/torch/distributed/" in stack[-1]  # innermost Python frame inside a collective
    _write_record(rank, {"kind": "timeout", "waiting_in_collective": waiting, "where": _innermost_user_frame(stack),
                         "traceback": report})
    _flush()
    time.sleep(1.0)  # let every rank's watchdog record its stack before the launcher tears the group down
    os._exit(_TIMEOUT_EXIT)


def _write_record(rank: int | None, record: dict[str, Any]) -> None:
    """Record how this rank failed for the launching process; ``rank`` None: a process that does not know its rank
    yet, recorded by its pid."""
    directory = os.environ.get(_RECORDS_ENV)
    if not directory:
        return
    import json

    with contextlib.suppress(OSError):
        name = f"failure-rank{rank}.json" if rank is not None else f"failure-pid{os.getpid()}.json"
        (Path(directory) / name).write_text(json.dumps({"rank": rank, "pid": os.getpid(), "time": time.time(),
                                                        **record}))


def _innermost_user_frame(stack: Sequence[str]) -> str:
    skip = ("/torch/", "/workbench/run/launcher.py", "/threading.py")
    for entry in reversed(stack):
        if not any(s in entry for s in skip):
            return entry.strip().splitlines()[0]
    return stack[-1].strip().splitlines()[0] if stack else "an unknown place"


def _watched(watch: RankWatch, log_dir: str, nprocs: int, timeout: float | None, name: str) -> list[RankFailure]:
    """The ranks the watch found: ended with code 0 and no result, or (when it stopped the launch) still running past
    their deadline."""
    found = [_silent_failure(rank, pid, log_dir, nprocs) for rank, pid in watch.silent()]
    for rank, pid, ran in watch.stopped.overdue if watch.stopped else ():
        tail = _log_tail(log_dir, rank % nprocs)
        code = watch.exit_code(pid)
        message = (f"TimeoutError: rank {rank} (pid {pid}) had no result {ran:.0f} s after it started running {name} "
                   f"(timeout {timeout:g} s), and its own watchdogs did not stop it: the launching process did"
                   + (f"; the end of its stderr log:\n{tail}" if tail else "; its stderr log is empty"))
        found.append(RankFailure(rank, _TIMEOUT_EXIT if code is None else code, message, True))
    return found


def _silent_failure(rank: int, pid: int, log_dir: str, nprocs: int) -> RankFailure:
    tail = _log_tail(log_dir, rank % nprocs)
    message = (f"rank {rank} (pid {pid}) exited with code 0 without returning a result"
               + (f"; the end of its stderr log:\n{tail}" if tail else "; its stderr log is empty"))
    return RankFailure(rank, 0, message, False)


def _failures(crashes: Mapping[Any, Any], log_dir: str, watched: Sequence[RankFailure] = ()) -> list[RankFailure]:
    """Every rank's story, root cause first: the ranks the watch found; the errors ranks recorded and the ranks that
    hung outside a collective, earliest first; ranks that crashed without a record (a signal, a native abort,
    ``os._exit``); ranks that timed out waiting in a collective; last, errors that are a symptom of a peer's death
    (its connection closed). ``crashes``: torch's failures by rank (exit code, pid, time)."""
    import json

    records = {}
    for path in Path(log_dir).glob("failure-rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            records[int(record["rank"])] = record
    by_pid = {}
    for path in Path(log_dir).glob("failure-pid*.json"):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            by_pid[int(record["pid"])] = record
    for rank, failure in crashes.items():  # a process that failed before it knew its rank: torch knows it
        record = by_pid.get(int(getattr(failure, "pid", -1)))
        if int(rank) not in records and record is not None:
            records[int(rank)] = {**record, "rank": int(rank)}
    exit_codes = {int(rank): int(f.exitcode) for rank, f in crashes.items()}
    seen = {f.rank for f in watched}
    out = [(-1, 0.0, f) for f in watched]
    for rank, record in records.items():
        if rank in seen:
            continue
        if record["kind"] == "timeout":
            where = record["where"]
            state = f"waiting in a collective, called at {where}" if record["waiting_in_collective"] else (
                f"stuck outside any collective at {where}")
            message = f"TimeoutError: rank {rank} timed out, {state}\n{record['traceback']}"
            out.append((0 if not record["waiting_in_collective"] else 2, record["time"],
                        RankFailure(rank, exit_codes.get(rank, _TIMEOUT_EXIT), message, True)))
        else:
            message = f"{record['message']}\n{record['traceback']}"
            if record["kind"] == "bootstrap":  # it never reached the function: say where it stopped
                message = (f"{record['message']}\n(before running {record['name']}, while {record['step']})"
                           f"{record.get('hint', '')}\n{record['traceback']}")
            secondary = any(s in record["message"] for s in _PEER_FAILURE)  # a symptom of another rank's death
            code = record.get("exitcode", exit_codes.get(rank, 1))
            out.append((3 if secondary else 0, record["time"], RankFailure(rank, code, message, False)))
    # crashes that left no record (a signal, os._exit): a root cause, named before the peers that lost their
    # connection to it; after the errors ranks recorded, whose time is exact (torch counts a crash in whole seconds,
    # once it noticed), and of which a native abort in a peer may be the consequence
    for rank, failure in crashes.items():
        if int(rank) not in records and int(rank) not in seen:
            out.append((1, failure.timestamp, RankFailure(int(rank), int(failure.exitcode), _crash(failure, log_dir),
                                                           False)))
    return [f for _, _, f in sorted(out, key=lambda item: (item[0], item[1]))]


def _crash(failure: Any, log_dir: str) -> str:
    """What is known of a rank that left no record: its signal or exit code and the end of its stderr log (where a
    native crash's Python stack lands, and anything it printed before it exited)."""
    code = int(failure.exitcode)
    what = f"exit code {code}, no error recorded (a crash or os._exit)"
    if code < 0:
        with contextlib.suppress(ValueError):
            what = f"killed by signal {signal.Signals(-code).name}"
    tail = _log_tail(log_dir, getattr(failure, "local_rank", None))
    return f"{what}; the end of its stderr log:\n{tail}" if tail else f"{what}; its stderr log is empty"


def _log_tail(log_dir: str, local_rank: int | None, limit: int = 40) -> str:
    """The last ``limit`` lines of the rank's stderr log (torch's layout: ``RUN/attempt_N/LOCAL_RANK/stderr.log``)."""
    if local_rank is None:
        return ""
    logs = sorted(Path(log_dir).glob(f"*/attempt_*/{int(local_rank)}/stderr.log"), key=lambda p: p.parent.parent.name)
    try:
        text = logs[-1].read_text(errors="replace") if logs else ""
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-limit:])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
