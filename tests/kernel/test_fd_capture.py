"""FdCapture: descriptors 1 and 2 read through pipes, in a child process whose own descriptors lead to files."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from workbench.kernel import fd_capture
from workbench.kernel.fd_capture import _MARK, _partial_mark


def _run_child(tmp_path: Path, body: str) -> tuple[str, str, str]:
    """Run ``body`` with an FdCapture whose deliveries are recorded; return (delivered, fd 1's file, fd 2's file)."""
    script = textwrap.dedent("""
        import ctypes, os, subprocess, sys, threading
        from workbench.kernel.fd_capture import FdCapture
        got, lock = [], threading.Lock()
        def deliver(name, text):
            with lock:
                got.append((name, text))
        capture = FdCapture()
        capture.start(deliver)
    """) + textwrap.dedent(body) + textwrap.dedent("""
        capture.stop()
        with open(sys.argv[1], "w") as f:
            f.write(repr(got))
    """)
    record = tmp_path / "delivered.txt"
    with open(tmp_path / "out.txt", "wb") as out, open(tmp_path / "err.txt", "wb") as err:
        subprocess.run([sys.executable, "-c", script, str(record)], stdout=out, stderr=err, check=True, timeout=60)
    return record.read_text(), (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()


def test_native_and_child_output_is_delivered_in_order_before_sync_returns(tmp_path: Path) -> None:
    delivered, out, err = _run_child(tmp_path, """
        os.write(1, b"one\\n")
        ctypes.CDLL(None).write(2, b"two\\n", 4)
        subprocess.run(["echo", "three"], check=True)
        assert capture.sync(5)
        with lock:
            seen = list(got)
        capture.logs["stderr"].write("to the log\\n")
        print("after sync:", seen, file=capture.logs["stdout"], flush=True)
    """)
    pieces = eval(delivered)
    assert "".join(t for n, t in pieces if n == "stdout") == "one\nthree\n"
    assert "".join(t for n, t in pieces if n == "stderr") == "two\n"
    # sync returned after every piece had been delivered; the logs reach the original descriptors directly
    assert out == f"after sync: {pieces!r}\n"
    assert err == "to the log\n"


def test_a_mark_split_across_reads_is_never_shown_and_text_around_it_is_kept(tmp_path: Path) -> None:
    capture = fd_capture.FdCapture.__new__(fd_capture.FdCapture)  # only the text handling, no descriptors
    import codecs
    import threading

    capture._decoders = {"stdout": codecs.getincrementaldecoder("utf-8")("replace")}
    capture._carry, capture._marks, capture._seen = {"stdout": b""}, {"stdout": 0}, threading.Condition()
    got: list[str] = []
    capture._deliver = lambda name, text: got.append(text)
    data = "héllo ".encode() + _MARK + b"world\n" + _MARK
    for cut in range(1, len(data)):
        got.clear()
        capture._marks["stdout"] = 0
        capture._take("stdout", data[:cut], final=False)
        capture._take("stdout", data[cut:], final=False)
        assert "".join(got) == "héllo world\n", cut
        assert capture._marks["stdout"] == 2, cut
    assert _partial_mark(b"abc" + _MARK[:5]) == 5 and _partial_mark(b"abc") == 0


def test_stop_points_the_descriptors_back_at_the_logs(tmp_path: Path) -> None:
    delivered, out, err = _run_child(tmp_path, """
        os.write(1, b"captured\\n")
        capture.sync(5)
        capture.stop()
        os.write(1, b"after stop\\n")
        os.write(2, b"err after stop\\n")
    """)
    assert eval(delivered) == [("stdout", "captured\n")]
    assert out == "after stop\n" and err == "err after stop\n"


def test_a_descriptor_pointed_at_a_file_gets_no_mark_and_sync_does_not_wait_for_it(tmp_path: Path) -> None:
    # a cell that sends a C library's chatter to a file with dup2: the marks went into that file, and every later
    # cell waited the whole timeout for them
    own = tmp_path / "own.txt"
    delivered, out, _ = _run_child(tmp_path, f"""
        import time
        f = open({str(own)!r}, "wb")
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        os.write(1, b"to the file\\n")
        start = time.monotonic()
        synced = capture.sync(5)
        took = time.monotonic() - start
        os.dup2(saved, 1)
        os.write(1, b"captured again\\n")
        capture.sync(5)
        print(synced, took < 1, file=capture.logs["stdout"], flush=True)
    """)
    assert own.read_bytes() == b"to the file\n"
    assert out == "True True\n"
    assert "".join(t for n, t in eval(delivered) if n == "stdout") == "captured again\n"
