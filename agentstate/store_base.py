"""StoreBase: how a StateStore is built (tiers, catalog, IO) and the helpers its operations share."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import AsyncIterator, Generator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from pydantic import BaseModel
from typing_extensions import Self

from agentstate.backends.base import Backend, BackendStats
from agentstate.catalog import Catalog
from agentstate.config import StoreConfig, TierConfig
from agentstate.errors import (
    InvalidArgumentError,
    KVShapeError,
)
from agentstate.index import ChunkIndex
from agentstate.io import IOEngine
from agentstate.keys import (
    ChunkKey,
    chunk_keys,
    namespace_for,
    validate_id,
)
from agentstate.memory import BufferPool
from agentstate.spec import ModelSpec
from agentstate.target import KVTarget, TensorTarget
from agentstate.tiers import Tier, TierManager
from agentstate.transfer import Span, Transfer

if TYPE_CHECKING:
    from agentstate.redis_catalog import RedisCatalog

log = logging.getLogger("agentstate.store")
S = TypeVar("S", bound="StoreBase")


class StoreStats(BaseModel):
    fingerprint: str
    tenant: str
    sessions: int
    indexed_keys: int
    tiers: list[BackendStats]
    counters: dict[str, int]


class StoreBase:
    """Construction and shared plumbing; the API is StateStore (store.py) and SessionOps (sessions.py)."""

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

    def for_tenant(self, tenant: str) -> Self:
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
        if not any(t.backend.remote and t.backend.durable for t in tiers):
            raise InvalidArgumentError(
                "a shared catalog (catalog_url) needs a durable remote tier (redis) to hold the chunks it names;"
                " mooncake evicts and loses values, so it can only cache them"
            )
        from agentstate.redis_catalog import RedisCatalog

        return RedisCatalog(
            self.config.catalog_url, cluster=self.config.catalog_cluster, prefix=self.config.catalog_prefix
        )

    def _default_record(self, tiers: list[Tier]) -> str:
        """LMDB by default; with a shared catalog, the durable remote tier, since every host must
        find the chunks a shared manifest names."""
        if self._catalog.shared:
            return next(t.name for t in tiers if t.backend.remote and t.backend.durable)
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

            backend = RedisBackend(
                cfg.url, cluster=cfg.cluster, ttl_seconds=cfg.ttl_seconds, prefix=cfg.prefix, timeout_s=cfg.timeout_s,
                breaker_threshold=cfg.breaker_threshold, breaker_cooldown_s=cfg.breaker_cooldown_s,
            )  # fmt: skip
        elif cfg.kind == "mooncake":
            from agentstate.backends.mooncake import MooncakeBackend

            backend = MooncakeBackend(
                cfg.master, metadata_url=cfg.metadata_url, admin_url=cfg.admin_url, local_host=cfg.local_host,
                protocol=cfg.protocol, rdma_devices=cfg.rdma_devices, segment_bytes=cfg.segment_bytes,
                buffer_bytes=cfg.buffer_bytes, prefix=cfg.prefix, timeout_s=cfg.timeout_s,
                breaker_threshold=cfg.breaker_threshold, breaker_cooldown_s=cfg.breaker_cooldown_s,
            )  # fmt: skip
        else:
            from agentstate.backends.file import FileBackend

            backend = FileBackend(root / (cfg.path or name), threads=self.config.io_threads, o_direct=cfg.o_direct)
        backend.name = name
        capacity = cfg.capacity_bytes if cfg.kind in ("host", "device", "file") else None
        return Tier(backend, capacity=capacity, is_device=cfg.kind == "device")

    @property
    def tiers(self) -> list[Backend]:
        return [t.backend for t in self.manager.tiers]

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

    def _spans(self, count: int, total: int | None = None, chunk_tokens: int | None = None) -> list[Span]:
        """Spans of `count` full chunks (of `chunk_tokens`, default this store's), plus a tail
        running to `total` tokens when given."""
        c = chunk_tokens or self.chunk_tokens
        spans = [(i * c, c) for i in range(count)]
        if total is not None and total > count * c:
            spans.append((count * c, total - count * c))
        return spans
