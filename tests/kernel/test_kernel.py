"""The launcher kernel end to end: 2 gloo ranks started by torch's elastic agent, driven over Jupyter's protocol.

One kernel serves the whole module (start-up costs seconds); tests run in file order and the last ones stop and
restart it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.support import execute, jupyter_path
from workbench.kernel.spec import install_kernel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    from jupyter_client.manager import start_new_kernel

    prefix = tmp_path_factory.mktemp("jupyter-prefix")
    install_kernel(nprocs=2, backend="gloo", name="wb-test-2", prefix=str(prefix))
    with jupyter_path(Path(prefix)):
        manager, client = start_new_kernel(kernel_name="wb-test-2", startup_timeout=120)
        try:
            yield manager, client
            run_dir = _run_dir(client, check=False)  # None when a test left the ranks broken
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=False)
    assert run_dir is None or not run_dir.exists(), sorted(run_dir.iterdir())  # the ranks left cleanly: all goes


def _run_dir(client: Any, check: bool = True) -> Any:
    """The folder of the local ranks' log, stack dump and ledger files."""
    out = execute(client, "import os\nos.environ['WORKBENCH_KERNEL_RUN_DIR']")
    if not check and out.reply["status"] != "ok":
        return None
    assert out.reply["status"] == "ok", out.error_text
    path = Path(out.result.strip("'"))
    assert path.is_dir() and (path / "ranks.log").exists()
    return path


def _define_x(client: Any) -> None:
    """Give every rank ``x = 10 * rank``: the state a test checks survives what it does (tests share one kernel, in
    whatever order and worker pytest-xdist runs them)."""
    assert execute(client, "x = 10 * rank").reply["status"] == "ok"


def test_state_persists_and_text_is_folded(kernel: tuple[Any, Any]) -> None:
    _, client = kernel
    out = execute(client, "x = 10 * rank\nprint('same on both')\nprint('I am rank', rank, 'of', world_size)")
    assert out.reply["status"] == "ok", out.error_text
    assert out.streams["stdout"] == "same on both\n[0] I am rank 0 of 2\n[1] I am rank 1 of 2\n"
    out = execute(client, "x + rank")  # rank 0's value: 0 (rank 1 would give 11)
    assert out.result == "0"


def test_ranks_magic_runs_a_subset_and_shows_its_lowest_rank(kernel: tuple[Any, Any]) -> None:
    _, client = kernel
    _define_x(client)
    out = execute(client, "%%ranks 1\nx += 1\nprint('x is', x)\nx")
    assert out.streams["stdout"] == "x is 11\n" and out.result == "11"
    assert execute(client, "x").result == "0"  # rank 0 did not run the cell


def test_rank_output_modes(kernel: tuple[Any, Any]) -> None:
    _, client = kernel
    code = "print('same')\nprint(rank)"
    execute(client, "%rank_output all")
    lines = execute(client, code).streams["stdout"].splitlines()  # every rank's lines, in arrival order
    assert sorted(lines) == ["[0] 0", "[0] same", "[1] 1", "[1] same"]
    assert lines.index("[0] same") < lines.index("[0] 0") and lines.index("[1] same") < lines.index("[1] 1")
    execute(client, "%rank_output 0")
    assert execute(client, code).streams["stdout"] == "same\n0\n"
    execute(client, "%rank_output folded")
    assert execute(client, code).streams["stdout"] == "same\n[0] 0\n[1] 1\n"


def test_the_agent_hosts_no_store_and_the_ranks_and_kernel_listen_on_loopback_only(kernel: tuple[Any, Any]) -> None:
    # torch's agent alone hosts its stores on every interface ('::'), where anyone could read and write them (and
    # make the agent unpickle what they wrote); on 127.0.0.1 every user of the host still could
    _, client = kernel
    code = ("import os\nfrom tests.listening import listening\n"
            "mine = listening([os.getpid(), int(os.environ['WORKBENCH_KERNEL_PID'])])\n"
            "print(sorted({host for host, _ in mine}), len(mine) > 0, listening([os.getppid()]))")
    out = execute(client, code)
    assert out.reply["status"] == "ok", out.error_text
    assert out.streams["stdout"] == "['127.0.0.1'] True []\n", out.streams["stdout"]


def test_rich_output_and_result_come_from_rank_0(kernel: tuple[Any, Any]) -> None:
    _, client = kernel
    out = execute(client, "from IPython.display import HTML, display\ndisplay(HTML(f'<b>rank {rank}</b>'))\n"
                          "{'rank': rank}")
    assert [d["text/html"] for d in out.displays] == ["<b>rank 0</b>"]
    assert out.result == "{'rank': 0}"


def test_a_collective_across_ranks(kernel: tuple[Any, Any]) -> None:
    _, client = kernel
    out = execute(client, "t = torch.full((3,), float(rank + 1))\ndist.all_reduce(t)\nt.tolist()")
    assert out.result == "[3.0, 3.0, 3.0]"  # 1 + 2 on every element


def test_native_output_and_child_processes_reach_the_cell_from_every_rank(kernel: tuple[Any, Any]) -> None:
    # what C code and child processes write to descriptor 1 (os.system, a subprocess, NCCL's debug lines) is shown
    # with its cell, not only in the ranks' log, and the cell's last native text comes before its end; descriptor 2
    # stays the log, where a native crash's last words must land
    _, client = kernel
    code = ("import ctypes, subprocess, sys\nos.system(f'echo shell-out {rank}; echo shell-err {rank} >&2')\n"
            "ctypes.CDLL(None).write(2, f'c-err {rank}\\n'.encode(), len(f'c-err {rank}\\n'))\n"
            "subprocess.run(['echo', 'child', str(rank)], stdout=sys.stdout, check=True)\n"
            "os.write(1, b'no newline')")
    out = execute(client, "import os\n" + code)
    assert out.reply["status"] == "ok", out.error_text
    stdout = out.streams["stdout"].splitlines()
    assert sorted(stdout) == ["[0] child 0", "[0] shell-out 0", "[1] child 1", "[1] shell-out 1", "no newline"], \
        out.streams  # the same text on both ranks is folded into one line
    assert out.streams["stderr"] == "", out.streams
    log = (_run_dir(client) / "ranks.log").read_text()
    assert all(f"{what} {rank}" in log for what in ("shell-err", "c-err") for rank in (0, 1)), log[-2000:]
    out = execute(client, "print('next cell')")  # nothing of the last cell arrives late
    assert out.streams == {"stdout": "next cell\n", "stderr": ""}, out.streams
    # a cell that points descriptor 1 at a file of its own: no mark of the kernel lands there, no cell waits for one
    path = _run_dir(client) / "native.txt"
    out = execute(client, f"%%ranks 0\nf = open({str(path)!r}, 'wb')\nsaved = os.dup(1)\nos.dup2(f.fileno(), 1)\n"
                          "os.write(1, b'to the file\\n')")
    start = time.monotonic()
    execute(client, "%%ranks 0\npass")
    took = time.monotonic() - start
    execute(client, "%%ranks 0\nos.dup2(saved, 1)\nf.close()")
    assert path.read_bytes() == b"to the file\n" and took < 0.9, (path.read_bytes(), took)
    path.unlink()
    assert execute(client, "os.system('echo back')").streams["stdout"] == "back\n"


def test_exception_on_one_rank_names_it_and_state_survives(kernel: tuple[Any, Any]) -> None:
    _, client = kernel
    _define_x(client)
    out = execute(client, "y = rank\nif rank == 1:\n    raise ValueError(f'bad shard on {rank}')\n'fine'")
    assert out.reply["status"] == "error" and out.reply["ename"] == "ValueError"
    assert out.reply["evalue"] == "[rank 1] bad shard on 1"
    lines = out.error_text.splitlines()
    assert lines[0] == "[rank 1] ValueError on rank 1 (its own traceback):"
    assert "raise ValueError" in out.error_text and "rank(s) 0 finished the cell" in out.error_text
    assert execute(client, "%%ranks 1\n(x, y)").result == "(10, 1)"


def test_exit_and_quit_ask_the_frontend_as_ipykernel_and_every_rank_goes_on(kernel: tuple[Any, Any]) -> None:
    _, client = kernel
    _define_x(client)
    for code, keep in (("exit()", False), ("quit()", False), ("exit(keep_kernel=True)", True)):
        out = execute(client, code, total=60)
        assert out.reply["status"] == "ok", out.error_text  # was AttributeError: no ask_exit
        assert out.reply["payload"] == [{"source": "ask_exit", "keepkernel": keep}], out.reply
    assert execute(client, "t = torch.ones(1)\ndist.all_reduce(t)\n(t.item(), x)").result == "(2.0, 0)"


def test_a_failed_rank_does_not_leave_peers_waiting_in_a_collective(kernel: tuple[Any, Any]) -> None:
    _, client = kernel
    _define_x(client)
    start = time.monotonic()
    out = execute(client, "if rank == 1:\n    raise KeyError('missing key')\ndist.all_reduce(torch.ones(1))",
                  timeout=90)
    assert time.monotonic() - start < 60
    # the root cause is rank 1's error, not rank 0's "connection closed" symptom
    assert out.reply["ename"] == "KeyError" and out.reply["evalue"].startswith("[rank 1]")
    assert "rank(s) 0 wait in a collective that the other ranks left (rank 1 failed)" in out.streams["stderr"]
    assert "process groups re-created on every rank" in out.streams["stderr"]
    again = execute(client, "t = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nt.tolist()")
    assert again.result == "[3.0, 3.0]" and execute(client, "x").result == "0"


def test_a_rank_that_enters_a_collective_after_its_peer_failed_is_freed_too(kernel: tuple[Any, Any]) -> None:
    # rank 0 is still computing when the kernel first looks (2 s after rank 1's error): it used to be named once and
    # then left to wait in the all_reduce for gloo's 30 minutes
    _, client = kernel
    start = time.monotonic()
    out = execute(client, "import time\nif rank == 1:\n    raise ValueError('bad shard')\ntime.sleep(4)\n"
                          "dist.all_reduce(torch.ones(1))", timeout=60, total=60)
    assert time.monotonic() - start < 30
    assert out.reply["ename"] == "ValueError" and out.reply["evalue"] == "[rank 1] bad shard"
    stderr = out.streams["stderr"]
    assert "rank(s) 1 failed; still running outside any collective: rank 0 at" in stderr, stderr
    assert "rank(s) 0 wait in a collective that the other ranks left (rank 1 failed)" in stderr, stderr
    assert execute(client, "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result == "2.0"


def test_hang_report_then_interrupt_then_the_next_cell_works(kernel: tuple[Any, Any]) -> None:
    manager, client = kernel
    _define_x(client)
    execute(client, "%hang_timeout 2")
    reported = threading.Event()

    def watch(msg: dict) -> None:
        if msg["msg_type"] == "stream" and "still running after" in msg["content"]["text"]:
            reported.set()
            manager.interrupt_kernel()  # what JupyterLab's stop button sends (SIGINT to the kernel)

    out = execute(client, "import time\nif rank == 1:\n    time.sleep(600)\ndist.barrier()", timeout=120,
                  on_output=watch)
    execute(client, "%hang_timeout off")
    assert reported.is_set()
    stderr = out.streams["stderr"]
    assert "rank 1: busy outside any collective at" in stderr and "time.sleep(600)" in stderr
    assert "rank 0: waiting in a collective, called at" in stderr and "dist.barrier()" in stderr
    assert stderr.index("rank 1: busy") < stderr.index("rank 0: waiting")  # the culprit first
    assert out.reply["ename"] == "KeyboardInterrupt" and out.reply["evalue"].startswith("[rank 1]")
    again = execute(client, "t = torch.ones(1)\ndist.all_reduce(t)\n(t.item(), x)")
    assert again.result == "(2.0, 0)"  # collectives work again, and the state survived


HOLD_THE_GIL = """import ctypes, subprocess
def hold_the_gil(seconds):  # a C call that keeps the GIL (PyDLL) until a child writes: signals do not end it
    child = subprocess.Popen(['sh', '-c', f'sleep {seconds}; echo'], stdout=subprocess.PIPE)
    ctypes.PyDLL(None).read(child.stdout.fileno(), ctypes.create_string_buffer(1), 1)
    child.wait()
if rank == 1:
    hold_the_gil(8)
dist.barrier()
'done'"""


def test_a_rank_holding_the_gil_in_native_code_is_reported_with_its_stack(kernel: tuple[Any, Any]) -> None:
    # Rank 1's main thread holds the GIL in a C call, so its I/O thread cannot answer; faulthandler's dump (C, no
    # GIL) still gives its Python stack, and rank 0's ledger names the collective it waits in.
    _, client = kernel
    execute(client, "%hang_timeout 2")
    seen: dict[str, float] = {}

    def watch(msg: dict) -> None:
        if msg["msg_type"] == "stream" and "still running after" in msg["content"]["text"]:
            seen.setdefault("report", time.monotonic())

    start = time.monotonic()
    out = execute(client, HOLD_THE_GIL, timeout=120, on_output=watch)
    execute(client, "%hang_timeout off")
    assert out.reply["status"] == "ok", out.error_text  # nothing was interrupted: the call returned, then the barrier
    assert seen["report"] - start < 2 + 5, seen["report"] - start
    stderr = out.streams["stderr"]
    assert "rank 1: busy outside any collective at" in stderr
    assert "line 4, in hold_the_gil (holding the GIL in native code: no answer; stack from faulthandler)" in stderr
    assert "--- rank 1 Python stack (faulthandler) (innermost last):" in stderr
    native = stderr.split("--- rank 1 Python stack (faulthandler)")[1].split("---")[0]
    assert "hold_the_gil(8)" in native and "ctypes.PyDLL(None).read(" in native  # the cell's own lines
    assert "rank 0: waiting in a collective, called at" in stderr
    assert "dist.barrier()" in stderr and ": barrier #" in stderr and "on group default (ranks 0,1), for " in stderr
    assert stderr.index("rank 1: busy") < stderr.index("rank 0: waiting")  # the culprit first


def test_a_widget_lives_on_rank_0_and_its_comm_goes_both_ways(kernel: tuple[Any, Any]) -> None:
    _, client = kernel
    seen: list[dict] = []
    out = execute(client, "import ipywidgets\ns = ipywidgets.IntSlider(value=3 + rank)\ns",
                  on_output=lambda m: seen.append(m) if m["msg_type"].startswith("comm_") else None)
    assert out.reply["status"] == "ok", out.error_text
    opens = [m["content"] for m in seen if m["msg_type"] == "comm_open"]
    sliders = [c for c in opens if c["data"]["state"].get("_model_name") == "IntSliderModel"]
    assert len(sliders) == 1 and sliders[0]["target_name"] == "jupyter.widget"  # rank 1's widget stays there
    assert sliders[0]["data"]["state"]["value"] == 3  # rank 0's
    model_id = out.results[0]["application/vnd.jupyter.widget-view+json"]["model_id"]
    assert model_id == sliders[0]["comm_id"]
    # what the browser sends when the user drags the slider to 7
    message = client.session.msg("comm_msg", {"comm_id": model_id, "data": {
        "method": "update", "state": {"value": 7}, "buffer_paths": []}})
    client.shell_channel.send(message)
    deadline = time.monotonic() + 10
    while execute(client, "s.value").result != "7" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert execute(client, "s.value").result == "7"
    assert execute(client, "%%ranks 1\ns.value").result == "4"  # the widget on rank 1 was not touched
    seen.clear()
    execute(client, "s.value = 9", on_output=lambda m: seen.append(m) if m["msg_type"] == "comm_msg" else None)
    updates = [m["content"]["data"] for m in seen]  # the kernel side's change reaches the browser
    assert {"method": "update", "state": {"value": 9}, "buffer_paths": []} in updates
    # a widget shown by a cell without rank 0 pointed at a model the notebook never got (an empty, broken view)
    out = execute(client, "%%ranks 1\nipywidgets.IntSlider()")
    assert out.reply["status"] == "ok", out.error_text
    assert list(out.results[0]) == ["text/plain"], out.results
    assert "a widget made on rank 1: widgets live on rank 0" in out.result, out.result


MESH = ("from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import Shard, distribute_tensor\n"
        "mesh = init_device_mesh('cpu', (2,))\n"
        "dt = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])\n"
        "dt.to_local().tolist()")


def test_an_interrupted_collective_is_freed_while_a_device_mesh_holds_the_groups(kernel: tuple[Any, Any]) -> None:
    # A live DeviceMesh (and a DTensor on it) keeps the gloo process group alive on the idle rank, so destroying
    # the group there does not close its connections: the rank left in the collective must still be freed.
    manager, client = kernel
    _define_x(client)
    assert execute(client, MESH).result == "[0.0, 1.0]"  # rank 0's shard of [0, 1, 2, 3]
    execute(client, "%hang_timeout 2")
    reported = threading.Event()

    def watch(msg: dict) -> None:
        if msg["msg_type"] == "stream" and "still running after" in msg["content"]["text"] and not reported.is_set():
            reported.set()
            manager.interrupt_kernel()

    start = time.monotonic()
    out = execute(client, "if rank == 0:\n    dist.all_reduce(torch.ones(1))\n'done'", timeout=60, on_output=watch)
    elapsed = time.monotonic() - start
    execute(client, "%hang_timeout off")
    assert reported.is_set() and elapsed < 30, elapsed
    stderr = out.streams["stderr"]
    assert "rank 0: waiting in a collective, called at" in stderr and "dist.all_reduce" in stderr
    assert "rank(s) 0 wait in a collective that the other ranks left (rank 1 finished the cell)" in stderr
    assert "process groups re-created on every rank" in stderr
    assert out.reply["status"] == "error" and out.reply["evalue"].startswith("[rank 0]")
    assert "rank(s) 1 finished the cell" in out.error_text
    again = execute(client, MESH.replace("(2,))", "(2,))\nt = torch.ones(1)\ndist.all_reduce(t)") + ", t.item(), x")
    assert again.reply["status"] == "ok", again.error_text
    assert again.result == "([0.0, 1.0], 2.0, 0)"  # a new mesh and collectives work; the state survived


def test_a_crashed_rank_is_reported_and_restart_restarts_every_rank(kernel: tuple[Any, Any]) -> None:
    manager, client = kernel
    run_dir = _run_dir(client)
    out = execute(client, "%%ranks 1\nimport os\nos._exit(3)", timeout=120)
    assert out.reply["ename"] == "RanksStopped" and "Restart the kernel" in out.reply["evalue"]
    assert str(run_dir / "ranks.log") in out.reply["evalue"]
    assert out.reply["evalue"].startswith("the ranks stopped: rank 1 exited with code 3, and torch's elastic agent "
                                          "stopped the others"), out.reply["evalue"]
    manager.restart_kernel(now=False)
    assert (run_dir / "ranks.log").exists()  # the agent failed: its log, which the error names, is kept
    client.wait_for_ready(timeout=120)
    out = execute(client, "('x' in globals(), world_size, dist.is_initialized())")
    assert out.result == "(False, 2, True)"


def test_a_local_rank_whose_process_ends_mid_cell_ends_the_cell_naming_it(tmp_path: Path) -> None:
    # torch's agent goes on while a worker that exited with code 0 leaves the others running: the cell used to wait
    # for it forever, and interrupts could not end it
    from jupyter_client.manager import start_new_kernel

    install_kernel(nprocs=2, backend="gloo", name="wb-test-exit", prefix=str(tmp_path))
    with jupyter_path(tmp_path):
        manager, client = start_new_kernel(kernel_name="wb-test-exit", startup_timeout=120)
    try:
        assert execute(client, "rank").result == "0"
        start = time.monotonic()
        out = execute(client, "import os, time\nif rank == 1:\n    os._exit(0)\ntime.sleep(2)", timeout=60, total=60)
        assert time.monotonic() - start < 20
        assert out.reply["ename"] == "RanksLost", out.reply
        assert out.reply["evalue"].startswith("rank(s) 1 of the job are gone: their process ended during the cell")
        assert "Restart the kernel (Kernel > Restart Kernel) to start new ranks." in out.streams["stderr"]
        # it was running the cell, not idle between cells
        assert "rank 1 on host " in out.streams["stderr"] and ": last seen running cell 2 (no stack seen yet)" in (
            out.streams["stderr"]), out.streams["stderr"]
        out = execute(client, "rank", timeout=60, total=60)  # the kernel ended the job: not "exited before joining"
        assert out.reply["ename"] == "RanksNotReady", out.reply
        assert out.reply["evalue"].startswith("this kernel's ranks are gone: it ended their job after rank(s) 1 were "
                                              "lost: their process ended during the cell"), out.reply["evalue"]
        assert out.reply["evalue"].endswith("Restart the kernel (Kernel > Restart Kernel) to start new ranks.")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_after_a_rank_fails_its_peers_collectives_among_themselves_go_on(tmp_path: Path) -> None:
    # the kernel looks every 2 s for ranks left waiting on the failed one; collectives of a group without it must
    # not be taken for that (they were released, and every process group re-created, in the middle of the loop)
    from jupyter_client.manager import start_new_kernel

    install_kernel(nprocs=3, backend="gloo", name="wb-test-3", prefix=str(tmp_path))
    with jupyter_path(tmp_path):
        manager, client = start_new_kernel(kernel_name="wb-test-3", startup_timeout=120)
    try:
        code = ("import time\ng = dist.new_group([0, 1])\nif rank == 2:\n    raise ValueError('rank 2 fails')\n"
                "time.sleep(3)\nx = torch.ones(4_000_000)\nfor n in range(300):\n    dist.all_reduce(x, group=g)\n"
                "print('done', n)")
        out = execute(client, code, timeout=60, total=90)
        assert out.reply["ename"] == "ValueError" and out.reply["evalue"] == "[rank 2] rank 2 fails", out.reply
        assert out.streams["stdout"] == "[0,1] done 299\n", out.streams  # folded: the same line on both
        assert "wait in a collective that the other ranks left" not in out.streams["stderr"], out.streams["stderr"]
        run_dir = _run_dir(client)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)  # SIGKILL: the ranks see the kernel's pid gone within a second
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and sorted(run_dir.glob("rank*")):
        time.sleep(0.2)
    assert sorted(p.name for p in run_dir.iterdir()) == ["ranks.log"]  # each rank removed its stack and ledger files
