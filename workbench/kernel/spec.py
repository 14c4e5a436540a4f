"""Install, list and remove the launcher kernel's Jupyter kernelspecs (through jupyter_client)."""

from __future__ import annotations

import json
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from workbench.kernel.protocol import parse_listen

__all__ = ["KernelSpecInfo", "install_kernel", "list_kernels", "remove_kernel"]

_MARK = "workbench"  # kernelspec metadata key that marks our kernels


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelSpecInfo:
    """An installed workbench kernel: its name, where it lives, and the ranks it starts."""

    name: str
    path: str
    display_name: str
    nprocs: int
    backend: str
    listen: str | None

    def __str__(self) -> str:
        ranks = f"{self.nprocs} local rank(s)" if self.nprocs else f"ranks join at {self.listen}"
        return f"{self.name:<28} {ranks}, {self.backend}  ({self.path})"


def install_kernel(*, nprocs: int, backend: str = "gloo", name: str | None = None, user: bool = False,
                   prefix: str | None = None, listen: str | None = None, hang_timeout: float | None = None,
                   hang_action: str = "report", display_name: str | None = None, close_sockets: bool = True,
                   join_timeout: float | None = None, dead_after: float | None = None, live: bool = True,
                   flight_recorder: bool | None = None) -> str:
    """Write a kernelspec that starts ``nprocs`` local ranks (or waits for ranks at ``listen``); return its path.

    ``listen`` is ``HOST:PORT``, ``:PORT`` or ``PORT`` (host 127.0.0.1 then; ``0.0.0.0`` binds every interface,
    which the kernel warns about); ranks join with the token the kernel writes to a file of mode 0600 at start.

    ``close_sockets=False``: when ranks are left stuck in a gloo collective, only destroy the process groups
    instead of also closing every rank's TCP connections (sockets a cell opened itself are closed too otherwise);
    groups held alive by device meshes, FSDP modules or DTensors then keep stuck ranks stuck until a restart.

    ``join_timeout``: seconds the first cell waits for every rank to join (default 300); ``dead_after``: seconds a
    rank may be silent, its connection gone, before it is lost and the cell ends naming it (default 30).

    ``live=False``: no live view of running cells (``%live on`` still turns it on). ``flight_recorder=True``: hang
    reports add every rank's last collectives from torch's flight recorder, and the local ranks keep 2000 entries
    (``TORCH_FR_BUFFER_SIZE`` / ``TORCH_NCCL_TRACE_BUFFER_SIZE``); ``False``: never; ``None`` (default): only when
    the kernel's environment sets one of those above 0 (``%flight_recorder on|off`` changes it per session).

    Installs into ``prefix`` (``PREFIX/share/jupyter/kernels/NAME``), the user's Jupyter directory (``user``), or
    by default this Python environment (``sys.prefix``), where a JupyterLab of the same environment finds it.
    """
    from jupyter_client.kernelspec import KernelSpecManager

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: use gloo (CPU) or nccl (GPU)")
    if nprocs < 0 or (nprocs == 0 and not listen):
        raise ValueError(f"nprocs {nprocs}: give >= 1 local ranks, or 0 with listen=HOST:PORT for ranks a "
                         "scheduler starts")
    if user and prefix:
        raise ValueError("give user=True or prefix=DIR, not both")
    if hang_action not in ("report", "interrupt"):
        raise ValueError(f"hang_action {hang_action!r}: use report or interrupt")
    if listen:
        parse_listen(listen)  # a bad HOST:PORT fails here, not when the kernel starts
    if hang_timeout is not None and not 0 < hang_timeout < math.inf:  # 0 reports every cell; NaN never
        raise ValueError(f"hang_timeout {hang_timeout!r}: seconds must be > 0 and finite (or None: off)")
    for label, value, least in (("join_timeout", join_timeout, 0.0), ("dead_after", dead_after, 1.0)):
        if value is not None and not value > least:
            raise ValueError(f"{label} {value!r}: seconds must be > {least:g}")
    name = name or (f"workbench-{backend}-{nprocs}" if nprocs else f"workbench-{backend}-remote")
    where = f"{nprocs} ranks" if nprocs else "remote ranks"
    env = {"WORKBENCH_KERNEL_NPROCS": str(nprocs), "WORKBENCH_KERNEL_BACKEND": backend,
           "WORKBENCH_KERNEL_HANG_ACTION": hang_action}
    if listen:
        env["WORKBENCH_KERNEL_LISTEN"] = listen
    if not close_sockets:
        env["WORKBENCH_KERNEL_CLOSE_SOCKETS"] = "0"
    if hang_timeout is not None:
        env["WORKBENCH_KERNEL_HANG_TIMEOUT"] = f"{hang_timeout:g}"
    if join_timeout is not None:
        env["WORKBENCH_KERNEL_JOIN_TIMEOUT"] = f"{join_timeout:g}"
    if dead_after is not None:
        env["WORKBENCH_KERNEL_DEAD_AFTER"] = f"{dead_after:g}"
    if not live:
        env["WORKBENCH_KERNEL_LIVE"] = "off"
    if flight_recorder is not None:
        env["WORKBENCH_KERNEL_FLIGHT_RECORDER"] = "on" if flight_recorder else "off"
    if flight_recorder:  # the recorder's size is read once, when a rank makes its first process group
        env.update(TORCH_FR_BUFFER_SIZE="2000", TORCH_NCCL_TRACE_BUFFER_SIZE="2000")
    spec = {
        "argv": [sys.executable, "-m", "workbench.kernel.app", "-f", "{connection_file}"],
        "display_name": display_name or f"workbench SPMD ({where}, {backend})",
        "language": "python",
        "interrupt_mode": "signal",
        "env": env,
        "metadata": {_MARK: {"nprocs": nprocs, "backend": backend, "listen": listen}, "debugger": False},
    }
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "kernel.json").write_text(json.dumps(spec, indent=1))
        return KernelSpecManager().install_kernel_spec(
            tmp, kernel_name=name, user=user, prefix=None if user else (prefix or sys.prefix))


def _manager(prefix: str | None):
    from jupyter_client.kernelspec import KernelSpecManager

    manager = KernelSpecManager()
    if prefix:
        manager.kernel_dirs.insert(0, str(Path(prefix) / "share" / "jupyter" / "kernels"))
    return manager


def list_kernels(prefix: str | None = None) -> list[KernelSpecInfo]:
    """The workbench kernels Jupyter can see (plus those under ``prefix``)."""
    out = []
    for name, entry in sorted(_manager(prefix).get_all_specs().items()):
        spec = entry["spec"]
        mark = spec.get("metadata", {}).get(_MARK)
        if mark is not None:
            out.append(KernelSpecInfo(name=name, path=entry["resource_dir"], display_name=spec["display_name"],
                                      nprocs=int(mark["nprocs"]), backend=mark["backend"], listen=mark.get("listen")))
    return out


def remove_kernel(name: str, prefix: str | None = None) -> str:
    """Remove an installed workbench kernel; return the directory removed. Refuses kernels that are not ours."""
    manager = _manager(prefix)
    ours = {k.name: k for k in list_kernels(prefix)}
    if name not in ours:
        known = ", ".join(sorted(ours)) or "none installed"
        raise KeyError(f"no workbench kernel named {name!r} (workbench kernels: {known})")
    return manager.remove_kernel_spec(name)
