"""Review of the async save's lifecycle: ``wait()`` from several threads, a Ctrl-C while it waits, and what a
finished handle keeps alive. Files are compared with safetensors' own ``load_file`` of the values cloned at the
call."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb


def _read(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 64, generator=gen) for i in range(4)}


@pytest.fixture
def slow_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every data write takes 0.1 s (headers are not slowed): the writes are still running when ``wait()`` starts."""
    real = os.pwrite

    def slow(fd: int, data, offset: int) -> int:
        if len(data) > 1024:
            time.sleep(0.1)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow)


@pytest.mark.parametrize("write_mode", ["direct", "gather"])
def test_wait_from_two_threads_at_once_publishes_once_and_both_get_the_result(tmp_path: Path, slow_writes,
                                                                              write_mode: str) -> None:
    # a trainer's checkpoint thread waits on the handle while the main thread calls result(): both finished the save,
    # one published it and the other failed to publish it again, and both raised "nothing was published"
    state = _state()
    expected = {k: v.clone() for k, v in state.items()}
    handle = wb.save_hf(state, tmp_path / "ckpt", async_save=True, write_mode=write_mode, write_threads=1)
    start = threading.Barrier(2)
    outcomes: list[object] = [None, None]

    def waiter(index: int) -> None:
        start.wait()
        try:
            outcomes[index] = handle.wait()
        except BaseException as exc:  # the outcome is what the test checks
            outcomes[index] = exc

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(isinstance(o, wb.SaveResult) for o in outcomes), outcomes
    assert outcomes[0] is outcomes[1] and handle.wait() is outcomes[0]
    read = _read(tmp_path / "ckpt")
    assert read.keys() == expected.keys() and all(torch.equal(read[k], expected[k]) for k in expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_save_while_another_thread_waits_on_the_last_one_follows_it(tmp_path: Path, slow_writes) -> None:
    # the handle a background thread waits on is still this process's save in progress: the next save_hf to the same
    # path waits for it to publish (as for a handle nobody waits on) instead of refusing "call its wait()"
    first, second = _state(0), _state(1)
    expected = {k: v.clone() for k, v in second.items()}
    handle = wb.save_hf(first, tmp_path / "ckpt", async_save=True, write_threads=1)
    waiting = threading.Thread(target=handle.wait)
    waiting.start()
    time.sleep(0.05)  # the thread is inside wait(), the writes still running
    wb.save_hf(second, tmp_path / "ckpt")
    waiting.join(60)
    assert handle.wait().path == tmp_path / "ckpt"
    read = _read(tmp_path / "ckpt")
    assert all(torch.equal(read[k], expected[k]) for k in expected)


def test_a_ctrl_c_in_the_status_exchange_leaves_no_live_temporary_behind(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # wait() spends its time in the status exchange while slower ranks write: a Ctrl-C there left .ckpt.incomplete
    # claimed by this process, its heartbeat beating, and every later save to the path refused as "in progress"
    from workbench.io.hf import save_session

    wb.save_hf({"old": torch.zeros(3)}, tmp_path / "ckpt")
    handle = wb.save_hf(_state(0), tmp_path / "ckpt", async_save=True)
    real = save_session.agree

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(save_session, "agree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        handle.wait()
    monkeypatch.setattr(save_session, "agree", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left, the old checkpoint intact
    assert list(_read(tmp_path / "ckpt")) == ["old"]
    state = _state(1)
    expected = {k: v.clone() for k, v in state.items()}
    wb.save_hf(state, tmp_path / "ckpt")  # the path is free again
    read = _read(tmp_path / "ckpt")
    assert read.keys() == expected.keys() and all(torch.equal(read[k], expected[k]) for k in expected)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_neither_finishes_nor_removes_its_parents_async_save(tmp_path: Path, slow_writes) -> None:
    # the child inherits the list of pending saves but not their writer threads: its save_hf waited forever for the
    # parent's writes, and its exit abandoned (removed) the parent's save
    import atexit
    import signal

    state = _state()
    expected = {k: v.clone() for k, v in state.items()}
    handle = wb.save_hf(state, tmp_path / "ckpt", async_save=True, write_threads=1)
    pid = os.fork()
    if pid == 0:  # the child: a save of its own, then its interpreter's exit
        code = 1
        try:
            wb.save_hf({"x": torch.ones(2)}, tmp_path / "child")
            atexit._run_exitfuncs()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the child's save hung or failed"
    assert _read(tmp_path / "child")["x"].tolist() == [1.0, 1.0]
    handle.wait()
    read = _read(tmp_path / "ckpt")
    assert read.keys() == expected.keys() and all(torch.equal(read[k], expected[k]) for k in expected)


def test_an_async_save_never_waited_on_leaves_nothing_at_exit(tmp_path: Path) -> None:
    # abandoned at exit: nothing published, and its temporary directory (a whole checkpoint's bytes) not left behind
    import subprocess
    import sys

    script = (
        "import sys, torch, workbench as wb\n"
        "wb.save_hf({'w': torch.ones(256, 256)}, sys.argv[1], async_save=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ckpt")], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert "was never waited on" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("write_mode", ["direct", "gather"])
def test_a_handle_kept_after_wait_does_not_keep_the_model_alive(tmp_path: Path, write_mode: str) -> None:
    # a trainer keeps its last handle (to call result() later); the model it saved is dropped or its parameters
    # replaced: the handle held every one of the model's tensors, a whole model of memory (device memory on GPU)
    import gc
    import weakref

    import numpy as np

    memory = np.arange(4096, dtype=np.float32)  # the storage behind the model's tensor, which numpy lets us watch
    alive = weakref.ref(memory)
    state = {"w": torch.from_numpy(memory).reshape(64, 64)}
    del memory
    handle = wb.save_hf(state, tmp_path / "ckpt", async_save=True, write_mode=write_mode)
    handle.wait()
    del state
    gc.collect()
    assert alive() is None, "the finished save's handle keeps the model's memory"
    assert _read(tmp_path / "ckpt")["w"].equal(torch.arange(4096, dtype=torch.float32).reshape(64, 64))
