"""StateStore: the async API engines and agent frameworks call (prefixes, matches, sessions)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel

from agentstate.backends.base import Backend, BackendStats
from agentstate.catalog import Catalog
from agentstate.config import StoreConfig, TierConfig
from agentstate.errors import (
    InvalidArgumentError,
    KVShapeError,
)
from agentstate.index import ChunkIndex
from agentstate.io import Batch, IOEngine, batches
from agentstate.keys import (
    CHUNK_PREFIX,
    TAIL_PREFIX,
    ChunkKey,
    chunk_keys,
    namespace_for,
    token_array,
    validate_id,
)
from agentstate.manifest import MatchResult
from agentstate.memory import BufferPool
from agentstate.prefetch import PrefetchHandle, PrefetchPolicy, deadline_for
from agentstate.sessions import SessionOps, _leading
from agentstate.spec import ModelSpec
from agentstate.target import KVTarget, TensorTarget
from agentstate.tiers import Tier, TierManager
from agentstate.transfer import Span, Transfer

if TYPE_CHECKING:
    from agentstate.redis_catalog import RedisCatalog

log = logging.getLogger("agentstate.store")


class StoreStats(BaseModel):
    fingerprint: str
    tenant: str
    sessions: int
    indexed_keys: int
    tiers: list[BackendStats]
    counters: dict[str, int]


class StateStore(SessionOps):
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
        tiers = [self._build_tier(t) for t in config.tier_list()]
        self._catalog = self._build_catalog(tiers)
        record = config.record_tier or self._default_record(tiers)
        self.manager = TierManager(
            tiers, self.index, record=record, policy=config.write_policy,
            threshold=config.write_through_threshold, exclusive=config.exclusive,
        )  # fmt: skip
        self.record = self.manager.record
        self.io = IOEngine(config.io_depth)
        self._buffers = BufferPool(config.restore_pool_bytes)
        self._transfer = Transfer(
            spec=spec, manager=self.manager, io=self.io, pool=self._pool,
            batch_bytes=config.batch_bytes, promote=config.promote_on_read,
        )  # fmt: skip
        self._locks: dict[str, asyncio.Lock] = {}
        self._deleting: dict[str, asyncio.Future[None]] = {}
        self._owner = True

    def for_tenant(self, tenant: str) -> StateStore:
        """This store seen as another tenant: same tiers, index and catalog; that tenant's sessions
        and key namespace. One process serves many tenants this way (the HTTP service does), since a
        data directory is opened once per process. Closing a view closes nothing.
        """
        view = copy.copy(self)
        view.tenant = validate_id(tenant, "tenant")
        view.namespace = namespace_for(view.tenant, self.config.shared_namespace)
        view._owner = False
        return view

    def _build_catalog(self, tiers: list[Tier]) -> Catalog | RedisCatalog:
        if self.config.catalog_url is None:
            return Catalog(Path(self.config.path) / "catalog")
        if not any(t.backend.remote for t in tiers):
            raise InvalidArgumentError("a shared catalog (catalog_url) needs a remote tier to hold the chunks it names")
        from agentstate.redis_catalog import RedisCatalog

        return RedisCatalog(
            self.config.catalog_url, cluster=self.config.catalog_cluster, prefix=self.config.catalog_prefix
        )

    def _default_record(self, tiers: list[Tier]) -> str:
        """LMDB by default; with a shared catalog, the remote tier, since every host must find the
        chunks a shared manifest names."""
        if self._catalog.shared:
            return next(t.name for t in tiers if t.backend.remote)
        return next(
            (t.name for t in tiers if t.backend.durable and t.name == "lmdb"),
            next((t.name for t in reversed(tiers) if t.backend.durable), ""),
        )

    def _build_tier(self, cfg: TierConfig) -> Tier:
        root, name = Path(self.config.path), cfg.tier_name
        backend: Backend
        if cfg.kind == "host":
            from agentstate.backends.host import HostBackend

            backend = HostBackend(cfg.capacity_bytes if cfg.capacity_bytes is not None else 1 << 62)
        elif cfg.kind == "device":
            from agentstate.backends.device import DeviceBackend

            backend = DeviceBackend(cfg.device)
        elif cfg.kind == "lmdb":
            from agentstate.backends.lmdb import LMDBBackend

            backend = LMDBBackend(
                root / (cfg.path or name), map_size=self.config.lmdb_map_size,
                max_map_size=self.config.lmdb_max_map_size, threads=self.config.io_threads,
            )  # fmt: skip
        elif cfg.kind == "redis":
            from agentstate.backends.redis import RedisBackend

            backend = RedisBackend(cfg.url, cluster=cfg.cluster, ttl_seconds=cfg.ttl_seconds)
        else:
            from agentstate.backends.file import FileBackend

            backend = FileBackend(root / (cfg.path or name), threads=self.config.io_threads, o_direct=cfg.o_direct)
        backend.name = name
        capacity = cfg.capacity_bytes if cfg.kind in ("host", "device", "file") else None
        return Tier(backend, capacity=capacity, is_device=cfg.kind == "device")

    @property
    def tiers(self) -> list[Backend]:
        return [t.backend for t in self.manager.tiers]

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
        found: dict[str, list[str]] = {}
        for tier in self.manager.tiers:
            if tier.backend.durable and not tier.backend.remote:
                found[tier.name] = [
                    k for p in (CHUNK_PREFIX, TAIL_PREFIX) async for k in tier.backend.keys(f"{p}{fp}/")
                ]
        await self.manager.adopt_existing(found)
        return self

    async def __aenter__(self) -> StateStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def flush(self) -> None:
        """Wait until background work (promotions of chunks read from slow tiers) is done."""
        await self._transfer.flush()

    async def close(self) -> None:
        if not self._owner:
            return
        await self.flush()
        for tier in self.tiers:
            await tier.close()
        await self._catalog.close()
        self._pool.shutdown(wait=True)
        self._buffers.clear()

    # -- helpers -------------------------------------------------------------------------------

    def _keys(self, tokens: Sequence[int]) -> list[ChunkKey]:
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
        name = f"{self.tenant}/{session_id}"
        lock = self._locks.setdefault(name, asyncio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and self._locks.get(name) is lock:
                del self._locks[name]

    async def _store_chunks(self, keys: Sequence[str], kv: torch.Tensor, *, durable: bool) -> int:
        """Write the chunks not stored yet (dedupe); returns how many were new. Keys must be pinned.

        Durable stores (snapshots) dedupe against the record tier only: a chunk held by a cache
        alone is written again, to the record tier.
        """
        waits = {self._deleting[k] for k in keys if k in self._deleting}
        if waits:
            await asyncio.gather(*waits)
        if durable and self.record.backend.remote:
            missing = await self._missing_remote(keys)
        elif durable:
            missing = [i for i, k in enumerate(keys) if not self.index.holds(k, self.record.name)]
        else:
            missing = [i for i, k in enumerate(keys) if not self.index.tiers_of(k)]
        if missing:
            slices = self._slices(kv, len(keys))
            await self._transfer.write([keys[i] for i in missing], [slices[i] for i in missing], durable=durable)
        return len(missing)

    async def _missing_remote(self, keys: Sequence[str]) -> list[int]:
        """Which chunks the shared record tier lacks, touching the ones it has (so no host's gc takes
        them before this commit names them). Asked every time: another host may have collected a
        chunk this index still lists."""
        present = await self.record.backend.touch(keys)
        self.manager.note(self.record, keys, present)
        return [i for i, hit in enumerate(present) if not hit]

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
                await self.manager.delete(dead)
        finally:
            for key in candidates:
                del self._deleting[key]
            done.set_result(None)

    def _target(self, into: object) -> KVTarget:
        if isinstance(into, KVTarget):
            return into
        if not isinstance(into, torch.Tensor) or into.dim() != 5:
            raise KVShapeError(
                "into must be a KVTarget or a 5-dim canonical KV tensor [layers, planes, tokens, heads, dim]"
            )
        return TensorTarget(into, self.spec)

    def _spans(self, count: int, total: int | None = None) -> list[Span]:
        """Spans of `count` full chunks, plus a tail running to `total` tokens when given."""
        c = self.chunk_tokens
        spans = [(i * c, c) for i in range(count)]
        if total is not None and total > count * c:
            spans.append((count * c, total - count * c))
        return spans

    # -- shared prefixes -----------------------------------------------------------------------

    async def put_prefix(self, tokens: Sequence[int] | torch.Tensor, kv: torch.Tensor) -> int:
        """Store the full chunks of a shared prefix once; returns how many tokens were newly stored.

        The prefix is kept (referenced) until removed, whatever happens to sessions that share it.
        """
        packed = token_array(tokens)
        self.spec.check_kv(kv, len(packed))
        keys = self._keys(packed)
        with self._pinned(keys):
            new = await self._store_chunks(keys, kv, durable=False)
            await self._catalog.add_prefix(keys)
        return new * self.chunk_tokens

    async def match(self, tokens: Sequence[int] | torch.Tensor) -> MatchResult:
        """How many leading tokens are cached (whole chunks), and which tier serves each chunk."""
        keys = self._keys(token_array(tokens))
        n = await self._longest_prefix(keys)
        tiers = [self.manager.fastest(k) or "" for k in keys[:n]]
        return MatchResult(tokens=n * self.chunk_tokens, chunks=n, tiers=tiers)

    async def _longest_prefix(self, keys: Sequence[str]) -> int:
        """Index first; the keys past what it knows are asked of remote tiers in one batch."""
        n = self.index.longest_prefix(keys)
        if n < len(keys):
            await self.manager.discover(keys[n:])
            n = self.index.longest_prefix(keys)
        return n

    def prefetch(self, tokens: Sequence[int] | torch.Tensor) -> PrefetchHandle:
        """Start bringing the matched prefix of `tokens` into host memory; `load` completes it."""
        keys = self._keys(token_array(tokens))
        keys = keys[: self.index.longest_prefix(keys)]
        handle = PrefetchHandle(keys, self.index)
        slow = [k for k in keys if not self._in_memory(k)]
        runs = batches([self.chunk_tokens * self.spec.token_bytes] * len(slow), self.config.batch_bytes)

        def op(run: list[str]) -> Callable[[], Awaitable[None]]:
            async def go() -> None:
                handle.staged.update(await self._transfer.fetch(run, [self.chunk_tokens] * len(run)))

            return go

        # One task per run, ungated: their reads go through the IO engine, which bounds them.
        handle.start(Batch([asyncio.ensure_future(op([slow[i] for i in run])()) for run in runs]))
        return handle

    def _in_memory(self, key: str) -> bool:
        return any(not t.backend.durable for t in self.manager.holders(key))

    async def load(
        self,
        tokens: Sequence[int] | torch.Tensor,
        into: torch.Tensor | KVTarget,
        *,
        policy: PrefetchPolicy | None = None,
        timeout: float | None = None,
        prefetch: PrefetchHandle | None = None,
    ) -> int:
        """Write the cached prefix of `tokens` into `into`; returns how many tokens landed (whole chunks).

        `into` is a canonical tensor or a KVTarget (e.g. a paged pool). A chunk that turns out
        missing or corrupt ends the prefix there. Under `best_effort`/`timeout` only what is in
        memory by the deadline is copied; the rest keeps arriving in the background.
        """
        target = self._target(into)
        packed = token_array(tokens)
        keys = self._keys(packed)
        n = min(await self._longest_prefix(keys), target.num_tokens // self.chunk_tokens)
        policy = policy or self.config.prefetch_policy
        deadline = deadline_for(
            policy, n * self.chunk_tokens, timeout=timeout, base=self.config.prefetch_timeout_base_s,
            per_1k=self.config.prefetch_timeout_per_1k_tokens_s,
        )  # fmt: skip
        if deadline is None:
            if prefetch is not None:
                await prefetch.wait()
        else:
            prefetch = prefetch or self.prefetch(packed)
            await prefetch.wait(deadline)
            n = min(n, prefetch.ready(self._in_memory))
        with self._pinned(keys[:n]):
            ok = await self._transfer.read(
                keys[:n], self._spans(n), target, staged=prefetch.staged if prefetch else None
            )
        target.synchronize()
        return _leading(ok) * self.chunk_tokens

    async def stats(self) -> StoreStats:
        return StoreStats(
            fingerprint=self.fingerprint, tenant=self.tenant, sessions=await self._catalog.session_count(),
            indexed_keys=len(self.index), tiers=[await t.stats() for t in self.tiers],
            counters={**self._transfer.counts, **self.manager.counts, "io_peak_in_flight": self.io.peak_in_flight},
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
