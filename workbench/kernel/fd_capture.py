"""What a rank's native code and child processes write to a file descriptor (its stdout, 1), read back as text.

``sys.stdout`` of a rank is a Python object the kernel replaced; ``os.system``, a subprocess, NCCL's debug lines
write to the descriptor underneath it, which would reach only the ranks' log. ``FdCapture`` points descriptors at
pipes and reads them on a thread of its own, handing each piece of text to a callback (the rank sends it to the
notebook). The rank captures descriptor 1 only: descriptor 2 stays the log, because what native code writes there
just before it aborts (``std::terminate``'s reason, glibc's ``double free``) would die in a pipe whose reader never
ran again.

Whatever must reach the log itself writes to ``logs[name]``: a duplicate of the descriptor as it was, never the
pipe. ``sync`` returns once everything written to the pipes before it has been handed over: a cell's last native
line is shown with the cell, not after it.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import select
import threading
from collections.abc import Callable
from typing import TextIO

__all__ = ["FdCapture"]

_MARK = b"\x00workbench-fd-sync\x00"  # written by sync through each pipe, atomic (shorter than PIPE_BUF), never shown
_STREAMS = (("stdout", 1), ("stderr", 2))


class FdCapture:
    """Descriptors of this process (``streams``: name and number; default 1 and 2), read through pipes (see the
    module docstring).

    Made in two steps: the constructor redirects the descriptors and opens the logs; ``start(deliver)`` starts the
    reading thread, which calls ``deliver(name, text)`` (``name``: ``"stdout"`` or ``"stderr"``) from that thread.
    """

    def __init__(self, streams: tuple[tuple[str, int], ...] = _STREAMS) -> None:
        self._streams = streams
        self._saved: dict[str, int] = {}
        self._pipes: dict[str, tuple[int, int]] = {}  # name -> the write end's (device, inode)
        self._read_fds: dict[int, str] = {}
        self._decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name, _ in streams}
        self._carry = {name: b"" for name, _ in streams}
        self._marks = dict.fromkeys(self._decoders, 0)
        self._seen = threading.Condition()
        self._thread: threading.Thread | None = None
        self._deliver: Callable[[str, str], None] | None = None
        self._stopped = False
        self.logs: dict[str, TextIO] = {}
        for name, fd in streams:
            saved = os.dup(fd)  # not inheritable (PEP 446): a child process writes to the pipe, never to the log
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)  # inheritable: children write here
            os.close(write_end)
            info = os.fstat(fd)
            self._saved[name], self._read_fds[read_end], self._pipes[name] = saved, name, (info.st_dev, info.st_ino)
            self.logs[name] = open(os.dup(saved), "w", encoding="utf-8", errors="replace", buffering=1)  # noqa: SIM115

    def start(self, deliver: Callable[[str, str], None]) -> None:
        """Start handing what arrives on the pipes to ``deliver(name, text)``, on a daemon thread."""
        self._deliver = deliver
        self._thread = threading.Thread(target=self._read_loop, name="workbench-fd-capture", daemon=True)
        self._thread.start()

    def sync(self, timeout: float = 1.0) -> bool:
        """Return once what was written to the descriptors before this call has been delivered (False when that
        took longer than ``timeout`` seconds). A descriptor the process pointed elsewhere (``dup2`` onto a file, or
        closed and reused) gets no mark: marks go only into this capture's own pipes, never into a user's file."""
        if self._thread is None or self._stopped:
            return True
        with self._seen:
            wanted = {}
            for name, fd in self._streams:
                if self._leads_to_pipe(name, fd):
                    wanted[name] = self._marks[name] + 1
        for name, fd in self._streams:
            if name in wanted:
                try:
                    os.write(fd, _MARK)
                except OSError:
                    del wanted[name]
        with self._seen:
            return self._seen.wait_for(lambda: all(self._marks[n] >= wanted[n] for n in wanted), timeout)

    def _leads_to_pipe(self, name: str, fd: int) -> bool:
        try:
            info = os.fstat(fd)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == self._pipes[name]

    def stop(self, timeout: float = 1.0) -> None:
        """Point descriptors 1 and 2 back at the logs, deliver what the pipes still hold (for up to ``timeout``
        seconds: a child process may keep its end open), and stop the thread."""
        if self._stopped:
            return
        self._stopped = True
        for name, fd in self._streams:
            if self._leads_to_pipe(name, fd):  # one the process pointed elsewhere stays where it points
                with contextlib.suppress(OSError):
                    os.dup2(self._saved[name], fd)
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the reading thread --------------------------------------------------------------------------------
    def _read_loop(self) -> None:
        open_fds = dict(self._read_fds)
        while open_fds:
            try:
                ready, _, _ = select.select(list(open_fds), [], [], 0.1)
            except (OSError, ValueError):
                break
            if not ready:
                if self._stopped:  # drained; a child process may still hold a pipe open: it no longer matters
                    break
                continue
            for read_fd in ready:
                try:
                    data = os.read(read_fd, 1 << 16)
                except OSError:
                    data = b""
                name = open_fds[read_fd]
                if not data:
                    del open_fds[read_fd]
                    self._take(name, b"", final=True)
                    continue
                self._take(name, data, final=False)
        for name in self._decoders:
            self._take(name, b"", final=True)
        for read_fd in self._read_fds:
            with contextlib.suppress(OSError):
                os.close(read_fd)

    def _take(self, name: str, data: bytes, final: bool) -> None:
        """Drop the sync marks out of ``data``, count them, and deliver the rest as text."""
        buffer = self._carry[name] + data
        marks = buffer.count(_MARK)
        if marks:
            buffer = buffer.replace(_MARK, b"")
        keep = 0 if final else _partial_mark(buffer)
        self._carry[name] = buffer[len(buffer) - keep:] if keep else b""
        text = self._decoders[name].decode(buffer[:len(buffer) - keep], final=final)
        if text and self._deliver is not None:
            try:
                self._deliver(name, text)
            except Exception:  # a delivery that fails must not stop the reading: the pipe would fill and block
                with contextlib.suppress(Exception):
                    self.logs[name].write(text)
        if marks:
            with self._seen:
                self._marks[name] += marks
                self._seen.notify_all()


def _partial_mark(buffer: bytes) -> int:
    """How many bytes at the end of ``buffer`` could begin a mark whose rest has not arrived yet."""
    for size in range(min(len(_MARK) - 1, len(buffer)), 0, -1):
        if buffer.endswith(_MARK[:size]):
            return size
    return 0
