"""``SaveResult``: what one rank did for a save, as ``save_hf`` (or an async save's ``wait()``) returns it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from workbench.display import html_of
from workbench.io.hf.save_timings import SaveTimings

__all__ = ["SaveResult"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveResult:
    """What one rank did for a save: the published path, its files and bytes, and the time it took.

    ``blocked_seconds`` is how long ``save_hf`` held the caller (for an async save, until the snapshot was
    taken); ``snapshot_bytes`` the bytes copied into host memory the save owns. ``predicted_peak_bytes`` is the
    schedule's peak, with the backend's receive buffers (gloo's scratch) counted. ``timings`` says where the
    time went (stages and writer threads; see ``SaveTimings``).
    """

    path: Path
    rank: int
    files: tuple[str, ...]
    bytes_written: int
    seconds: float
    calls: int
    predicted_peak_bytes: int
    blocked_seconds: float = 0.0
    snapshot_bytes: int = 0
    write_mode: str = "gather"
    direct_tensors: int = 0
    timings: SaveTimings = field(default_factory=SaveTimings)

    def __str__(self) -> str:
        return (
            f"saved {self.path} (rank {self.rank}: {len(self.files)} file(s), {self.bytes_written} bytes, "
            f"{self.calls} gather calls, {self.seconds:.2f} s)"
        )

    def _repr_html_(self) -> str | None:
        """HTML for notebooks, from the renderer ``workbench.viz`` registers (``workbench.display``)."""
        return html_of(self)
