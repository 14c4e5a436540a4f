"""Atomic publish, the contract: a checkpoint appears under its final name complete, or not at all.

A save writes into a hidden sibling ``.NAME.incomplete/`` (the *temporary* path) and publishes it under
``NAME`` (the *final* path) in one step, only after every file is written and fsynced. Whatever happens
before that step (crash, kill, a rank failing), ``NAME`` still holds the previous checkpoint, untouched.
The name itself is the completion marker: nothing under a temporary name counts as a checkpoint.

States of one save::

    prepare()           finalize()
    ---------> .NAME.incomplete/ ----------> NAME/        (the previous NAME/ is replaced, then deleted)
                      |
                      +--- abort() ----> (removed; NAME/ untouched)

Who calls what (SPMD): exactly **one** rank (say rank 0) calls ``prepare`` and ``finalize``; every rank
writes its files into ``temporary`` in between. The caller puts a barrier after ``prepare`` (no rank
writes before the directory exists) and one before ``finalize`` (every rank has written, fsynced and
reported success; on any failure the primary calls ``abort`` instead), and one after it if ranks read
the result. Implementations are named for the mechanism that makes the step atomic
(``AtomicRenamePublisher`` in ``publish.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = ["INCOMPLETE_SUFFIX", "Publisher", "is_temporary_path", "temporary_path"]

INCOMPLETE_SUFFIX = ".incomplete"


def temporary_path(final: Path | str) -> Path:
    """The hidden sibling a save of ``final`` writes into: ``exp/hf-100`` -> ``exp/.hf-100.incomplete``."""
    final = Path(final)
    return final.with_name(f".{final.name}{INCOMPLETE_SUFFIX}")


def is_temporary_path(path: Path | str) -> bool:
    """True for a path named like an unpublished save (``.NAME.incomplete``)."""
    name = Path(path).name
    return name.startswith(".") and name.endswith(INCOMPLETE_SUFFIX) and len(name) > len(INCOMPLETE_SUFFIX) + 1


@runtime_checkable
class Publisher(Protocol):
    """Writes go to ``temporary``; ``finalize`` makes them appear at ``final`` in one atomic step.

    NOTE: ``prepare``, ``finalize`` and ``abort`` are called on one rank only; see the module docstring
    for the barriers around them.
    """

    @property
    def final(self) -> Path:
        """Where the checkpoint is published."""
        ...

    @property
    def temporary(self) -> Path:
        """Where the files are written before publishing."""
        ...

    def prepare(self) -> Path:
        """Create a fresh, empty temporary directory (removing a stale one, never one a live save holds) and
        return it.

        *Implementation hint:* refuse, with the path in the message, when ``final`` cannot be replaced.
        """
        ...

    def finalize(self) -> Path:
        """Make the temporary directory's content durable, then publish it at ``final``; return ``final``.

        *Implementation hint:* fsync every file and directory before the publishing step, and the parent
        directory after it.
        """
        ...

    def abort(self) -> None:
        """Remove the temporary directory; ``final`` is left untouched."""
        ...
