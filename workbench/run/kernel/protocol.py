"""What the kernel and its ranks say to each other over ZMQ: JSON messages, one connection string.

The kernel binds a ROUTER socket; every rank connects one DEALER whose identity is its global rank. Messages are
JSON objects with an ``op`` (never pickles: a rank's port may face a cluster network). A connection string
carries the address and the kernel's token, which a rank must present before the kernel talks to it:
``tcp://10.0.0.5:5555#3f9c...``.

kernel -> rank: ``execute`` (code, ranks shown), ``stacks``, ``interrupt``, ``release`` (close the process groups'
connections and destroy the groups, so peers stuck in a collective get an error), ``reinit`` (new process
groups), ``complete``, ``exit``.
rank -> kernel: ``hello``, ``stream``, ``display``, ``clear_output``, ``comm``, ``done``, ``stacks``,
``complete``, ``released``, ``reinit_done``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["ENV_CONNECT", "ENV_KERNEL_PID", "Connection", "decode", "encode"]

ENV_CONNECT = "WORKBENCH_KERNEL_CONNECT"  # set by the kernel for the ranks it starts itself
ENV_KERNEL_PID = "WORKBENCH_KERNEL_PID"  # local ranks exit when this process is gone


@dataclass(frozen=True, slots=True)
class Connection:
    """Where a rank finds its kernel (``address``: a ZMQ endpoint) and the ``token`` it must present."""

    address: str
    token: str

    @classmethod
    def parse(cls, text: str) -> Connection:
        """``"tcp://host:port#token"`` -> Connection; a clear error for anything else."""
        address, sep, token = text.strip().partition("#")
        if not sep or not token or not address.startswith("tcp://") or ":" not in address[len("tcp://"):]:
            raise ValueError(f"kernel connection {text!r}: expected tcp://HOST:PORT#TOKEN, as the kernel prints "
                             "in its first cell (%ranks_connect) or its log")
        return cls(address, token)

    def __str__(self) -> str:
        return f"{self.address}#{self.token}"


def encode(message: dict[str, Any]) -> bytes:
    """A message as bytes on the wire."""
    return json.dumps(message, separators=(",", ":"), default=str).encode()


def decode(frame: bytes) -> dict[str, Any]:
    """Bytes from the wire -> message; raises ValueError on anything that is not a JSON object with an op."""
    message = json.loads(frame)
    if not isinstance(message, dict) or "op" not in message:
        raise ValueError("not a workbench kernel message")
    return message
