"""``StageTimes``: what the timings of a save and of a load share: seconds by named stage, and how to read them."""

from __future__ import annotations

from typing import ClassVar

__all__ = ["StageTimes"]

_SHOWN = 5e-4  # seconds below which a figure is left out of the text


class StageTimes:
    """A mixin for a frozen dataclass of seconds whose ``STAGES`` ran one after the other on the calling thread."""

    __slots__ = ()
    STAGES: ClassVar[tuple[str, ...]] = ()

    def _seconds_of(self, names: tuple[str, ...]) -> float:
        return sum(getattr(self, s) for s in names)

    def slowest_stage(self) -> str:
        """The calling thread's longest stage."""
        return max(self.STAGES, key=lambda s: getattr(self, s))

    def _listed(self, names: tuple[str, ...], empty: str) -> str:
        """``"name 0.123, ..."`` for the figures of ``names`` worth showing, else ``empty``."""
        shown = ", ".join(f"{s} {getattr(self, s):.3f}" for s in names if getattr(self, s) >= _SHOWN)
        return shown or empty
