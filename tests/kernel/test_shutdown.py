"""A kernel's shutdown, as JupyterLab's Shut Down / Restart asks for it through jupyter_client, leaves nothing behind.

jupyter_client sends shutdown_request, SIGTERMs the kernel 2.5 s later and SIGKILLs it 2.5 s after that; the ranks'
agent runs in a session of its own, so neither signal reaches it. Whatever the kernel does not end itself (the agent,
its ranks, the private store folder, the ranks' folder) outlives it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.support import execute, jupyter_path
from workbench.kernel.spec import install_kernel

pytestmark = pytest.mark.slow

WHO = ("import os\n"
       "print(os.getpid(), os.getppid(), flush=True)\n"  # the rank and its parent, torch's agent
       "print(os.environ['WORKBENCH_KERNEL_RUN_DIR'], os.path.dirname(os.environ['WORKBENCH_STORE']), flush=True)")
HOLD_THE_GIL_FOR_A_MINUTE = ("import ctypes, time\nprint('holding', flush=True)\ntime.sleep(0.5)\n"
                             "ctypes.PyDLL(None).sleep(60)")  # a C call that keeps the GIL: no signal handler runs


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[tuple[Any, Any, list[int], Path, Path]]:
    """A 2-rank kernel, the pids of its ranks and agent, its ranks' folder and its private store folder."""
    from jupyter_client.manager import start_new_kernel

    install_kernel(nprocs=2, backend="gloo", name="wb-test-shutdown", prefix=str(tmp_path))
    with jupyter_path(tmp_path):
        manager, client = start_new_kernel(kernel_name="wb-test-shutdown", startup_timeout=120)
    pids: list[int] = []
    try:
        out = execute(client, WHO)
        assert out.reply["status"] == "ok", out.error_text
        lines = [line.rsplit("] ", 1)[-1].split() for line in out.streams["stdout"].splitlines()]
        pids = sorted({int(word) for line in lines for word in line if word.isdigit()})  # both ranks, their agent
        # the folders as printed, not the cell's repr: a long temporary folder wraps a tuple's repr over lines
        run_dir, store = (Path(p) for p in next(line for line in lines if not line[0].isdigit()))
        assert len(pids) == 3 and run_dir.is_dir() and store.is_dir()
        yield manager, client, pids, run_dir, store
    finally:
        client.stop_channels()
        if manager.has_kernel:
            manager.shutdown_kernel(now=True)
        for pid in pids:  # whatever a failed test left running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _running(pids: list[int], within: float = 1.0) -> list[int]:
    """Those of ``pids`` still running (not ended, nor a zombie) after up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        alive = [pid for pid in pids if _runs(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _runs(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_a_shutdown_while_a_rank_holds_the_gil_leaves_no_process_and_no_store(kernel: Any) -> None:
    # the rank holding the GIL never answers the kernel's exit: only a signal ends it, and the kernel must send it
    # before jupyter_client's SIGTERM ends the kernel
    manager, client, pids, run_dir, store = kernel
    msg_id = client.execute(f"%%ranks 1\n{HOLD_THE_GIL_FOR_A_MINUTE}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        msg = client.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id and "holding" in msg["content"].get("text", ""):
            break
    time.sleep(1.0)  # rank 1 is in the C call now
    manager.shutdown_kernel(now=False)
    assert _running(pids) == []
    assert not store.exists()
    assert (run_dir / "ranks.log").exists()  # a rank had to be killed: its log is kept


def test_a_clean_shutdown_removes_the_ranks_folder_and_the_store(kernel: Any) -> None:
    manager, _, pids, run_dir, store = kernel
    assert (store / "agent").is_dir()  # torch's agent keeps its files in the store folder, not in one of /tmp
    # ranks leaving on a busy host may take longer than jupyter_client's default 2.5 s before its SIGTERM (which
    # kills them, keeping their log): the kernel waits as long as the client does
    manager.shutdown_wait_time = 60.0
    manager.shutdown_kernel(now=False)
    assert _running(pids) == []
    assert not store.exists() and not run_dir.exists()


def test_a_sigterm_to_the_kernel_takes_its_ranks_and_store_with_it(kernel: Any) -> None:
    # what jupyter_client sends a kernel whose shutdown takes longer than 2.5 s
    manager, _, pids, _, store = kernel
    kernel_process = manager.provisioner.process
    kernel_process.send_signal(signal.SIGTERM)
    kernel_process.wait(30)
    assert kernel_process.returncode == -signal.SIGTERM  # it still ends as SIGTERM ends a process
    assert _running(pids) == []
    assert not store.exists()
