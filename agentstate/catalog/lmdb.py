"""The local catalog: session manifests, shared-prefix records and chunk reference counts, in LMDB.

One synced LMDB transaction commits a manifest together with the reference-count changes it
implies, so a crash leaves either the old session or the new one and counts that match it.
Chunks whose count reaches zero are returned to the caller for deletion; a crash before that
deletion leaves orphans with no count, which `StateStore.gc` sweeps.

A damaged catalog file is refused at open (`agentstate.backends.lmdb_env.open_env`: an empty or
truncated `data.mdb` is CorruptDataError, never a fresh empty catalog), and every LMDB error is a
typed one (damage CorruptDataError, a full disk CapacityError, the rest BackendError).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import lmdb

from agentstate.backends.base import disk_full
from agentstate.backends.lmdb_env import DATA_FILE, close_env, lmdb_error, open_env
from agentstate.catalog.base import Catalog, Committed, named_keys
from agentstate.errors import AgentStateError, BackendError, CapacityError, ConflictError
from agentstate.manifest import SessionManifest, decode_manifest, encode_manifest

_NO_VERSION = 0
CATALOG_FORMAT = 2
T = TypeVar("T")


class LMDBCatalog(Catalog):
    """The local catalog of one data directory (LMDB). `RedisCatalog` is the same interface over a
    store every host shares."""

    shared = False

    def __init__(self, path: str | Path, *, map_size: int = 64 << 20) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self._path = Path(path)
        self.created = not (self._path / DATA_FILE).exists()
        """whether this open made a new, empty catalog (none was there)"""
        self._env = open_env(self._path, "catalog", map_size=map_size, max_dbs=6)
        try:
            self._sessions = self._env.open_db(b"sessions")
            self._refs = self._env.open_db(b"refs")
            self._prefixes = self._env.open_db(b"prefixes")
            self._meta = self._env.open_db(b"meta")
            self._usage = self._env.open_db(b"usage")  # tenant/session -> {"counters": {...}, "hit": t}
            self._records = self._env.open_db(b"records")  # tenant/session NUL name -> framed record
            self._upgrade()
        except BaseException as exc:
            self._env.close()
            if isinstance(exc, lmdb.Error):
                raise self._error(exc, "cannot open catalog") from exc
            raise
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentstate-catalog")

    def _upgrade(self) -> None:
        """Bring an older catalog to this format, once, in one transaction: format 1 counted
        chunks only; format 2 counts every manifest's tail too."""
        with self._env.begin(write=True) as txn:
            if txn.get(b"format", db=self._meta) is not None:
                return
            tails = [
                m.tail_key
                for _, raw in txn.cursor(db=self._sessions)
                if (m := self._parse(raw)).tail_key is not None
            ]
            self._add_refs(txn, tails, +1)
            txn.put(b"format", CATALOG_FORMAT.to_bytes(4, "little"), db=self._meta)

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._typed, fn, *args)

    def _typed(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn` with LMDB's errors typed. A transaction refused with MDB_MAP_RESIZED (another
        process grew the map past this one's) adopts the new size and runs `fn` once more: the
        catalog has one worker thread, so none of its transactions is open then."""
        for attempt in range(2):
            try:
                return fn(*args)
            except lmdb.MapResizedError as exc:
                if attempt:
                    raise BackendError(f"catalog at {self._path}: {exc}") from exc
                try:
                    self._env.set_mapsize(0)
                except lmdb.Error as again:
                    raise lmdb_error(again, f"catalog at {self._path}: cannot adopt the new map size") from again
            except lmdb.Error as exc:
                raise self._error(exc, "catalog") from exc
        raise AssertionError("unreachable")

    def _error(self, exc: lmdb.Error, what: str) -> AgentStateError:
        if disk_full(self._path, exc):
            return CapacityError(f"{what} at {self._path}: the disk is full ({exc})")
        return lmdb_error(exc, f"{what} at {self._path}")

    async def _write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run a write transaction body, growing the map when full (one thread: no txn is open then)."""

        def run() -> T:
            while True:
                try:
                    with self._env.begin(write=True) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    self._env.set_mapsize(self._env.info()["map_size"] * 2)

        return await self._run(run)

    # -- sessions ------------------------------------------------------------------------------

    @staticmethod
    def _skey(tenant: str, session_id: str) -> bytes:
        return f"{tenant}/{session_id}".encode()

    @staticmethod
    def _parse(raw: bytes | memoryview) -> SessionManifest:
        return decode_manifest(raw)

    def _record(self, txn: lmdb.Transaction, key: bytes) -> dict[str, object]:
        raw = txn.get(key, db=self._usage)
        if raw is None:
            return {}
        try:
            record = json.loads(bytes(raw))
        except ValueError:
            return {}  # accounting only: a damaged record restarts from zero, never blocks a session
        return record if isinstance(record, dict) else {}

    def _with_hit(self, txn: lmdb.Transaction, key: bytes, raw: bytes | memoryview) -> SessionManifest:
        manifest = self._parse(raw)
        hit = self._record(txn, key).get("hit")
        if isinstance(hit, int | float):
            manifest.last_hit_at = float(hit)
        return manifest

    async def get(self, tenant: str, session_id: str) -> SessionManifest | None:
        def run() -> SessionManifest | None:
            key = self._skey(tenant, session_id)
            with self._env.begin() as txn:
                raw = txn.get(key, db=self._sessions)
                return None if raw is None else self._with_hit(txn, key, raw)

        return await self._run(run)

    async def add_usage(
        self, deltas: Mapping[tuple[str, str], Mapping[str, int]], hits: Mapping[tuple[str, str], float]
    ) -> None:
        def run(txn: lmdb.Transaction) -> None:
            for tenant, session_id in dict.fromkeys([*deltas, *hits]):  # one read and one put per record
                key = self._skey(tenant, session_id)
                if session_id and txn.get(key, db=self._sessions) is None:
                    continue  # removed meanwhile: only its tenant's totals keep its counts
                record = self._record(txn, key)
                counts = deltas.get((tenant, session_id))
                if counts:
                    counters = record.get("counters")
                    counters = dict(counters) if isinstance(counters, dict) else {}
                    for what, n in counts.items():
                        counters[what] = int(counters.get(what, 0)) + int(n)
                    record["counters"] = counters
                at = hits.get((tenant, session_id))
                if at is not None:
                    old = record.get("hit")
                    record["hit"] = max(float(at), float(old) if isinstance(old, int | float) else 0.0)
                txn.put(key, json.dumps(record).encode(), db=self._usage)

        if deltas or hits:
            await self._write(run)

    async def usage(self, tenant: str, session_id: str) -> dict[str, int]:
        def run() -> dict[str, int]:
            with self._env.begin() as txn:
                counters = self._record(txn, self._skey(tenant, session_id)).get("counters")
            return {str(k): int(v) for k, v in counters.items()} if isinstance(counters, dict) else {}

        return await self._run(run)

    async def manifests(self, tenant: str | None = None) -> list[SessionManifest]:
        def run() -> list[SessionManifest]:
            prefix = b"" if tenant is None else f"{tenant}/".encode()
            with self._env.begin() as txn:
                cursor = txn.cursor(db=self._sessions)
                found = cursor.set_range(prefix)
                out = []
                while found and cursor.key().startswith(prefix):
                    out.append(self._with_hit(txn, bytes(cursor.key()), cursor.value()))
                    found = cursor.next()
            return out

        return await self._run(run)

    async def manifest_page(self, tenant: str, after: str, limit: int) -> list[SessionManifest]:
        def run() -> list[SessionManifest]:
            prefix = f"{tenant}/".encode()
            with self._env.begin() as txn:
                cursor = txn.cursor(db=self._sessions)
                found = cursor.set_range(prefix + after.encode() + b"\x00" if after else prefix)
                out: list[SessionManifest] = []
                while found and len(out) < limit and cursor.key().startswith(prefix):
                    out.append(self._with_hit(txn, bytes(cursor.key()), cursor.value()))
                    found = cursor.next()
            return out

        return await self._run(run)

    async def version(self, tenant: str, session_id: str) -> int:
        manifest = await self.get(tenant, session_id)
        return manifest.version if manifest else _NO_VERSION

    async def commit(self, manifest: SessionManifest, expected_version: int | None) -> Committed:
        """Write `manifest` if the stored version is `expected_version` (None: must not exist)."""
        return await self._write(self._putter(manifest, expected_version))

    async def commit_all(self, changes: Sequence[tuple[SessionManifest, SessionManifest | None]]) -> list[Committed]:
        """Write every `(manifest, prev)` in one synced transaction (each `manifest` if the stored
        version is `prev`'s, None: must not exist): all of them or, on a conflict, a full disk or
        a crash, none. An import commits this way, so a refused one leaves no session behind."""
        puts = [self._putter(m, p.version if p else None) for m, p in changes]
        return await self._write(lambda txn: [put(txn) for put in puts]) if puts else []

    def _putter(
        self, manifest: SessionManifest, expected_version: int | None
    ) -> Callable[[lmdb.Transaction], Committed]:
        """One commit of `manifest` as the body of a write transaction (the manifest encoded once, here)."""
        key = self._skey(manifest.tenant, manifest.session_id)
        body = encode_manifest(manifest)

        def run(txn: lmdb.Transaction) -> Committed:
            raw = txn.get(key, db=self._sessions)
            old = None if raw is None else self._parse(raw)
            found = _NO_VERSION if old is None else old.version
            if found != (expected_version or _NO_VERSION):
                raise ConflictError(
                    f"session {manifest.session_id!r} is at version {found}, expected {expected_version}"
                )
            txn.put(key, body, db=self._sessions)
            self._add_refs(txn, named_keys(manifest), +1)
            zeroed = self._add_refs(txn, named_keys(old) if old else [], -1)
            return Committed(zeroed, None)

        return run

    async def remove(self, tenant: str, session_id: str) -> tuple[SessionManifest | None, list[str]]:
        def run(txn: lmdb.Transaction) -> tuple[SessionManifest | None, list[str]]:
            raw = txn.pop(self._skey(tenant, session_id), db=self._sessions)
            if raw is None:
                return None, []
            txn.delete(self._skey(tenant, session_id), db=self._usage)  # its tenant's totals stay
            old = self._parse(raw)
            return old, self._add_refs(txn, named_keys(old), -1)

        return await self._write(run)

    # -- records -------------------------------------------------------------------------------

    @staticmethod
    def _rkey(tenant: str, session_id: str, name: str = "") -> bytes:
        return f"{tenant}/{session_id}\0{name}".encode()  # ids and names hold no NUL

    async def put_records(self, tenant: str, session_id: str, items: Mapping[str, bytes]) -> None:
        def run(txn: lmdb.Transaction) -> None:
            for name, value in items.items():
                txn.put(self._rkey(tenant, session_id, name), value, db=self._records)

        if items:
            await self._write(run)

    async def records(self, tenant: str, session_id: str, prefix: str = "") -> list[tuple[str, bytes]]:
        def run() -> list[tuple[str, bytes]]:
            start = self._rkey(tenant, session_id, prefix)
            cut = len(self._rkey(tenant, session_id))
            with self._env.begin(db=self._records) as txn:
                cursor = txn.cursor()
                found = cursor.set_range(start)
                out = []
                while found and cursor.key().startswith(start):
                    out.append((bytes(cursor.key())[cut:].decode(), bytes(cursor.value())))
                    found = cursor.next()
            return out

        return await self._run(run)

    async def records_named(self, tenant: str, session_id: str, names: Sequence[str]) -> list[tuple[str, bytes]]:
        def run() -> list[tuple[str, bytes]]:
            with self._env.begin(db=self._records) as txn:
                found = [(n, txn.get(self._rkey(tenant, session_id, n))) for n in names]
            return [(n, bytes(v)) for n, v in found if v is not None]

        return await self._run(run) if names else []

    async def record_sessions(self, tenant: str | None = None) -> list[tuple[str, str]]:
        def run() -> list[tuple[str, str]]:
            prefix = b"" if tenant is None else f"{tenant}/".encode()
            found: dict[tuple[str, str], None] = {}
            with self._env.begin(db=self._records) as txn:
                cursor = txn.cursor()
                if not cursor.set_range(prefix):
                    return []
                while cursor.key().startswith(prefix):
                    where = bytes(cursor.key()).split(b"\0", 1)[0]
                    t, _, s = where.decode().partition("/")
                    found[(t, s)] = None
                    if not cursor.set_range(where + b"\1"):  # past this session's records
                        break
            return list(found)

        return await self._run(run)

    async def record_names(self, tenant: str, session_id: str, prefix: str = "") -> list[str]:
        def run() -> list[str]:
            start = self._rkey(tenant, session_id, prefix)
            cut = len(self._rkey(tenant, session_id))
            with self._env.begin(db=self._records) as txn:
                cursor = txn.cursor()
                if not cursor.set_range(start):
                    return []
                out = []
                for key in cursor.iternext(keys=True, values=False):
                    if not key.startswith(start):
                        break
                    out.append(bytes(key)[cut:].decode())
            return out

        return await self._run(run)

    def _drop_records(self, txn: lmdb.Transaction, tenant: str, session_id: str, names: Sequence[str] | None) -> int:
        if names is not None:
            return sum(bool(txn.delete(self._rkey(tenant, session_id, n), db=self._records)) for n in names)
        start = self._rkey(tenant, session_id)
        cursor = txn.cursor(db=self._records)
        removed = 0
        found = cursor.set_range(start)
        while found and cursor.key().startswith(start):
            found = cursor.delete()  # moves to the next record
            removed += 1
        return removed

    async def remove_records(self, tenant: str, session_id: str, names: Sequence[str] | None = None) -> int:
        return await self._write(lambda txn: self._drop_records(txn, tenant, session_id, names))

    # -- shared prefixes -----------------------------------------------------------------------

    async def add_prefix(self, keys: Sequence[str]) -> bool:
        """Record a shared prefix (named by its last key) so its chunks are kept; False if known."""

        def run(txn: lmdb.Transaction) -> bool:
            name = keys[-1].encode()
            if txn.get(name, db=self._prefixes) is not None:
                return False
            txn.put(name, "\n".join(keys).encode(), db=self._prefixes)
            self._add_refs(txn, keys, +1)
            return True

        return await self._write(run) if keys else False

    async def remove_prefix(self, last_key: str) -> list[str]:
        def run(txn: lmdb.Transaction) -> list[str]:
            raw = txn.pop(last_key.encode(), db=self._prefixes)
            return [] if raw is None else self._add_refs(txn, bytes(raw).decode().split("\n"), -1)

        return await self._write(run)

    async def prefix_keys(self) -> set[str]:
        def run() -> set[str]:
            with self._env.begin(db=self._prefixes) as txn:
                return {k for _, raw in txn.cursor() for k in bytes(raw).decode().split("\n")}

        return await self._run(run)

    # -- reference counts ----------------------------------------------------------------------

    def _add_refs(self, txn: lmdb.Transaction, keys: Iterable[str], delta: int) -> list[str]:
        zeroed = []
        for key in keys:
            raw_key = key.encode()
            raw = txn.get(raw_key, db=self._refs)
            count = (0 if raw is None else int.from_bytes(raw, "little")) + delta
            if count > 0:
                txn.put(raw_key, count.to_bytes(8, "little"), db=self._refs)
            else:
                txn.delete(raw_key, db=self._refs)
                zeroed.append(key)
        return zeroed

    async def refcounts(self, keys: Sequence[str]) -> list[int]:
        def run() -> list[int]:
            with self._env.begin(db=self._refs) as txn:
                return [int.from_bytes(txn.get(k.encode()) or b"", "little") for k in keys]

        return await self._run(run)

    async def session_count(self) -> int:
        def run() -> int:
            with self._env.begin() as txn:
                return int(txn.stat(self._sessions)["entries"])

        return await self._run(run)

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        close_env(self._env, self._path)
