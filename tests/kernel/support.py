"""Drive a workbench kernel through jupyter_client, the protocol layer under nbclient and JupyterLab."""

from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class CellOutput:
    """Everything one execute_request produced on iopub, plus its reply."""

    reply: dict[str, Any]
    streams: dict[str, str] = field(default_factory=lambda: {"stdout": "", "stderr": ""})
    results: list[dict[str, Any]] = field(default_factory=list)
    displays: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)

    @property
    def result(self) -> str | None:
        return self.results[0]["text/plain"] if self.results else None

    @property
    def error_text(self) -> str:
        return "\n".join(ANSI.sub("", line) for e in self.errors for line in e["traceback"])


def execute(client: Any, code: str, timeout: float = 120, on_output: Any = None, total: float | None = None
            ) -> CellOutput:
    """Run one cell and collect its outputs (``on_output(msg)`` sees each iopub message as it arrives). ``timeout``
    bounds the wait for each message; ``total`` (seconds) the whole cell: a live view's updates keep arriving while
    a cell hangs, so only ``total`` turns a hang into a failure."""
    msg_id = client.execute(code)
    out = CellOutput(reply={})
    end = None if total is None else time.monotonic() + total
    while True:
        if end is not None and time.monotonic() > end:
            raise TimeoutError(f"the cell did not end within {total:g} s: {code!r}")
        msg = client.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if on_output is not None:
            on_output(msg)
        if kind == "status" and content["execution_state"] == "idle":
            break
        if kind == "stream":
            out.streams[content["name"]] += content["text"]
        elif kind == "execute_result":
            out.results.append(content["data"])
        elif kind == "display_data":
            out.displays.append(content["data"])
        elif kind == "error":
            out.errors.append(content)
    while True:
        reply = client.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            out.reply = reply["content"]
            return out


@contextmanager
def jupyter_path(prefix: Path):
    """Let Jupyter find kernelspecs installed under ``prefix`` (as JUPYTER_PATH does for a user)."""
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (str(prefix / "share" / "jupyter"), old) if p)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = old
