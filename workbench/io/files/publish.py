"""AtomicRenamePublisher: publish a checkpoint directory by one atomic rename (see ``publish_types``).

Mechanism, on one POSIX filesystem:

* ``final`` does not exist: ``rename(temporary, final)``, atomic by POSIX.
* ``final`` exists: the temporary is renamed to a name of this publisher's own (``.NAME.replaced-PID-ID.incomplete``),
  then Linux ``renameat2(that, final, RENAME_EXCHANGE)`` swaps the two directories in one step (readers see the old
  checkpoint or the new one, never neither), and the old one, now at that name, is deleted. Never at
  ``.NAME.incomplete``: there another save to ``final`` would take it for a dead save's, delete it and start its
  own, which this cleanup would then delete.
* Without ``renameat2`` (not Linux, kernel < 3.15, a filesystem that refuses the flag): ``final`` is renamed
  aside to ``.NAME.old``, the temporary renamed to ``final``, then the old one deleted. **Window:** between
  the two renames ``final`` does not exist; a crash there leaves the old checkpoint complete at
  ``.NAME.old``, and the next ``prepare`` renames it back.

NOTE: ``prepare``, ``finalize`` and ``abort`` are called by one rank only; the caller puts barriers
around them (after ``prepare``, before ``finalize``), as the ``publish_types`` docstring explains.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import os
import re
import shutil
import uuid
import warnings
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from workbench.errors import CheckpointError
from workbench.faults import fault_point
from workbench.io.files.complete import OLD_SUFFIX, content_problems, is_complete, validate_final
from workbench.io.files.index import INDEX_NAME
from workbench.io.files.ownership import (
    HEARTBEAT_PERIOD,
    MARKER_NAME,
    Heartbeat,
    LiveClaim,
    incomplete_save,
    read_owner,
    remove_if_stale,
    write_owner,
)
from workbench.io.files.publish_types import INCOMPLETE_SUFFIX, is_temporary_path, temporary_path
from workbench.io.files.write import fsync_dir, fsync_file
from workbench.layout.layout_file import LAYOUT_FILE_NAME

__all__ = ["OLD_SUFFIX", "AtomicRenamePublisher", "exchange_paths", "is_complete", "validate_final"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 1 << 1
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


# a replaced checkpoint's weights, in any of the formats HF folders hold them (and their indexes): never kept beside
# new weights, where a loader that prefers one of them would read the old values
_CONFIG = "config.json"  # HF's model folder holds it before any weights (save_pretrained of the config first)
_WEIGHTS = re.compile(r".*\.safetensors|.*\.index\.json|pytorch_model.*\.bin|consolidated.*\.pth|tf_model.*\.h5"
                      r"|flax_model.*\.msgpack")


_ADAPTER_CONFIG = "adapter_config.json"  # a PEFT adapter's folder: its weights are never a checkpoint's to replace
_MODEL_WEIGHTS = re.compile(r"model(-\d+-of-\d+)?\.safetensors")  # what a save writes (and HF names a model's)
_SAFETENSORS = re.compile(r".*\.safetensors(\.index\.json)?")


def not_a_checkpoint(path: Path) -> str | None:
    """Why the existing directory ``path`` is not one a save may write its weights into (None: it may).

    It may when it is empty, or a model folder of files only (no directory, which the save would delete): one with
    the index or ``model*.safetensors`` weights (a checkpoint), or with a ``config.json`` and no weights of another
    format (HF's folder before its weights). Safetensors files of other names make a folder no checkpoint of its own
    (``diffusion_pytorch_model.safetensors``, another model's) and are never replaced in a PEFT adapter's folder
    (``adapter_config.json``, ``adapter_model.safetensors``); beside a checkpoint's own weights they are those weights
    in another layout (Mistral's ``consolidated.safetensors``) and are replaced with them. The folder's other
    files are kept beside the new weights (``AtomicRenamePublisher._carry_other_files``)."""
    names, folders = [], []
    with os.scandir(path) as entries:
        for entry in entries:
            (folders if entry.is_dir(follow_symlinks=False) else names).append(entry.name)
    if folders:
        return f"it holds directories, which a save would delete: {_shown(f'{n}/' for n in folders)}"
    checkpoint = INDEX_NAME in names or any(_MODEL_WEIGHTS.fullmatch(n) for n in names)
    foreign = [n for n in names if _SAFETENSORS.fullmatch(n) and not (n == INDEX_NAME or _MODEL_WEIGHTS.fullmatch(n))]
    adapter = _ADAPTER_CONFIG in names or any(n.startswith("adapter_model") for n in foreign)
    if foreign and (adapter or not checkpoint):  # beside a checkpoint: its weights in another layout, replaced too
        return (f"it holds safetensors files that are not a checkpoint's model weights ({_shown(foreign)}: a PEFT "
                f"adapter's, another model's or another variant's), which a save would delete")
    if not names or checkpoint:
        return None
    if _CONFIG in names:  # a model folder: taken when it holds no weights a save would delete
        others = [n for n in names if _WEIGHTS.fullmatch(n)]
        if not others:
            return None
        return f"its weights are in another format ({_shown(others)}), which a save of safetensors would delete"
    return f"no {INDEX_NAME}, no model*.safetensors file and no {_CONFIG}, but {_shown(names)}: not a model folder"


def _shown(names: Iterable[str], most: int = 4) -> str:
    """The first ``most`` of ``names`` in order, for a message."""
    ordered = sorted(names)
    return ", ".join(ordered[:most]) + (", ..." if len(ordered) > most else "")


def _devices(final: Path) -> tuple[int, int]:
    """The filesystem (``st_dev``) of the directory at ``final`` (a symbolic link's own) and that of its parent,
    where the temporary directory is made."""
    return os.lstat(final).st_dev, os.stat(final.parent).st_dev


def _elsewhere(final: Path) -> str | None:
    """Why the existing directory ``final`` cannot be replaced by one made in its parent, or None: a directory is
    never renamed or exchanged over a mount point (EBUSY) or across filesystems (EXDEV). A symbolic link is: only
    the link itself is replaced (and on an overlay a link may report its lower layer's device)."""
    if final.is_symlink():
        return None
    if os.path.ismount(final):
        return "it is a mount point (a volume mounted at that path)"
    here, parent = _devices(final)
    if here != parent:
        return "it is on another filesystem than its parent directory"
    return None


@functools.cache
def _renameat2() -> Any:
    """libc's ``renameat2`` (glibc >= 2.28), or None."""
    for name in (None, ctypes.util.find_library("c")):
        try:
            fn = getattr(ctypes.CDLL(name, use_errno=True), "renameat2", None)
        except OSError:
            continue
        if fn is not None:
            fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
            fn.restype = ctypes.c_int
            return fn
    return None


def exchange_paths(a: Path | str, b: Path | str) -> bool:
    """Swap two existing paths atomically (``renameat2(RENAME_EXCHANGE)``); False where unsupported.

    Raises:
        OSError: the exchange is supported but failed (missing path, different filesystems, permissions).
    """
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _fsync_tree(root: Path, *, skip: str = MARKER_NAME) -> int:
    """fsync every regular file under ``root`` but ``skip`` at its top (the owner marker, never published) and every
    directory (deepest first); return the file count."""
    count = 0
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            if name == skip and dirpath == os.fspath(root):
                continue
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                fsync_file(path)
                count += 1
        fsync_dir(dirpath)
    return count


def _identity(path: Path) -> tuple[int, int] | None:
    """``path``'s own (device, inode), or None when nothing is there."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


class AtomicRenamePublisher:
    """Publish the directory ``.NAME.incomplete`` as ``NAME`` by an atomic rename (or exchange).

    Args:
        final: the checkpoint directory to (re)place, e.g. ``exp/hf-100``.
        use_exchange: try ``renameat2(RENAME_EXCHANGE)`` when ``final`` exists (False forces the
            rename-aside fallback; for tests and filesystems known to refuse the flag).
        heartbeat_period: seconds between the heartbeats of the owner marker, recorded in it (readers judge the
            save stale after ``STALE_PERIODS`` periods without one; see ``io/files/ownership.py``).

    From ``prepare`` until ``finalize`` or ``abort`` the publisher holds ``temporary`` live in this process (a
    ``LiveClaim``) and beats its marker's heartbeat from a daemon thread, so no ``clean_incomplete`` or ``prepare``,
    here or in another process, takes it for a leftover.

    Example (rank 0 only; ``barrier`` is the caller's)::

        publisher = AtomicRenamePublisher(Path("exp/hf-100"))
        if rank == 0:
            publisher.prepare()
        barrier()
        write_safetensors(publisher.temporary / name, tensors)   # every writer rank
        barrier()                                               # after every rank reported success
        if rank == 0:
            publisher.finalize()   # or publisher.abort() if any rank failed
    """

    def __init__(
        self, final: Path | str, *, use_exchange: bool = True, heartbeat_period: float = HEARTBEAT_PERIOD
    ) -> None:
        # absolute now: a relative path would name another place once the working directory changes (an async
        # save's writers, heartbeat and publish run later); not resolved: a symbolic link at ``final`` is replaced
        self._final = Path(os.path.abspath(final))
        if not Path(final).name or Path(final).name in (".", ".."):
            raise CheckpointError(f"cannot publish to {final!r}: the final path needs a directory name")
        name = self._final.name
        if is_temporary_path(self._final) or (name.startswith(".") and name.endswith((OLD_SUFFIX, ".staging"))):
            raise CheckpointError(
                f"cannot publish to {final!r}: that is the name of a save's temporary directory (.NAME.incomplete, "
                ".NAME.old or a .staging one), which another save may be writing: choose the checkpoint's own name")
        if not heartbeat_period > 0:
            raise CheckpointError(f"heartbeat_period must be a positive number of seconds, got {heartbeat_period!r}")
        self.use_exchange = use_exchange
        self.heartbeat_period = float(heartbeat_period)
        self._claim: LiveClaim | None = None
        self._heartbeat: Heartbeat | None = None
        self._moved: Path | None = None  # where the new checkpoint lies, unpublished, once it left ``temporary``

    @property
    def final(self) -> Path:
        """Where the checkpoint is published."""
        return self._final

    @property
    def temporary(self) -> Path:
        """The hidden sibling written before publishing: ``.NAME.incomplete``."""
        return temporary_path(self._final)

    @property
    def aside(self) -> Path:
        """Where the fallback moves the old checkpoint during its window: ``.NAME.old``."""
        return self._final.with_name(f".{self._final.name}{OLD_SUFFIX}")

    def prepare(self) -> Path:
        """Create a fresh ``temporary`` holding only its owner marker, hold it live, start its heartbeat, and return
        it. A stale one (see ``io/files/ownership.py``: a dead pid on this host, a heartbeat older than ten periods, no
        marker, or a leftover of this process) is removed; a live one is never touched: an error names it.

        Also repairs an interrupted fallback publish: an old checkpoint left at ``.NAME.old`` goes back
        to ``NAME`` when ``NAME`` is missing, and is deleted when ``NAME`` exists. Calling it again starts over.

        Raises:
            CheckpointError: ``final`` exists and is not a directory, or is a mount point or on another filesystem
                than its parent (no rename could publish there: refused before any data is written), or is a
                directory that is not a checkpoint (``not_a_checkpoint``: a save would delete what it holds), or its
                parent is missing or not writable; or ``temporary`` belongs to a live save (of this process, or
                of another whose heartbeat is fresh: its host, pid, job and heartbeat age are named); or the
                directory cannot be made.
        """
        final, parent = self._final, self._final.parent
        if not parent.is_dir():
            raise CheckpointError(f"cannot save to {final}: parent directory {parent} does not exist; create it first")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise CheckpointError(f"cannot save to {final}: parent directory {parent} is not writable by this process")
        if os.path.lexists(final) and not final.is_dir():
            raise CheckpointError(
                f"cannot save to {final}: it exists and is a file, not a checkpoint directory; "
                "move it away or choose another path"
            )
        if final.is_dir() and (why := _elsewhere(final)) is not None:
            raise CheckpointError(
                f"cannot save to {final}: {why}; a save writes its files into {self.temporary}, in the parent "
                "directory, and publishes by renaming that directory over the path, which cannot be done over a "
                f"mount point or across filesystems: save to a subdirectory of it instead (e.g. {final / 'checkpoint'})"
            )
        if final.is_dir() and (why := not_a_checkpoint(final)) is not None:
            raise CheckpointError(
                f"cannot save to {final}: it is a directory that is not a checkpoint ({why}); a save replaces the "
                "directory at its path, keeping only the files of a model folder beside its weights: save to a new "
                "path (a subdirectory, say) or move what it holds away"
            )
        self._repair_aside()
        self._remove_dead_replaced()
        self._release()  # a second prepare starts over: what this publisher made is now a stale leftover
        temporary = self.temporary
        try:
            claim = LiveClaim(temporary, exclusive=True)
        except ValueError:
            owner = read_owner(temporary)
            raise CheckpointError(
                f"cannot save to {final}: {temporary} belongs to a save still in progress in this process "
                f"({owner.describe() if owner else f'pid {os.getpid()}'}); let it finish first (an async save: "
                "call its wait())"
            ) from None
        try:
            self._make_temporary()
        except BaseException:
            claim.release()
            raise
        self._claim = claim
        self._heartbeat = Heartbeat(temporary / MARKER_NAME)
        weakref.finalize(self, _let_go, claim, self._heartbeat)  # a publisher dropped unfinished holds nothing
        return temporary

    def _make_temporary(self) -> None:
        """Remove a stale ``temporary`` and create the new one already holding its marker (one rename): no reader
        ever sees it without an owner. The caller holds its exclusive claim."""
        final, parent, temporary = self._final, self._final.parent, self.temporary
        if os.path.lexists(temporary):
            found = incomplete_save(temporary, claims=False)
            if found.live:
                assert found.owner is not None
                raise CheckpointError(
                    f"cannot save to {final}: {temporary} belongs to a save still in progress "
                    f"({found.owner.describe()}); wait for it, or if that job is dead run "
                    f"wb.clean_incomplete({str(parent)!r}, force=True)"
                )
            try:
                removed = remove_if_stale(found, holding=True)
            except OSError as exc:
                raise CheckpointError(f"cannot remove the stale temporary directory {temporary}: {exc}") from exc
            if not removed:
                raise CheckpointError(
                    f"cannot save to {final}: another save took over {temporary} while this one prepared "
                    f"({read_owner(temporary) or 'no owner marker yet'}); try again once it has finished"
                )
        staging = parent / f".{final.name}{INCOMPLETE_SUFFIX}.{os.getpid()}-{id(self):x}.staging"
        renamed = False
        try:
            _remove(staging)
            staging.mkdir()
            write_owner(staging, period=self.heartbeat_period)
            try:
                os.rename(staging, temporary)  # refused when a new save's (non-empty) directory appeared meanwhile
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                raise CheckpointError(
                    f"cannot save to {final}: another save created {temporary} while this one prepared "
                    f"({read_owner(temporary) or 'no owner marker yet'}); try again once it has finished"
                ) from None
            renamed = True
            fsync_dir(parent)
        except BaseException as exc:
            if renamed:  # ours, claimed and unpublished: its marker must not make a dead save look live to others
                with contextlib.suppress(OSError):
                    _remove(temporary)
            if isinstance(exc, OSError):
                raise CheckpointError(f"cannot create the temporary directory {temporary}: {exc}") from exc
            raise
        finally:
            with contextlib.suppress(OSError):  # gone after the rename; left only when a step before it failed
                _remove(staging)

    def _release(self) -> None:
        """Stop the heartbeat and let go of ``temporary`` (idempotent)."""
        _let_go(self._claim, self._heartbeat)
        self._claim = self._heartbeat = None

    def _remove_dead_replaced(self) -> None:
        """Remove the replaced checkpoints that publishers killed while deleting them left beside ``final``
        (``.NAME.replaced-*.incomplete``), once their owner is gone (the liveness rule of ``io/files/ownership.py``):
        each is a whole old checkpoint's worth of disk. One being deleted now is live and is left alone."""
        name, suffix = re.escape(self._final.name), re.escape(INCOMPLETE_SUFFIX)
        pattern = re.compile(rf"\.{name}\.replaced-[0-9]+-[0-9a-f]+{suffix}")
        with contextlib.suppress(OSError):
            for entry in os.scandir(self._final.parent):
                if pattern.fullmatch(entry.name):
                    found = incomplete_save(Path(entry.path))
                    if not found.live:
                        with contextlib.suppress(OSError):
                            remove_if_stale(found)

    def _repair_aside(self) -> None:
        aside = self.aside
        if not os.path.lexists(aside):
            return
        try:
            if os.path.lexists(self._final):
                _remove(aside)
            else:
                os.rename(aside, self._final)
                fsync_dir(self._final.parent)
        except OSError as exc:
            raise CheckpointError(
                f"an interrupted publish left the old checkpoint at {aside}, and restoring it failed: {exc}"
            ) from exc

    def finalize(self, *, verify: bool = True) -> Path:
        """fsync everything under ``temporary``, then publish it at ``final`` atomically; return ``final``.

        Args:
            verify: first check the content as ``validate_final`` would (index, files, headers, sizes),
                and refuse to publish a damaged checkpoint. Pass False for directories that are not HF
                checkpoints.

        Raises:
            CheckpointError: nothing to publish (``prepare`` not called, or aborted), verification failed
                (the temporary is kept for inspection and ``final`` is untouched), ``final`` became a file,
                or a rename failed. After a failure the publisher no longer holds ``temporary`` (no heartbeat):
                ``abort`` removes it, and so may any ``clean_incomplete``.
        """
        try:
            return self._finalize(verify)
        finally:
            self._release()  # published, or failed: either way this save no longer writes the directory

    def _finalize(self, verify: bool) -> Path:
        temporary, final = self.temporary, self._final
        if not temporary.is_dir() or temporary.is_symlink():
            raise CheckpointError(
                f"nothing to publish at {final}: {temporary} does not exist; call prepare() first (or it was aborted)"
            )
        if verify:
            problems = content_problems(temporary)
            if problems:
                listed = "\n  - ".join(problems)
                raise CheckpointError(
                    f"refusing to publish {temporary} as {final} ({final} is untouched):\n  - {listed}"
                )
        try:
            _fsync_tree(temporary)  # all but the marker, which stays until the directory is published: without it
            # another process's clean_incomplete would take the directory for a dead save's and delete it
            if self._heartbeat is not None:
                self._heartbeat.stop()  # the claim still holds the directory in this process
            fault_point("rename", 0)
            if not os.path.lexists(final):
                os.rename(temporary, final)
            elif not final.is_dir():
                raise CheckpointError(f"cannot publish at {final}: it exists and is a file, not a directory")
            elif (why := not_a_checkpoint(final)) is not None:  # it changed while the save ran: never replace it
                raise CheckpointError(
                    f"cannot publish at {final}: while the save ran it became a directory that is not a checkpoint "
                    f"({why}); it was left as it is, and the new checkpoint was not published")
            else:
                carried = self._carry_other_files(temporary, final)
                if self.use_exchange:
                    self._publish_by_exchange(carried)
                else:
                    self._publish_by_rename_aside(temporary, carried)
            (final / MARKER_NAME).unlink(missing_ok=True)  # it belonged to the unpublished directory only
            fsync_dir(final)  # the marker's removal, durable with the publish
            fsync_dir(final.parent)
        except OSError as exc:
            raise CheckpointError(f"publishing {temporary} as {final} failed: {exc}") from exc
        return final

    @staticmethod
    def _carry_other_files(temporary: Path, final: Path) -> dict[str, tuple[int, int]]:
        """Hard-link (or copy) into ``temporary`` every file of the checkpoint at ``final`` that is not a
        checkpoint's own (weights in any HF format and their indexes, the layout, a save's marker) and that the new
        one does not hold: a model folder's ``config.json`` and tokenizer files, a trainer's optimizer state. A save
        replaces the weights of a folder, not what it holds beside them (as ``save_pretrained`` writing into it
        would). A file removed meanwhile is skipped. Returns each carried name with the (device, inode) it had."""
        carried: dict[str, tuple[int, int]] = {}
        with os.scandir(final) as entries:
            for entry in entries:
                name = entry.name
                if not _carried(entry) or os.path.lexists(temporary / name):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                    os.link(entry.path, temporary / name, follow_symlinks=False)
                except FileNotFoundError:  # removed since the scan (by its owner): nothing to keep
                    continue
                except OSError:  # a filesystem without hard links
                    try:
                        shutil.copy2(entry.path, temporary / name, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                carried[name] = (st.st_dev, st.st_ino)
        if carried:
            fsync_dir(temporary)
        return carried

    @staticmethod
    def _carry_late_files(old: Path, final: Path, carried: dict[str, tuple[int, int]]) -> list[str]:
        """After the publish, before the replaced checkpoint ``old`` is deleted: move into ``final`` the files
        written into the folder since ``_carry_other_files`` looked (a tokenizer saved, a ``config.json`` replaced
        by its writer meanwhile). A file the new checkpoint holds itself is never replaced; one carried earlier is,
        where its name now holds another file. A writer that resolved the folder's path before the publish and
        writes after this look still writes into ``old``: the window is this function's. Returns the files that could
        not be moved (each with why): the publish is done, so they are a warning, and ``old`` must be kept."""
        moved, left = False, []
        try:
            with os.scandir(old) as entries:
                for entry in entries:
                    name = entry.name
                    if not _carried(entry):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                        if os.path.lexists(final / name) and carried.get(name) in (None, (st.st_dev, st.st_ino)):
                            continue  # the new checkpoint's own file, or the one carried, unchanged
                        os.replace(entry.path, final / name)
                        moved = True
                    except FileNotFoundError:
                        continue
                    except OSError as exc:
                        left.append(f"{name} ({exc.strerror or exc})")
            if moved:
                fsync_dir(final)
        except OSError as exc:
            left.append(f"the folder could not be read again ({exc.strerror or exc})")
        return left

    def _publish_by_exchange(self, carried: dict[str, tuple[int, int]]) -> None:
        """Swap the new checkpoint in with ``renameat2(RENAME_EXCHANGE)`` (rename-aside where the filesystem refuses
        the flag), then dispose of the old one.

        The new checkpoint first leaves ``temporary`` for a name of this publisher's own, so the exchange puts the
        old one there: at ``.NAME.incomplete``, without an owner marker, another process's save to ``final`` would
        take it for a dead save's, delete it and start its own there, which this cleanup would then delete."""
        final, replaced = self._final, self._replaced_path()
        old = _identity(final)
        claim = LiveClaim(replaced)  # this process's clean_incomplete must not take our marker there for a leftover
        try:
            os.rename(self.temporary, replaced)  # ``temporary`` is free for the next save from here on
            self._moved = replaced
            if not exchange_paths(replaced, final):  # no renameat2, or a filesystem that refuses the flag
                self._publish_by_rename_aside(replaced, carried)
                return
            self._moved = None
            fsync_dir(final.parent)
            if not replaced.is_symlink():  # the old checkpoint: held live while it is disposed of (a link: no
                with contextlib.suppress(OSError):  # save deletes what it points to, so no marker goes there)
                    write_owner(replaced, period=self.heartbeat_period)
            self._dispose(replaced, old, carried)
        finally:
            claim.release()

    def _replaced_path(self) -> Path:
        """A new name of this publisher's own beside ``final``, shaped as a temporary's, so that what a crash leaves
        there is listed by ``latest_checkpoint`` and removed by ``clean_incomplete``."""
        unique = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        return self._final.with_name(f".{self._final.name}.replaced-{unique}{INCOMPLETE_SUFFIX}")

    def _publish_by_rename_aside(self, source: Path, carried: dict[str, tuple[int, int]]) -> None:
        final, aside = self._final, self.aside
        _remove(aside)
        old = _identity(final)
        os.rename(final, aside)
        # window: `final` is missing until the next rename; a crash here is repaired by prepare()
        os.rename(source, final)
        self._moved = None
        fsync_dir(final.parent)
        self._dispose(aside, old, carried)

    def _dispose(self, old: Path, identity: tuple[int, int] | None, carried: dict[str, tuple[int, int]]) -> None:
        """After the publish: move the files written meanwhile out of the replaced checkpoint ``old``, then delete
        it. The publish already happened, so what stops either is a warning, and ``old`` is handed over."""
        left = self._carry_late_files(old, self._final, carried)
        failed = None if left else self._discard(old, identity)
        if not left and failed is None:
            return
        kept = self._hand_over(old)
        if left:
            warnings.warn(
                f"published {self._final}, but files written into it while the save published could not be moved "
                f"into it: {', '.join(left)}. They are left in {kept}, the replaced checkpoint, which the next save "
                f"to {self._final} or clean_incomplete removes: move them out now", stacklevel=5)
        else:
            warnings.warn(f"published, but the replaced checkpoint at {kept} could not be deleted: {failed}",
                          stacklevel=5)

    @staticmethod
    def _discard(old: Path, identity: tuple[int, int] | None) -> str | None:
        """Delete the replaced checkpoint at ``old`` if it is still the directory that was published
        (``identity``: its device and inode), never another found at that name; why it could not be, or None."""
        try:
            fault_point("cleanup", 0)
            if identity is not None and _identity(old) == identity:
                _remove(old)
        except Exception as exc:
            return str(exc)
        return None

    def _hand_over(self, old: Path) -> Path:
        """Leave the replaced checkpoint ``old``, kept, to the next save's cleanup, and return where it lies: at
        ``.NAME.old`` (``prepare`` removes it), or moved to ``temporary`` without an owner marker (the next save to
        ``final`` removes it; where another save holds that name, it stays at ``old``, stale, for
        ``clean_incomplete``)."""
        if old == self.aside:
            return old
        with contextlib.suppress(OSError):
            if not old.is_symlink():
                (old / MARKER_NAME).unlink(missing_ok=True)
            if not os.path.lexists(self.temporary):
                os.rename(old, self.temporary)
                return self.temporary
        return old

    def abort(self) -> None:
        """Remove ``temporary`` and let go of it; ``final`` is left untouched. Safe to call twice. A temporary
        this publisher did not prepare is removed only when stale: another save's live directory is left alone."""
        # a publish that failed after the new checkpoint left ``temporary``: that name is no longer this save's
        unpublished, self._moved = self._moved or self.temporary, None
        if (unpublished == self.temporary and self._claim is None and os.path.lexists(unpublished)
                and incomplete_save(unpublished).live):
            return
        if self._heartbeat is not None:
            self._heartbeat.stop()
        try:
            _remove(unpublished)
        except OSError as exc:
            raise CheckpointError(f"cannot remove the temporary directory {unpublished}: {exc}") from exc
        finally:
            self._release()

    def __repr__(self) -> str:
        return f"AtomicRenamePublisher(final={str(self._final)!r})"


def _carried(entry: os.DirEntry) -> bool:
    """Whether a replaced checkpoint's ``entry`` is kept beside the new weights: a file (or link) that is not a
    checkpoint's own (weights of any HF format and their indexes, the layout, a save's marker)."""
    return not (entry.is_dir(follow_symlinks=False) or _WEIGHTS.fullmatch(entry.name)
                or entry.name in (LAYOUT_FILE_NAME, MARKER_NAME))


def _let_go(claim: LiveClaim | None, heartbeat: Heartbeat | None) -> None:
    if heartbeat is not None:
        heartbeat.stop()
    if claim is not None:
        claim.release()
