"""wb.launch on 4 local gloo ranks: results in rank order, rank-prefixed output, the failing rank named with its own
traceback, a hung rank told apart from the ranks waiting for it, and the caller's signal handlers given back; ranks
that die before the function runs (its module cannot be imported there, the process group cannot be made) are named
with their own traceback, which their log holds too.

Each launch costs seconds (4 spawned interpreters), so every test checks as much as it can from one launch.
"""

from __future__ import annotations

import importlib
import inspect
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from workbench import LaunchError, launch
from workbench.run import RankFailure


def _hello(delays: list[float]) -> dict:
    import os
    import sys
    import time

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    time.sleep(delays[rank])  # ranks finish out of order; the result must still come back in rank order
    print(f"hello from {rank} of {dist.get_world_size()}", flush=True)
    print(f"a warning from {rank}", file=sys.stderr, flush=True)
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return {"rank": rank, "pid": os.getpid(), "sum": int(total.item()), "env_rank": int(os.environ["RANK"])}


def _raise_on_rank_2() -> None:
    import time

    import torch
    import torch.distributed as dist

    dist.barrier()
    rank = dist.get_rank()
    if rank == 2:
        raise ValueError("rank 2 found a bad batch: 17 tokens where 16 fit")
    if rank == 3:
        time.sleep(120)  # busy outside any collective: only the launcher can stop it
    dist.all_reduce(torch.ones(1))  # ranks 0 and 1 wait for rank 2 here, and lose their peer


def _hang_on_rank_1() -> None:
    import time

    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(120)  # the hang: rank 1 never reaches the barrier
    dist.barrier()


def _hold_the_gil_on_rank_1() -> int:
    import re

    import torch.distributed as dist

    if dist.get_rank() == 1:  # the hang: C code that never gives up the GIL, so no Python thread runs
        re.match(r"(a+)+$", "a" * 40 + "b")
    return dist.get_rank()  # rank 0 is done at once: only a rank's own watchdog can stop rank 1


def _line_of(fn, text: str, occurrence: int = 1) -> int:
    """The file line number of the ``occurrence``-th source line of ``fn`` that contains ``text``."""
    lines, first = inspect.getsourcelines(fn)
    hits = [first + i for i, line in enumerate(lines) if text in line]
    return hits[occurrence - 1]


def _handlers() -> dict:
    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}


@pytest.mark.slow
def test_results_in_rank_order_with_rank_prefixed_output(capfd: pytest.CaptureFixture[str]) -> None:
    def on_term(signum: int, frame: object) -> None:  # a handler of the caller's own, to be given back
        raise AssertionError("SIGTERM reached the caller")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        before = _handlers()
        results = launch(_hello, nprocs=4, args=([0.6, 0.4, 0.2, 0.0],), timeout=60)
        after = _handlers()
    finally:
        signal.signal(signal.SIGTERM, previous)

    assert list(results) == [0, 1, 2, 3]
    assert [r["rank"] for r in results.values()] == [0, 1, 2, 3]
    assert [r["env_rank"] for r in results.values()] == [0, 1, 2, 3]
    assert all(r["sum"] == 1 + 2 + 3 + 4 for r in results.values())  # a real process group of 4
    pids = {r["pid"] for r in results.values()}
    assert len(pids) == 4 and os.getpid() not in pids  # four processes, none of them this one
    assert after == before and after[signal.SIGTERM] is on_term

    out, err = capfd.readouterr()
    for rank in range(4):
        assert f"[rank{rank}]: hello from {rank} of 4" in out.splitlines(), out
        assert f"[rank{rank}]: a warning from {rank}" in err.splitlines(), err


@pytest.mark.slow
def test_a_rank_that_raises_is_named_first_with_its_own_traceback() -> None:
    before = _handlers()
    start = time.perf_counter()
    with pytest.raises(LaunchError) as info:
        launch(_raise_on_rank_2, nprocs=4, timeout=60)
    elapsed = time.perf_counter() - start

    # rank 3 sleeps 120 s outside any collective: the launcher must stop it, not wait for it
    assert elapsed < 60, f"the launch took {elapsed:.1f} s to report a rank that raised at once"
    error = info.value
    first = error.failures[0]
    assert isinstance(first, RankFailure)
    assert first.rank == 2 and not first.timed_out and first.exitcode != 0
    assert "ValueError: rank 2 found a bad batch: 17 tokens where 16 fit" in first.message
    assert "Traceback" in first.message and "_raise_on_rank_2" in first.message
    assert "Connection closed" not in first.message  # the root cause, not a peer's symptom
    assert [f.rank for f in error.failures].count(2) == 1
    text = str(error)
    assert "rank 2 (error)" in text and "rank 2 failed" in text and "17 tokens where 16 fit" in text
    assert error.log_dir in text
    assert _handlers() == before  # given back after a failed launch too


@pytest.mark.slow
def test_a_hung_rank_is_named_stuck_outside_any_collective() -> None:
    before = _handlers()
    start = time.perf_counter()
    with pytest.raises(LaunchError) as info:
        launch(_hang_on_rank_1, nprocs=4, timeout=5)
    elapsed = time.perf_counter() - start

    # about 11 s on an idle 2-core machine (start-up, the 5 s timeout, the stacks); room for a loaded CI box,
    # still far from the 120 s the rank would sleep
    assert elapsed < 45, f"a 5 s timeout took {elapsed:.1f} s to report"
    error = info.value
    by_rank = {f.rank: f for f in error.failures}
    assert error.failures[0].rank == 1, str(error)
    sleep_line, barrier_line = _line_of(_hang_on_rank_1, "time.sleep(120)"), _line_of(_hang_on_rank_1, "barrier()", 2)
    hung = by_rank[1]
    assert hung.timed_out and hung.exitcode == 124
    # the innermost frame of user code: this file, this function, the very line that sleeps
    assert hung.message.splitlines()[0] == (
        f'TimeoutError: rank 1 timed out, stuck outside any collective at File "{__file__}", line {sleep_line}, '
        "in _hang_on_rank_1"
    ), hung.message
    for rank in (0, 2, 3):
        waiting = by_rank[rank]
        assert waiting.timed_out, waiting
        assert waiting.message.splitlines()[0] == (
            f"TimeoutError: rank {rank} timed out, waiting in a collective, called at "
            f'File "{__file__}", line {barrier_line}, in _hang_on_rank_1'
        ), waiting.message
    assert "rank 1 timed out" in str(error)
    assert _handlers() == before


def _stderr_logs(log_dir: str) -> dict[int, str]:
    """Each local rank's stderr.log under the launch's log folder (torch's elastic layout: .../attempt_0/RANK/)."""
    return {int(p.parent.name): p.read_text() for p in Path(log_dir).rglob("stderr.log")}


@pytest.mark.slow
def test_a_function_whose_module_the_ranks_cannot_import_is_named_with_the_import_error(tmp_path: Path) -> None:
    # a module this process imports from a folder the ranks do not have on their path: the function travels by
    # reference, so each rank dies unpickling it, before the function runs
    name = f"wb_only_here_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("def work():\n    return 42\n")
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))
    try:
        with pytest.raises(LaunchError) as info:
            launch(module.work, nprocs=2, timeout=60)
    finally:
        sys.modules.pop(name, None)

    error = info.value
    assert sorted(f.rank for f in error.failures) == [0, 1], str(error)
    for failure in error.failures:
        lines = failure.message.splitlines()
        assert lines[0] == f"ModuleNotFoundError: No module named '{name}'", failure.message
        assert lines[1] == f"(before running {name}.work, while loading it in the rank (unpickling imports its module))"
        assert "register_pickle_by_value" in failure.message  # what to do about it
        assert "Traceback (most recent call last)" in failure.message and "cloudpickle.loads" in failure.message
        assert not failure.timed_out and failure.exitcode == 1
    text = str(error)
    # both ranks fail the same way at once: the first failure is listed first, in either order
    head = text.splitlines()[0]
    assert head.endswith(("rank 0 (error), rank 1 (error)", "rank 1 (error), rank 0 (error)")), head
    assert f"No module named '{name}'" in text
    logs = _stderr_logs(error.log_dir)  # the rank's own log holds its traceback (it was empty)
    assert sorted(logs) == [0, 1]
    for rank, log in logs.items():
        assert f"rank {rank} failed before running {name}.work" in log, log
        assert f"ModuleNotFoundError: No module named '{name}'" in log and "Traceback" in log


@pytest.mark.slow
def test_a_rank_that_cannot_join_the_process_group_is_named_with_its_traceback() -> None:
    # gloo asked to use a network interface that does not exist: init_process_group raises in every rank
    nic = "wbnosuchnic0"
    with pytest.raises(LaunchError) as info:
        launch(_hello, nprocs=2, args=([0.0, 0.0],), timeout=60, env={"GLOO_SOCKET_IFNAME": nic})

    error = info.value
    assert sorted(f.rank for f in error.failures) == [0, 1], str(error)
    for failure in error.failures:
        lines = failure.message.splitlines()
        assert lines[0].startswith("RuntimeError: ") and f"Unable to find address for: {nic}" in lines[0], lines
        assert lines[1] == f"(before running {__name__}._hello, while initializing the 'gloo' process group)", lines
        assert "init_process_group" in failure.message and "Traceback" in failure.message
    logs = _stderr_logs(error.log_dir)
    assert all(f"Unable to find address for: {nic}" in log for log in logs.values()) and sorted(logs) == [0, 1]
    assert "GLOO_SOCKET_IFNAME" not in os.environ or os.environ["GLOO_SOCKET_IFNAME"] != nic  # given back


@pytest.mark.slow
def test_a_rank_that_crashes_before_the_function_runs_shows_its_stack_from_its_log(tmp_path: Path) -> None:
    # rank 1 dies in native code (SIGSEGV) while importing the function's module: no Python exception, no record;
    # the error shows the signal and the rank's own stack, which faulthandler wrote into its stderr log
    name = f"wb_crashes_on_import_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == os.environ.get('WB_TEST_CRASH_RANK', '-'):\n"
        "    import ctypes\n"
        "    ctypes.string_at(0)  # a read of address 0\n"
        "def work():\n"
        "    return 1\n"
    )
    sys.path.insert(0, str(tmp_path))  # the ranks import it too (spawn hands them this path)
    try:
        module = importlib.import_module(name)
        with pytest.raises(LaunchError) as info:
            launch(module.work, nprocs=2, timeout=60, env={"WB_TEST_CRASH_RANK": "1"})
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)

    error = info.value
    first = error.failures[0]
    assert first.rank == 1 and first.exitcode == -signal.SIGSEGV, str(error)
    assert first.message.startswith("killed by signal SIGSEGV; the end of its stderr log:\n"), first.message
    assert "Segmentation fault" in first.message
    assert f'File "{tmp_path / name}.py", line 4 in <module>' in first.message  # the crashing line of the module


@pytest.mark.slow
def test_a_rank_that_holds_the_gil_past_the_timeout_is_stopped_and_named() -> None:
    # the Python watchdog is a thread: it cannot run while rank 1's regex holds the GIL, and the old launch waited
    # forever. The C backstop (faulthandler) dumps rank 1's stack into its log and exits it 10 s after the timeout.
    start = time.perf_counter()
    with pytest.raises(LaunchError) as info:
        launch(_hold_the_gil_on_rank_1, nprocs=2, timeout=2)
    elapsed = time.perf_counter() - start
    assert elapsed < 60, f"a 2 s timeout took {elapsed:.1f} s to report"
    (failure,) = info.value.failures
    assert failure.rank == 1, str(info.value)
    line = _line_of(_hold_the_gil_on_rank_1, "re.match(")
    assert "Timeout (0:00:12)!" in failure.message, failure.message
    assert f'File "{__file__}", line {line} in _hold_the_gil_on_rank_1' in failure.message, failure.message


def _listeners_of_this_rank_and_its_agent() -> dict:
    import os

    import torch.distributed as dist

    from tests.listening import listening

    dist.barrier()  # every rank's process group is up (gloo's listeners too)
    found = {"rank": listening([os.getpid()]), "agent": listening([os.getppid()])}  # the agent: the launching process
    dist.barrier()
    return found


@pytest.mark.slow
def test_a_local_launch_hosts_no_store_and_its_ranks_listen_on_loopback_only() -> None:
    # torch's agent alone hosts two stores on every interface ('::'), where anyone could read and write the process
    # groups' set-up and make the agent unpickle what they wrote; on 127.0.0.1 every user of the host still could
    from tests.listening import LOOPBACK, listening

    results = launch(_listeners_of_this_rank_and_its_agent, nprocs=2, timeout=60)
    for rank, found in results.items():
        assert found["agent"] == [], f"rank {rank}'s agent listens on {found['agent']}: a store on a socket"
        assert found["rank"], f"rank {rank}: no listening socket seen (gloo's at least must be)"
        assert {host for host, _ in found["rank"]} <= LOOPBACK, f"rank {rank} listens on {found['rank']}"
    assert listening([os.getpid()]) == [], "the launch left a socket listening in the caller"


def _store_variables_seen() -> dict:
    import os

    import torch
    import torch.distributed as dist

    total = torch.ones(1)
    dist.all_reduce(total)
    names = ("WORKBENCH_STORE", "GLOO_SOCKET_IFNAME", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    return {"sum": float(total), **{n: os.environ.get(n) for n in names}}


@pytest.mark.slow
def test_a_launch_given_its_own_endpoint_ignores_the_store_of_the_ranks_it_runs_in(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a kernel's rank has its kernel's store in its environment: a wb.launch(rdzv_endpoint=...) from a cell must
    # meet through its own endpoint (here the kernel's store is gone: joining it hung until killed)
    from workbench.run.launcher import _free_port
    from workbench.run.private_store import PrivateStore

    with PrivateStore() as kernels:
        inherited = kernels.agent_environment({})
    for name, value in inherited.items():
        monkeypatch.setenv(name, value)
    start = time.perf_counter()
    results = launch(_store_variables_seen, nprocs=2, timeout=60, rdzv_endpoint=f"127.0.0.1:{_free_port()}")
    assert time.perf_counter() - start < 45
    assert all(r == {"sum": 2.0, "WORKBENCH_STORE": None, "GLOO_SOCKET_IFNAME": None,
                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": None} for r in results.values()), results
    assert {n: os.environ.get(n) for n in inherited} == inherited  # the caller's environment given back


@pytest.mark.slow
def test_a_script_that_launches_outside_a_main_guard_is_told_to_add_one(tmp_path: Path) -> None:
    # spawn imports the script again in every rank, which then calls launch itself: the rank used to exit with code 1
    # and an empty log ("no error recorded"); the LaunchError now names the script and the fix
    import subprocess

    script = tmp_path / "unguarded.py"
    script.write_text("import workbench as wb\n\ndef work():\n    return 1\n\ntry:\n    wb.launch(work, nprocs=3, "
                      "timeout=60)\nexcept wb.LaunchError as e:\n    print('RANKS', sorted(f.rank for f in e.failures))\n"
                      "    raise\n")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert done.returncode != 0
    assert "LaunchError" in done.stderr, done.stderr[-3000:]
    assert f"{script} calls wb.launch when it is imported" in done.stderr, done.stderr[-3000:]
    assert 'if __name__ == "__main__":' in done.stderr
    assert "no error recorded" not in done.stderr  # every rank refused says so, under its own rank
    ranks = [line for line in done.stdout.splitlines() if line.startswith("RANKS")]
    assert ranks and eval(ranks[0][6:]) == sorted(set(eval(ranks[0][6:]))), done.stdout


def test_a_launch_that_fails_before_starting_leaves_no_store_or_log_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the private store's folder holds the rendezvous files: one left behind by a launch that never started is litter
    # in /tmp at best; its log folder likewise
    import tempfile

    import torch.distributed.launcher.api as api

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def refuse(**kwargs: object) -> None:
        raise RuntimeError("no launch today")

    monkeypatch.setattr(api, "LaunchConfig", refuse)
    with pytest.raises(RuntimeError, match="no launch today"):
        launch(_hello, nprocs=2, args=([0.0] * 2,))
    assert list(tmp_path.iterdir()) == []


def test_a_script_read_from_stdin_is_told_to_be_saved_to_a_file(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # ``python - < script.py``: spawn runs '<stdin>' again in every rank, and each rank died with an empty log.
    # Scripts spawn can run again are not refused: one imported by name (``python -m``, a zip app), one whose
    # relative path holds from the directory the process started in, one with no file (a notebook)
    from multiprocessing import process

    from workbench.run.launcher import _refuse_a_script_spawn_cannot_import

    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__spec__", None, raising=False)
    monkeypatch.setattr(main, "__file__", "<stdin>", raising=False)
    with pytest.raises(ValueError, match=r"came from '<stdin>', not from a file it can run: save the script"):
        launch(_hello, nprocs=2, args=([0.0] * 2,))
    (tmp_path / "script.py").write_text("")
    monkeypatch.setattr(process, "ORIGINAL_DIR", str(tmp_path))
    monkeypatch.setattr(main, "__file__", "script.py")  # relative, and the process has changed directory since
    _refuse_a_script_spawn_cannot_import()
    monkeypatch.setattr(main, "__file__", "app.pyz/__main__.py")
    monkeypatch.setattr(main, "__spec__", type("Spec", (), {"name": "__main__"})())  # a zip app: run by name
    _refuse_a_script_spawn_cannot_import()
    monkeypatch.delattr(main, "__file__")
    monkeypatch.setattr(main, "__spec__", None)
    _refuse_a_script_spawn_cannot_import()
