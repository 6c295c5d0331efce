"""Redis tier: chunks as binary values in a Redis server or Redis Cluster.

The remote tier a fleet shares. Every call is one pipeline (a cluster client splits it by slot),
bounded by a timeout, behind a circuit breaker: a server that is down or slow turns reads into
counted misses within `timeout_s`, and after `breaker_threshold` consecutive failures the tier is
skipped for `breaker_cooldown_s` without touching the network. Writes that fail raise
BackendError (retryable); they never leave a partial value, since SET is atomic per key.

Reads (`get_into`, `read`) go through `redis_wire`: GET replies parsed straight into the caller's
buffers over a few pipelined connections per node; writes (`put`) through `redis_writes`: pipelined
SETs sent from the values' own memory. Everything else, and any read or write those clients cannot
settle (TLS or unusual URLs, MOVED/ASK, a refused handshake), goes through redis-py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from agentstate.backends import redis_wire as wire
from agentstate.backends.base import Backend, BackendStats, ReadSink
from agentstate.backends.redis_pool import WireReader
from agentstate.backends.redis_writes import WireWriter
from agentstate.edges import CORE_PREFIXES, key_spaces
from agentstate.errors import AgentStateError, BackendError, BackendRefusedError, CapacityError, InvalidArgumentError

if TYPE_CHECKING:
    from agentstate.config import RedisTier, StoreConfig

log = logging.getLogger("agentstate.backends.redis")
FAILED = object()  # a key whose call failed (its node was down), as opposed to a miss
T = TypeVar("T")


def value_namespaces() -> tuple[str, ...]:
    """Where values live under the prefix: chunks and tails (`agentstate.keys`) and the key spaces adapters
    declare (`agentstate.edges`: an engine's pages). The shared catalog's defaults put its `m/` hashes and
    `x/` records under the same `agentstate:` prefix: never values."""
    return (*CORE_PREFIXES, *(s.prefix for s in key_spaces()))


# OBJECT IDLETIME has a resolution of seconds and is reset by any read or TOUCH of the key.
_DELETE_IF_IDLE = """
local idle = redis.call('OBJECT', 'IDLETIME', KEYS[1])
if idle and idle >= tonumber(ARGV[1]) then return redis.call('DEL', KEYS[1]) end
return 0
"""


def refusal_of(exc: BaseException) -> AgentStateError | None:
    """The typed error for an error reply that retrying cannot fix; None for an outage.

    A cluster that is down or resharding (CLUSTERDOWN, TRYAGAIN) is an outage that may heal.
    """
    from redis.exceptions import ClusterDownError, ResponseError, TryAgainError

    if not isinstance(exc, ResponseError) or isinstance(exc, ClusterDownError | TryAgainError):
        return None
    reason = str(exc.args[-1] if exc.args else exc)[-200:]  # a pipeline's message quotes the value: keep the reason
    if "OOM" in reason or "maxmemory" in reason:
        return CapacityError(f"remote store is full: {reason}")
    return BackendRefusedError(f"redis refused the command: {reason}")


def _byte_view(value: bytes | bytearray | memoryview) -> memoryview:
    """A flat view of unsigned bytes (its len is its byte count), whatever the buffer's own format."""
    view = memoryview(value)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


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

    @property
    def state(self) -> str:
        """`closed`, `open` (calls are skipped) or `half_open` (cooled down: the next call is a probe)."""
        if self.opened_at is None:
            return "closed"
        return "open" if self.open else "half_open"

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
        retries: int = 2,
        connections: int = 4,
    ) -> None:
        """`connections`: wire connections per node for GET and EXISTS (one large value in flight on each;
        see redis_pool). `retries`: reconnects after a dropped connection, on either path."""
        import redis.asyncio as aioredis  # optional dependency: loaded only when this tier is chosen
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff

        # Chunks are MiB-sized: 1 MiB socket reads (default 64 KiB) take a value in a few reads.
        opts: dict[str, Any] = {
            "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, "socket_read_size": 1 << 20,
        }  # fmt: skip
        # Retries only for what may succeed a moment later (connection drops, timeouts), inside
        # redis-py; an answer that refuses (an error reply) is never retried. The cluster client
        # retries those itself, after refreshing its slot map (cluster_error_retry_attempts).
        if not cluster:
            opts["retry"] = Retry(ExponentialBackoff(cap=timeout_s / 4, base=0.01), retries)
        if cluster:
            self._client: Any = aioredis.RedisCluster.from_url(url, **opts)
        else:
            self._client = aioredis.Redis.from_url(url, **opts)
        # Exception, not just RedisError: redis-py can fail internally when a node drops mid-write
        # (e.g. AttributeError on a connection it just closed); for a remote tier that is an outage.
        self.client_errors: tuple[type[BaseException], ...] = (Exception,)
        self._refusal = refusal_of
        self.prefix, self.ttl_seconds, self.timeout_s = prefix, ttl_seconds, timeout_s
        self.cluster = cluster
        parsed = urlsplit(url)
        self.server = f"{parsed.hostname or '127.0.0.1'}:{parsed.port or 6379}"  # never the password
        self.breaker = CircuitBreaker(breaker_threshold, breaker_cooldown_s)
        self._node_breakers: dict[str, CircuitBreaker] = {}
        self._counts: Counter[str] = Counter()
        self._max_in_flight = max_in_flight
        self._gate: asyncio.Semaphore | None = None
        # The wire read path: None where the URL needs redis-py (TLS, a unix socket, URL options).
        config = wire.wire_config(url)
        self._wire = WireReader(self, config, connections, retries) if config else None
        self._writer = WireWriter(self, self._wire, connections, retries) if self._wire else None

    def stored_key(self, key: str) -> str:
        """The name `key` is stored under in Redis (this tier's prefix added)."""
        return self.prefix + key

    def breaker_of(self, node: str | None) -> CircuitBreaker:
        """The breaker of `node` (a cluster node's name), or the tier's (None: a single server)."""
        if node is None:
            return self.breaker
        if node not in self._node_breakers:
            self._node_breakers[node] = CircuitBreaker(self.breaker.threshold, self.breaker.cooldown_s)
        return self._node_breakers[node]

    def gate(self) -> asyncio.Semaphore:
        """What bounds this tier's calls in flight (`max_in_flight`), on either read path: made on
        first use, inside the running loop."""
        if self._gate is None:
            self._gate = asyncio.Semaphore(self._max_in_flight)
        return self._gate

    def count(self, **deltas: int) -> None:
        """Add to what `counters()` reports (reads, misses, errors, refused, bad_replies, ...)."""
        self._counts.update(deltas)

    async def load_slot_map(self) -> None:
        """A cluster's slot map, fetched once (a no-op once known); `node_of` reads it."""
        await self._client.initialize()

    def node_of(self, key: str) -> Any:
        """The cluster node (redis-py's: name, host, port) that owns `key`, by the slot map."""
        return self._client.get_node_from_key(self.stored_key(key))

    @property
    def trips(self) -> int:
        """Times a breaker opened: the tier's (single server) or any node's (cluster)."""
        return self.breaker.trips + sum(b.trips for b in self._node_breakers.values())

    def breakers(self) -> dict[str, CircuitBreaker]:
        """Every breaker by node: the server's `host:port`; in a cluster each node's name seen so far,
        and `cluster` for calls not routed to one node (key listing)."""
        return {("cluster" if self.cluster else self.server): self.breaker, **self._node_breakers}

    def counters(self) -> dict[str, int]:
        """What this process counted (reads, misses, writes, deletes, errors, refused): no call to Redis."""
        return dict(self._counts)

    async def server_memory(self) -> dict[str, tuple[int, int]]:
        """`INFO memory` of each server: node -> (used_memory, maxmemory; 0 = no limit). One cheap call
        per node, never a SCAN; the whole server's memory (the catalog and anything else stored there
        included). Empty while the breaker is open or when the call fails: a scrape never waits on an
        outage or counts as one."""
        if self.breaker.open:
            return {}
        try:
            if self.cluster:
                info = await asyncio.wait_for(self._client.info("memory", target_nodes="primaries"), self.timeout_s)
            else:
                info = {self.server: await asyncio.wait_for(self._client.info("memory"), self.timeout_s)}
        except self.client_errors as exc:
            log.debug("redis INFO memory failed (%s: %s)", type(exc).__name__, exc)
            return {}
        return {node: (int(i.get("used_memory", 0)), int(i.get("maxmemory", 0))) for node, i in info.items()}

    async def _call(self, op: Callable[[], Awaitable[T]], node: str | None = None) -> T:
        """Run one round trip under the timeout and the breaker (of `node` in a cluster); failures
        raise BackendError."""
        breaker = self.breaker_of(node)
        if breaker.open:
            self._counts["errors"] += 1
            raise BackendError(f"redis {node or 'tier'} unavailable (circuit open)")
        try:
            async with self.gate():
                result = await asyncio.wait_for(op(), self.timeout_s)
        except self.client_errors as exc:
            refused = self._refusal(exc)
            if refused is not None:  # the node is up and answered: not a failure of its health
                breaker.success()
                self._counts["refused"] += 1
                raise refused from exc
            breaker.failure()
            self._counts["errors"] += 1
            log.warning("redis call to %s failed (%s: %s)", node or "server", type(exc).__name__, exc)
            raise BackendError(f"redis call failed: {type(exc).__name__}: {exc}") from exc
        breaker.success()
        return result

    async def _pipeline(
        self, build: Callable[[Any], object], node: str | None = None, errors: list[AgentStateError] | None = None
    ) -> list[Any]:
        """One pipelined round trip. A command the server refused (an error reply for that key
        alone) comes back as FAILED, its typed error in `errors`; an outage fails the whole call."""

        async def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            build(pipe)
            results = list(await pipe.execute(raise_on_error=False))
            for i, result in enumerate(results):
                if isinstance(result, BaseException):
                    if self._refusal(result) is None:
                        raise result  # an outage: the breaker hears of it
                    self._counts["refused"] += 1
                    if errors is not None:
                        errors.append(self._refusal(result))  # type: ignore[arg-type]
                    results[i] = FAILED
            return results

        return await self._call(run, node)

    async def _per_key(
        self, keys: Sequence[str], command: Callable[[Any, str], object], errors: list[AgentStateError] | None = None
    ) -> list[Any]:
        """One command per key, pipelined; a key whose call failed comes back as FAILED (and its
        error is appended to `errors`).

        A cluster gets one pipeline per node, all at once, each behind that node's breaker: a dead
        node costs only the keys it holds, and the live nodes keep serving theirs.
        """
        errors = [] if errors is None else errors
        if not self.cluster:
            try:
                return await self._pipeline(lambda p: [command(p, self.stored_key(k)) for k in keys], None, errors)
            except AgentStateError as exc:
                errors.append(exc)
                return [FAILED] * len(keys)
        groups: dict[str, list[int]] = {}
        try:
            await self.load_slot_map()
            for i, key in enumerate(keys):
                groups.setdefault(self.node_of(key).name, []).append(i)
        except self.client_errors:
            groups = {"?": list(range(len(keys)))}  # no slot map: let the client route (and fail) it all
        out: list[Any] = [FAILED] * len(keys)

        async def run(node: str, idx: list[int]) -> None:
            try:
                got = await self._pipeline(lambda p: [command(p, self.stored_key(keys[i])) for i in idx], node, errors)
            except AgentStateError as exc:
                errors.append(exc)
                return
            for i, value in zip(idx, got):
                out[i] = value

        await asyncio.gather(*(run(node, idx) for node, idx in groups.items()))
        return out

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        if self._wire is None or not keys:
            return await self.exists_via_client(keys)
        return await self._wire.exists(keys)

    async def exists_via_client(self, keys: Sequence[str]) -> list[bool]:
        """EXISTS through redis-py: the wire reader's fallback for the keys it cannot settle (MOVED, ...)."""
        got = await self._per_key(keys, lambda p, k: p.exists(k)) if keys else []
        return [v is not FAILED and bool(v) for v in got]  # an unreachable node holds nothing we can use

    async def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        if self._wire is None:
            return await super().get_into(keys, buffers)
        views = [_byte_view(b) for b in buffers]
        if any(v.readonly for v in views):  # a caller's mistake, not an outage of the node
            raise InvalidArgumentError("get_into needs writable buffers")
        return [max(n, 0) for n in await self._wire.read(keys, views)] if keys else []

    async def read(self, keys: Sequence[str], sink: ReadSink) -> list[bool]:
        if not keys:
            return []
        if self._wire is None:
            return await self.read_via_client(keys, sink)
        sinks = [lambda view, i=i: sink(i, view) for i in range(len(keys))]  # type: ignore[misc]
        return [n >= 0 for n in await self._wire.read(keys, sinks)]

    async def read_bounded(self, keys: Sequence[str], sink: ReadSink, limits: Sequence[int]) -> list[bool]:
        """`read`, refusing (as a counted miss, its connection dropped) a reply that declares more than
        `limits[i]` bytes before receiving or allocating any of it: a server's length is not trusted."""
        if len(limits) != len(keys):
            raise InvalidArgumentError("keys and limits differ in length")
        if not keys:
            return []
        if self._wire is None:
            return await self.read_via_client(keys, sink, limits)
        sinks = [lambda view, i=i: sink(i, view) for i in range(len(keys))]  # type: ignore[misc]
        return [n >= 0 for n in await self._wire.read(keys, sinks, limits)]

    async def read_via_client(
        self, keys: Sequence[str], sink: ReadSink, limits: Sequence[int] | None = None
    ) -> list[bool]:
        """Reads through redis-py: whole values as bytes, handed to the sink. With `limits`, each is a
        GETRANGE of at most limit + 1 bytes, so the server sends no more than that (one byte more says
        the value is too long: a miss). A reply that is not a string (a server out of protocol) is a
        counted miss, never handed on."""
        if limits is None:
            values = await self._per_key(keys, lambda p, k: p.get(k))
        else:
            bound = dict(zip(keys, limits))
            values = await self._per_key(keys, lambda p, k: p.getrange(k, 0, bound[k[len(self.prefix) :]]))
        found = [False] * len(keys)
        bad = 0
        for i, value in enumerate(values):
            if value is None or value is FAILED:
                continue
            if not isinstance(value, bytes | bytearray) or (limits is not None and len(value) > limits[i]):
                bad += 1
                continue
            if limits is not None and not value:  # GETRANGE of a missing key: empty (no value is)
                continue
            found[i] = True
            sink(i, memoryview(value))
        if bad:
            self._counts.update(errors=bad, bad_replies=bad)
            log.warning("redis GET: %d replies not a value of their key's size, treated as misses", bad)
        self._counts.update(reads=sum(found), misses=len(keys) - sum(found))
        return found

    async def put(self, keys: Sequence[str], values: Sequence[bytes | bytearray | memoryview]) -> None:
        if not keys:
            return
        if len(keys) != len(values):
            raise InvalidArgumentError("keys and values differ in length")
        if self._writer is None:
            return await self.put_via_client(keys, values)
        views = [_byte_view(v) for v in values]
        errors, doubt = await self._writer.put(keys, views, self.ttl_seconds)
        self._counts["writes"] += sum(e is None for e in errors)
        asked = set(doubt)
        failed = [e for i, e in enumerate(errors) if e is not None and i not in asked]
        if doubt:
            try:
                await self.put_via_client([keys[i] for i in doubt], [views[i] for i in doubt])
            except AgentStateError as exc:
                failed.append(exc)
        if failed:  # the most specific reason: a full store is a CapacityError, not an outage
            raise next((e for e in failed if isinstance(e, CapacityError)), failed[0])

    async def put_via_client(self, keys: Sequence[str], values: Sequence[bytes | bytearray | memoryview]) -> None:
        """SETs through redis-py: the wire writer's fallback (TLS or unusual URLs, MOVED/ASK, a refused
        handshake)."""
        data = dict(zip(keys, values, strict=True))
        errors: list[AgentStateError] = []
        # A view, not a copy: redis-py sends memoryviews as they are; they live until the call returns.
        set_ = lambda p, k: p.set(k, _byte_view(data[k[len(self.prefix) :]]), ex=self.ttl_seconds)
        got = await self._per_key(keys, set_, errors)
        failed = sum(v is FAILED for v in got)
        self._counts["writes"] += len(keys) - failed
        if failed:  # the most specific reason: a full store is a CapacityError, not an outage
            raise next((e for e in errors if isinstance(e, CapacityError)), errors[0])

    async def delete(self, keys: Sequence[str]) -> None:
        if keys:
            got = await self._per_key(keys, lambda p, k: p.delete(k))
            if any(v is FAILED for v in got):
                raise BackendError("redis delete failed")
            self._counts["deletes"] += len(keys)

    async def touch(self, keys: Sequence[str]) -> list[bool]:
        """TOUCH resets each key's idle time (EXISTS does not); a failure raises, since a snapshot
        that cannot confirm a chunk in the shared store must write it again or fail."""
        got = await self._per_key(keys, lambda p, k: p.touch(k)) if keys else []
        if any(v is FAILED for v in got):
            raise BackendError("redis touch failed")
        return [bool(n) for n in got]

    async def delete_idle(self, keys: Sequence[str], idle_seconds: float) -> list[str]:
        idle = str(int(idle_seconds))
        got = await self._per_key(keys, lambda p, k: p.eval(_DELETE_IF_IDLE, 1, k, idle)) if keys else []
        deleted = [k for k, n in zip(keys, got) if n is not FAILED and int(n)]
        self._counts["deletes"] += len(deleted)
        return deleted

    async def keys(self, prefix: str | None = None) -> AsyncIterator[str]:
        pattern = self.stored_key(prefix or "").replace("*", r"\*").replace("?", r"\?").replace("[", r"\[") + "*"
        if self.breaker.open:
            raise BackendError("redis tier unavailable (circuit open)")
        try:
            async for raw in self._client.scan_iter(match=pattern, count=1000):
                key = raw.decode() if isinstance(raw, bytes) else raw
                yield key[len(self.prefix) :]
        except self.client_errors as exc:
            self.breaker.failure()
            self._counts["errors"] += 1
            raise BackendError(f"redis scan failed: {type(exc).__name__}: {exc}") from exc

    async def sizes(self, keys: Sequence[str]) -> list[int]:
        got = await self._per_key(keys, lambda p, k: p.strlen(k)) if keys else []
        return [0 if n is FAILED else int(n) for n in got]

    async def stats(self) -> BackendStats:
        """Counts and value bytes under this backend's prefix (a SCAN: for admin, never for a scrape).
        Only the value namespaces: a shared catalog under the same prefix holds hashes (STRLEN of one is
        WRONGTYPE) and prefix records, which are not this tier's."""
        try:
            keys = [k for ns in value_namespaces() async for k in self.keys(ns)]
        except BackendError:
            keys = []  # unreachable: report the counters we have
        return BackendStats(
            name=self.name, items=len(keys), bytes_used=sum(await self.sizes(keys)), capacity_bytes=None,
            **{k: self._counts[k] for k in ("reads", "writes", "deletes", "misses", "errors")},
        )  # fmt: skip

    async def close(self) -> None:
        if self._wire is not None:
            self._wire.close()
        if self._writer is not None:
            self._writer.close()
        await self._client.aclose()


def from_config(cfg: RedisTier, store: StoreConfig) -> RedisBackend:
    """The Redis tier of a store."""
    return RedisBackend(
        cfg.url, cluster=cfg.cluster, ttl_seconds=cfg.ttl_seconds, prefix=cfg.prefix, timeout_s=cfg.timeout_s,
        breaker_threshold=cfg.breaker_threshold, breaker_cooldown_s=cfg.breaker_cooldown_s,
        connections=cfg.connections,
    )  # fmt: skip
