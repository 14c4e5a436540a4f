"""Python stacks of a rank that cannot answer: faulthandler's dump, written by a C signal handler without the GIL.

A rank whose main thread sits in native code while holding the GIL (a C call made through ``ctypes.PyDLL``, an
extension that never releases it) cannot run its I/O thread, so it answers no stack request. At start every rank
``register``s ``SIGNAL`` with faulthandler into a file of its own; ``dump`` sends the signal to the rank's process
and returns what the handler wrote: every thread's Python frames, walked in C. It works from any process of the
rank's host (the kernel for ranks on its host, a peer rank for the others). ``parse`` picks the rank's main
thread out of the dump and ``format_frames`` shows it as ``traceback.format_stack`` would, with source lines
where the reader can see them.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TypeVar

K = TypeVar("K")

__all__ = ["SIGNAL", "Frame", "dump", "dump_all", "file_source", "format_frames", "parse", "register", "summarize"]

SIGNAL = signal.SIGUSR2  # SIGUSR1 stays faulthandler's dump into the rank's log, for people
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
# frames of the machinery between a rank's main loop and the user's cell, left out of stack reports
_MACHINERY = ("/IPython/", "/workbench/kernel/", "runpy", "/threading.py")


@dataclass(frozen=True, slots=True)
class Frame:
    """One Python frame of a native dump."""

    file: str
    line: int
    function: str


def register(path: str) -> IO[bytes]:
    """Rank side: from now on ``SIGNAL`` writes every thread's stack into ``path`` (mode 0600). Keep the file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    out = os.fdopen(fd, "wb", buffering=0)
    faulthandler.register(SIGNAL, file=out, all_threads=True, chain=False)
    return out


def dump(pid: int, path: str, timeout: float = 2.0) -> str | None:
    """Signal ``pid`` and return what its handler wrote to ``path``; None if it could not be signalled or wrote
    nothing within ``timeout`` seconds."""
    return dump_all({0: (pid, path)}, timeout)[0]


def dump_all(targets: dict[K, tuple[int, str]], timeout: float = 2.0) -> dict[K, str | None]:
    """``dump`` for several processes at once (all are signalled first): ``{key: (pid, path)}`` -> their text.

    The handler writes at once, in C; a dump is complete once its file stops growing for a moment."""
    start: dict[K, int] = {}
    for key, (pid, path) in targets.items():
        try:
            size = os.path.getsize(path)
            os.kill(pid, SIGNAL)
            start[key] = size
        except OSError:
            pass
    sizes = dict(start)
    grew_at: dict[K, float] = {}
    done: set[K] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(done) < len(start):
        time.sleep(0.01)
        now = time.monotonic()
        for key in start.keys() - done:
            with contextlib.suppress(OSError):
                size = os.path.getsize(targets[key][1])
                if size != sizes[key]:
                    sizes[key], grew_at[key] = size, now
                elif key in grew_at and now - grew_at[key] > 0.05:
                    done.add(key)
    out: dict[K, str | None] = dict.fromkeys(targets)
    for key in start:
        if sizes[key] > start[key]:
            with open(targets[key][1], "rb") as f:
                f.seek(start[key])
                out[key] = f.read(sizes[key] - start[key]).decode(errors="replace")
    return out


def parse(text: str, thread: int) -> list[Frame] | None:
    """The frames of thread ``thread`` (its ``threading`` ident) in a dump, innermost last; None if absent."""
    frames: list[Frame] | None = None
    current = None
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            current = int(head.group(1), 16)
            if current == thread:
                frames = []
            continue
        match = _FRAME.match(line)
        if match and current == thread and frames is not None:
            frames.append(Frame(match.group(1), int(match.group(2)), match.group(3)))
    return None if frames is None else frames[::-1]


def format_frames(frames: list[Frame], source: Callable[[str, int], str] | None = None) -> list[str]:
    """Frames as ``traceback.format_stack`` entries (``source(file, line)`` gives the line's text, or "")."""
    out = []
    for frame in frames:
        text = source(frame.file, frame.line).strip() if source is not None else ""
        out.append(f'  File "{frame.file}", line {frame.line}, in {frame.function}\n'
                   + (f"    {text}\n" if text else ""))
    return out


def file_source(file: str, line: int) -> str:
    """The text of ``line`` in ``file`` on this host ("" for none)."""
    import linecache

    return linecache.getline(file, line) if not file.startswith("<") else ""


def summarize(entries: list[str]) -> dict[str, object]:
    """Stack entries (``traceback.format_stack``'s, or ``format_frames``') as the kernel shows them: the frames
    from the cell in, whether the innermost is in ``torch.distributed``, and the innermost line of user code."""
    from workbench.run.launcher import _innermost_user_frame

    stack = [entry for entry in entries if not any(m in entry for m in _MACHINERY)]
    in_collective = bool(stack) and "/torch/distributed/" in stack[-1]
    where = _innermost_user_frame(stack) if stack else ""
    code = next((entry.strip().splitlines()[1].strip() for entry in reversed(stack)
                 if entry.strip().startswith(where) and len(entry.strip().splitlines()) > 1), "") if where else ""
    return {"stack": stack, "in_collective": in_collective, "where": where, "code": code}
