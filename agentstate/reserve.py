"""Room held on a filesystem for an undo that must not fail for lack of it.

Why: deleting from LMDB needs free pages (it copies every page it changes), so the undo of an
import that filled the disk failed on the same full disk, and the sessions it had written stayed.
A `Reserve` holds a preallocated file with no name on each filesystem the undo writes to. Before
each step that could fill the disk, the caller grows it by what undoing that step needs; if even
that room is gone, the step is refused before it writes anything. The caller releases it (the
file's blocks go back to the filesystem) right before the undo runs, or once the work stands, so
the undo finds at least that room whatever filled the disk meanwhile. The file has no name (an
O_TMPFILE, or a file unlinked as soon as it is made), so a crash gives its room back with the
process and leaves nothing in the data directory.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from agentstate.config import StoreConfig
from agentstate.errors import BackendError, CapacityError

_O_TMPFILE: int = getattr(os, "O_TMPFILE", 0)
_O_CLOEXEC: int = getattr(os, "O_CLOEXEC", 0)
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT}
_ZEROS = bytes(1 << 20)
_log = logging.getLogger("agentstate.reserve")


class Reserve:
    """Bytes held free on the filesystems of `dirs` (one file per filesystem); a context manager
    that releases them on exit. Blocking calls: a few syscalls each, no data written where the
    filesystem allocates without writing (fallocate)."""

    def __init__(self, dirs: Iterable[Path]) -> None:
        self._files: dict[int, tuple[Path, int]] = {}  # st_dev -> (directory, fd)
        self.held = 0
        """bytes held on each filesystem"""
        try:
            for d in dirs:
                d = Path(d)
                dev = d.stat().st_dev
                if dev not in self._files:
                    self._files[dev] = (d, _unnamed_file(d))
        except BaseException:
            self.release()
            raise

    def grow(self, nbytes: int) -> None:
        """Hold `nbytes` more on every filesystem; CapacityError (holding no more than before)
        when one of them has no room for it."""
        if nbytes <= 0:
            return
        for d, fd in self._files.values():
            try:
                _allocate(fd, self.held, nbytes)
            except OSError as exc:
                os.ftruncate(fd, self.held)  # give back what a partial allocation took
                if exc.errno in _NO_ROOM:
                    raise CapacityError(
                        f"the disk under {d} is full: no room left for {nbytes} bytes more ({exc.strerror})"
                    ) from None
                raise BackendError(f"cannot hold room on the disk under {d}: {exc}") from exc
        self.held += nbytes

    def release(self) -> None:
        """Give every held byte back to its filesystem (idempotent)."""
        files, self._files = self._files, {}
        for _, fd in files.values():
            os.close(fd)  # the file has no name: closing it frees its blocks
        self.held = 0

    def __enter__(self) -> Reserve:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _unnamed_file(directory: Path) -> int:
    """A writable file in `directory` that no name points to (freed when its fd closes)."""
    try:
        if _O_TMPFILE:
            try:
                return os.open(directory, os.O_RDWR | _O_TMPFILE | _O_CLOEXEC, 0o600)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                    raise
        fd, name = tempfile.mkstemp(prefix=".reserve-", dir=directory)
        os.unlink(name)
        return fd
    except OSError as exc:
        if exc.errno in _NO_ROOM:
            raise CapacityError(f"the disk under {directory} is full ({exc.strerror})") from None
        raise BackendError(f"cannot hold room on the disk under {directory}: {exc}") from exc


def _allocate(fd: int, offset: int, nbytes: int) -> None:
    """Make the filesystem back `nbytes` at `offset` of `fd` with real blocks now."""
    fallocate = getattr(os, "posix_fallocate", None)  # missing on macOS
    if fallocate is not None:
        try:
            fallocate(fd, offset, nbytes)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    done = 0  # a filesystem without fallocate: write the bytes
    while done < nbytes:
        done += os.pwrite(fd, _ZEROS[: min(len(_ZEROS), nbytes - done)], offset + done)
    os.fsync(fd)


def local_dirs(config: StoreConfig) -> list[Path]:
    """The directories of a store's local catalog and local durable tiers: where its deletes and an
    import's undo write, so where room is held for them."""
    root = Path(config.path)
    tiers = [root / (t.path or t.tier_name) for t in config.tier_list() if t.kind in ("lmdb", "file")]
    return [d for d in [root, *tiers] if d.is_dir()]


class StandingReserve:
    """Room a store keeps free on its disks for as long as it is open, spent only to free space.

    Why: on a disk that filled, deleting a session or sweeping chunks needs free pages first (LMDB
    copies every page it changes), so the full disk refused the very deletes that would make room,
    and only an operator with a shell could recover. The store holds `nbytes` in a `Reserve`; an
    operation that frees space and meets a full disk spends it (`spend`) and runs again, and the
    room is taken back (`refill`) once that operation stood. Best effort: a disk already full at
    open holds none (logged once), and every other behaviour is the same as without it.
    """

    def __init__(self, dirs: Iterable[Path], nbytes: int) -> None:
        self._dirs = [Path(d) for d in dirs]
        self._nbytes = nbytes
        self._reserve: Reserve | None = None
        self._warned = False
        self.refill()

    @property
    def held(self) -> bool:
        return self._reserve is not None

    def refill(self) -> None:
        """Hold the room again if it is not held (after it was spent, or missing at open)."""
        if self._reserve is not None or self._nbytes <= 0 or not self._dirs:
            return
        try:
            reserve = Reserve(self._dirs)
            try:
                reserve.grow(self._nbytes)
            except BaseException:
                reserve.release()
                raise
        except (CapacityError, BackendError) as exc:
            if not self._warned:
                _log.warning("no room held for deletes on a full disk: %s", exc)
                self._warned = True
            return
        self._reserve, self._warned = reserve, False

    def spend(self) -> bool:
        """Give the room back to the filesystem for an operation that frees space; False if none was held."""
        reserve, self._reserve = self._reserve, None
        if reserve is None:
            return False
        reserve.release()
        return True

    def close(self) -> None:
        self.spend()
