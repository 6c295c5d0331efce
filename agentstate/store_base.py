"""StoreScope: what a StateStore is made of (a ChunkStore, a catalog, the accounting log, the
writers' locks), seen as one tenant, and the helpers its operations share. The chunk layer
(`agentstate.chunks`) owns every chunk's bytes; this layer owns sessions, prefixes and the
references that keep chunks alive. `StateStore` (store.py) and its session operations
(`Sessions`, sessions.py) each hold a scope: composed, not derived.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from typing_extensions import Self

from agentstate.catalog import Catalog, LMDBCatalog
from agentstate.chunks import ChunkStore, Span
from agentstate.config import StoreConfig
from agentstate.datadir import CATALOG
from agentstate.errors import AgentStateError, CapacityError, KVShapeError
from agentstate.keyed_locks import KeyedLocks
from agentstate import edges
from agentstate.keys import (
    CHUNK_PREFIX, TAIL_PREFIX, ChunkKey, chunk_keys, namespace_for, token_array, validate_id,
)  # fmt: skip
from agentstate.reserve import StandingReserve, local_dirs
from agentstate.spec import ModelSpec
from agentstate.target import KVTarget, TensorTarget
from agentstate.usage import UsageLog

if TYPE_CHECKING:
    import torch

log = logging.getLogger("agentstate.store")
T = TypeVar("T")


class StoreScope:
    """The parts of one open data directory, as one tenant sees them (`for_tenant`: another)."""

    def __init__(self, config: StoreConfig, spec: ModelSpec, *, read_only: bool = False) -> None:
        self.config = config
        self.spec = spec
        self.fingerprint = spec.fingerprint
        self.tenant = validate_id(config.tenant, "tenant")
        self.namespace = namespace_for(self.tenant, config.shared_namespace)
        self.chunk_tokens = config.chunk_tokens
        self.chunks = ChunkStore(config, spec, shared_catalog=config.catalog_url is not None, read_only=read_only)
        try:
            self.catalog: Catalog = self._build_catalog()
        except BaseException:
            self.chunks.release_lock()  # the tiers' files close when collected; the lock must go now
            raise
        self.usage_log = UsageLog(self.catalog, config.usage_flush_s, enabled=not read_only)
        """accounting and hit times on their way to the catalog (one for every tenant view)"""
        self.locks = KeyedLocks()
        """one writer at a time per tenant/session (shared by every tenant view)"""
        self.room = StandingReserve([] if read_only else local_dirs(config), config.disk_reserve_bytes)
        """room held free on the local disks for deletes that meet a full disk (see `freeing`)"""
        self.gc_cursors: dict[str, Any] = {}
        """tenant -> where its `gc_step` pass stands (a GcCursor; shared by every tenant view)"""
        self._owner = True

    def for_tenant(self, tenant: str) -> Self:
        """This store seen as another tenant: same chunks and catalog; that tenant's sessions and
        key namespace. One process serves many tenants this way (the HTTP service does), since a
        data directory is opened once per process. Closing a view closes nothing.
        """
        view = copy.copy(self)
        view.tenant = validate_id(tenant, "tenant")
        view.namespace = namespace_for(view.tenant, self.config.shared_namespace)
        view._owner = False
        return view

    def _build_catalog(self) -> Catalog:
        if self.config.catalog_url is None:
            return LMDBCatalog(Path(self.config.path) / CATALOG)
        from agentstate.catalog.redis import RedisCatalog

        return RedisCatalog(
            self.config.catalog_url, cluster=self.config.catalog_cluster, prefix=self.config.catalog_prefix
        )

    @property
    def key_prefixes(self) -> list[str]:
        """Where this spec's chunks and tails live in every tier (what open adopts and gc sweeps)."""
        return [f"{CHUNK_PREFIX}{self.fingerprint}/", f"{TAIL_PREFIX}{self.fingerprint}/"]

    async def flush(self) -> None:
        """Wait until background work (promotions of chunks read from slow tiers) is done."""
        await self.chunks.flush()

    async def close(self) -> None:
        if not self._owner:
            return
        self.room.close()
        try:
            try:
                await self.usage_log.close()
            except AgentStateError as exc:  # accounting only: never keeps the data directory from closing
                log.warning("usage not saved at close: %s", exc)
            await self.chunks.close()
        finally:
            await self.catalog.close()

    # -- helpers -------------------------------------------------------------------------------

    async def freeing(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run `op`, an operation that frees space (a catalog removal, a collect, a sweep). On a full
        disk it spends the standing reserve and runs once more: a full disk never refuses the deletes
        that make room. `op` must be safe to run again after a CapacityError (each is one transaction,
        or deletes what is still there)."""
        try:
            result = await op()
        except CapacityError:
            if not self.room.spend():
                raise
            log.warning("the disk is full: spending the room held for deletes")
            result = await op()
        self.room.refill()
        return result

    def chunk_keys(self, tokens: Sequence[int]) -> list[ChunkKey]:
        """The keys of the full chunks of `tokens` in this tenant's namespace."""
        return list(
            chunk_keys(
                tokens, namespace=self.namespace, fingerprint=self.fingerprint, chunk_tokens=self.chunk_tokens,
                chain=self.spec.model_fingerprint,
            )
        )

    def prefix_keys(self, tokens: Sequence[int]) -> list[ChunkKey]:
        """The keys of the full chunks of a shared prefix: the chunk chain, or an engine's own scheme
        (`key_scheme`, declared by its adapter), where the store's own tenant is that engine's requests
        without a cache salt and any other tenant those whose salt is its id."""
        scheme, argument = edges.key_scheme(self.config.key_scheme)
        if scheme is None:
            return self.chunk_keys(tokens)
        salt = None if self.config.shared_namespace or self.tenant == self.config.tenant else self.tenant
        packed = token_array(tokens)
        return [ChunkKey(k) for k in scheme.keys(packed, self.fingerprint, self.chunk_tokens, argument, salt)]

    def prefix_key_base(self) -> str:
        """What every prefix key starts with before its last part (the data plane's handles carry that part)."""
        scheme, argument = edges.key_scheme(self.config.key_scheme)
        if scheme is None:
            return f"{CHUNK_PREFIX}{self.fingerprint}/"
        return scheme.base(self.fingerprint, self.chunk_tokens, argument)

    def slices(self, kv: torch.Tensor, count: int) -> list[torch.Tensor]:
        """The first `count` full chunks of canonical `kv`, as views."""
        c = self.chunk_tokens
        return [kv[:, :, i * c : (i + 1) * c] for i in range(count)]

    @contextlib.asynccontextmanager
    async def session_lock(self, session_id: str) -> AsyncIterator[None]:
        """Hold the one writer's place of this tenant's session in this process (every tenant view
        shares it): what snapshot, fork and delete take, and what an import holds for each session
        it replaces from its check to its commit, so none of them runs in between."""
        async with self.locks.hold(f"{self.tenant}/{session_id}"):
            yield

    async def collect(self, keys: Sequence[str]) -> None:
        """Delete what lost its last reference (or never got one), unless something pinned it meanwhile."""
        await self.chunks.collect(list(keys), self.catalog.refcounts)

    def target(self, into: object) -> KVTarget:
        """`into` as a KVTarget (a canonical tensor is wrapped); KVShapeError for anything else."""
        import torch

        if isinstance(into, KVTarget):
            return into
        if not isinstance(into, torch.Tensor) or into.dim() != 5:
            raise KVShapeError(
                "into must be a KVTarget or a 5-dim canonical KV tensor [layers, planes, tokens, heads, dim]"
            )
        return TensorTarget(into, self.spec)

    def spans(self, count: int, total: int | None = None, chunk_tokens: int | None = None) -> list[Span]:
        """Spans of `count` full chunks (of `chunk_tokens`, default this store's), plus a tail
        running to `total` tokens when given."""
        c = chunk_tokens or self.chunk_tokens
        spans = [(i * c, c) for i in range(count)]
        if total is not None and total > count * c:
            spans.append((count * c, total - count * c))
        return spans

