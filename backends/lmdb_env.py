"""Opening an LMDB environment safely, and LMDB's errors as agentstate's typed errors.

Shared by the LMDB tier (`agentstate.backends.lmdb`) and the catalog (`agentstate.catalog`).

LMDB maps its data file and trusts it: touching a page the map names past the end of a truncated
file is a SIGBUS, which no exception handler catches. So `open_env` checks the file before the
engine sees it (an existing file shorter than its two meta pages, 0 bytes included, is damage:
LMDB would quietly re-initialise a 0-byte file as a fresh, empty store) and again once it is open,
before any page is read through the map: every page in use must lie inside the file.

"In use" is not simply "below the last page number the meta page records": LMDB can commit with
the last few page numbers allocated but free and never written, so a healthy file may be a little
shorter than `(last_pgno + 1) * psize`. When it is, the pages past its end must all be listed in
LMDB's free-page tree, which is read here with plain reads (`os.pread`), never through the map.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from pathlib import Path
from typing import Any

import lmdb

from agentstate.errors import AgentStateError, BackendError, CorruptDataError

DATA_FILE = "data.mdb"

_CORRUPT = tuple(
    getattr(lmdb, name)
    for name in (
        "CorruptedError", "PageNotFoundError", "InvalidError", "BadValsizeError", "VersionMismatchError",
        "IncompatibleError", "BadChecksumError",
    )
    if hasattr(lmdb, name)
)  # fmt: skip
"""LMDB errors that mean the file's bytes are wrong (not the disk, not the caller)."""

# LMDB 0.9's on-disk layout (64-bit, host byte order), as far as the free-page tree needs it.
_MAGIC = 0xBEEFC0DE
_HDR = 16  # page header: pgno u64, pad u16, flags u16, lower u16, upper u16
_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA = 0x01
_NO_PAGE = (1 << 64) - 1
_E = "<" if sys.byteorder == "little" else ">"
_U16, _U32, _U64 = struct.Struct(_E + "H"), struct.Struct(_E + "I"), struct.Struct(_E + "Q")


def lmdb_error(exc: BaseException, what: str) -> AgentStateError:
    """The typed error for an `lmdb.Error`: damage is CorruptDataError, the rest BackendError.
    (Callers check for a full disk first: that is CapacityError.)"""
    if isinstance(exc, _CORRUPT):
        return CorruptDataError(f"{what}: the LMDB file is damaged ({exc})")
    return BackendError(f"{what}: {exc}")


def open_env(path: str | Path, what: str, **kwargs: Any) -> lmdb.Environment:
    """`lmdb.open(path, subdir=True, **kwargs)`, refusing a damaged data file with CorruptDataError
    before anything of it is read through the map. A missing data file is a fresh store."""
    path = Path(path)
    file = path / DATA_FILE
    check_data_file(file, what)
    try:
        env = lmdb.open(str(path), subdir=True, **kwargs)
    except lmdb.Error as exc:
        raise lmdb_error(exc, f"cannot open {what} at {path}") from exc
    try:
        _check_extent(env, file, what)
    except BaseException:
        env.close()
        raise
    return env


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
    """After opening: no page LMDB may read lies past the end of the file."""
    psize, last = env.stat()["psize"], env.info()["last_pgno"]  # the meta pages only
    size = file.stat().st_size  # after the meta: a concurrent commit only makes the file longer
    if size >= (last + 1) * psize:
        return
    short = range(-(-size // psize), last + 1)  # pages not (wholly) in the file
    free = _free_pages(file, psize)
    if free is None or not all(p in free for p in short):
        raise CorruptDataError(
            f"{what} file {file} is truncated: {size} bytes, but pages up to {last} "
            f"({(last + 1) * psize} bytes) are in use"
        )


def _free_pages(file: Path, psize: int) -> set[int] | None:
    """Every page number LMDB's free-page tree lists, read with plain reads; None when the tree
    cannot be read whole (a page of it past the end of the file, or not a B-tree page)."""
    fd = os.open(file, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        metas = [os.pread(fd, _HDR + 136, n * psize) for n in (0, 1)]
        if any(len(m) < _HDR + 136 or _U32.unpack_from(m, _HDR)[0] != _MAGIC for m in metas):
            return None
        meta = max(metas, key=lambda m: _U64.unpack_from(m, _HDR + 128)[0])  # mm_txnid: the newest
        root = _U64.unpack_from(meta, _HDR + 24 + 40)[0]  # the free DB's md_root

        def page(pgno: int, count: int = 1) -> bytes | None:
            if (pgno + count) * psize > size:
                return None
            buf = os.pread(fd, count * psize, pgno * psize)
            return buf if len(buf) == count * psize else None

        free: set[int] = set()
        todo = [] if root == _NO_PAGE else [root]
        while todo:
            buf = page(todo.pop())
            if buf is None:
                return None
            flags, lower = _U16.unpack_from(buf, 10)[0], _U16.unpack_from(buf, 12)[0]
            if not flags & (_P_BRANCH | _P_LEAF) or not _HDR <= lower <= psize:
                return None
            for i in range((lower - _HDR) // 2):
                at = _U16.unpack_from(buf, _HDR + 2 * i)[0]
                if at + 8 > psize:
                    return None
                lo, hi, nflags, ksize = (_U16.unpack_from(buf, at + 2 * j)[0] for j in range(4))
                if flags & _P_BRANCH:
                    todo.append(lo | hi << 16 | nflags << 32)
                    continue
                data, dsize = at + 8 + ksize, lo | hi << 16
                if nflags & _F_BIGDATA:
                    if data + 8 > psize:
                        return None
                    first = _U64.unpack_from(buf, data)[0]
                    ids = page(first, (_HDR - 1 + dsize) // psize + 1)
                    if ids is None:
                        return None
                    ids = ids[_HDR : _HDR + dsize]
                else:
                    ids = buf[data : data + dsize]
                if len(ids) < 8:
                    return None
                count = _U64.unpack_from(ids, 0)[0]
                if len(ids) < 8 * (count + 1):
                    return None
                free.update(struct.unpack_from(f"{_E}{count}Q", ids, 8))
        return free
    except OSError:
        return None
    finally:
        os.close(fd)
