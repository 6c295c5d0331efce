"""File tier: one file per key on a local disk or NVMe, so restores can read with O_DIRECT.

- Layout `root/<h0h1>/<h2h3>/<name>`, h = blake2b(key): 65536 shards keep directories small.
  `<name>` is the key percent-encoded over `[a-z0-9_-]`: `.` and `/` are always encoded, so no name
  is `.`/`..` or crosses a directory, and lowercase-only names cannot merge two keys on a
  case-insensitive filesystem. A key whose name would pass 200 bytes (a tail key with long tenant and
  session ids) is stored as `~<h>-<n>` with its n-byte UTF-8 key appended to the file, so every key
  still round-trips through `keys()`.
- `put` writes a temp name (`.tmp-*`) in the final directory, fsyncs it, renames it over the final
  name and fsyncs each touched directory once per call: a crash leaves the old state or the new one.
  Temp files of a crash are removed on open and never listed.
- An in-memory index (key -> file size) is rebuilt by a scan on open. It answers `exists`, `sizes`
  and `stats`; reads and `keys()` go to the disk. One process owns a root at a time (the open scan
  deletes temp files).
- It only stores bytes: capacity, eviction order and pins belong to the chunk layer
  (`agentstate.chunks.tiers`), which deletes what it evicts through `delete`.
- `_busy` maps each key with a write or unlink in flight to a future; an operation on a key first
  waits for it, so a put never races a delete of the same file.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import hashlib
import logging
import mmap
import os
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import unquote

from agentstate.backends.base import Backend, BackendStats, ReadSink, disk_full, fsync_dir

from agentstate.errors import BackendError, CapacityError, InvalidArgumentError
from agentstate.memory import host_buffer

if TYPE_CHECKING:
    from agentstate.config import FileTier, StoreConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
Loc = tuple[str, str, bytes]  # (directory, path, trailer: the key of a long-name file, else b"")

_TMP, _MAX_NAME = ".tmp-", 200
_ALIGN = 4096  # O_DIRECT wants buffer address, file offset and length aligned to the logical block
_UNSAFE = re.compile(r"[^a-z0-9_-]+")
_LONG = re.compile(r"~[0-9a-f]{32}-([1-9][0-9]*)")
_SHARD = re.compile(r"[0-9a-f]{2}")
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC: int = getattr(os, "O_CLOEXEC", 0)
_O_READ = os.O_RDONLY | _O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)  # a planted symlink is not followed
_fdatasync: Callable[[int], None] = getattr(os, "fdatasync", os.fsync)
_FADV_DONTNEED: int | None = getattr(os, "POSIX_FADV_DONTNEED", None)
_FADV_WILLNEED: int | None = getattr(os, "POSIX_FADV_WILLNEED", None)
_WINDOW = 64 << 20  # announced bytes waiting for their readers, at most (see _ReadAhead)
_READERS = 8  # files read at once, at least: measured here, 8 cold 8 MiB files in flight read ~1.25x faster than 4


def _encode(key: str) -> str:
    return _UNSAFE.sub(lambda m: "".join(f"%{b:02x}" for b in m.group().encode()), key)


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


def _fill(fd: int, view: memoryview, offset: int, need: int) -> None:
    """preadv until `need` bytes are in `view` (an O_DIRECT view may be longer, to stay aligned)."""
    done = 0
    while done < need:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(errno.EIO, "file ended early")
        done += n


class _ReadAhead:
    """Announces buffered read batches to the kernel (POSIX_FADV_WILLNEED), a bounded window ahead.

    A buffered read submits only its readahead window before it blocks; announced first, the next
    files of the batch are already queued at the disk while the readers copy, which is what the
    disk needs for its parallel read speed. Not too far ahead: with hundreds of MiB announced at
    once, the readers wait behind reads of files they reach last (one run here: slower than no
    advice at all), so at most `window` announced bytes wait for their reader. Advice only: a file gone,
    refused, or already being read is skipped, and an announcement whose read never starts (a
    cancelled call) leaves the window after `_EXPIRE` seconds.
    """

    _EXPIRE = 1.0

    def __init__(self, window: int) -> None:
        self.window = window
        self._ahead: dict[str, tuple[int, float]] = {}  # path -> (bytes, when announced), not yet read
        self._bytes = 0  # the sum of _ahead's bytes
        self._reading: Counter[str] = Counter()
        self._cv = threading.Condition()

    def _room(self) -> bool:
        if self._bytes < self.window:
            return True
        old = time.monotonic() - self._EXPIRE  # full: announcements whose read never started leave
        for path in [p for p, (_, t) in self._ahead.items() if t < old]:
            self._bytes -= self._ahead.pop(path)[0]
        return self._bytes < self.window

    def announce(self, paths: Sequence[str]) -> None:
        for path in paths:
            try:
                fd = os.open(path, _O_READ)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                with self._cv:
                    if path in self._ahead or self._reading[path]:
                        continue
                    self._cv.wait_for(self._room, timeout=self._EXPIRE)
                    if self._reading[path]:  # its reader started meanwhile
                        continue
                    self._ahead[path] = (size, time.monotonic())
                    self._bytes += size
                os.posix_fadvise(fd, 0, size, _FADV_WILLNEED)  # type: ignore[arg-type]
            except OSError:
                pass
            finally:
                os.close(fd)

    def reading(self, path: str) -> None:
        """A reader starts on `path`: no advice for it from now on (the reader's own readahead runs)."""
        with self._cv:
            self._reading[path] += 1

    def consumed(self, path: str) -> None:
        """A reader is done with `path`: its announced bytes leave the window."""
        with self._cv:
            self._reading[path] -= 1
            if self._reading[path] <= 0:
                del self._reading[path]
            self._bytes -= self._ahead.pop(path, (0, 0.0))[0]
            self._cv.notify_all()


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _aligned_buffer(size: int) -> mmap.mmap:
    """A fresh page-aligned buffer of `size` rounded up to a block, on huge pages where THP allows."""
    cap = _round_up(max(size, 1))
    fresh = host_buffer(cap)
    return fresh if isinstance(fresh, mmap.mmap) else mmap.mmap(-1, cap)


class _Staging:
    """Read buffers reused across reads, as the ReadSink contract allows (a view is valid only
    during the sink call). Reuse skips the first-touch page faults of a fresh buffer per read,
    which on this VM cost more than the read; at most `keep` idle buffers are kept."""

    def __init__(self, keep: int) -> None:
        self._free: list[mmap.mmap] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        cap = _round_up(max(size, 1))
        with self._lock:
            for j, buf in enumerate(self._free):
                if len(buf) == cap:
                    return self._free.pop(j)
        return _aligned_buffer(size)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)


def _byte_view(value: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(value)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class FileBackend(Backend):
    """Durable file-per-key tier: optional O_DIRECT reads.

    `threads` bounds the files written at once (each read or write is one blocking call on a pool,
    which releases the GIL); reads run on a pool of `read_threads` (default: `threads`, at least 8),
    because a disk reads at its parallel speed only with several files in flight, and a thread
    blocked on a read costs no CPU. Buffered reads of a batch are first announced to the kernel
    (POSIX_FADV_WILLNEED, on a thread of their own, up to 64 MiB ahead of the readers) so the
    disk has the next files in flight while the readers copy; `announce = False` turns that off. `o_direct=True` reads around the page
    cache: no copy out of it and no memory held, slower warm; use it under a host tier, which
    already caches hot chunks. `sync=False` skips every fsync (tests, benchmarks); the tier is then
    not durable.
    """

    name = "file"
    durable = True
    trusted = False

    def __init__(
        self,
        root: str | Path,
        *,
        threads: int = 8,
        read_threads: int | None = None,
        o_direct: bool = False,
        sync: bool = True,
    ) -> None:
        if threads < 1 or (read_threads is not None and read_threads < 1):
            raise InvalidArgumentError("threads and read_threads must be >= 1")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._root = str(self.root.resolve())
        self.sync = sync
        self._direct = bool(o_direct and _O_DIRECT)
        if o_direct and not _O_DIRECT:
            log.info("O_DIRECT does not exist on this platform; %s reads buffered", self._root)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="agentstate-file")
        readers = read_threads if read_threads is not None else max(threads, _READERS)
        self._readers = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="agentstate-file-read")
        # One thread that announces each buffered read batch (WILLNEED) ahead of the readers, so that
        # announcing never waits behind the reads it is meant to get in flight early.
        self._announcer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentstate-file-ra")
        self._ahead = _ReadAhead(_WINDOW)
        self._announcing: set[asyncio.Future[None]] = set()
        self.announce = _FADV_WILLNEED is not None
        self._staging = _Staging(keep=readers)
        self._dirs: set[str] = set()  # shard directories whose own entries are known to be durable
        self._index: dict[str, int] = {}
        self._busy: dict[str, asyncio.Future[None]] = {}
        self._counts: Counter[str] = Counter()
        self._used = 0  # bytes of indexed files
        self._closed = False
        for shard in self._shards():
            for key, size, _ in self._list_shard(shard, clean=True):
                self._index[key] = size
                self._used += size

    # -- naming and scanning -------------------------------------------------------------------

    def _locate(self, key: str) -> Loc:
        if not key:
            raise InvalidArgumentError("empty key")
        raw = key.encode()
        h = hashlib.blake2b(raw, digest_size=16).hexdigest()
        d = os.path.join(self._root, h[:2], h[2:4])
        name = _encode(key)
        if len(name) <= _MAX_NAME:
            return d, os.path.join(d, name), b""
        return d, os.path.join(d, f"~{h}-{len(raw)}"), raw

    def _decode(self, path: str, name: str) -> str | None:
        """The key stored at `path`, or None for a file this backend would never have written there."""
        try:
            if m := _LONG.fullmatch(name):
                with open(path, "rb") as f:
                    f.seek(-int(m[1]), os.SEEK_END)
                    key = f.read().decode()
            else:
                key = unquote(name, errors="strict")
        except (OSError, UnicodeDecodeError):
            return None
        return key if key and self._locate(key)[1] == path else None

    def _shards(self) -> list[str]:
        with os.scandir(self._root) as it:
            return [e.path for e in it if _SHARD.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]

    def _list_shard(self, shard: str, clean: bool) -> list[tuple[str, int, int]]:
        """(key, size, mtime_ns) of the files under one top-level shard: one page of a walk."""
        out: list[tuple[str, int, int]] = []
        with os.scandir(shard) as it:
            leaves = [e.path for e in it if _SHARD.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
        for leaf in leaves:
            with os.scandir(leaf) as it:
                for e in it:
                    if e.name.startswith(_TMP):
                        if clean:  # only on open: at run time a temp name is a write in flight
                            _unlink(e.path)
                        continue
                    try:
                        if e.is_file(follow_symlinks=False) and (key := self._decode(e.path, e.name)):
                            st = e.stat(follow_symlinks=False)
                            out.append((key, st.st_size, st.st_mtime_ns))
                    except FileNotFoundError:
                        continue
        return out

    # -- blocking file IO (worker threads) -----------------------------------------------------

    def _write(self, loc: Loc, view: memoryview) -> None:
        d, path, trailer = loc
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, _TMP + secrets.token_hex(8))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
        try:
            try:
                for part in (view, memoryview(trailer)):
                    while part:
                        part = part[os.write(fd, part) :]
                if self.sync:
                    _fdatasync(fd)
                    if self._direct and _FADV_DONTNEED is not None:  # O_DIRECT reads never use these pages
                        os.posix_fadvise(fd, 0, 0, _FADV_DONTNEED)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise

    def _direct_refused(self, exc: OSError) -> bool:
        if exc.errno != errno.EINVAL:
            return False
        if self._direct:  # several threads may meet the refusal; one flips the switch and logs
            self._direct = False
            log.info("O_DIRECT refused under %s (%s); reading buffered from now on", self._root, exc)
        return True

    def _load(self, loc: Loc, dest: memoryview | None, i: int = 0, sink: ReadSink | None = None) -> int:
        """Read one file into `dest` (get_into) or a fresh buffer handed to `sink` (read); -1 = missing."""
        self._ahead.reading(loc[1])
        try:
            return self._load_path(loc, dest, i, sink)
        finally:
            self._ahead.consumed(loc[1])

    def _load_path(self, loc: Loc, dest: memoryview | None, i: int, sink: ReadSink | None) -> int:
        while True:
            direct = self._direct
            try:
                fd = os.open(loc[1], _O_READ | (_O_DIRECT if direct else 0))
            except FileNotFoundError:
                return -1
            except OSError as exc:
                if direct and self._direct_refused(exc):
                    continue
                raise
            try:
                return self._load_fd(fd, direct, loc[2], dest, i, sink)
            except OSError as exc:  # some filesystems accept O_DIRECT at open and refuse the read
                if not (direct and self._direct_refused(exc)):
                    raise
            finally:
                os.close(fd)

    def _load_fd(
        self, fd: int, direct: bool, trailer: bytes, dest: memoryview | None, i: int, sink: ReadSink | None
    ) -> int:
        staging = self._staging
        size = os.fstat(fd).st_size
        vlen = size - len(trailer)
        if vlen < 0:
            raise OSError(errno.EIO, "file shorter than its key trailer")
        if dest is None:
            buf = staging.take(size)
            with memoryview(buf) as view:
                _fill(fd, view, 0, size)
                sink(i, view[:vlen])  # type: ignore[misc]
            staging.give(buf)
            return vlen
        if vlen > len(dest) or vlen == 0:
            return 0
        if not direct:
            _fill(fd, dest, 0, vlen)
            return vlen
        # Page-aligned caller memory takes the whole blocks straight from the disk; the unaligned
        # tail (or all of it, for unaligned memory) comes through an aligned bounce buffer.
        aligned = ctypes.addressof(ctypes.c_char.from_buffer(dest)) % _ALIGN == 0
        bulk = vlen & ~(_ALIGN - 1) if aligned else 0
        if bulk:
            _fill(fd, dest[:bulk], 0, bulk)
        if bulk < vlen:
            with _aligned_buffer(size - bulk) as bounce, memoryview(bounce) as view:
                _fill(fd, view, bulk, size - bulk)
                dest[bulk:vlen] = view[: vlen - bulk]
        return vlen

    # -- async API -----------------------------------------------------------------------------

    def _check(self) -> None:
        if self._closed:
            raise BackendError("file backend is closed")

    async def _settle(self, keys: Sequence[str]) -> None:
        """Wait until no write or unlink of these keys is in flight."""
        while pending := {id(f): f for k in keys if (f := self._busy.get(k)) is not None}:
            await asyncio.gather(*pending.values())

    async def _gather(
        self, fn: Callable[..., T], *arg_lists: Sequence[object], pool: ThreadPoolExecutor | None = None
    ) -> list[T | BaseException]:
        loop = asyncio.get_running_loop()
        calls = (loop.run_in_executor(pool or self._pool, fn, *args) for args in zip(*arg_lists))
        return await asyncio.gather(*calls, return_exceptions=True)

    def _account_reads(self, keys: Sequence[str], results: Sequence[int | BaseException]) -> None:
        """Count hits, misses and errors (a failed read is a miss the engine recomputes)."""
        for key, r in zip(keys, results):
            if isinstance(r, BaseException):
                log.warning("file tier read of %s failed: %r", key, r)
            self._counts["errors" if isinstance(r, BaseException) else "misses" if r < 0 else "reads"] += 1

    def _start_reads(self, locs: Sequence[Loc]) -> None:
        """Announce a buffered batch's files on the announcer thread; the reads start without waiting."""
        if self._direct or not self.announce or not locs:
            return
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._announcer, self._ahead.announce, [loc[1] for loc in locs])
        self._announcing.add(fut)
        fut.add_done_callback(self._announcing.discard)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check()
        return [key in self._index for key in keys]

    async def read(self, keys: Sequence[str], sink: ReadSink) -> list[bool]:
        self._check()
        n = len(keys)
        locs = [self._locate(k) for k in keys]
        self._start_reads(locs)
        results = await self._gather(self._load, locs, [None] * n, range(n), [sink] * n, pool=self._readers)
        self._account_reads(keys, results)
        return [isinstance(r, int) and r >= 0 for r in results]

    async def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        self._check()
        if len(keys) != len(buffers):
            raise InvalidArgumentError("keys and buffers differ in length")
        locs = [self._locate(k) for k in keys]
        self._start_reads(locs)
        results = await self._gather(self._load, locs, [_byte_view(b) for b in buffers], pool=self._readers)
        self._account_reads(keys, results)
        return [r if isinstance(r, int) and r > 0 else 0 for r in results]

    async def put(self, keys: Sequence[str], values: Sequence[bytes | bytearray | memoryview]) -> None:
        self._check()
        if len(keys) != len(values):
            raise InvalidArgumentError("keys and values differ in length")
        await self._settle(keys)
        jobs: dict[str, tuple[Loc, memoryview]] = {}
        for key, value in zip(keys, values):
            if key not in self._index and key not in jobs:  # values are immutable: an equal key holds equal bytes
                jobs[key] = (self._locate(key), _byte_view(value))
        if not jobs:
            return
        sizes = {k: len(view) + len(loc[2]) for k, (loc, view) in jobs.items()}
        self._used += sum(sizes.values())  # reserved while in flight
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._busy.update(dict.fromkeys(jobs, done))
        # Shielded: a cancelled caller must not leave files on disk that the accounting forgot.
        error = await asyncio.shield(asyncio.ensure_future(self._store(jobs, sizes, done)))
        if error is not None:
            if disk_full(self._root, error, sum(sizes.values())):
                raise CapacityError(f"file tier at {self._root}: the disk is full ({error})") from error
            raise BackendError(f"file tier write failed: {error}") from error

    async def _store(
        self,
        jobs: dict[str, tuple[Loc, memoryview]],
        sizes: dict[str, int],
        done: asyncio.Future[None],
    ) -> BaseException | None:
        results: list[None | BaseException] = [BackendError("not written")] * len(jobs)
        synced: list[None | BaseException] = []
        try:
            results = await self._gather(self._write, [loc for loc, _ in jobs.values()], [v for _, v in jobs.values()])
            if self.sync:  # each touched directory once; a shard not yet known durable, its parents too
                leaves = {loc[0] for loc, _ in jobs.values()}
                fresh = [p for d in leaves - self._dirs for p in (os.path.dirname(d), self._root)]
                synced = await self._gather(fsync_dir, list(leaves.union(fresh)))
                if not any(synced):
                    self._dirs |= leaves
        finally:
            for key, r in zip(jobs, results):
                if r is None:  # on disk, so indexed, even if its directory's fsync failed below
                    self._index[key] = sizes[key]
                else:
                    self._used -= sizes[key]
                self._counts["writes" if r is None else "errors"] += 1
            for key in jobs:
                self._busy.pop(key, None)
            done.set_result(None)
        return next((r for r in [*results, *synced] if r is not None), None)

    async def delete(self, keys: Sequence[str]) -> None:
        """Unlink files; no fsync, since a deleted value that reappears after a crash is harmless."""
        self._check()
        await self._settle(keys)
        gone = [k for k in dict.fromkeys(keys) if k in self._index]
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._busy.update(dict.fromkeys(gone, done))
        for key in gone:
            self._used -= self._index.pop(key)
        try:
            await self._gather(_unlink, [self._locate(k)[1] for k in gone])
        finally:
            for key in gone:
                self._busy.pop(key, None)
            done.set_result(None)
        self._counts["deletes"] += len(gone)

    async def keys(self, prefix: str | None = None) -> AsyncIterator[str]:
        """Walk the disk, one top-level shard per executor call, so a large tree never blocks the loop."""
        self._check()
        loop = asyncio.get_running_loop()
        for shard in await loop.run_in_executor(self._pool, self._shards):
            for key, _, _ in await loop.run_in_executor(self._pool, self._list_shard, shard, False):
                if prefix is None or key.startswith(prefix):
                    yield key

    async def sizes(self, keys: Sequence[str]) -> list[int]:
        return [self._index.get(k, 0) for k in keys]

    @property
    def location(self) -> Path:
        return self.root

    async def stats(self) -> BackendStats:
        return BackendStats(
            name=self.name, items=len(self._index), bytes_used=self._used, capacity_bytes=None,
            **{k: self._counts[k] for k in ("reads", "writes", "deletes", "misses", "errors")},
        )  # fmt: skip

    async def close(self) -> None:
        if self._closed:
            return
        while self._busy:
            await self._settle(list(self._busy))
        self._closed = True
        self._announcer.shutdown(wait=True, cancel_futures=True)  # advice not yet given is dropped
        self._readers.shutdown(wait=True)
        self._pool.shutdown(wait=True)


def from_config(cfg: FileTier, store: StoreConfig) -> FileBackend:
    """The file tier of a store: `cfg.path` (default: the tier's name) under the data directory."""
    return FileBackend(Path(store.path) / (cfg.path or cfg.tier_name), threads=store.io_threads, o_direct=cfg.o_direct)
