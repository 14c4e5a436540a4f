"""The launcher kernel on 2 GPUs (NCCL), driven over Jupyter's protocol (skipped without 2 CUDA devices).

An FSDP2 model saved with ``wb.save_hf`` from cells and loaded back bit for bit; then the two NCCL hangs of
issue 21, each reported within ``hang_timeout`` + 5 s and freed by the interrupt without a restart (every rank's
communicators aborted, new process groups made, variables kept), after which a collective works:

* rank 0 alone runs ``dist.all_reduce(t); t.item()``: the all_reduce returns at once (NCCL queues it), the
  ``item()`` waits in a CUDA sync for a kernel that never ends;
* rank 0 alone makes the first call on a group made in the same cell.

The live view under NCCL names a rank whose GPU has not finished its all_reduce (it waits in ``t.item()``) while
its peer sleeps at a line of the cell. A second kernel, installed with ``flight_recorder=True`` (every rank keeps
torch's flight recorder, 2000 entries), reports the first hang with each rank's last collectives from the recorder
(group, op, sequence number, state) and is still freed by the interrupt.

Run on a 2-GPU machine: ``PYTHONPATH=. python -m pytest -q -o addopts="" tests/gpu/test_kernel_nccl.py`` (the
empty addopts drops ``--mpl``, for a machine without pytest-mpl). Set
``WORKBENCH_GPU_LOGS=DIR`` to keep the ranks' logs (torch's NCCL messages at INFO) there.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

HANG_TIMEOUT = 5


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    yield from _start(tmp_path_factory, "wb-nccl-2")


@pytest.fixture(scope="module")
def recorder_kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    yield from _start(tmp_path_factory, "wb-nccl-fr-2", flight_recorder=True)


def _start(tmp_path_factory: pytest.TempPathFactory, name: str, **options: Any) -> Iterator[tuple[Any, Any]]:
    from jupyter_client.manager import start_new_kernel

    from tests.kernel.support import execute, jupyter_path
    from workbench.kernel.spec import install_kernel

    prefix = tmp_path_factory.mktemp("jupyter-prefix")
    install_kernel(nprocs=2, backend="nccl", name=name, prefix=str(prefix), **options)
    # jupyter_client 8.10 fails on env=None: pass an environment only when one is given
    logs = {"env": {**os.environ, "TORCH_CPP_LOG_LEVEL": "INFO"}} if os.environ.get("WORKBENCH_GPU_LOGS") else {}
    with jupyter_path(Path(prefix)):
        manager, client = start_new_kernel(kernel_name=name, startup_timeout=300, **logs)
    try:
        first = execute(client, "(dist.get_backend(), str(device), torch.cuda.current_device())", timeout=300)
        assert first.result == "('nccl', 'cuda:0', 0)", first.error_text
        yield manager, client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
        _keep_logs(name)


def _keep_logs(name: str) -> None:
    """Copy the newest ranks' log to $WORKBENCH_GPU_LOGS/NAME.log (what torch and NCCL said there)."""
    keep = os.environ.get("WORKBENCH_GPU_LOGS")
    logs = sorted(Path(os.environ.get("TMPDIR", "/tmp")).glob("workbench-kernel-*/ranks.log"),
                  key=lambda p: p.stat().st_mtime)
    if keep and logs:
        shutil.copy(logs[-1], Path(keep) / f"{name}.log")


SAVE_AND_LOAD = """
import tempfile
from pathlib import Path
import workbench as wb
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

def build(seed):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 96)).to(device, torch.bfloat16)
    fully_shard(net, mesh=init_device_mesh("cuda", (world_size,)))
    return net

model, copy = build(0), build(1)
box = [tempfile.mkdtemp(prefix="wb-nccl-kernel-") if rank == 0 else None]
dist.broadcast_object_list(box, src=0)
saved = Path(box[0]) / "ckpt"
wb.save_hf(model, saved)
wb.load_hf(copy, saved)
want = {k: v.full_tensor() for k, v in model.state_dict().items()}
got = {k: v.full_tensor() for k, v in copy.state_dict().items()}
(sorted(want), all(torch.equal(got[k], want[k]) for k in want), (saved / "model.safetensors.index.json").exists())
"""


def test_an_fsdp2_model_saved_and_loaded_from_cells(kernel: tuple[Any, Any]) -> None:
    from tests.kernel.support import execute

    _, client = kernel
    out = execute(client, SAVE_AND_LOAD, timeout=300)
    assert out.reply["status"] == "ok", out.error_text
    assert out.result == "(['0.bias', '0.weight', '1.bias', '1.weight'], True, True)", out.result


def test_what_each_gpu_rank_runs_in_a_shell_is_shown_with_its_cell(kernel: tuple[Any, Any]) -> None:
    # os.system writes to the rank's descriptor 1 (as NCCL's and torch's native warnings do to 1 and 2): it is shown
    # with the cell, from every rank, each naming the GPU it is bound to
    from tests.kernel.support import execute

    _, client = kernel
    code = ("import os\nos.system(f'nvidia-smi --query-gpu=index --format=csv,noheader "
            "--id={torch.cuda.current_device()} | sed \"s/^/gpu /\"')")
    out = execute(client, code, timeout=120)
    assert out.reply["status"] == "ok", out.error_text
    lines = sorted(out.streams["stdout"].splitlines())
    assert lines == ["[0] gpu 0", "[1] gpu 1"], out.streams


def _rank_pids(client: Any) -> dict[int, int]:
    from tests.kernel.support import execute

    execute(client, "%rank_output all")
    text = execute(client, "import os\nprint('pid', os.getpid())").streams["stdout"]
    execute(client, "%rank_output folded")
    return {int(r): int(p) for r, p in re.findall(r"^\[(\d+)\] pid (\d+)$", text, re.M)}


def _threads(pids: dict[int, int]) -> str:
    """Each rank's threads (name, state, kernel wait channel) and faulthandler's Python stacks into the ranks' log
    (SIGUSR1): what holds a rank that an abort did not free."""
    lines = []
    for rank, pid in pids.items():
        for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
            try:
                name = (task / "comm").read_text().strip()
                state = (task / "stat").read_text().split(")")[-1].split()[0]
                wchan = (task / "wchan").read_text().strip()
            except OSError:
                continue
            lines.append(f"rank {rank} thread {task.name} {name}: {state} {wchan}")
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            pass
    return "\n".join(lines)


def _hang_then_next_cell(kernel: tuple[Any, Any], cell: str) -> tuple[Any, float, float, Any]:
    """Run a hanging cell with an interrupting hang timeout; return its output, when the report came, when the
    cell ended (seconds from its start) and the next cell's output."""
    from tests.kernel.support import execute

    _, client = kernel
    execute(client, f"%hang_timeout {HANG_TIMEOUT} interrupt")
    seen: dict[str, float] = {}
    reported = threading.Event()

    def watch(msg: dict) -> None:
        if msg["msg_type"] == "stream" and "still running after" in msg["content"]["text"]:
            seen.setdefault("report", time.monotonic())
            reported.set()

    start = time.monotonic()
    out = execute(client, cell, timeout=180, on_output=watch)
    ended = time.monotonic() - start
    execute(client, "%hang_timeout off")
    again = execute(client, "t = torch.ones(1, device=device) * (rank + 1)\ndist.all_reduce(t)\n"
                            "(t.item(), kept)", timeout=120)
    usable = time.monotonic() - start
    report = seen.get("report", float("inf")) - start
    print(f"\nNCCL hang ({cell.splitlines()[-1].strip()}): report {report - HANG_TIMEOUT:.1f} s after the hang "
          f"timeout; cell ended {ended - HANG_TIMEOUT:.1f} s after the interrupt; next collective done "
          f"{usable - HANG_TIMEOUT:.1f} s after it")
    return out, report, ended, again


def test_a_rank_alone_in_all_reduce_then_item_is_reported_and_freed(kernel: tuple[Any, Any]) -> None:
    from tests.kernel.support import execute

    execute(kernel[1], "kept = 10 + rank")
    out, report, ended, again = _hang_then_next_cell(kernel, "t = torch.ones(1, device=device)\nif rank == 0:\n"
                                                             "    dist.all_reduce(t)\n    t.item()\n")
    stderr = out.streams["stderr"]
    assert report < HANG_TIMEOUT + 5, (report, stderr)
    assert "rank 0: " in stderr and "t.item()" in stderr, stderr
    assert "the GPU has not finished its all_reduce #" in stderr, stderr
    assert "aborting every rank's NCCL communicators" in stderr, stderr
    assert "process groups re-created on every rank" in stderr, stderr
    assert out.reply["status"] == "error" and out.reply["evalue"].startswith("[rank 0]"), out.reply
    assert ended < HANG_TIMEOUT + 30, ended
    assert again.reply["status"] == "ok", again.error_text
    assert again.result == "(3.0, 10)"  # 1 + 2 over the new groups; rank 0's variable kept


def test_a_rank_alone_in_its_first_call_on_a_group_is_reported_and_freed(kernel: tuple[Any, Any]) -> None:
    from tests.kernel.support import execute

    execute(kernel[1], "kept = 10 + rank")
    out, report, ended, again = _hang_then_next_cell(
        kernel, "g = dist.new_group([0, 1])\nx = torch.ones(1, device=device)\nif rank == 0:\n"
                "    dist.all_reduce(x, group=g)\n    x.item()\n")
    stderr = out.streams["stderr"]
    assert report < HANG_TIMEOUT + 5, (report, stderr)
    # the first call on a group made in the cell waits in the call itself (NCCL sets the group's communicator up)
    assert "rank 0: waiting in a collective, called at" in stderr and "dist.all_reduce(x, group=g)" in stderr, stderr
    assert ": all_reduce #1 on group " in stderr, stderr
    assert "aborting every rank's NCCL communicators" in stderr, stderr
    assert "process groups re-created on every rank" in stderr, stderr
    assert out.reply["status"] == "error" and out.reply["evalue"].startswith("[rank 0]"), out.reply
    assert ended < HANG_TIMEOUT + 30, ended
    assert again.reply["status"] == "ok", again.error_text
    assert again.result == "(3.0, 10)"


def test_the_live_view_names_a_rank_whose_gpu_has_not_finished_its_all_reduce(kernel: tuple[Any, Any]) -> None:
    from tests.kernel.support import execute

    _, client = kernel
    live: list[tuple[float, str]] = []
    start = time.monotonic()

    def watch(msg: dict) -> None:
        if msg["msg_type"] in ("display_data", "update_display_data") and "workbench-live-" in str(
                msg["content"].get("transient")):
            live.append((time.monotonic() - start, msg["content"]["data"]["text/plain"]))

    out = execute(client, "import time\nt = torch.ones(1, device=device)\nif rank == 1:\n    time.sleep(4)\n"
                          "dist.all_reduce(t)\nt.item()", timeout=120, on_output=watch)
    assert out.reply["status"] == "ok" and out.result == "2.0", out.error_text
    count = out.reply["execution_count"]
    during = [text for at, text in live if at < 4.0]
    assert during, live
    print("\nlive view under NCCL:\n" + during[-1] + "\nthen: " + live[-1][1])
    text = during[-1]
    # rank 0's all_reduce returned at once (NCCL queues it); it waits in item() for the GPU
    assert re.search(rf"rank 0 +GPU busy In \[{count}\] line 6: t\.item\(\) \(the GPU has not finished its "
                     r"all_reduce #\d+ on group default \(ranks 0,1\)\)", text), text
    assert re.search(rf"rank 1 +running In \[{count}\] line 4: time\.sleep\(4\)", text), text
    assert live[-1][1].startswith("cell ran ") and "on 2 ranks" in live[-1][1], live[-1]


def test_the_flight_recorder_names_the_call_each_rank_reached_and_the_interrupt_still_frees_them(
        recorder_kernel: tuple[Any, Any]) -> None:
    from tests.kernel.support import execute

    _, client = recorder_kernel
    pids = _rank_pids(client)
    assert sorted(pids) == [0, 1], pids
    execute(client, "kept = 10 + rank\nx = torch.ones(1, device=device)\ndist.all_reduce(x)\nx.item()")
    try:
        out, report, ended, again = _hang_then_next_cell(
            recorder_kernel, "t = torch.ones(1, device=device)\nif rank == 0:\n    dist.all_reduce(t)\n    t.item()\n")
    finally:
        print("\nrank threads after the hang:\n" + _threads(pids))
    stderr = out.streams["stderr"]
    print(stderr)
    assert report < HANG_TIMEOUT + 5, (report, stderr)
    assert "flight recorder (torch's; each rank's last collectives, newest first):" in stderr, stderr
    reached = {int(r): (int(seq), state) for r, seq, state in re.findall(
        r"^  rank (\d): all_reduce #(\d+) on group 0 \(default_pg(?:, ranks 0,1)?\) (\w+)", stderr, re.M)}
    assert set(reached) == {0, 1}, stderr
    assert reached[0][0] == reached[1][0] + 1 and reached[1][1] == "completed", reached  # rank 0: one call more
    assert reached[0][1] in ("scheduled", "started"), reached  # never completed: its peer did not come
    assert "process groups re-created on every rank" in stderr, stderr
    assert ended < HANG_TIMEOUT + 30, ended
    assert again.reply["status"] == "ok" and again.result == "(3.0, 10)", again.error_text


def test_with_the_recorder_a_rank_alone_in_its_first_call_on_a_group_is_still_freed(
        recorder_kernel: tuple[Any, Any]) -> None:
    from tests.kernel.support import execute

    _, client = recorder_kernel
    pids = _rank_pids(client)
    execute(client, "kept = 10 + rank")
    try:
        out, report, ended, again = _hang_then_next_cell(
            recorder_kernel, "g = dist.new_group([0, 1])\nx = torch.ones(1, device=device)\nif rank == 0:\n"
                             "    dist.all_reduce(x, group=g)\n    x.item()\n")
    finally:
        print("\nrank threads after the hang:\n" + _threads(pids))
    stderr = out.streams["stderr"]
    print(stderr)
    assert report < HANG_TIMEOUT + 5, (report, stderr)
    assert ": all_reduce #1 on group " in stderr, stderr  # from the ledger: the call that sets the group up
    recorded = re.findall(r"^  ranks? ([\d,-]+): (.*)$", stderr.split("flight recorder (torch's;")[-1], re.M)
    assert {r for ranks, _ in recorded for r in ranks.split(",")} >= {"0", "1"}, stderr  # every rank answered
    assert "process groups re-created on every rank" in stderr, stderr
    assert ended < HANG_TIMEOUT + 30, ended
    assert again.reply["status"] == "ok" and again.result == "(3.0, 10)", again.error_text
