"""The stores through which one host's ranks meet: files only this user can open, no socket at all.

torch's elastic agent hosts two ``TCPStore`` servers of its own (the rendezvous store and the store it shares with
its workers). They bind every interface and have no token, and the rendezvous state in them is a pickle the agent
loads again and again: whoever reaches the port can read and write every key of the process groups' set-up, and run
code in the agent. Binding them to 127.0.0.1 only narrows that to every user of the host. For ranks that all run on
this host (``wb.launch`` and a kernel's local ranks) the launching process makes a directory only its user can open
(``PrivateStore``) and the ranks meet through two ``FileStore`` files in it:

* the agent's rendezvous (c10d, ``store_type=file``), with no store of the agent's own for its workers
  (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; the ``MASTER_ADDR``/``MASTER_PORT`` it still sets name a port nobody
  hosts);
* the ranks' process group, whose file the ranks find in ``ENV_STORE``, under ``RANKS_PREFIX``;
* gloo and NCCL's bootstrap listen on the loopback interface (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``, unless
  the caller chose an interface). Those listeners are torch's and have no token either: they are reachable from
  this host only.

Ranks on several hosts still meet through the agent's TCP store on every interface: those hosts must reach it.

A store records who made it (``owner.json``: host, pid, boot id and PID namespace). One whose maker was killed
(``SIGKILL``, the out-of-memory killer: no ``close()`` ran) is removed by the next store made in the same temporary
folder, once its maker's pid is gone in this PID space and nothing in it changed for ``ABANDONED_AFTER`` seconds
(its ranks and agent end within seconds of their kernel). A store of another host, boot or PID namespace, or with no
record, is left alone.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Any

from workbench.pid_space import PidSpace, in_this_pid_space, this_pid_space

__all__ = [
    "ABANDONED_AFTER",
    "ENV_STORE",
    "RANKS_PREFIX",
    "PrivateStore",
    "connect_store",
    "inherited_variables",
    "remove_abandoned_stores",
    "store_path",
]

ENV_STORE = "WORKBENCH_STORE"
RANKS_PREFIX = "workbench/ranks"
_LOOPBACK_IFNAME = "lo"  # Linux's loopback interface, which gloo and NCCL bind by name
_ENV_CHOSEN = "WORKBENCH_STORE_IFNAMES"  # which of the interface variables the store chose (not the user)
_PREFIX = "workbench-store-"
_OWNER = "owner.json"
_MAX_OWNER_BYTES = 4096
ABANDONED_AFTER = 60.0
"""Seconds a store whose maker is gone must have been left unchanged before another store removes it."""


class PrivateStore:
    """A directory only this user can open (``mkdtemp``: mode 0700) holding the agent's rendezvous file and the
    ranks' store file; ``close()`` (or the ``with`` block's end) removes it."""

    def __init__(self) -> None:
        remove_abandoned_stores(tempfile.gettempdir())
        self.directory = tempfile.mkdtemp(prefix=_PREFIX)
        space = this_pid_space()
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "boot": space.boot, "namespace": space.namespace}
        with open(os.path.join(self.directory, _OWNER), "x") as f:
            json.dump(owner, f)

    @property
    def rendezvous(self) -> str:
        """The agent's c10d rendezvous endpoint: its ``FileStore``'s file."""
        return os.path.join(self.directory, "rendezvous")

    @property
    def ranks(self) -> str:
        """The ranks' ``FileStore`` file (the value of ``ENV_STORE``)."""
        return os.path.join(self.directory, "ranks")

    def agent_environment(self, environ: dict[str, str] | None = None) -> dict[str, str]:
        """The variables the agent and its ranks need: the ranks' store, no agent-hosted store, and gloo and NCCL on
        the loopback interface (where ``environ`` names no interface of its own)."""
        environ = os.environ if environ is None else environ
        extra = {ENV_STORE: self.ranks, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        if sys.platform.startswith("linux"):
            chosen = [n for n in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not environ.get(n)]
            extra.update({n: _LOOPBACK_IFNAME for n in chosen})
            extra[_ENV_CHOSEN] = ",".join(chosen)
        return extra

    @staticmethod
    def agent_rendezvous() -> dict[str, Any]:
        """The c10d rendezvous settings that make the agent meet through the file ``rendezvous``."""
        return {"store_type": "file"}

    def close(self) -> None:
        """Remove the directory and its files (the ranks and the agent are done with them)."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PrivateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_abandoned_stores(folder: str, *, after: float = ABANDONED_AFTER) -> list[str]:
    """Remove the stores in ``folder`` (this user's) whose maker's pid is gone in this PID space and in which nothing
    changed for ``after`` seconds; returns the removed directories. Any store it cannot judge is kept."""
    removed = []
    try:
        entries = [e for e in os.scandir(folder) if e.name.startswith(_PREFIX)]
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            if not _abandoned(entry.path, now - after):
                continue
        except OSError:  # gone meanwhile, or unreadable: not ours to judge
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _abandoned(directory: str, changed_before: float) -> bool:
    """Whether the store at ``directory`` names a maker in this PID space whose pid no longer runs, and neither it
    nor a file in it changed after ``changed_before`` (epoch seconds)."""
    with open(os.path.join(directory, _OWNER), "rb") as f:
        raw = f.read(_MAX_OWNER_BYTES + 1)
    if len(raw) > _MAX_OWNER_BYTES:
        return False
    try:
        owner = json.loads(raw)
        host, pid = str(owner["host"]), int(owner["pid"])
        space = PidSpace(str(owner.get("boot", "")), str(owner.get("namespace", "")))
    except (ValueError, KeyError, TypeError):
        return False
    if not in_this_pid_space(host, space) or pid <= 0 or _running(pid):
        return False
    with os.scandir(directory) as inside:
        times = [os.stat(directory).st_mtime, *(e.stat(follow_symlinks=False).st_mtime for e in inside)]
    return max(times) < changed_before


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process has this pid
        return True
    return True


def inherited_variables(environ: dict[str, str] | None = None) -> list[str]:
    """The variables a launch that makes no store must not pass on (its ranks meet through the agent's store, maybe
    across hosts): the store made for the ranks this process belongs to (a kernel's rank launching ranks of its
    own), the loopback interface chosen for them, and the note of what was chosen."""
    environ = os.environ if environ is None else environ
    chosen = [n for n in environ.get(_ENV_CHOSEN, "").split(",") if n and environ.get(n) == _LOOPBACK_IFNAME]
    return [n for n in (ENV_STORE, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", _ENV_CHOSEN, *chosen) if n in environ]


def store_path() -> str | None:
    """The ranks' store file from ``ENV_STORE``, or None when this rank was not started with one (ranks of several
    hosts, or a torchrun of the user's own)."""
    return os.environ.get(ENV_STORE) or None


def connect_store(path: str) -> Any:
    """The ranks' store at ``path``, scoped to their keys (``RANKS_PREFIX``)."""
    import torch.distributed as dist

    return dist.PrefixStore(RANKS_PREFIX, dist.FileStore(path, -1))
