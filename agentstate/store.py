"""StateStore: the async API engines and agent frameworks call (prefixes, matches, sessions)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from agentstate.backends.base import BackendStats
from agentstate.config import StoreConfig
from agentstate.io import Batch, batches
from agentstate.keys import (
    CHUNK_PREFIX,
    TAIL_PREFIX,
    token_array,
)
from agentstate.manifest import MatchResult
from agentstate.prefetch import PrefetchHandle, PrefetchPolicy, deadline_for
from agentstate.sessions import SessionOps, _leading
from agentstate.spec import ModelSpec
from agentstate.target import KVTarget

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

    async def prefetch(self, tokens: Sequence[int] | torch.Tensor) -> PrefetchHandle:
        """Start bringing the matched prefix of `tokens` into host memory; `load` completes it.

        Returns once the prefix is known (one batched `exists` per remote tier for chunks the index
        lacks); the reads go on in the background.
        """
        keys = self._keys(token_array(tokens))
        keys = keys[: await self._longest_prefix(keys)]
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
            prefetch = prefetch or await self.prefetch(packed)
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
