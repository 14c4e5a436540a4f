"""What ranks print after their cell ended (a thread the cell started, native code) is shown under that cell, folded
as while it ran: ipykernel shows a thread's output under the last cell (its parent header), it used to reach only
the ranks' log."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.support import execute, jupyter_path
from workbench.kernel.spec import install_kernel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from jupyter_client.manager import start_new_kernel

    prefix = tmp_path_factory.mktemp("jupyter-prefix")
    install_kernel(nprocs=2, backend="gloo", name="wb-test-late", prefix=str(prefix))
    with jupyter_path(Path(prefix)):
        manager, client = start_new_kernel(kernel_name="wb-test-late", startup_timeout=120)
    try:
        assert execute(client, "rank").result == "0"  # the ranks joined: later cells start at once
        yield client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def _later(seconds: float) -> str:
    """A cell that starts a thread printing ``seconds`` after the cell ran (one wall-clock instant for both ranks, so
    their lines arrive together), from Python and from a child process (descriptor 1)."""
    return ("import os, threading, time\n"
            f"at = [time.time() + {seconds!r}]\n"
            "dist.broadcast_object_list(at, src=0)\n"
            "def later():\n"
            "    time.sleep(max(0.0, at[0] - time.time()))\n"
            "    print('late on every rank', flush=True)\n"
            "    print('late from rank', rank, flush=True)\n"
            "    os.system('echo native late')\n"
            "threading.Thread(target=later, daemon=True).start()")


def _late_stdout(client: Any, code: str, expected: str, within: float = 30) -> str:
    """Run ``code``, then collect what comes on stdout under its parent header after it ended, up to ``expected``."""
    ids: set[str] = set()
    out = execute(client, code, on_output=lambda msg: ids.add(msg["parent_header"]["msg_id"]))
    assert out.reply["status"] == "ok" and out.streams["stdout"] == "", out
    text = ""
    deadline = time.monotonic() + within
    while len(text) < len(expected) and time.monotonic() < deadline:
        try:
            msg = client.get_iopub_msg(timeout=1)
        except Exception:  # queue.Empty: nothing yet
            continue
        if msg["msg_type"] == "stream" and msg["parent_header"].get("msg_id") in ids:
            text += msg["content"]["text"]
    return text


def test_a_threads_output_after_its_cell_ended_is_shown_under_it_folded(client: Any) -> None:
    expected = "late on every rank\n[0] late from rank 0\n[1] late from rank 1\nnative late\n"
    assert _late_stdout(client, _later(2.0), expected) == expected
    out = execute(client, "import os\nprint(open(os.environ['WORKBENCH_KERNEL_RUN_DIR'] + '/ranks.log').read().count("
                          "'late'))")
    assert out.streams["stdout"] == "0\n"  # not in the log any more


def test_rank_output_0_shows_only_the_lowest_ranks_late_output(client: Any) -> None:
    execute(client, "%rank_output 0")
    try:
        expected = "late on every rank\nlate from rank 0\nnative late\n"
        assert _late_stdout(client, _later(2.0), expected) == expected
    finally:
        execute(client, "%rank_output folded")
