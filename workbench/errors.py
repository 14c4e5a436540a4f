"""Exception types of workbench: every error names what is wrong, where, and what to do."""

from __future__ import annotations

__all__ = ["CheckpointError", "LayoutError", "LayoutFileError", "PeersAbsent", "PlanError", "WorkbenchError"]


class WorkbenchError(ValueError):
    """Base class of every error workbench raises on bad input."""


class LayoutError(WorkbenchError):
    """A mesh, placement or LoadSpec that cannot describe a real sharded tensor."""


class LayoutFileError(LayoutError):
    """A layout file (TOML) that cannot be read; the message names the file, line and field."""


class PlanError(WorkbenchError):
    """A load or save plan that cannot be built for the given spec, rank and policy."""


class CheckpointError(WorkbenchError):
    """A checkpoint on disk that does not match what was expected of it."""


class PeersAbsent(CheckpointError):
    """The other ranks of the world did not join a collective save or load within its timeout (called on one rank
    alone, or a peer died or hangs); raised on the ranks that waited, before anything was written or read."""
