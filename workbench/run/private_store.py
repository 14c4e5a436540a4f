"""The store through which one host's ranks meet, reachable from this host only.

torch's elastic agent hosts two ``TCPStore`` servers of its own (the rendezvous store and the store it shares with
its workers) and they bind every interface: no bind address can be given, and a store has no token, so any host
that reaches the port could read and write the keys through which the ranks set up their process groups. For ranks
that all run on this host (``wb.launch`` and a kernel's local ranks) the launching process hosts the one store
instead, on a socket it binds to 127.0.0.1 (``TCPStore(master_listen_fd=...)``):

* the agent joins it as a client (c10d rendezvous, ``is_host=false``) and is told not to host a store of its own
  (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``);
* the ranks find it in ``ENV_STORE`` (not ``MASTER_ADDR``/``MASTER_PORT``, which the agent sets to a port nobody
  hosts then) and join the process group through it, under ``RANKS_PREFIX``;
* gloo and NCCL's bootstrap listen on the loopback interface too (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``,
  unless the caller chose an interface).

Ranks on several hosts still meet through the agent's store on every interface: those hosts must reach it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from datetime import timedelta
from typing import Any

__all__ = ["ENV_STORE", "RANKS_PREFIX", "LoopbackStore", "connect_store", "inherited_variables", "store_address"]

ENV_STORE = "WORKBENCH_STORE"
RANKS_PREFIX = "workbench/ranks"
_LOOPBACK = "127.0.0.1"
_LOOPBACK_IFNAME = "lo"  # Linux's loopback interface, which gloo and NCCL bind by name
_ENV_CHOSEN = "WORKBENCH_STORE_IFNAMES"  # which of the interface variables the store chose (not the user)


class LoopbackStore:
    """A ``TCPStore`` server hosted by this process on 127.0.0.1 only; ``close()`` (or the ``with`` block's end)
    stops it."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._socket.bind((_LOOPBACK, 0))
            self._socket.listen(socket.SOMAXCONN)
            self.port: int = self._socket.getsockname()[1]
            # the store's server owns (and closes) the descriptor it is given: a duplicate, so that this object
            # closes only its own and never a number the server already gave back to the process
            served = os.dup(self._socket.fileno())
        except BaseException:
            self._socket.close()
            raise
        try:
            self._store: Any = dist.TCPStore(
                _LOOPBACK, self.port, is_master=True, wait_for_workers=False, multi_tenant=True,
                master_listen_fd=served, timeout=timedelta(minutes=10))
        except BaseException:  # whether the server closed ``served`` is not known: left as it is, not closed twice
            self._socket.close()
            raise

    @property
    def endpoint(self) -> str:
        """``HOST:PORT`` of the store, as a rendezvous endpoint and as the value of ``ENV_STORE``."""
        return f"{_LOOPBACK}:{self.port}"

    def agent_environment(self, environ: dict[str, str] | None = None) -> dict[str, str]:
        """The variables the agent and its ranks need: the store's address, no agent-hosted store, and gloo and
        NCCL on the loopback interface (where ``environ`` names no interface of its own)."""
        environ = os.environ if environ is None else environ
        extra = {ENV_STORE: self.endpoint, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        if sys.platform.startswith("linux"):
            chosen = [n for n in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not environ.get(n)]
            extra.update({n: _LOOPBACK_IFNAME for n in chosen})
            extra[_ENV_CHOSEN] = ",".join(chosen)
        return extra

    @staticmethod
    def agent_rendezvous() -> dict[str, Any]:
        """The c10d rendezvous settings that make the agent a client of this store."""
        return {"is_host": False}

    def close(self) -> None:
        """Stop serving: the store's server ends with the last reference (closing its descriptor), and this
        object's own socket is closed."""
        self._store = None
        with contextlib.suppress(OSError):
            self._socket.close()

    def __enter__(self) -> LoopbackStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def inherited_variables(environ: dict[str, str] | None = None) -> list[str]:
    """The variables a launch that hosts no store must not pass on (its ranks meet through the agent's store, maybe
    across hosts): the address of a store hosted for the ranks this process belongs to (a kernel's rank launching
    ranks of its own), the loopback interface chosen for them, and the note of what was chosen."""
    environ = os.environ if environ is None else environ
    chosen = [n for n in environ.get(_ENV_CHOSEN, "").split(",") if n and environ.get(n) == _LOOPBACK_IFNAME]
    return [n for n in (ENV_STORE, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", _ENV_CHOSEN, *chosen) if n in environ]


def store_address() -> tuple[str, int] | None:
    """The ``(host, port)`` of the launcher's loopback store from ``ENV_STORE``, or None when this rank was not
    started with one (ranks of several hosts, or a torchrun of the user's own)."""
    value = os.environ.get(ENV_STORE)
    if not value:
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{ENV_STORE}={value!r} is not HOST:PORT")
    return host, int(port)


def connect_store(address: tuple[str, int], timeout: timedelta = timedelta(minutes=10)) -> Any:
    """A client of the launcher's store at ``address``, scoped to the ranks' keys (``RANKS_PREFIX``)."""
    import torch.distributed as dist

    host, port = address
    client = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return dist.PrefixStore(RANKS_PREFIX, client)
