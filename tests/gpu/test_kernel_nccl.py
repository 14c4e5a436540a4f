"""The launcher kernel on 2 GPUs (NCCL), driven over Jupyter's protocol (skipped without 2 CUDA devices).

An FSDP2 model saved with ``wb.save_hf`` from cells and loaded back bit for bit; then the two NCCL hangs of
issue 21, each reported within ``hang_timeout`` + 5 s and freed by the interrupt without a restart (every rank's
communicators aborted, new process groups made, variables kept), after which a collective works:

* rank 0 alone runs ``dist.all_reduce(t); t.item()``: the all_reduce returns at once (NCCL queues it), the
  ``item()`` waits in a CUDA sync for a kernel that never ends;
* rank 0 alone makes the first call on a group made in the same cell.

Run on a 2-GPU machine: ``PYTHONPATH=. python -m pytest -q tests/gpu/test_kernel_nccl.py``.
"""

from __future__ import annotations

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
    from jupyter_client.manager import start_new_kernel

    from tests.kernel.support import execute, jupyter_path
    from workbench.run.kernel.spec import install_kernel

    prefix = tmp_path_factory.mktemp("jupyter-prefix")
    install_kernel(nprocs=2, backend="nccl", name="wb-nccl-2", prefix=str(prefix))
    with jupyter_path(Path(prefix)):
        manager, client = start_new_kernel(kernel_name="wb-nccl-2", startup_timeout=300)
    try:
        first = execute(client, "(dist.get_backend(), str(device), torch.cuda.current_device())", timeout=300)
        assert first.result == "('nccl', 'cuda:0', 0)", first.error_text
        yield manager, client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)


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
