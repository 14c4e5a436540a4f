"""``TimedCommunicator``: time every all-gather of a real save, to overlay on its planned schedule."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["TimedCommunicator"]


class TimedCommunicator:
    """Wraps a Communicator and records the seconds and bytes of each ``all_gather``, in call order.

    Pass it as ``save_hf(..., comm=TimedCommunicator(inner))``; ``measured(result)`` is what
    ``plot_schedule(schedule, measured=...)`` overlays. On CUDA each gather is synchronized before its clock
    stops (the time is the collective's, not its launch's), and ``peak_bytes`` is the device's peak allocation
    since the communicator was made. Every other attribute is the wrapped communicator's.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.call_seconds: list[float] = []
        self.call_bytes: list[int] = []
        self._cuda = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prepare_gather(self, send: Any, mesh_dim: Any) -> Any:
        """The wrapped ``prepare_gather`` (untimed: the allocation before the flag), or None where it has none."""
        from workbench.run.communicator import own_prepare_gather

        prepare = own_prepare_gather(self.inner)
        return prepare(send, mesh_dim) if prepare is not None else None

    def all_gather(self, send: Any, mesh_dim: Any, **kwargs: Any) -> Any:
        """The wrapped ``all_gather``, timed."""
        cuda = getattr(send, "is_cuda", False)
        if cuda and not self._cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(send.device)
            self._cuda = True
        start = time.perf_counter()
        out = self.inner.all_gather(send, mesh_dim, **kwargs)
        if cuda:
            import torch

            torch.cuda.synchronize(send.device)
        self.call_seconds.append(time.perf_counter() - start)
        self.call_bytes.append(out.numel() * out.element_size())
        return out

    def measured(self, result: Any = None) -> dict[str, Any]:
        """``{"call_seconds", "call_bytes", "seconds", "predicted_peak_bytes", "peak_bytes"}`` of the calls so
        far (with the save's total time and its own predicted peak, writer queue included, when its SaveResult
        is given; ``peak_bytes`` on CUDA only)."""
        out: dict[str, Any] = {"call_seconds": list(self.call_seconds), "call_bytes": list(self.call_bytes)}
        if result is not None:
            out["seconds"] = result.seconds
            if getattr(result, "predicted_peak_bytes", None) is not None:
                out["predicted_peak_bytes"] = result.predicted_peak_bytes
        if self._cuda:
            import torch

            out["peak_bytes"] = int(torch.cuda.max_memory_allocated())
        return out
