"""One writer per data directory: an advisory lock held for as long as a store is open.

LMDB environments, the file tier's open scan (which removes temp files), the in-memory index and
gc all assume that this process is the only writer of the directory. Two writers interleave
deletes with the other's dedupe and lose committed chunks; so the first opener holds `LOCK`
exclusively and every later opener, in this process or another, gets `DataDirLockedError`
naming the holder. Read-only openers (the admin CLI's `ls`, `inspect`, `stats`, `verify`,
`export`) share the lock with each other, never with a writer.

The lock is `flock(2)`: the kernel drops it when the holder exits, however it dies, so a crash
never leaves a directory locked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from pathlib import Path

from agentstate.errors import AgentStateError, BackendError, CapacityError, DataDirLockedError

LOCK = "LOCK"
"""The lock file's name in a data directory (a writer's PID is written into it)."""


class DataDirLock:
    """An acquired lock on one data directory; `release()` (idempotent) gives it back."""

    def __init__(self, path: Path, fd: int, shared: bool, created: Path | None = None) -> None:
        self.path = path
        self.shared = shared
        self.created = created
        """the outermost directory `acquire` made (None: the data directory existed)"""
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, directory: str | os.PathLike[str], *, shared: bool = False) -> DataDirLock:
        """Take the directory's lock now, or raise DataDirLockedError (never waits)."""
        root = Path(directory)
        path = root / LOCK
        created = next((d for d in reversed([root, *root.parents]) if not d.exists()), None)
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise _os_error(root, exc) from exc
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)  # the directory, if made here, is the holder's now: left as it is
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DataDirLockedError(f"cannot lock data directory {root}: {exc}") from exc
            who = f"process {holder}" if holder else "read-only openers (admin commands)"
            mode = "read" if shared else "write"
            raise DataDirLockedError(
                f"data directory {root} is in use by {who}; it cannot be opened to {mode} until that"
                " process closes it (stop the server, or go through its HTTP API)",
                pid=holder,
            ) from None
        lock = cls(path, fd, shared, created)
        if not shared:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError as exc:
                lock.release()
                raise _os_error(root, exc) from exc
        return lock

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            if not self.shared:
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def discard(self) -> None:
        """Release after a failed open: a directory this lock made is removed with everything in it
        (the LOCK file, a fresh LMDB's files), so a failed open leaves nothing behind. Only a writer
        does this: it held the directory alone from the moment it existed, so all in it is its own."""
        if self._fd is not None and not self.shared and self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
        self.release()

    @property
    def held(self) -> bool:
        return self._fd is not None


def _os_error(root: Path, exc: OSError) -> AgentStateError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CapacityError(f"cannot lock data directory {root}: the disk is full ({exc})")
    return BackendError(f"cannot lock data directory {root}: {exc}")


def _holder(fd: int) -> int | None:
    """The PID a writer recorded in the lock file (None for readers, or an unreadable file)."""
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text.isdigit() else None
    except (OSError, UnicodeDecodeError):
        return None
