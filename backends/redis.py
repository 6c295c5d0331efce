"""Redis tier: chunks as binary values in a Redis server or Redis Cluster (redis-py asyncio).

The remote tier a fleet shares. Every call is one pipeline (a cluster client splits it by slot),
bounded by a timeout, behind a circuit breaker: a server that is down or slow turns reads into
counted misses within `timeout_s`, and after `breaker_threshold` consecutive failures the tier is
skipped for `breaker_cooldown_s` without touching the network. Writes that fail raise
BackendError (retryable); they never leave a partial value, since SET is atomic per key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from agentstate.backends.base import Backend, BackendStats, ReadSink

from agentstate.errors import BackendError

log = logging.getLogger("agentstate.backends.redis")
T = TypeVar("T")


# OBJECT IDLETIME has a resolution of seconds and is reset by any read or TOUCH of the key.
_DELETE_IF_IDLE = """
local idle = redis.call('OBJECT', 'IDLETIME', KEYS[1])
if idle and idle >= tonumber(ARGV[1]) then return redis.call('DEL', KEYS[1]) end
return 0
"""


class CircuitBreaker:
    """Opens after `threshold` consecutive failures; lets one probe through after `cooldown_s`."""

    def __init__(self, threshold: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold, self.cooldown_s, self.clock = threshold, cooldown_s, clock
        self.failures = 0
        self.opened_at: float | None = None
        self.trips = 0

    @property
    def open(self) -> bool:
        return self.opened_at is not None and self.clock() - self.opened_at < self.cooldown_s

    def success(self) -> None:
        self.failures, self.opened_at = 0, None

    def failure(self) -> None:
        self.failures += 1
        if self.failures >= self.threshold and (self.opened_at is None or not self.open):
            self.opened_at = self.clock()
            self.trips += 1


class RedisBackend(Backend):
    name = "redis"
    durable = True
    trusted = False
    remote = True

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        cluster: bool = False,
        prefix: str = "agentstate:",
        ttl_seconds: int | None = None,
        timeout_s: float = 2.0,
        breaker_threshold: int = 3,
        breaker_cooldown_s: float = 5.0,
        max_in_flight: int = 16,
    ) -> None:
        import redis.asyncio as aioredis  # optional dependency: loaded only when this tier is chosen

        # Chunks are MiB-sized: 1 MiB socket reads (default 64 KiB) take a value in a few reads.
        opts: dict[str, Any] = {
            "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, "socket_read_size": 1 << 20,
        }  # fmt: skip
        if cluster:
            self._client: Any = aioredis.RedisCluster.from_url(url, **opts)
        else:
            self._client = aioredis.Redis.from_url(url, **opts)
        self._errors = (aioredis.RedisError, OSError, asyncio.TimeoutError)
        self.prefix, self.ttl_seconds, self.timeout_s = prefix, ttl_seconds, timeout_s
        self.breaker = CircuitBreaker(breaker_threshold, breaker_cooldown_s)
        self._counts: Counter[str] = Counter()
        self._max_in_flight = max_in_flight
        self._gate: asyncio.Semaphore | None = None

    def _k(self, key: str) -> str:
        return self.prefix + key

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run one round trip under the timeout and the breaker; failures raise BackendError."""
        if self.breaker.open:
            self._counts["errors"] += 1
            raise BackendError("redis tier unavailable (circuit open)")
        if self._gate is None:
            self._gate = asyncio.Semaphore(self._max_in_flight)  # bounded connections, like any pool
        try:
            async with self._gate:
                result = await asyncio.wait_for(op(), self.timeout_s)
        except self._errors as exc:
            self.breaker.failure()
            self._counts["errors"] += 1
            log.warning("redis call failed (%s: %s)", type(exc).__name__, exc)
            raise BackendError(f"redis call failed: {type(exc).__name__}: {exc}") from exc
        self.breaker.success()
        return result

    async def _pipeline(self, build: Callable[[Any], object]) -> list[Any]:
        async def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            build(pipe)
            return list(await pipe.execute())

        return await self._call(run)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        try:
            got = await self._pipeline(lambda p: [p.exists(self._k(k)) for k in keys])
        except BackendError:
            return [False] * len(keys)  # an unreachable tier holds nothing we can use
        return [bool(n) for n in got]

    async def read(self, keys: Sequence[str], sink: ReadSink) -> list[bool]:
        if not keys:
            return []
        try:
            values = await self._pipeline(lambda p: [p.get(self._k(k)) for k in keys])
        except BackendError:
            self._counts["misses"] += len(keys)
            return [False] * len(keys)
        for i, value in enumerate(values):
            if value is not None:
                sink(i, memoryview(value))
        hits = sum(v is not None for v in values)
        self._counts.update(reads=hits, misses=len(keys) - hits)
        return [v is not None for v in values]

    async def put(self, keys: Sequence[str], values: Sequence[bytes | bytearray | memoryview]) -> None:
        if not keys:
            return
        await self._pipeline(
            lambda p: [p.set(self._k(k), bytes(v), ex=self.ttl_seconds) for k, v in zip(keys, values, strict=True)]
        )
        self._counts["writes"] += len(keys)

    async def delete(self, keys: Sequence[str]) -> None:
        if keys:
            await self._pipeline(lambda p: [p.delete(self._k(k)) for k in keys])
            self._counts["deletes"] += len(keys)

    async def touch(self, keys: Sequence[str]) -> list[bool]:
        """TOUCH resets each key's idle time (EXISTS does not); a failure raises, since a snapshot
        that cannot confirm a chunk in the shared store must write it again or fail."""
        if not keys:
            return []
        return [bool(n) for n in await self._pipeline(lambda p: [p.touch(self._k(k)) for k in keys])]

    async def delete_idle(self, keys: Sequence[str], idle_seconds: float) -> list[str]:
        if not keys:
            return []
        idle = str(int(idle_seconds))
        got = await self._pipeline(lambda p: [p.eval(_DELETE_IF_IDLE, 1, self._k(k), idle) for k in keys])
        deleted = [k for k, n in zip(keys, got) if int(n)]
        self._counts["deletes"] += len(deleted)
        return deleted

    async def keys(self, prefix: str | None = None) -> AsyncIterator[str]:
        pattern = self._k(prefix or "").replace("*", r"\*").replace("?", r"\?").replace("[", r"\[") + "*"
        if self.breaker.open:
            raise BackendError("redis tier unavailable (circuit open)")
        try:
            async for raw in self._client.scan_iter(match=pattern, count=1000):
                key = raw.decode() if isinstance(raw, bytes) else raw
                yield key[len(self.prefix) :]
        except self._errors as exc:
            self.breaker.failure()
            self._counts["errors"] += 1
            raise BackendError(f"redis scan failed: {type(exc).__name__}: {exc}") from exc

    async def sizes(self, keys: Sequence[str]) -> list[int]:
        if not keys:
            return []
        try:
            return [int(n) for n in await self._pipeline(lambda p: [p.strlen(self._k(k)) for k in keys])]
        except BackendError:
            return [0] * len(keys)

    async def stats(self) -> BackendStats:
        """Counts and value bytes under this backend's prefix (a SCAN: for admin, not hot paths)."""
        try:
            keys = [k async for k in self.keys()]
        except BackendError:
            keys = []  # unreachable: report the counters we have
        return BackendStats(
            name=self.name, items=len(keys), bytes_used=sum(await self.sizes(keys)), capacity_bytes=None,
            **{k: self._counts[k] for k in ("reads", "writes", "deletes", "misses", "errors")},
        )  # fmt: skip

    async def close(self) -> None:
        await self._client.aclose()
