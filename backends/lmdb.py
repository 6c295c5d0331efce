"""LMDB tier: the durable local store. One environment in a data directory.

- Writes are group-committed: concurrent `put`/`delete` calls queue up and one writer task
  commits everything queued in a single synced transaction, so 200 concurrent snapshots cost a
  handful of fsyncs, not 200.
- Reads run on a bounded thread pool inside read transactions opened with `buffers=True`: the
  sink sees LMDB's mmap directly, so a value is copied once, into its destination.
- The map grows (doubling) instead of failing with MDB_MAP_FULL, up to `max_map_size`; resizing
  needs every transaction of this process closed, which `_TxnGate` arranges. When another process
  grew the map past ours (MDB_MAP_RESIZED), the gate adopts its size and the call runs again.
- A damaged data file is refused at open (`lmdb_env.open_env`), and every LMDB error is a typed
  one: damage is CorruptDataError, a full disk CapacityError, anything else BackendError.
- Values of at least `value_log_min_bytes` (KV chunks of real models: MiBs) go to the value log
  (`value_log.py`): appended to a segment file and synced once per group commit, LMDB keeping a
  pointer in its `\x01values` database, committed in the same transaction as the rest of the
  batch. LMDB's own path for such values (fresh dirty pages, page-run writes, sync) ran at a third
  of the disk's durable write speed. Small values, and every value written before the log existed,
  stay in LMDB's main database; reads look in both.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import lmdb
from agentstate.backends.base import Backend, BackendStats, ReadSink, disk_full, io_pool
from agentstate.backends.lmdb_env import close_env, lmdb_error, open_env
from agentstate.backends.value_log import Pointer, ValueLog

from agentstate.errors import BackendError, CapacityError, CorruptDataError, InvalidArgumentError

if TYPE_CHECKING:
    from agentstate.config import LMDBTier, StoreConfig

_KEYS_PAGE = 1024
T = TypeVar("T")
log = logging.getLogger("agentstate.backends.lmdb")
_POINTERS = b"\x01values"  # the named database of value-log pointers (a key of the main database)
_NEXT = b"\x01next-segment"  # in the pointer database: the least number a new segment may take
_RESERVED = b"\x01"  # keys starting with it are the backend's own, never a caller's


class _TxnGate:
    """Shared/exclusive gate: transactions enter shared, a map resize enters exclusive."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False

    def __enter__(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._resizing)
            self._active += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def exclusive(self, fn: object) -> None:
        with self._cond:
            self._resizing = True
            try:
                self._cond.wait_for(lambda: self._active == 0)
                fn()  # type: ignore[operator]
            finally:
                self._resizing = False
                self._cond.notify_all()


@dataclass
class _WriteOp:
    puts: list[tuple[bytes, bytes | bytearray | memoryview]] = field(default_factory=list)
    deletes: list[bytes] = field(default_factory=list)
    done: asyncio.Future[None] | None = None
    reclaim: bool = False  # answered only after the reclaim pass that follows the commit


class LMDBBackend(Backend):
    name = "lmdb"
    durable = True
    trusted = False

    def __init__(
        self,
        path: str | Path,
        *,
        map_size: int = 1 << 30,
        max_map_size: int | None = None,
        threads: int = 4,
        sync: bool = True,
        value_log_min_bytes: int | None = 256 << 10,
        segment_bytes: int = 1 << 30,
    ) -> None:
        self.path = Path(path)
        created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_map_size = max_map_size
        self.value_log_min_bytes = value_log_min_bytes
        try:
            self._env = open_env(
                self.path, "LMDB", size_key="lmdb_map_size", map_size=map_size, sync=sync, metasync=sync, max_dbs=1,
                max_readers=max(126, threads * 4), max_spare_txns=threads, readahead=True,
            )  # fmt: skip
            try:
                self._log = ValueLog(self.path, segment_bytes=segment_bytes, sync=sync)
                self._ptrs = self._open_pointers()
            except BaseException:
                self._env.close()
                raise
        except BaseException:
            if created:  # a failed open leaves nothing behind in a directory it made
                shutil.rmtree(self.path, ignore_errors=True)
            raise
        self._gate = _TxnGate()
        self._pool = io_pool(threads, "agentstate-lmdb")
        self._queue: list[_WriteOp] = []
        self._writer: asyncio.Task[None] | None = None
        self._counts: Counter[str] = Counter()
        self._closed = False

    def _open_pointers(self) -> lmdb._Database | None:
        """The pointer database, and the value log's accounting from it. A store that never used
        the log and will not (value_log_min_bytes None) has none, and opening it writes nothing."""
        try:
            try:
                ptrs = self._env.open_db(_POINTERS, create=False)
            except lmdb.NotFoundError:
                if self.value_log_min_bytes is None:
                    return None
                ptrs = self._env.open_db(_POINTERS)
            with self._env.begin(db=ptrs) as txn:
                raw_next = txn.get(_NEXT)
                pointers = [p for _, p in _pointers(txn)]
        except lmdb.Error as exc:
            raise lmdb_error(exc, f"cannot open LMDB at {self.path}") from exc
        self._log.adopt(pointers, int(raw_next.decode()) if raw_next and raw_next.isdigit() else 0)
        return ptrs

    def _locate(self, txn: lmdb.Transaction, key: bytes) -> memoryview | bytes | Pointer | None:
        """Where a key's bytes are: inline in LMDB (the bytes), or in the value log (its pointer);
        None when absent. A pointer that is damaged or runs past its segment is absent too (a miss,
        recomputed), counted and logged."""
        value = txn.get(key)
        if value is not None or self._ptrs is None:
            return value
        raw = txn.get(key, db=self._ptrs)
        if raw is None:
            return None
        pointer = Pointer.unpack(raw)
        if pointer is None or not self._log.valid(pointer):
            self._lost(key, pointer)
            return None
        return pointer

    def _bytes(self, key: bytes, where: memoryview | bytes | Pointer | None) -> memoryview | bytes | None:
        """The bytes `_locate` found: a view of the value log's mapping for a pointer."""
        if not isinstance(where, Pointer):
            return where
        view = self._log.view(where)
        if view is None:
            self._lost(key, where)
        return view

    def _lost(self, key: bytes, pointer: Pointer | None) -> None:
        self._counts["errors"] += 1
        log.warning("LMDB at %s: the value log has no bytes for %r (%s)", self.path, key, pointer)

    # -- reads ---------------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        if self._closed:
            raise BackendError("LMDB backend is closed")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _txn(self, fn: Callable[[], T], what: str) -> T:
        """Run `fn` (which opens its own transaction) inside the gate, with LMDB's errors typed. A
        transaction refused with MDB_MAP_RESIZED (another process grew the map past this one's)
        adopts the new size and runs `fn` once more."""
        for attempt in range(2):
            try:
                with self._gate:
                    return fn()
            except lmdb.MapResizedError as exc:
                if attempt:
                    self._counts["errors"] += 1
                    raise BackendError(f"LMDB {what} at {self.path}: {exc}") from exc
                self._adopt_map_size()
            except lmdb.Error as exc:
                self._counts["errors"] += 1
                raise lmdb_error(exc, f"LMDB {what} at {self.path}") from exc
        raise AssertionError("unreachable")

    def _read_sync(self, keys: Sequence[str], sink: ReadSink) -> list[bool]:
        def run() -> list[bool]:
            found = []
            with self._env.begin(buffers=True) as txn:
                raw = [k.encode() for k in keys]
                where = [self._locate(txn, k) for k in raw]
                pointers = [p for p in where if isinstance(p, Pointer)]
                if len(pointers) > 1:  # announced before the first is touched (see ValueLog.prefetch)
                    self._log.prefetch(pointers)
                for i, (key, loc) in enumerate(zip(raw, where)):
                    value = self._bytes(key, loc)
                    if value is not None:
                        sink(i, value)
                    found.append(value is not None)
            return found

        found = self._txn(run, "read")
        hits = sum(found)
        self._counts.update(reads=hits, misses=len(found) - hits)
        return found

    async def read(self, keys: Sequence[str], sink: ReadSink) -> list[bool]:
        return await self._run(self._read_sync, keys, sink)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        def run() -> list[bool]:
            with self._env.begin(buffers=True) as txn:
                return [self._locate(txn, k.encode()) is not None for k in keys]

        return await self._run(self._txn, run, "read")

    async def sizes(self, keys: Sequence[str]) -> list[int]:
        def run() -> list[int]:
            with self._env.begin(buffers=True) as txn:
                found = [self._locate(txn, k.encode()) for k in keys]
                return [w.length if isinstance(w, Pointer) else 0 if w is None else len(w) for w in found]

        return await self._run(self._txn, run, "read")

    async def keys(self, prefix: str | None = None) -> AsyncIterator[str]:
        """Inline keys, then the value log's (a key is in one of them; a put moves it)."""
        for db in (None, self._ptrs) if self._ptrs is not None else (None,):
            start = (prefix or "").encode()
            while True:
                page = await self._run(self._keys_page, start, prefix, db)
                for key in page:
                    yield key
                if len(page) < _KEYS_PAGE:
                    break
                start = page[-1].encode() + b"\x00"

    def _keys_page(self, start: bytes, prefix: str | None, db: lmdb._Database | None) -> list[str]:
        def run() -> list[str]:
            out: list[str] = []
            with self._env.begin(db=db) as txn:
                cursor = txn.cursor()
                if not cursor.set_range(start):
                    return out
                for raw in cursor.iternext(keys=True, values=False):
                    if bytes(raw[:1]) == _RESERVED:
                        continue
                    key = _text(raw)
                    if prefix is not None and not key.startswith(prefix):
                        break
                    out.append(key)
                    if len(out) == _KEYS_PAGE:
                        break
            return out

        return self._txn(run, "key listing")

    # -- writes (group commit) -----------------------------------------------------------------

    async def put(self, keys: Sequence[str], values: Sequence[bytes | bytearray | memoryview]) -> None:
        if len(keys) != len(values):
            raise ValueError("keys and values differ in length")
        if any(not k or k.startswith("\x01") for k in keys):
            raise InvalidArgumentError("LMDB keys must be non-empty and must not start with \\x01 (the backend's own)")
        await self._submit(_WriteOp(puts=[(k.encode(), v) for k, v in zip(keys, values)]))

    async def delete(self, keys: Sequence[str]) -> None:
        await self._submit(_WriteOp(deletes=[k.encode() for k in keys]))

    async def reclaim(self) -> None:
        """Through the writer (an empty commit; the value log's reclaim pass runs after it): crash
        leftovers and segments emptied by deletes go, sparse ones are compacted."""
        if self._ptrs is not None:
            await self._submit(_WriteOp(reclaim=True))

    async def _submit(self, op: _WriteOp) -> None:
        if self._closed:
            raise BackendError("LMDB backend is closed")
        op.done = asyncio.get_running_loop().create_future()
        self._queue.append(op)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._drain())
        await op.done

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                await loop.run_in_executor(self._pool, self._commit, batch)
            except Exception as exc:  # noqa: BLE001 - every waiter of the failed transaction gets the error
                self._release(batch)
                for op in batch:
                    if not op.done.done():  # type: ignore[union-attr]
                        op.done.set_exception(exc)  # type: ignore[union-attr]
                continue
            self._release(batch)
            for op in batch:
                if not op.done.done() and not op.reclaim:  # type: ignore[union-attr]
                    op.done.set_result(None)  # type: ignore[union-attr]
            if self._ptrs is not None:
                try:  # after the writers are answered: space comes back off their path
                    await loop.run_in_executor(self._pool, self._reclaim)
                except Exception as exc:  # noqa: BLE001 - nothing is lost; retried after the next commit
                    self._counts["errors"] += 1
                    log.warning("LMDB at %s: reclaiming value-log space failed: %s", self.path, exc)
            for op in batch:  # reclaim() callers: their pass is done (or failed, logged and counted)
                if not op.done.done():  # type: ignore[union-attr]
                    op.done.set_result(None)  # type: ignore[union-attr]

    @staticmethod
    def _release(batch: list[_WriteOp]) -> None:
        """The transaction is over: the batch holds its writers' values no longer, so a writer that
        reuses a stored value's buffer (`ChunkStore.recycle`) finds nothing else referencing it."""
        for op in batch:
            op.puts = []

    def _large(self, value: bytes | bytearray | memoryview) -> bool:
        return self.value_log_min_bytes is not None and self._ptrs is not None and len(value) >= self.value_log_min_bytes

    def _commit(self, batch: list[_WriteOp]) -> None:
        """One synced transaction for the whole batch; large values reach the value log (synced)
        before the transaction that points at them begins."""
        large = [(key, value) for op in batch for key, value in op.puts if self._large(value)]
        if large and self.max_map_size is not None:
            self._check_room(sum(len(v) for _, v in large))
        try:
            written = self._log.write([memoryview(v).cast("B") for _, v in large]) if large else []
        except OSError as exc:
            self._counts["errors"] += 1
            if disk_full(self.path, exc, sum(len(v) for _, v in large)):
                raise CapacityError(f"LMDB value log at {self.path}: the disk is full ({exc})") from exc
            raise BackendError(f"LMDB value log write at {self.path}: {exc}") from exc
        try:
            added, dropped = self._commit_txn(batch, written)
        except BaseException:
            self._log.undo(written)
            raise
        self._log.added(added)
        self._log.dropped(dropped)

    def _check_room(self, need: int) -> None:
        """`max_map_size` bounds the tier: LMDB's pages in use and the value log's files together."""
        assert self.max_map_size is not None
        info, psize = self._env.info(), self._env.stat()["psize"]
        used = (info["last_pgno"] + 1) * psize + self._log.file_bytes
        if used + need > self.max_map_size:
            self._counts["errors"] += 1
            raise CapacityError(
                f"LMDB at {self.path} is full at its limit of {self.max_map_size} bytes "
                f"({used} used, {need} more to write)"
            )

    def _commit_txn(self, batch: list[_WriteOp], pointers: list[Pointer]) -> tuple[list[Pointer], list[Pointer]]:
        """The batch's transaction; `pointers` are its large values' places, in batch order."""
        resized = False
        ptrs = self._ptrs
        while True:
            added: list[Pointer] = []
            dropped: list[Pointer] = []
            placed = iter(pointers)

            def unlink(txn: lmdb.Transaction, key: bytes, dropped: list[Pointer] = dropped) -> None:
                if ptrs is not None and (old := txn.pop(key, db=ptrs)) is not None and (p := Pointer.unpack(old)):
                    dropped.append(p)

            try:
                with self._gate, self._env.begin(write=True) as txn:
                    for op in batch:
                        for key, value in op.puts:
                            if not self._large(value):
                                txn.put(key, value)
                                unlink(txn, key)
                            else:  # a put replaces what the key held, as LMDB's own put does
                                pointer = next(placed)
                                unlink(txn, key)
                                txn.put(key, pointer.pack(), db=ptrs)
                                txn.delete(key)
                                added.append(pointer)
                        for key in op.deletes:
                            txn.delete(key)
                            unlink(txn, key)
                    if pointers:
                        txn.put(_NEXT, str(self._log.next_segment).encode(), db=ptrs)
            except lmdb.MapFullError:
                self._grow()
                continue
            except lmdb.MapResizedError as exc:
                if resized:
                    self._counts["errors"] += 1
                    raise BackendError(f"LMDB write at {self.path}: {exc}") from exc
                resized = True
                self._adopt_map_size()
                continue
            except lmdb.Error as exc:
                self._counts["errors"] += 1
                if disk_full(self.path, exc, sum(len(v) for op in batch for _, v in op.puts)):
                    raise CapacityError(f"LMDB at {self.path}: the disk is full ({exc})") from exc
                raise lmdb_error(exc, f"LMDB write at {self.path}") from exc
            self._counts.update(writes=sum(len(op.puts) for op in batch), deletes=sum(len(op.deletes) for op in batch))
            return added, dropped

    def _reclaim(self) -> None:
        """Remove segments no pointer names; copy forward the live values of mostly dead ones (at
        most a few segments' worth per commit, so one call stays short).

        Removal waits for every read transaction of this process to end (the gate), so no view
        of a removed segment is ever read. A copied value's pointer moves only if it still names
        the old place (a delete in between wins); then the old segment holds nothing live."""
        budget = 4 * self._log.segment_bytes
        empty, sparse = self._log.reclaimable()
        while sparse is not None and budget > 0:
            budget -= self._compact(sparse)
            empty, sparse = self._log.reclaimable()
        if empty:
            self._gate.exclusive(lambda: self._log.remove(empty))

    def _compact(self, segment: int) -> int:
        """Copy the live values of `segment` to the active one; returns the bytes copied."""
        with self._gate, self._env.begin(db=self._ptrs) as txn:
            moving = [(k, p) for k, p in _pointers(txn) if p.segment == segment]
            views = [self._log.view(p) for _, p in moving]
            if any(v is None for v in views):
                self._log.exempt(segment)  # a damaged segment is left for verify to report, not copied
                return 0
            copies = self._log.write(views)  # type: ignore[arg-type]
            del views
        moved: list[tuple[Pointer, Pointer]] = []
        try:
            with self._gate, self._env.begin(write=True, db=self._ptrs) as txn:
                for (key, old), new in zip(moving, copies):
                    if Pointer.unpack(txn.get(key) or b"") == old:
                        txn.put(key, new.pack())
                        moved.append((old, new))
                txn.put(_NEXT, str(self._log.next_segment).encode())
        except BaseException:
            self._log.undo(copies)
            raise
        self._log.added(new for _, new in moved)
        self._log.dropped(old for old, _ in moved)
        self._counts["compactions"] += 1
        return sum(p.length for _, p in moving)

    def _grow(self) -> None:
        current = self._env.info()["map_size"]
        new = current * 2
        if self.max_map_size is not None and current >= self.max_map_size:
            self._counts["errors"] += 1
            raise CapacityError(f"LMDB map at {self.path} is full at its limit of {self.max_map_size} bytes")
        if self.max_map_size is not None:
            new = min(new, self.max_map_size)
        self._set_map_size(new)

    def _adopt_map_size(self) -> None:
        """Take the map size another process set (LMDB's `mdb_env_set_mapsize(env, 0)`)."""
        self._set_map_size(0)

    def _set_map_size(self, size: int) -> None:
        try:
            self._gate.exclusive(lambda: self._env.set_mapsize(size))
        except lmdb.Error as exc:
            self._counts["errors"] += 1
            raise lmdb_error(exc, f"LMDB map resize at {self.path}") from exc

    # -- admin ---------------------------------------------------------------------------------

    @property
    def location(self) -> Path:
        return self.path

    @property
    def limit_bytes(self) -> int | None:
        """`max_map_size`: then `stats().capacity_bytes` is this limit, not the current map."""
        return self.max_map_size

    async def stats(self) -> BackendStats:
        def figures() -> tuple[int, int, int]:
            stats = [self._env.stat()]
            items = stats[0]["entries"]
            if self._ptrs is not None:
                with self._env.begin(db=self._ptrs) as txn:
                    stats.append(txn.stat(self._ptrs))
                    items += stats[1]["entries"] - 1 - (txn.get(_NEXT) is not None)  # its name, its counter
            pages = sum(st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"] for st in stats)
            return items, pages * stats[0]["psize"], self._env.info()["map_size"]

        def run() -> BackendStats:
            items, used, map_size = self._txn(figures, "stats")
            return BackendStats(
                name=self.name, items=items, bytes_used=used + self._log.file_bytes,
                capacity_bytes=self.max_map_size or map_size,
                **{k: self._counts[k] for k in ("reads", "writes", "deletes", "misses", "errors", "evictions")},
            )  # fmt: skip

        return await self._run(run)

    async def close(self) -> None:
        if self._closed:
            return
        if self._writer is not None:
            await asyncio.shield(self._writer)
        self._closed = True
        self._pool.shutdown(wait=True)
        self._log.close()
        close_env(self._env, self.path)


def _pointers(txn: lmdb.Transaction) -> Iterator[tuple[bytes, Pointer]]:
    """(key, pointer) of every value-log record a transaction of the pointer database sees; a
    record that is not a pointer (damage) is skipped here and a miss when read."""
    for raw_key, raw in txn.cursor():
        key = bytes(raw_key)
        if not key.startswith(_RESERVED) and (pointer := Pointer.unpack(raw)) is not None:
            yield key, pointer


def _text(raw: bytes) -> str:
    try:
        return bytes(raw).decode()
    except UnicodeDecodeError as exc:
        raise CorruptDataError(f"LMDB key {bytes(raw)[:64]!r} is not text: the file is damaged") from exc


def from_config(cfg: LMDBTier, store: StoreConfig) -> LMDBBackend:
    """The LMDB tier of a store: `cfg.path` (default: the tier's name) under the data directory,
    sized by the store's `lmdb_*` keys."""
    return LMDBBackend(
        Path(store.path) / (cfg.path or cfg.tier_name), map_size=store.lmdb_map_size,
        max_map_size=store.lmdb_max_map_size, threads=store.io_threads,
        value_log_min_bytes=store.lmdb_value_log_min_bytes, segment_bytes=store.lmdb_segment_bytes,
    )  # fmt: skip
