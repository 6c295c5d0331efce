"""Accounting per session and per tenant: what the cache saved, what it cost, where bytes came from.

Every resume, load, snapshot and hint adds to two sets of counters, the session's and its
tenant's (the tenant's outlive deleted sessions: they are the bill). Counters are exact integers
kept in memory and added to the catalog in one transaction every `usage_flush_s` (and at close),
together with each session's last hit time (what a sliding retention TTL counts from). A read of
usage adds what is still in memory, so it is exact in this process; a crash of the process loses
at most the last `usage_flush_s` of counts, never stored KV.

Counters:
- `tokens_read`: tokens served from the cache (restored into an engine);
- `tokens_written`: tokens whose KV was stored (new chunks and tails; dedupe makes this smaller
  than what was snapshotted), `tokens_deduped` the rest;
- `tokens_recomputed`: tokens asked for that the cache did not serve, which the engine computes;
- `bytes_written`: stored bytes written; `bytes_read:<tier>`: stored bytes read from each tier;
- `resumes`, `snapshots`, `loads`, `hints`: operations.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from agentstate.errors import AgentStateError

if TYPE_CHECKING:
    from agentstate.catalog.base import Catalog

log = logging.getLogger("agentstate.usage")
TENANT_TOTAL = ""
"""The session id under which a tenant's totals are kept (no session id is empty)."""
UsageKey = tuple[str, str]
"""(tenant, session id), or (tenant, TENANT_TOTAL)"""


class Usage(BaseModel):
    """Accounting of one session, or of a whole tenant (`session_id` None)."""

    model_config = ConfigDict(frozen=True)

    tenant: str
    session_id: str | None = None
    tokens_read: int = 0
    tokens_written: int = 0
    tokens_deduped: int = 0
    tokens_recomputed: int = 0
    bytes_written: int = 0
    bytes_read: dict[str, int] = Field(default_factory=dict, description="stored bytes read, per tier")
    bytes_stored: dict[str, int] = Field(
        default_factory=dict, description="a session's stored bytes per tier, as this process sees them now"
    )
    resumes: int = 0
    snapshots: int = 0
    loads: int = 0
    hints: int = 0
    last_hit_at: float | None = None

    @classmethod
    def of(
        cls, tenant: str, session_id: str | None, counters: Mapping[str, int], *, last_hit_at: float | None = None,
        bytes_stored: Mapping[str, int] | None = None,
    ) -> Usage:  # fmt: skip
        plain = {k: int(v) for k, v in counters.items() if ":" not in k and k in cls.model_fields}
        read = {k.split(":", 1)[1]: int(v) for k, v in counters.items() if k.startswith("bytes_read:")}
        return cls(
            tenant=tenant, session_id=session_id, bytes_read=read, bytes_stored=dict(bytes_stored or {}),
            last_hit_at=last_hit_at, **plain,
        )  # fmt: skip


class UsageLog:
    """Counters and hit times not yet in the catalog; one flush task per store."""

    def __init__(self, catalog: Catalog, interval_s: float, *, enabled: bool = True) -> None:
        self._catalog = catalog
        self._enabled = enabled  # a read-only store (the admin CLI) counts nothing
        self._interval_s = interval_s
        self._deltas: dict[UsageKey, Counter[str]] = {}
        self._hits: dict[UsageKey, float] = {}
        self.totals: dict[str, Counter[str]] = {}
        """per tenant, every count of this process since it started (Prometheus counters)"""
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def add(self, tenant: str, session_id: str | None, counts: Mapping[str, int]) -> None:
        """Count `counts` for the session (if any) and for its tenant."""
        counts = {k: int(v) for k, v in counts.items() if v}
        if not counts or not self._enabled:
            return
        self.totals.setdefault(tenant, Counter()).update(counts)
        for key in [(tenant, TENANT_TOTAL), *([(tenant, session_id)] if session_id else [])]:
            self._deltas.setdefault(key, Counter()).update(counts)
        self._schedule()

    def hit(self, tenant: str, session_id: str, at: float) -> None:
        if not self._enabled:
            return
        key = (tenant, session_id)
        self._hits[key] = max(at, self._hits.get(key, 0.0))
        self._schedule()

    def last_hit(self, tenant: str, session_id: str) -> float | None:
        """A hit of this process not yet in the catalog."""
        return self._hits.get((tenant, session_id))

    def pending(self, tenant: str, session_id: str | None) -> Counter[str]:
        return Counter(self._deltas.get((tenant, session_id or TENANT_TOTAL), {}))

    async def read(self, tenant: str, session_id: str | None) -> Counter[str]:
        """The counters of (tenant, session) as the catalog holds them plus what is pending: exact,
        since a flush moves counts under the same lock."""
        async with self._lock:
            counts = Counter(await self._catalog.usage(tenant, session_id or TENANT_TOTAL))
            counts.update(self.pending(tenant, session_id))
        return counts

    def forget(self, tenant: str, session_id: str) -> None:
        """A removed session: its own pending counts and hit go (its tenant's totals stay)."""
        self._deltas.pop((tenant, session_id), None)
        self._hits.pop((tenant, session_id), None)

    def _schedule(self) -> None:
        if self._task is None and not self._closed:
            with contextlib.suppress(RuntimeError):  # no running loop: flushed at close
                self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while self._deltas or self._hits:
                await asyncio.sleep(self._interval_s)
                try:
                    await self.flush()
                except AgentStateError as exc:  # kept in memory; the next round retries
                    log.warning("usage flush failed (%s); retrying in %.1fs", exc, self._interval_s)
        finally:
            self._task = None

    async def flush(self) -> None:
        """Add everything pending to the catalog in one call; on failure it stays pending.

        The write is shielded from cancellation (close cancels the flush task; so does a shutdown):
        a cancel while it is in flight waits for its outcome, because the catalog may commit it all
        the same (a thread inside an LMDB transaction, a Redis pipeline already sent), and counts
        put back after a write that committed would be added twice."""
        async with self._lock:
            deltas, hits = self._deltas, self._hits
            if not deltas and not hits:
                return
            self._deltas, self._hits = {}, {}
            write = asyncio.ensure_future(self._catalog.add_usage(deltas, hits))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                with contextlib.suppress(BaseException):
                    await asyncio.wait({write})
                if not write.done() or write.cancelled() or write.exception() is not None:
                    self._restore(deltas, hits)
                raise
            except BaseException:
                self._restore(deltas, hits)
                raise

    def _restore(self, deltas: dict[UsageKey, Counter[str]], hits: dict[UsageKey, float]) -> None:
        """Counts whose write did not commit: pending again, for the next flush."""
        for key, counts in deltas.items():
            self._deltas.setdefault(key, Counter()).update(counts)
        for key, at in hits.items():
            self._hits[key] = max(at, self._hits.get(key, 0.0))

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush()
