"""StateStore: the async API engines and agent frameworks call (prefixes, matches, sessions)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Generator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from agentstate.backends.base import Backend, BackendStats
from agentstate.backends.host import HostBackend
from agentstate.backends.lmdb import LMDBBackend
from agentstate.catalog import Catalog
from agentstate.config import StoreConfig
from agentstate.errors import (
    ConflictError,
    CorruptDataError,
    InvalidArgumentError,
    KVShapeError,
    SessionNotFoundError,
    SpecMismatchError,
)
from agentstate.index import ChunkIndex
from agentstate.keys import CHUNK_PREFIX, TAIL_PREFIX, chunk_keys, namespace_for, tail_key, token_array, validate_id
from agentstate.manifest import MatchResult, ResumeResult, SessionManifest, now
from agentstate.memory import empty_host
from agentstate.spec import ModelSpec
from agentstate.transfer import Transfer

log = logging.getLogger("agentstate.store")


class StoreStats(BaseModel):
    fingerprint: str
    tenant: str
    sessions: int
    indexed_keys: int
    tiers: list[BackendStats]
    counters: dict[str, int]


class StateStore:
    """Per-session and shared-prefix KV state over a host tier and LMDB.

    Open with `async with StateStore.open(path_or_config, spec) as store:` (or `await` it and
    `await store.close()`). All methods are coroutines and safe to run concurrently.
    """

    def __init__(self, config: StoreConfig, spec: ModelSpec) -> None:
        self.config = config
        self.spec = spec
        self.fingerprint = spec.fingerprint
        self.tenant = validate_id(config.tenant, "tenant")
        self.namespace = namespace_for(self.tenant, config.shared_namespace)
        self.chunk_tokens = config.chunk_tokens
        self.index = ChunkIndex()
        self._pool = ThreadPoolExecutor(max_workers=config.io_threads, thread_name_prefix="agentstate-cpu")
        root = Path(config.path)
        self._lmdb = LMDBBackend(
            root / "chunks", map_size=config.lmdb_map_size, max_map_size=config.lmdb_max_map_size,
            threads=config.io_threads,
        )  # fmt: skip
        self._catalog = Catalog(root / "catalog")
        self._host: HostBackend | None = None
        if config.host_capacity_bytes:
            self._host = HostBackend(
                config.host_capacity_bytes, on_evict=lambda keys: self.index.discard(keys, "host")
            )
        self.tiers: list[Backend] = [t for t in (self._host, self._lmdb) if t is not None]
        self._transfer = Transfer(
            fingerprint=spec.fingerprint, tiers=self.tiers, index=self.index, pool=self._pool,
            io_depth=config.io_depth, batch_bytes=config.batch_bytes,
            promote_to=self._host if config.promote_on_read else None,
        )  # fmt: skip
        self._locks: dict[str, asyncio.Lock] = {}
        self._deleting: dict[str, asyncio.Future[None]] = {}

    @classmethod
    def open(cls, path_or_config: str | Path | StoreConfig, spec: ModelSpec, **overrides: Any) -> _Opening:
        if isinstance(path_or_config, StoreConfig):
            config = path_or_config.model_copy(update=overrides) if overrides else path_or_config
        else:
            config = StoreConfig(path=Path(path_or_config), **overrides)
        return _Opening(cls(config, spec))

    async def _start(self) -> StateStore:
        """Rebuild the index from the persistent tier: a reopened store finds all it had."""
        fp = self.fingerprint
        for prefix in (f"{CHUNK_PREFIX}{fp}/", f"{TAIL_PREFIX}{fp}/"):
            found = [key async for key in self._lmdb.keys(prefix)]
            self.index.add(found, self._lmdb.name)
        return self

    async def __aenter__(self) -> StateStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for tier in self.tiers:
            await tier.close()
        await self._catalog.close()
        self._pool.shutdown(wait=True)

    # -- helpers -------------------------------------------------------------------------------

    def _keys(self, tokens: Sequence[int]) -> list[str]:
        return list(
            chunk_keys(tokens, namespace=self.namespace, fingerprint=self.fingerprint, chunk_tokens=self.chunk_tokens)
        )

    def _slices(self, kv: torch.Tensor, count: int) -> list[torch.Tensor]:
        c = self.chunk_tokens
        return [kv[:, :, i * c : (i + 1) * c] for i in range(count)]

    @contextlib.contextmanager
    def _pinned(self, keys: Iterable[str]) -> Generator[None, None, None]:
        keys = list(keys)
        self.index.pin(keys)
        try:
            yield
        finally:
            self.index.unpin(keys)

    @contextlib.asynccontextmanager
    async def _session_lock(self, session_id: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(session_id, asyncio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and self._locks.get(session_id) is lock:
                del self._locks[session_id]

    async def _store_chunks(self, keys: list[str], kv: torch.Tensor) -> int:
        """Write the chunks the durable tier lacks (dedupe); returns how many were new. Keys must be pinned."""
        waits = {self._deleting[k] for k in keys if k in self._deleting}
        if waits:
            await asyncio.gather(*waits)
        missing = [i for i, k in enumerate(keys) if not self.index.holds(k, self._lmdb.name)]
        if missing:
            slices = self._slices(kv, len(keys))
            await self._transfer.write([keys[i] for i in missing], [slices[i] for i in missing], self.tiers)
        return len(missing)

    async def _collect(self, zeroed: list[str]) -> None:
        """Delete chunks that lost their last reference, unless something pinned them meanwhile."""
        candidates = [k for k in zeroed if not self.index.pinned(k) and k not in self._deleting]
        if not candidates:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        held = {k: self.index.tiers_of(k) for k in candidates}
        for key, tiers in held.items():
            self._deleting[key] = done
            for tier in tiers:
                self.index.discard([key], tier)
        try:
            counts = await self._catalog.refcounts(candidates)
            dead = [k for k, n in zip(candidates, counts) if n == 0]
            for key, n in zip(candidates, counts):
                if n:
                    for tier in held[key]:
                        self.index.add([key], tier)
            if dead:
                await asyncio.gather(*(tier.delete(dead) for tier in self.tiers))
        finally:
            for key in candidates:
                del self._deleting[key]
            done.set_result(None)

    async def _drop(self, keys: list[str]) -> None:
        await asyncio.gather(*(tier.delete(keys) for tier in self.tiers))
        for tier in self.tiers:
            self.index.discard(keys, tier.name)

    def _check_into(self, into: object) -> torch.Tensor:
        if not isinstance(into, torch.Tensor) or into.dim() != 5:
            raise KVShapeError("into must be a 5-dim canonical KV tensor [layers, planes, tokens, heads, dim]")
        return self.spec.check_kv(into, into.shape[2])

    # -- shared prefixes -----------------------------------------------------------------------

    async def put_prefix(self, tokens: Sequence[int] | torch.Tensor, kv: torch.Tensor) -> int:
        """Store the full chunks of a shared prefix once; returns how many tokens were newly stored.

        The prefix is kept (referenced) until removed, whatever happens to sessions that share it.
        """
        packed = token_array(tokens)
        self.spec.check_kv(kv, len(packed))
        keys = self._keys(packed)
        with self._pinned(keys):
            new = await self._store_chunks(keys, kv)
            await self._catalog.add_prefix(keys)
        return new * self.chunk_tokens

    async def match(self, tokens: Sequence[int] | torch.Tensor) -> MatchResult:
        """How many leading tokens are cached (whole chunks), and which tier serves each chunk."""
        keys = self._keys(token_array(tokens))
        n = self.index.longest_prefix(keys)
        order = [t.name for t in self.tiers]
        tiers = [min(self.index.tiers_of(k), key=order.index) for k in keys[:n]]
        return MatchResult(tokens=n * self.chunk_tokens, chunks=n, tiers=tiers)

    async def load(self, tokens: Sequence[int] | torch.Tensor, into: torch.Tensor) -> int:
        """Write the cached prefix of `tokens` into `into[:, :, :n]`; returns n (whole chunks that fit).

        A chunk that turns out missing or corrupt ends the prefix there: n counts only what is
        in `into` bit-exact.
        """
        into = self._check_into(into)
        keys = self._keys(token_array(tokens))
        n = min(self.index.longest_prefix(keys), into.shape[2] // self.chunk_tokens)
        with self._pinned(keys[:n]):
            ok = await self._transfer.read_into(keys[:n], self._slices(into, n))
        return _leading(ok) * self.chunk_tokens

    # -- sessions ------------------------------------------------------------------------------

    async def snapshot(
        self,
        session_id: str,
        tokens: Sequence[int] | torch.Tensor,
        kv: torch.Tensor,
        state: dict[str, Any] | None = None,
        *,
        ttl_seconds: float | None = None,
        pinned: bool = False,
    ) -> SessionManifest:
        """Durably store a session: chunks and tail reach LMDB first, then the manifest commits.

        A crash leaves the previous version or this one, never a mix.
        """
        validate_id(session_id)
        packed = token_array(tokens)
        if not packed:
            raise InvalidArgumentError("a session needs at least one token")
        self.spec.check_kv(kv, len(packed))
        state = _json_object(state)
        keys = self._keys(packed)
        full = len(keys) * self.chunk_tokens
        async with self._session_lock(session_id):
            prev = await self._catalog.get(self.tenant, session_id)
            version = prev.version + 1 if prev else 1
            tkey = tail_key(self.fingerprint, self.tenant, session_id, version) if len(packed) > full else None
            with self._pinned(keys + ([tkey] if tkey else [])):
                await self._store_chunks(keys, kv)
                if tkey:
                    await self._transfer.write([tkey], [kv[:, :, full:]], self.tiers)
                stamp = now()
                manifest = SessionManifest(
                    session_id=session_id, tenant=self.tenant, fingerprint=self.fingerprint,
                    chunk_tokens=self.chunk_tokens, tokens=packed.tolist(), chunk_keys=keys, tail_key=tkey,
                    state=state, version=version, parent=prev.parent if prev else None,
                    created_at=prev.created_at if prev else stamp, updated_at=stamp,
                    ttl_seconds=ttl_seconds, pinned=pinned,
                )  # fmt: skip
                zeroed = await self._catalog.commit(manifest, prev.version if prev else None)
            await self._collect(zeroed)
            if prev and prev.tail_key and prev.tail_key != tkey:
                await self._drop([prev.tail_key])
        return manifest

    async def _manifest(self, session_id: str) -> SessionManifest:
        validate_id(session_id)
        manifest = await self._catalog.get(self.tenant, session_id)
        if manifest is None or manifest.expired():
            raise SessionNotFoundError(f"no session {session_id!r}")
        if manifest.fingerprint != self.fingerprint:
            raise SpecMismatchError(
                f"session {session_id!r} was stored for spec {manifest.fingerprint}, this store serves {self.fingerprint}"
            )
        return manifest

    async def resume(self, session_id: str, into: torch.Tensor | None = None) -> ResumeResult:
        """Restore a session's tokens, state and KV, exact to the last token (tail included).

        KV lands in `into` (canonical, at least as many tokens as the session) when given, as an
        engine would pass its own buffer; else in a fresh huge-page host tensor.
        """
        manifest = await self._manifest(session_id)
        if into is None:
            kv = empty_host(self.spec.kv_shape(manifest.num_tokens), self.spec.torch_dtype)
        else:
            kv = self._check_into(into)
            if kv.shape[2] < manifest.num_tokens:
                raise KVShapeError(f"into holds {kv.shape[2]} tokens, session {session_id!r} has {manifest.num_tokens}")
        keys: list[str] = list(manifest.chunk_keys)
        dests = self._slices(kv, len(keys))
        if manifest.tail_key:
            keys.append(manifest.tail_key)
            dests.append(kv[:, :, len(manifest.chunk_keys) * self.chunk_tokens :])
        with self._pinned(keys):
            ok = await self._transfer.read_into(keys, dests)
        lead = _leading(ok)
        restored = manifest.num_tokens if lead == len(keys) else lead * self.chunk_tokens
        if restored < manifest.num_tokens:
            log.warning("session %s resumed %d of %d tokens: stored data missing or corrupt", session_id, restored, manifest.num_tokens)
        return ResumeResult(manifest=manifest, kv=kv[:, :, :restored], restored_tokens=restored)

    async def fork(self, source_id: str, new_id: str) -> SessionManifest:
        """A new session sharing every chunk of `source_id` (no copy); only the small tail is copied."""
        src = await self._manifest(source_id)
        validate_id(new_id)
        async with self._session_lock(new_id):
            if await self._catalog.get(self.tenant, new_id) is not None:
                raise ConflictError(f"session {new_id!r} already exists")
            tkey = None
            pins = list(src.chunk_keys)
            if src.tail_key:
                tail = self.spec.empty_kv(src.tail_tokens)
                tkey = tail_key(self.fingerprint, self.tenant, new_id, 1)
                pins.append(tkey)
            with self._pinned(pins):
                if src.tail_key and tkey:
                    if not (await self._transfer.read_into([src.tail_key], [tail]))[0]:
                        raise CorruptDataError(f"tail of session {source_id!r} is missing or corrupt")
                    await self._transfer.write([tkey], [tail], self.tiers)
                stamp = now()
                manifest = src.model_copy(
                    update=dict(session_id=new_id, tail_key=tkey, version=1, parent=source_id, created_at=stamp, updated_at=stamp)
                )
                await self._catalog.commit(manifest, None)
        return manifest

    async def delete(self, session_id: str) -> None:
        """Remove a session; chunks no other session or prefix references are deleted."""
        validate_id(session_id)
        async with self._session_lock(session_id):
            manifest, zeroed = await self._catalog.remove(self.tenant, session_id)
            if manifest is None:
                raise SessionNotFoundError(f"no session {session_id!r}")
            await self._collect(zeroed)
            if manifest.tail_key:
                await self._drop([manifest.tail_key])

    async def sessions(self) -> AsyncIterator[SessionManifest]:
        for manifest in await self._catalog.list(self.tenant):
            if not manifest.expired():
                yield manifest

    async def gc(self) -> int:
        """Delete expired sessions, then chunks and tails nothing references (crash leftovers)."""
        removed = 0
        for manifest in await self._catalog.list(self.tenant):
            if manifest.expired():
                with contextlib.suppress(SessionNotFoundError):
                    await self.delete(manifest.session_id)
                    removed += 1
        fp = self.fingerprint
        chunk = [k async for k in self._lmdb.keys(f"{CHUNK_PREFIX}{fp}/") if not self.index.pinned(k)]
        counts = await self._catalog.refcounts(chunk)
        orphans = [k for k, n in zip(chunk, counts) if n == 0]
        await self._collect(orphans)
        live_tails = {m.tail_key for m in await self._catalog.list(None)}
        tails = [
            k async for k in self._lmdb.keys(f"{TAIL_PREFIX}{fp}/") if k not in live_tails and not self.index.pinned(k)
        ]
        if tails:
            await self._drop(tails)
        return removed + len(orphans) + len(tails)

    async def stats(self) -> StoreStats:
        return StoreStats(
            fingerprint=self.fingerprint, tenant=self.tenant, sessions=await self._catalog.session_count(),
            indexed_keys=len(self.index), tiers=[await t.stats() for t in self.tiers],
            counters=dict(self._transfer.counts),
        )  # fmt: skip


class _Opening:
    """What `StateStore.open` returns: awaitable, or an async context manager that closes the store."""

    def __init__(self, store: StateStore) -> None:
        self._store = store

    def __await__(self) -> Generator[Any, None, StateStore]:
        return self._store._start().__await__()

    async def __aenter__(self) -> StateStore:
        return await self._store._start()

    async def __aexit__(self, *exc: object) -> None:
        await self._store.close()


def _leading(ok: Sequence[bool]) -> int:
    for i, good in enumerate(ok):
        if not good:
            return i
    return len(ok)


def _json_object(state: dict[str, Any] | None) -> dict[str, Any]:
    if state is None:
        return {}
    if not isinstance(state, dict):
        raise InvalidArgumentError(f"state must be a JSON object (dict), got {type(state).__name__}")
    try:
        return json.loads(json.dumps(state, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"state is not JSON-serializable: {exc}") from None
