"""The service's Prometheus metrics, through `prometheus_client`: requests and latencies, and the
store's tiers, counters and breakers.

Each app has its own `CollectorRegistry` (a process may hold several apps: tests do). Request
metrics are prometheus_client counters and histograms; the store's figures come from one custom
collector that reads, at scrape time, what the chunk layer counts in memory. Nothing a scrape does
lists a store: local tiers answer from their own bookkeeping (LMDB: one `stat`), a Redis tier gives
its breakers and counters from memory and one `INFO memory` per server, and the sessions gauge is
left out when the catalog is shared (counting it would SCAN Redis).

Processes: `agentstate serve` is one process (it holds the data directory's lock), so the store
collector is per process by nature: its gauges are live readings of one store. With
`PROMETHEUS_MULTIPROC_DIR` set, the request metrics go to prometheus_client's multiprocess files
and /metrics aggregates that directory (`MultiProcessCollector`), plus this process's store
collector. (prometheus_client reads the variable when it is first imported.)

Labels are bounded: a route is its template (`/v1/sessions/{session_id}`), never a concrete path,
a tier is its configured name, a node a Redis `host:port`, so /metrics does not grow with traffic.

Per-tenant accounting (`agentstate_tenant_*_total{tenant=...}`: tokens read, written, deduped and
recomputed, bytes written, bytes read per tier, resumes, snapshots, loads, hints) comes from the
store's `usage_log.totals` at scrape time: everything this process counted since it started, so
they are counters that restart at zero with the process, like every other one here (the exact,
persistent figures are `GET /v1/usage`). A tenant label is bounded by the service's token table.
These families name tenants, so they are only exported when /metrics itself needs a token
(`Limits.metrics_token`), or when the app is made with `tenant_metrics=True`: an open /metrics
never lists who uses the service.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from agentstate._version import __version__
from agentstate.backends.base import BackendStats
from agentstate.chunks.store import BreakerInfo, TierInfo
from agentstate.store import StateStore

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""What `generate_latest` writes (Prometheus 2 and 3 both read it)."""
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BREAKER_STATES = ("closed", "open", "half_open")
_TIER_COUNTERS = {  # chunk-layer counter -> (family, help)
    "hits": ("agentstate_tier_hits", "Chunks a tier served intact to a read."),
    "misses": (
        "agentstate_tier_misses",
        (
            "Chunks a read asked of a tier, no faster tier having served them, that it did not serve (not held,"
            " absent or corrupt); hits / (hits + misses) is the tier's hit rate."
        ),
    ),
    "read_bytes": ("agentstate_tier_read_bytes", "Bytes of the chunks a tier served."),
    "written_bytes": (
        "agentstate_tier_written_bytes",
        "Bytes this process stored into a tier (stores, promotions, demotions).",
    ),
    "corrupt": (
        "agentstate_tier_corrupt_chunks",
        "Chunks of a tier that failed their checks (dropped, read as misses).",
    ),
    "evictions": ("agentstate_tier_evictions", "Chunks evicted from a cache tier by the chunk layer."),
    "promotions": ("agentstate_tier_promotions", "Chunks promoted into a tier after a read from a slower one."),
    "put_errors": (
        "agentstate_tier_put_errors",
        "Failed writes to a cache or remote tier (skipped; the chunk is simply not there).",
    ),
}
_TENANT_COUNTERS = {  # usage counter (agentstate.usage) -> (family, help)
    "tokens_read": ("agentstate_tenant_tokens_read", "Tokens of a tenant served from the cache (resumes, loads)."),
    "tokens_written": (
        "agentstate_tenant_tokens_written",
        "Tokens of a tenant whose KV was stored (new chunks and tails; what dedupe skipped is not counted).",
    ),
    "tokens_deduped": (
        "agentstate_tenant_tokens_deduped",
        "Tokens of a tenant's snapshots and prefixes not stored again: the chunks were held already.",
    ),
    "tokens_recomputed": (
        "agentstate_tenant_tokens_recomputed",
        "Tokens a tenant's resumes and loads asked for that the cache did not serve (the engine computes them).",
    ),
    "bytes_written": ("agentstate_tenant_bytes_written", "Stored bytes written for a tenant (chunks and tails)."),
    "resumes": ("agentstate_tenant_resumes", "Session resumes of a tenant."),
    "snapshots": ("agentstate_tenant_snapshots", "Session snapshots of a tenant."),
    "loads": ("agentstate_tenant_loads", "Prefix loads of a tenant."),
    "hints": ("agentstate_tenant_hints", "Agent hints (paused, resuming, done) of a tenant."),
}
_TENANT_BYTES_READ = (
    "agentstate_tenant_bytes_read",
    "Stored bytes read for a tenant, per tier that served them.",
)
_STORE_COUNTERS = {  # chunk-layer counter -> (family, help)
    "prefetch_timeouts": (
        "agentstate_prefetch_timeouts",
        "Loads whose prefetch had not finished by its deadline (best_effort, timeout): the rest was reported not loaded.",
    ),
    "gc_removed": ("agentstate_gc_removed_chunks", "Chunks and tails gc removed (unreferenced)."),
    "demotions": ("agentstate_demotions", "Chunks written down to a slower tier before their eviction."),
    "cleanup_errors": ("agentstate_cleanup_errors", "Failed deletes of chunks a read found bad (retried later)."),
    "scratch_reused": (
        "agentstate_scratch_reused",
        "Encodes written into the buffer of an earlier value a copying tier (LMDB, files, Redis) had stored.",
    ),
    "scratch_fresh": ("agentstate_scratch_fresh", "Encodes that found no such buffer of their size: fresh memory."),
    "layout_conversions": (
        "agentstate_layout_conversions",
        "Chunks stored in an engine's own layout (vLLM's CPU blocks) converted to canonical KV for another reader.",
    ),
    "chunks_resliced": (
        "agentstate_chunks_resliced",
        "Chunks another TP size stored, read and kept under this rank's slice of heads (agentstate.slices).",
    ),
    "kv_events_published": ("agentstate_kv_events_published", "KV events (kv_events) published for routers."),
    "kv_events_dropped": (
        "agentstate_kv_events_dropped",
        "KV events replaced by one AllBlocksCleared because more than max_queue_size waited.",
    ),
    "kv_chunks_forgotten": (
        "agentstate_kv_chunks_forgotten",
        "Chunks announced removed to routers because more than max_tracked_chunks were tracked.",
    ),
}


@dataclass
class StoreFigures:
    """What one scrape reads of the store (gathered before the text is written, since that is sync)."""

    sessions: int | None
    indexed_keys: int
    tiers: list[TierInfo]
    tier_counts: dict[str, dict[str, int]]
    counters: dict[str, int]
    breakers: list[BreakerInfo]
    local: dict[str, BackendStats] = field(default_factory=dict)
    remote_errors: dict[str, int] = field(default_factory=dict)
    lmdb_map: dict[str, int] = field(default_factory=dict)
    lmdb_limit: dict[str, int] = field(default_factory=dict)
    disk_free: dict[str, int] = field(default_factory=dict)
    server_memory: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    inflight_bytes: int = 0
    tenants: dict[str, dict[str, int]] | None = None
    """per tenant, this process's usage counts (None: tenant metrics are not exported)"""


async def gather(store: StateStore, inflight_bytes: int = 0, *, tenants: bool = False) -> StoreFigures:
    """Read the store's figures without listing any tier (see the module doc); `tenants`: the
    per-tenant usage counts too (from memory)."""
    chunks = store.chunks
    figures = StoreFigures(
        sessions=None if store.catalog.shared else await store.catalog.session_count(),
        indexed_keys=len(chunks), tiers=chunks.tier_info(), tier_counts=chunks.tier_counters(),
        counters=chunks.counters(), breakers=chunks.breakers(), inflight_bytes=inflight_bytes,
        tenants={t: dict(c) for t, c in store.usage_log.totals.items()} if tenants else None,
    )  # fmt: skip
    for info in figures.tiers:
        backend = chunks.backend(info.name)
        if info.remote:
            if (counters := backend.counters()) is not None:
                figures.remote_errors[info.name] = int(counters.get("errors", 0))
            figures.server_memory[info.name] = await backend.server_memory()
            continue
        stats = figures.local[info.name] = await backend.stats()
        if info.kind == "lmdb":  # stats' capacity is the hard limit when one is set, else the current map
            limit = backend.limit_bytes
            (figures.lmdb_limit if limit else figures.lmdb_map)[info.name] = int(stats.capacity_bytes or 0)
        root = backend.location
        if info.durable and root is not None:
            try:
                st = os.statvfs(root)
            except OSError:
                continue
            figures.disk_free[info.name] = st.f_bavail * st.f_frsize
    return figures


class Metrics:
    """The registry of one app: request metrics fed by the Gate middleware, session latencies fed by
    the routes, and the store collector (with the per-tenant usage counters when `tenants`)."""

    def __init__(self, *, tenants: bool = False) -> None:
        self.tenants = tenants
        self.registry = CollectorRegistry()
        # prometheus_client picks file-backed values when it is imported with PROMETHEUS_MULTIPROC_DIR set.
        multiproc = values.ValueClass is not values.MutexValue
        reg = None if multiproc else self.registry  # multiprocess: values live in files, read by the collector
        self.requests = Counter("agentstate_http_requests", "HTTP requests answered.", ["method", "route", "status"],
                                registry=reg)  # fmt: skip
        self.body_bytes = Counter("agentstate_http_request_body_bytes", "Request body bytes received.", ["route"],
                                  registry=reg)  # fmt: skip
        self.latency = Histogram("agentstate_http_request_duration_seconds", "Time to answer a request.",
                                 ["method", "route"], buckets=BUCKETS, registry=reg)  # fmt: skip
        self.resume_seconds = Histogram("agentstate_resume_duration_seconds", "Time a successful resume took to "
                                        "restore a session's KV from the tiers.", buckets=BUCKETS, registry=reg)  # fmt: skip
        self.snapshot_seconds = Histogram("agentstate_snapshot_duration_seconds", "Time a successful snapshot took to "
                                          "store a session durably (chunks, tail, manifest).", buckets=BUCKETS,
                                          registry=reg)  # fmt: skip
        if multiproc:
            MultiProcessCollector(self.registry)
        self._store = StoreCollector()
        self.registry.register(self._store)

    def observe(self, method: str, route: str, status: int, seconds: float, received: int) -> None:
        self.requests.labels(method, route, str(status)).inc()
        if received:
            self.body_bytes.labels(route).inc(received)
        else:
            self.body_bytes.labels(route)  # the series exists from the first request
        self.latency.labels(method, route).observe(seconds)

    @staticmethod
    def timer() -> Callable[[], float]:
        """Seconds since this call (for observing only what succeeded)."""
        start = time.perf_counter()
        return lambda: time.perf_counter() - start

    async def render(self, store: StateStore, inflight_bytes: int = 0) -> bytes:
        figures = await gather(store, inflight_bytes, tenants=self.tenants)
        self._store.figures = figures  # no await from here on: a concurrent scrape cannot interleave
        return generate_latest(self.registry)


class StoreCollector(Collector):
    """The store's figures as metric families, from the last `gather` (per process; see module doc)."""

    def __init__(self) -> None:
        self.figures: StoreFigures | None = None

    def collect(self) -> Iterator[Metric]:
        build = GaugeMetricFamily("agentstate_build_info", "agentstate's version (value 1).",
                                  labels=["version", "python"])  # fmt: skip
        build.add_metric([__version__, platform.python_version()], 1)
        yield build
        f = self.figures
        if f is None:
            return
        if f.sessions is not None:
            yield GaugeMetricFamily("agentstate_sessions", "Sessions in the local catalog, all tenants (not exported "
                                    "with a shared catalog: counting it would scan Redis).", value=f.sessions)  # fmt: skip
        yield GaugeMetricFamily("agentstate_indexed_keys", "Chunk and tail keys in the in-memory index.",
                                value=f.indexed_keys)  # fmt: skip
        yield GaugeMetricFamily("agentstate_inflight_bytes", "KV bytes requests in flight hold of the service's "
                                "budget (max_inflight_bytes).", value=f.inflight_bytes)  # fmt: skip
        yield from self._tiers(f)
        yield from self._counters(f)
        yield from self._breakers(f)
        if f.tenants is not None:
            yield from self._tenants(f.tenants)

    @staticmethod
    def _tiers(f: StoreFigures) -> Iterator[Metric]:
        tier = ["tier"]
        info = GaugeMetricFamily("agentstate_tier_info", "A configured tier (value 1).",
                                 labels=["tier", "kind", "durable", "remote", "record"])  # fmt: skip
        chunks = GaugeMetricFamily("agentstate_tier_chunks", "Chunks a tier holds: what a local durable tier (LMDB, "
                                   "files) stores, as its backend counts it; a cache tier's as accounted; a remote tier's,"
                                   " those this process wrote or found there (not the store's total).", labels=tier)  # fmt: skip
        used = GaugeMetricFamily("agentstate_tier_bytes_used", "Bytes a local tier stores: value bytes of a capacity-"
                                 "managed tier (host, device, file), pages in use of LMDB plus its value log's segment files. Remote tiers: see "
                                 "agentstate_tier_written_bytes_total and agentstate_remote_memory_*.", labels=tier)  # fmt: skip
        capacity = GaugeMetricFamily("agentstate_tier_capacity_bytes", "Configured capacity: capacity_bytes of a "
                                     "host, device or file tier; lmdb_max_map_size of LMDB when set.", labels=tier)  # fmt: skip
        for t in f.tiers:
            info.add_metric([t.name, t.kind, str(t.durable).lower(), str(t.remote).lower(), str(t.record).lower()], 1)
            chunks.add_metric([t.name], f.local[t.name].items if t.lazy and t.name in f.local else t.chunks)
            if t.name in f.local:
                used.add_metric([t.name], t.used_bytes if t.capacity_bytes is not None else f.local[t.name].bytes_used)
            if t.capacity_bytes is not None:
                capacity.add_metric([t.name], t.capacity_bytes)
            elif t.name in f.lmdb_limit:
                capacity.add_metric([t.name], f.lmdb_limit[t.name])
        yield from (info, chunks, used, capacity)
        arena = GaugeMetricFamily("agentstate_tier_arena_free_bytes", "Host tier: touched buffers of dropped values"
                                  " kept for reuse (at most host_arena_bytes), process memory on top of"
                                  " agentstate_tier_bytes_used.",
                                  labels=tier)  # fmt: skip
        reused = CounterMetricFamily("agentstate_tier_arena_reused", "Host tier: values written into a reused buffer"
                                     " instead of fresh memory.", labels=tier)  # fmt: skip
        fresh = CounterMetricFamily("agentstate_tier_arena_fresh", "Host tier: values written into fresh memory (no"
                                    " free buffer of their size).", labels=tier)  # fmt: skip
        for t in f.tiers:
            if t.kind == "host" and t.name in f.local:
                arena.add_metric([t.name], f.local[t.name].arena_free_bytes)
                reused.add_metric([t.name], f.local[t.name].arena_reused)
                fresh.add_metric([t.name], f.local[t.name].arena_fresh)
        yield from (arena, reused, fresh)
        yield _gauges("agentstate_lmdb_map_size_bytes", "LMDB's current map size where no lmdb_max_map_size is set: "
                      "address space, not a capacity (the map doubles when full; the disk is the limit).", f.lmdb_map)  # fmt: skip
        yield _gauges("agentstate_tier_disk_free_bytes", "Free bytes of the filesystem under a local durable tier.",
                      f.disk_free)  # fmt: skip
        node = ["tier", "node"]
        mem_used = GaugeMetricFamily("agentstate_remote_memory_used_bytes", "used_memory of a remote tier's Redis "
                                     "server (INFO memory): the whole server's, whoever stored it.", labels=node)  # fmt: skip
        mem_max = GaugeMetricFamily("agentstate_remote_memory_max_bytes", "maxmemory of a remote tier's Redis server "
                                    "(0: no limit).", labels=node)  # fmt: skip
        for name, nodes in f.server_memory.items():
            for n, (u, m) in sorted(nodes.items()):
                mem_used.add_metric([name, n], u)
                mem_max.add_metric([name, n], m)
        yield from (mem_used, mem_max)

    @staticmethod
    def _counters(f: StoreFigures) -> Iterator[Metric]:
        for what, (name, help_text) in _TIER_COUNTERS.items():
            family = CounterMetricFamily(name, help_text, labels=["tier"])
            for t in f.tiers:
                family.add_metric([t.name], f.tier_counts.get(t.name, {}).get(what, 0))
            yield family
        errors = CounterMetricFamily("agentstate_tier_errors", "Failed backend calls of a tier (outages, timeouts, "
                                     "open breaker).", labels=["tier"])  # fmt: skip
        for t in f.tiers:
            if t.name in f.local:
                errors.add_metric([t.name], f.local[t.name].errors)
            elif t.name in f.remote_errors:
                errors.add_metric([t.name], f.remote_errors[t.name])
        yield errors
        for key, (name, help_text) in _STORE_COUNTERS.items():
            yield CounterMetricFamily(name, help_text, value=f.counters.get(key, 0))

    @staticmethod
    def _tenants(totals: dict[str, dict[str, int]]) -> Iterator[Metric]:
        for what, (name, help_text) in _TENANT_COUNTERS.items():
            family = CounterMetricFamily(name, help_text, labels=["tenant"])
            for tenant, counts in sorted(totals.items()):
                family.add_metric([tenant], counts.get(what, 0))
            yield family
        read = CounterMetricFamily(*_TENANT_BYTES_READ, labels=["tenant", "tier"])
        for tenant, counts in sorted(totals.items()):
            for key, n in sorted(counts.items()):
                if key.startswith("bytes_read:"):
                    read.add_metric([tenant, key.split(":", 1)[1]], n)
        yield read

    @staticmethod
    def _breakers(f: StoreFigures) -> Iterator[Metric]:
        node = ["tier", "node"]
        state = GaugeMetricFamily("agentstate_breaker_state", "Circuit breaker of a remote tier's node: 1 for its "
                                  "current state (closed, open, half_open).", labels=[*node, "state"])  # fmt: skip
        trips = CounterMetricFamily("agentstate_breaker_trips", "Times a remote node's circuit breaker opened.",
                                    labels=node)  # fmt: skip
        for b in f.breakers:
            for s in BREAKER_STATES:
                state.add_metric([b.tier, b.node, s], int(b.state == s))
            trips.add_metric([b.tier, b.node], b.trips)
        yield from (state, trips)


def _gauges(name: str, help_text: str, by_tier: dict[str, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=["tier"])
    for tier, value in sorted(by_tier.items()):
        family.add_metric([tier], value)
    return family
