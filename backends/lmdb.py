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
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import lmdb
from agentstate.backends.base import Backend, BackendStats, ReadSink, disk_full
from agentstate.backends.lmdb_env import lmdb_error, open_env

from agentstate.errors import BackendError, CapacityError, CorruptDataError

_KEYS_PAGE = 1024
T = TypeVar("T")


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
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_map_size = max_map_size
        self._env = open_env(
            self.path, "LMDB", map_size=map_size, sync=sync, metasync=sync,
            max_readers=max(126, threads * 4), max_spare_txns=threads, readahead=True,
        )  # fmt: skip
        self._gate = _TxnGate()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="agentstate-lmdb")
        self._queue: list[_WriteOp] = []
        self._writer: asyncio.Task[None] | None = None
        self._counts: Counter[str] = Counter()
        self._closed = False

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
                for i, key in enumerate(keys):
                    value = txn.get(key.encode())
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
                return [txn.get(k.encode()) is not None for k in keys]

        return await self._run(self._txn, run, "read")

    async def sizes(self, keys: Sequence[str]) -> list[int]:
        def run() -> list[int]:
            with self._env.begin(buffers=True) as txn:
                return [len(v) if (v := txn.get(k.encode())) is not None else 0 for k in keys]

        return await self._run(self._txn, run, "read")

    async def keys(self, prefix: str | None = None) -> AsyncIterator[str]:
        start = (prefix or "").encode()
        while True:
            page = await self._run(self._keys_page, start, prefix)
            for key in page:
                yield key
            if len(page) < _KEYS_PAGE:
                return
            start = page[-1].encode() + b"\x00"

    def _keys_page(self, start: bytes, prefix: str | None) -> list[str]:
        def run() -> list[str]:
            out: list[str] = []
            with self._env.begin() as txn:
                cursor = txn.cursor()
                if not cursor.set_range(start):
                    return out
                for raw in cursor.iternext(keys=True, values=False):
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
        await self._submit(_WriteOp(puts=[(k.encode(), v) for k, v in zip(keys, values)]))

    async def delete(self, keys: Sequence[str]) -> None:
        await self._submit(_WriteOp(deletes=[k.encode() for k in keys]))

    async def _submit(self, op: _WriteOp) -> None:
        if self._closed:
            raise BackendError("LMDB backend is closed")
        op.done = asyncio.get_running_loop().create_future()
        self._queue.append(op)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._drain())
        await op.done

    async def _drain(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                await asyncio.get_running_loop().run_in_executor(self._pool, self._commit, batch)
            except Exception as exc:  # noqa: BLE001 - every waiter of the failed transaction gets the error
                for op in batch:
                    if not op.done.done():  # type: ignore[union-attr]
                        op.done.set_exception(exc)  # type: ignore[union-attr]
                continue
            for op in batch:
                if not op.done.done():  # type: ignore[union-attr]
                    op.done.set_result(None)  # type: ignore[union-attr]

    def _commit(self, batch: list[_WriteOp]) -> None:
        resized = False
        while True:
            try:
                with self._gate, self._env.begin(write=True) as txn:
                    for op in batch:
                        for key, value in op.puts:
                            txn.put(key, value)
                        for key in op.deletes:
                            txn.delete(key)
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
            return

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

    async def stats(self) -> BackendStats:
        def run() -> BackendStats:
            st, info = self._txn(lambda: (self._env.stat(), self._env.info()), "stats")
            pages = st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
            return BackendStats(
                name=self.name, items=st["entries"], bytes_used=pages * st["psize"],
                capacity_bytes=self.max_map_size or info["map_size"],
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
        self._env.close()


def _text(raw: bytes) -> str:
    try:
        return bytes(raw).decode()
    except UnicodeDecodeError as exc:
        raise CorruptDataError(f"LMDB key {bytes(raw)[:64]!r} is not text: the file is damaged") from exc
