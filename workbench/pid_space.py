"""Which processes a pid names.

A pid means something only inside one PID namespace of one boot of one kernel. Containers often share a host name
(or run with the node's), and each has its own pid 1, 2, ...: a host name and a pid say nothing about a process until
the boot and the PID namespace match too. Whatever acts on a pid another process reported (an owner marker's liveness,
a signal for a rank's stacks) first checks ``in_this_pid_space``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

__all__ = ["PidSpace", "in_this_pid_space", "this_pid_space"]


@dataclass(frozen=True, slots=True)
class PidSpace:
    """A kernel's boot id and a PID namespace of it, as ``/proc`` names them; empty where the kernel does not say."""

    boot: str = ""
    namespace: str = ""

    @property
    def known(self) -> bool:
        """Whether both are recorded (an unknown space matches no known one; see ``in_this_pid_space``)."""
        return bool(self.boot) and bool(self.namespace)


def this_pid_space() -> PidSpace:
    """This process's boot id (``/proc/sys/kernel/random/boot_id``) and PID namespace (``pid:[4026531836]``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return PidSpace(boot, namespace)


def in_this_pid_space(host: str, space: PidSpace) -> bool:
    """True when a pid reported from ``host`` in ``space`` names a process this one can look up and signal: the same
    host name, boot and PID namespace. Where neither side names its PID space (a kernel without ``/proc``), the host
    name is all there is to go by, as it was before spaces were recorded."""
    if host != socket.gethostname():
        return False
    here = this_pid_space()
    if not space.known and not here.known:
        return True
    return space.known and space == here
