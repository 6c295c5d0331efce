"""Opening an LMDB environment safely, and LMDB's errors as agentstate's typed errors.

Shared by the LMDB tier (`agentstate.backends.lmdb`) and the catalog (`agentstate.catalog`).

LMDB maps its data file and trusts it: touching a page the map names past the end of a truncated
file is a SIGBUS, which no exception handler catches, and a garbage page sends LMDB (and py-lmdb,
which prefaults every page of a value it returns) wherever its sizes and offsets point. So
`open_env` checks the file before the engine sees it (an existing file shorter than its two meta
pages, 0 bytes included, is damage: LMDB would quietly re-initialise a 0-byte file as a fresh,
empty store) and again once it is open, before any page is read through the map: it walks every
B-tree with plain reads (`os.pread`), and every page in use, every node and every value must lie
inside the file and inside its page. That reads the branch and leaf pages (what listing the keys
reads anyway), not the values.

The walk reads every branch and leaf page, so it grows with the store (about a second per
100,000 small chunks). A clean close records what the data file looked like (`close_env`: its
last transaction, size, inode, mtime and ctime, in `checked.json` beside it); an open that finds
the file exactly so skips the walk. The kernel sets a file's ctime on every change to it
(truncation and writes included) and no user call can set it back, so a match means nothing
touched the file since a close that either walked it or wrote it through LMDB from a walked state.
A crash leaves the file changed since its last record, so the open after it walks. Not defended:
damage below the filesystem (the media), which changes no ctime; values carry their own checksums.

"In use" is not "below the last page number the meta page records": LMDB can commit with its
highest page numbers allocated but free and never written, so a healthy file may be shorter than
`(last_pgno + 1) * psize`; only a page some tree reaches must be in the file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import struct
import sys
from pathlib import Path
from typing import Any

import lmdb

from agentstate.config import MAX_MAP_BYTES
from agentstate.errors import AgentStateError, BackendError, CapacityError, ConfigError, CorruptDataError

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"

_CORRUPT = tuple(
    getattr(lmdb, name)
    for name in (
        "CorruptedError", "PageNotFoundError", "InvalidError", "BadValsizeError", "VersionMismatchError",
        "IncompatibleError", "BadChecksumError",
    )
    if hasattr(lmdb, name)
)  # fmt: skip
"""LMDB errors that mean the file's bytes are wrong (not the disk, not the caller)."""

# LMDB 0.9's on-disk layout (64-bit, host byte order), as far as the walk needs it.
_MAGIC = 0xBEEFC0DE
_HDR = 16  # page header: pgno u64, pad u16, flags u16, lower u16, upper u16
_P_BRANCH, _P_LEAF = 0x01, 0x02
_P_IGNORED = 0x10 | 0x4000 | 0x8000  # P_DIRTY, P_LOOSE, P_KEEP: in-memory marks, harmless at rest
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_NO_PAGE = (1 << 64) - 1
_E = "<" if sys.byteorder == "little" else ">"
_U16, _U32, _U64 = struct.Struct(_E + "H"), struct.Struct(_E + "I"), struct.Struct(_E + "Q")


def lmdb_error(exc: BaseException, what: str) -> AgentStateError:
    """The typed error for an `lmdb.Error`: damage is CorruptDataError, the rest BackendError.
    (Callers check for a full disk first: that is CapacityError.)"""
    if isinstance(exc, _CORRUPT):
        return CorruptDataError(f"{what}: the LMDB file is damaged ({exc})")
    return BackendError(f"{what}: {exc}")


def open_env(path: str | Path, what: str, *, size_key: str | None = None, **kwargs: Any) -> lmdb.Environment:
    """`lmdb.open(path, subdir=True, **kwargs)`, refusing a damaged data file with CorruptDataError
    before anything of it is read through the map. A missing data file is a fresh store.

    A `map_size` the platform cannot map (past MAX_MAP_BYTES, or refused with ENOMEM) is a
    ConfigError naming `size_key`, the setting it came from. An open that fails leaves no file it
    created: a fresh store's data and lock files go again (an existing store's are never touched)."""
    path = Path(path)
    file = path / DATA_FILE
    map_size = kwargs.get("map_size", 0)
    if map_size > MAX_MAP_BYTES:
        raise _size_error(what, path, size_key, map_size, "it is past the largest map this platform can hold")
    check_data_file(file, what)
    _check_room(path, what)
    fresh = {name for name in (DATA_FILE, LOCK_FILE) if not (path / name).exists()}
    try:
        try:
            env = lmdb.open(str(path), subdir=True, **kwargs)
        except OverflowError as exc:
            raise _size_error(what, path, size_key, map_size, str(exc)) from exc
        except lmdb.Error as exc:
            if _enomem(exc) and map_size:
                raise _size_error(what, path, size_key, map_size, str(exc)) from exc
            raise lmdb_error(exc, f"cannot open {what} at {path}") from exc
        try:
            if not _unchanged(env, file):
                _check_extent(env, file, what)
        except BaseException:
            env.close()
            raise
    except BaseException:
        if DATA_FILE in fresh:  # nothing was ever stored in a data file this call created
            for name in fresh:
                with contextlib.suppress(OSError):
                    (path / name).unlink()
        raise
    return env


STAMP_FILE = "checked.json"
_STAMPED = ("st_size", "st_ino", "st_dev", "st_mtime_ns", "st_ctime_ns")


def close_env(env: lmdb.Environment, path: str | Path) -> None:
    """Close an environment this process opened through `open_env`, flushed, and record what its
    data file looks like now, so that the next open can skip the walk (a record that cannot be
    written costs that open the walk, nothing else)."""
    path = Path(path)
    try:
        env.sync(True)
        txnid = env.info()["last_txnid"]
    except lmdb.Error:
        env.close()
        return
    env.close()
    stamp = path / STAMP_FILE
    tmp = path / f"{STAMP_FILE}.{os.getpid()}.tmp"
    try:
        st = os.stat(path / DATA_FILE)
        tmp.write_text(json.dumps({"txnid": txnid, **{k: getattr(st, k) for k in _STAMPED}}))
        os.replace(tmp, stamp)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _unchanged(env: lmdb.Environment, file: Path) -> bool:
    """Whether the data file is exactly as a clean close recorded it (then it needs no walk). Any
    doubt (no record, a malformed one, one field different) is a no."""
    try:
        raw = json.loads((file.parent / STAMP_FILE).read_text())
        st = os.stat(file)
        return (
            isinstance(raw, dict)
            and raw.get("txnid") == env.info()["last_txnid"]
            and all(type(raw.get(k)) is int and raw[k] == getattr(st, k) for k in _STAMPED)
        )
    except (OSError, ValueError, lmdb.Error):
        return False


def _enomem(exc: lmdb.Error) -> bool:
    return "Cannot allocate memory" in str(exc) or os.strerror(errno.ENOMEM) in str(exc)


def _size_error(what: str, path: Path, key: str | None, size: int, why: str) -> ConfigError:
    name = key or "map_size"
    return ConfigError(
        f"{name} = {size} bytes cannot be mapped for {what} at {path}: {why} (the map is one range of virtual"
        f" address space; this platform allows at most {MAX_MAP_BYTES} bytes, less where the address space or"
        f" the overcommit policy is smaller): lower {name}",
        key=name,
    )


_ROOM = 1 << 20
"""Free bytes a new environment needs: its lock file and first pages are mapped, and a page of a
sparse file that a full filesystem (tmpfs) cannot back is a SIGBUS on first touch, not an error."""


def _check_room(path: Path, what: str) -> None:
    """Before creating an environment's files (either missing): refuse a full filesystem."""
    if (path / DATA_FILE).exists() and (path / "lock.mdb").exists():
        return
    try:
        st = os.statvfs(path)
    except OSError:
        return
    if st.f_bavail * st.f_frsize < _ROOM:
        raise CapacityError(f"cannot create {what} at {path}: the disk is full ({st.f_bavail * st.f_frsize} bytes free)")


def check_data_file(file: Path, what: str = "LMDB") -> None:
    """Before opening: an existing data file must hold at least its two meta pages."""
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(64)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise BackendError(f"cannot read {what} file {file}: {exc}") from exc
    psize = _header_psize(head) or mmap.PAGESIZE
    if size < 2 * psize:
        raise CorruptDataError(
            f"{what} file {file} is damaged: {size} bytes, shorter than its two meta pages ({2 * psize} bytes)"
            + (" (an empty file is not an empty store)" if size == 0 else "")
        )


def _header_psize(head: bytes) -> int | None:
    """The page size meta page 0 records, if `head` starts like an LMDB 0.9 data file."""
    if len(head) < _HDR + 28 or _U32.unpack_from(head, _HDR)[0] != _MAGIC:
        return None
    psize = _U32.unpack_from(head, _HDR + 24)[0]  # mm_psize: the free DB's md_pad
    return psize if 512 <= psize <= 1 << 16 and psize & (psize - 1) == 0 else None


def _check_extent(env: lmdb.Environment, file: Path, what: str) -> None:
    """After opening: every page LMDB may read lies inside the file and inside its page."""
    for _ in range(3):
        try:
            with env.begin() as txn:  # pins the snapshot: its pages are not reused while we read them
                psize = env.stat()["psize"]
                problem = _check_pages(file, psize, txn.id())
        except lmdb.Error as exc:
            raise lmdb_error(exc, f"cannot open {what} at {file.parent}") from exc
        if problem is not _UNPINNED:
            break
    else:
        return  # two commits by another process during each try: left to LMDB's own checks
    if problem is not None:
        raise CorruptDataError(f"{what} file {file} is damaged: {problem}")


_UNPINNED = "the snapshot's meta page was overwritten"


def _check_pages(file: Path, psize: int, txnid: int) -> str | None:
    """Walk every B-tree of snapshot `txnid` of an LMDB 0.9 data file with plain reads (`os.pread`):
    what makes a page unsafe to read through the map, or None. A page is unsafe when it lies past
    the end of the file (truncation), or when its header or nodes point outside it (garbage): LMDB
    and py-lmdb follow such sizes and offsets without checking them. Overflow values are checked
    for their extent only, not read (the free-page lists excepted: LMDB writes to what they name).
    """
    fd = os.open(file, os.O_RDONLY)
    try:
        return _Walk(fd, os.fstat(fd).st_size, psize).run(txnid)
    except _Bad as bad:
        return str(bad)
    finally:
        os.close(fd)


class _Bad(Exception):
    pass


class _Walk:
    def __init__(self, fd: int, size: int, psize: int) -> None:
        self.fd, self.size, self.psize = fd, size, psize
        self.next_pgno = 0
        self.seen: set[int] = set()

    def within(self, pgno: int, count: int = 1) -> None:
        """Pages `pgno` .. `pgno + count - 1` are in use and in the file."""
        if pgno < 2 or count < 1 or pgno + count > self.next_pgno:
            raise _Bad(f"a reference to page {pgno} (+{count}) outside the {self.next_pgno} pages in use")
        if (pgno + count) * self.psize > self.size:
            raise _Bad(
                f"it is truncated: {self.size} bytes, but page {pgno + count - 1} is in use "
                f"({(pgno + count) * self.psize} bytes)"
            )

    def read(self, pgno: int, count: int = 1) -> bytes:
        self.within(pgno, count)
        buf = os.pread(self.fd, count * self.psize, pgno * self.psize)
        if len(buf) != count * self.psize:
            raise _Bad(f"page {pgno} cannot be read whole")
        return buf

    def run(self, txnid: int) -> str | None:
        metas = [os.pread(self.fd, _HDR + 136, n * self.psize) for n in (0, 1)]
        if len(metas[0]) >= 28 and _U32.unpack_from(metas[0], 24)[0] == _MAGIC:
            return None  # LMDB 1.0's layout (24-byte page headers): not walked here
        if any(len(m) < _HDR + 136 or _U32.unpack_from(m, _HDR)[0] != _MAGIC for m in metas):
            raise _Bad("a meta page is not an LMDB 0.9 meta page")
        meta = next((m for m in metas if _U64.unpack_from(m, _HDR + 128)[0] == txnid), None)
        if meta is None:
            return _UNPINNED
        self.next_pgno = _U64.unpack_from(meta, _HDR + 120)[0] + 1
        free_root, main_root = (_U64.unpack_from(meta, _HDR + 24 + 48 * i + 40)[0] for i in (0, 1))
        self.tree(free_root, free=True)
        roots = self.tree(main_root, free=False)
        while roots:  # named databases (the catalog's): F_SUBDATA records in the main tree
            roots = [r for root in roots for r in self.tree(root, free=False)]
        return None

    def tree(self, root: int, free: bool) -> list[int]:
        """Check one B-tree; returns the roots of the named databases its leaves record."""
        subs: list[int] = []
        todo = [] if root == _NO_PAGE else [(root, 0)]
        while todo:
            pgno, depth = todo.pop()
            if pgno in self.seen or depth > 32:
                raise _Bad(f"page {pgno} is reachable twice, or the tree is deeper than LMDB allows")
            self.seen.add(pgno)
            buf = self.read(pgno)
            flags, lower, upper = (_U16.unpack_from(buf, at)[0] for at in (10, 12, 14))
            kind = flags & ~_P_IGNORED
            if _U64.unpack_from(buf, 0)[0] != pgno or kind not in (_P_BRANCH, _P_LEAF):
                raise _Bad(f"page {pgno} is not the B-tree page it should be (flags {flags:#x})")
            if not _HDR <= lower <= upper <= self.psize or (kind == _P_BRANCH and lower == _HDR):
                raise _Bad(f"page {pgno} has a bad header (lower {lower}, upper {upper})")
            for i in range((lower - _HDR) // 2):
                at = _U16.unpack_from(buf, _HDR + 2 * i)[0]
                if not upper <= at <= self.psize - 8:
                    raise _Bad(f"page {pgno} node {i} lies outside its page")
                lo, hi, nflags, ksize = (_U16.unpack_from(buf, at + 2 * j)[0] for j in range(4))
                data = at + 8 + ksize
                if data > self.psize:
                    raise _Bad(f"page {pgno} node {i}: its key runs past its page")
                if kind == _P_BRANCH:
                    todo.append((lo | hi << 16 | nflags << 32, depth + 1))
                    continue
                value = self.value(pgno, i, buf, data, lo | hi << 16, nflags, read=free)
                if nflags & _F_SUBDATA:
                    if len(value) != 48:
                        raise _Bad(f"page {pgno} node {i}: a named database record of {len(value)} bytes")
                    sub = _U64.unpack_from(value, 40)[0]
                    if sub != _NO_PAGE:
                        subs.append(sub)
                elif free:
                    self.free_list(pgno, i, value)
        return subs

    def value(self, pgno: int, i: int, buf: bytes, data: int, dsize: int, nflags: int, *, read: bool) -> bytes:
        """A leaf node's value: in its page, or (F_BIGDATA) in overflow pages, whose extent is
        checked and, with `read`, read (otherwise the value comes back empty)."""
        if nflags & ~(_F_BIGDATA | _F_SUBDATA) or nflags == _F_BIGDATA | _F_SUBDATA:
            raise _Bad(f"page {pgno} node {i} has flags {nflags:#x} no agentstate database uses")
        if not nflags & _F_BIGDATA:
            if data + dsize > self.psize:
                raise _Bad(f"page {pgno} node {i}: its value runs past its page")
            return buf[data : data + dsize]
        if data + 8 > self.psize:
            raise _Bad(f"page {pgno} node {i}: its overflow page number runs past its page")
        first, count = _U64.unpack_from(buf, data)[0], (_HDR - 1 + dsize) // self.psize + 1
        if not read:
            self.within(first, count)
            return b""
        return self.read(first, count)[_HDR : _HDR + dsize]

    def free_list(self, pgno: int, i: int, ids: bytes) -> None:
        """A free-page record: a count, then that many page numbers below the last page in use
        (LMDB writes the pages it names, so one past the map would be a crash later)."""
        count = _U64.unpack_from(ids, 0)[0] if len(ids) >= 8 else -1
        if count < 0 or len(ids) < 8 * (count + 1):
            raise _Bad(f"free-page record {i} on page {pgno} is malformed")
        if count and not all(2 <= n < self.next_pgno for n in struct.unpack_from(f"{_E}{count}Q", ids, 8)):
            raise _Bad(f"free-page record {i} on page {pgno} names pages past the last page in use")
