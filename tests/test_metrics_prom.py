"""/metrics through prometheus_client: families, types and units as Prometheus reads them
(`text_string_to_metric_families`), values that move with real operations, a Redis tier scraped
without a SCAN (a real redis-server: INFO commandstats before and after), breakers, and SGLang's
`get_stats()` through SGLang's own storage factory and metrics collector.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import lmdb
import pytest
import redis
import torch
from prometheus_client.parser import text_string_to_metric_families

from agentstate import StateStore, StoreConfig
from agentstate._version import __version__
from agentstate.client import AsyncClient
from agentstate.config import TierConfig
from agentstate.server.gate import Limits
from agentstate.server.service import create_app
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.redis_server import RedisCluster, RedisServer, free_port
from tests.sglang_child import TORCHVISION_PLACEHOLDER

TOKEN = "metrics-test-token-0123456789"
LIMITS = Limits(handle_secret="metrics-test-handle-secret-0123")
Families = dict[str, Any]

# family -> type, as the parser names them (a counter without its _total)
EXPECTED = {
    "agentstate_build_info": "gauge",
    "agentstate_http_requests": "counter",
    "agentstate_http_request_body_bytes": "counter",
    "agentstate_http_request_duration_seconds": "histogram",
    "agentstate_resume_duration_seconds": "histogram",
    "agentstate_snapshot_duration_seconds": "histogram",
    "agentstate_indexed_keys": "gauge",
    "agentstate_inflight_bytes": "gauge",
    "agentstate_tier_info": "gauge",
    "agentstate_tier_chunks": "gauge",
    "agentstate_tier_bytes_used": "gauge",
    "agentstate_tier_capacity_bytes": "gauge",
    "agentstate_tier_arena_free_bytes": "gauge",
    "agentstate_tier_arena_reused": "counter",
    "agentstate_tier_arena_fresh": "counter",
    "agentstate_lmdb_map_size_bytes": "gauge",
    "agentstate_tier_disk_free_bytes": "gauge",
    "agentstate_remote_memory_used_bytes": "gauge",
    "agentstate_remote_memory_max_bytes": "gauge",
    "agentstate_tier_hits": "counter",
    "agentstate_tier_misses": "counter",
    "agentstate_tier_read_bytes": "counter",
    "agentstate_tier_written_bytes": "counter",
    "agentstate_tier_corrupt_chunks": "counter",
    "agentstate_tier_evictions": "counter",
    "agentstate_tier_promotions": "counter",
    "agentstate_tier_put_errors": "counter",
    "agentstate_tier_errors": "counter",
    "agentstate_prefetch_timeouts": "counter",
    "agentstate_gc_removed_chunks": "counter",
    "agentstate_demotions": "counter",
    "agentstate_cleanup_errors": "counter",
    "agentstate_breaker_state": "gauge",
    "agentstate_breaker_trips": "counter",
}


def parse(text: str) -> Families:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: Families, name: str, suffix: str = "", **labels: str) -> float:
    """The one sample of family `name` (sample name `name + suffix`) whose labels include `labels`."""
    found = [
        s.value for s in families[name].samples
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    ]  # fmt: skip
    assert len(found) == 1, (name, suffix, labels, families[name].samples)
    return float(found[0])


@pytest.fixture
async def app_client(tmp_path: Path) -> AsyncIterator[Any]:
    """(store, SDK client, scrape) over the app in process (ASGI); store reopened by calling again."""
    opened: list[tuple[StateStore, AsyncClient, httpx.AsyncClient]] = []

    async def make(config: StoreConfig) -> tuple[StateStore, AsyncClient, Any]:
        store = await StateStore.open(config, SPEC4)
        transport = httpx.ASGITransport(app=create_app(store, {TOKEN: "alice"}, LIMITS))
        sdk = AsyncClient("http://svc", TOKEN, spec=SPEC4, transport=transport)
        raw = httpx.AsyncClient(base_url="http://svc", transport=transport)
        opened.append((store, sdk, raw))

        async def scrape() -> Families:
            r = await raw.get("/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
            assert "alice" not in r.text  # no label names a tenant
            return parse(r.text)

        return store, sdk, scrape

    yield make
    for store, sdk, raw in opened:
        await raw.aclose()
        await sdk.aclose()
        await store.close()


def local_config(data: Path) -> StoreConfig:
    return StoreConfig(path=data, chunk_tokens=64, lmdb_map_size=64 << 20)


async def test_families_types_units_and_values_that_move(app_client: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    tokens, kv = random_tokens(300), random_kv(SPEC4, 300)  # four chunks and a tail
    store, sdk, scrape = await app_client(local_config(data))
    await sdk.snapshot("s1", tokens, kv)
    fam = await scrape()
    for name, kind in EXPECTED.items():
        assert name in fam and fam[name].type == kind, (name, fam.get(name))
        if "bytes" in name or "seconds" in name:  # units last (one name kept from before, for its readers)
            assert name.endswith(("_bytes", "_seconds")) or name == "agentstate_tier_bytes_used", name
    assert value(fam, "agentstate_build_info", version=__version__) == 1
    assert value(fam, "agentstate_snapshot_duration_seconds", "_count") == 1
    assert value(fam, "agentstate_snapshot_duration_seconds", "_sum") > 0
    assert value(fam, "agentstate_snapshot_duration_seconds", "_bucket", le="+Inf") == 1
    assert value(fam, "agentstate_resume_duration_seconds", "_count") == 0
    assert value(fam, "agentstate_sessions") == 1
    for tier in ("host", "lmdb"):
        assert value(fam, "agentstate_tier_written_bytes", "_total", tier=tier) > 300 * SPEC4.token_bytes
        assert value(fam, "agentstate_tier_chunks", tier=tier) == 5
    assert value(fam, "agentstate_tier_capacity_bytes", tier="host") == store.config.tier_list()[0].capacity_bytes
    assert "lmdb" not in {s.labels["tier"] for s in fam["agentstate_tier_capacity_bytes"].samples}  # no limit set
    assert value(fam, "agentstate_tier_arena_fresh", "_total", tier="host") >= 4  # four chunks into fresh memory
    assert value(fam, "agentstate_tier_arena_reused", "_total", tier="host") == 0  # nothing dropped yet to reuse
    assert value(fam, "agentstate_tier_arena_free_bytes", tier="host") == 0
    assert "lmdb" not in {s.labels["tier"] for s in fam["agentstate_tier_arena_free_bytes"].samples}
    assert value(fam, "agentstate_lmdb_map_size_bytes", tier="lmdb") == 64 << 20  # labelled as what it is
    assert value(fam, "agentstate_tier_bytes_used", tier="lmdb") > 0
    assert value(fam, "agentstate_tier_disk_free_bytes", tier="lmdb") > 0
    assert value(fam, "agentstate_tier_info", tier="lmdb", kind="lmdb", record="true") == 1
    assert not fam["agentstate_breaker_state"].samples  # no remote tier
    manifest = await store.for_tenant("alice").session("s1")
    await store.close()

    # One chunk damaged in LMDB; a fresh process (empty host tier) resumes from LMDB.
    damaged = manifest.chunk_keys[2]
    with lmdb.open(str(data / "chunks")) as env, env.begin(write=True) as txn:
        stored = txn.get(damaged.encode())
        assert stored is not None
        raw = bytearray(stored)
        raw[-1] ^= 0x40
        txn.put(damaged.encode(), bytes(raw))
    store, sdk, scrape = await app_client(local_config(data))
    got = await sdk.resume("s1")
    assert got.restored_tokens == 128 and bits_equal(got.kv, kv[:, :, :128])
    await store.chunks.flush()  # promotions run in the background
    fam = await scrape()
    assert value(fam, "agentstate_resume_duration_seconds", "_count") == 1
    assert value(fam, "agentstate_tier_corrupt_chunks", "_total", tier="lmdb") == 1
    assert value(fam, "agentstate_tier_corrupt_chunks", "_total", tier="host") == 0
    lmdb_hits = value(fam, "agentstate_tier_hits", "_total", tier="lmdb")
    assert lmdb_hits >= 2 and value(fam, "agentstate_tier_hits", "_total", tier="host") == 0
    assert value(fam, "agentstate_tier_misses", "_total", tier="host") == lmdb_hits + 1  # +1: the damaged one
    assert value(fam, "agentstate_tier_misses", "_total", tier="lmdb") == 1
    chunk_bytes = len(raw)
    assert value(fam, "agentstate_tier_read_bytes", "_total", tier="lmdb") >= 2 * chunk_bytes
    assert value(fam, "agentstate_tier_read_bytes", "_total", tier="host") == 0
    promoted = value(fam, "agentstate_tier_promotions", "_total", tier="host")
    assert promoted == lmdb_hits

    # The next resume is served by the host tier it was promoted into.
    await sdk.resume("s1")
    fam = await scrape()
    assert value(fam, "agentstate_tier_hits", "_total", tier="host") == promoted
    assert value(fam, "agentstate_tier_read_bytes", "_total", tier="host") >= 2 * chunk_bytes
    assert value(fam, "agentstate_resume_duration_seconds", "_count") == 2
    assert value(fam, "agentstate_http_requests", "_total", method="POST", route="/v1/sessions/{session_id}/resume",
                 status="200") == 2  # fmt: skip


async def test_prefetch_timeouts_gc_removals_and_evictions_are_counted(app_client: Any, tmp_path: Path) -> None:
    store, _, scrape = await app_client(local_config(tmp_path / "data"))
    tokens, kv = random_tokens(256, seed=1), random_kv(SPEC4, 256, seed=1)
    await store.put_prefix(tokens, kv)
    evicted = await store.chunks.evict("host", budget_bytes=0)
    assert evicted.evicted == 4

    lmdb_tier = store.chunks.backend("lmdb")
    release = asyncio.Event()
    read = lmdb_tier.read

    async def slow_read(keys: Any, sink: Any) -> list[bool]:
        await release.wait()
        return await read(keys, sink)

    lmdb_tier.read = slow_read  # type: ignore[method-assign]
    handle = await store.prefetch(tokens)
    into = torch.zeros(SPEC4.kv_shape(256), dtype=SPEC4.torch_dtype)
    loaded = await store.load(tokens, into, policy="timeout", timeout=0.05, prefetch=handle)
    assert loaded == 0
    release.set()
    await handle.wait()
    lmdb_tier.read = read  # type: ignore[method-assign]

    leftovers = [f"c/{store.fingerprint}/{i:064x}" for i in range(3)]  # a crash's: stored, named by nothing
    with store.chunks.pinned(leftovers):
        await store.chunks.write(leftovers, [kv[:, :, :64]] * 3, durable=True)
    assert await store.gc() == 3
    fam = await scrape()
    assert value(fam, "agentstate_prefetch_timeouts", "_total") == 1
    assert value(fam, "agentstate_gc_removed_chunks", "_total") == 3
    assert value(fam, "agentstate_tier_evictions", "_total", tier="host") == 4


async def test_scrapes_of_a_redis_tier_issue_no_scan(
    app_client: Any, tmp_path: Path, redis_server: RedisServer
) -> None:
    """Remote tier and shared catalog under one prefix, as the defaults have it (`agentstate:`)."""
    prefix = f"agentstate-{uuid.uuid4().hex[:8]}:"
    config = StoreConfig(
        path=tmp_path / "data", chunk_tokens=64, lmdb_map_size=64 << 20, catalog_url=redis_server.url,
        catalog_prefix=prefix, tiers=[TierConfig(kind="host"), TierConfig(kind="lmdb"),
                                      TierConfig(kind="redis", url=redis_server.url, prefix=prefix)],
    )  # fmt: skip
    store, sdk, scrape = await app_client(config)
    await sdk.snapshot("r1", random_tokens(300, seed=2), random_kv(SPEC4, 300, seed=2))
    await sdk.resume("r1")
    admin = redis.Redis.from_url(redis_server.url)

    def scans() -> int:
        return int(admin.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))

    before = scans()
    for _ in range(4):
        fam = await scrape()
    assert scans() == before
    node = f"127.0.0.1:{redis_server.port}"
    assert value(fam, "agentstate_breaker_state", tier="redis", node=node, state="closed") == 1
    assert value(fam, "agentstate_breaker_state", tier="redis", node=node, state="open") == 0
    assert value(fam, "agentstate_breaker_trips", "_total", tier="redis", node=node) == 0
    assert value(fam, "agentstate_remote_memory_used_bytes", tier="redis", node=node) > 0
    assert value(fam, "agentstate_remote_memory_max_bytes", tier="redis", node=node) >= 0
    assert value(fam, "agentstate_tier_written_bytes", "_total", tier="redis") > 300 * SPEC4.token_bytes
    assert "agentstate_sessions" not in fam  # counting a shared catalog's sessions is a SCAN
    assert "redis" not in {s.labels["tier"] for s in fam["agentstate_tier_bytes_used"].samples}

    # The admin figures (a SCAN, on request only) count the tier's values, not the catalog's hash and
    # prefix records under the same prefix (STRLEN of the hash was a WRONGTYPE on every call).
    assert admin.type(f"{prefix}m/alice/r1") == b"hash"
    stats = await store.chunks.backend("redis").stats()
    assert stats.items == 5 and stats.bytes_used == sum(admin.strlen(k) for k in admin.scan_iter(f"{prefix}[ct]/*"))
    admin.close()


async def test_breaker_state_and_trips_of_a_dead_node(app_client: Any, tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    dead = TierConfig(kind="redis", url=url, timeout_s=0.5, breaker_threshold=1, breaker_cooldown_s=60)
    config = StoreConfig(path=tmp_path / "data", chunk_tokens=64, lmdb_map_size=64 << 20,
                         tiers=[TierConfig(kind="host"), TierConfig(kind="lmdb"), dead])  # fmt: skip
    _, sdk, scrape = await app_client(config)
    await sdk.snapshot("d1", random_tokens(130, seed=5), random_kv(SPEC4, 130, seed=5))  # the remote put fails, skipped
    fam = await scrape()
    node = url.removeprefix("redis://").removesuffix("/0")
    assert value(fam, "agentstate_breaker_state", tier="redis", node=node, state="open") == 1
    assert value(fam, "agentstate_breaker_state", tier="redis", node=node, state="closed") == 0
    assert value(fam, "agentstate_breaker_trips", "_total", tier="redis", node=node) == 1
    assert value(fam, "agentstate_tier_put_errors", "_total", tier="redis") == 1
    assert value(fam, "agentstate_tier_errors", "_total", tier="redis") >= 1
    assert not fam["agentstate_remote_memory_used_bytes"].samples  # an open breaker: the scrape does not wait


CHILD = TORCHVISION_PLACEHOLDER + r"""
import torch
try:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.observability.metrics_collector import StorageMetrics, StorageMetricsCollector
except ModuleNotFoundError as exc:
    print("SKIP " + json.dumps(exc.name)); sys.exit(0)
from prometheus_client import REGISTRY, generate_latest
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
path, extra = sys.argv[1], json.loads(sys.argv[2])
device = MHATokenToKVPool(size=64, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=16, layer_num=3, device="cpu",
                          enable_memory_saver=False, enable_alt_stream=False)
host = MHATokenToKVPoolHost(device._mha_buffer_info(), layout="layer_first", host_to_device_ratio=2.0, host_size=0,
                            page_size=4, pin_memory=False, device="cpu", device_capacity_tokens=64, start_layer=0, end_layer=3)
cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                           enable_storage_metrics=True, is_page_first_layout=False, model_name="test/metrics",
                           extra_config={**extra, "path": path})
backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
backend.register_mem_pool_host(host)
idx = host.alloc(24)
keys = ["k0", "k1", "k2"]
out = {"set": backend.batch_set_v1(keys, idx[:12]), "again": backend.batch_set_v1(keys, idx[:12]),
       "get": backend.batch_get_v1(keys + ["gap"], idx[8:24])}
stats = backend.get_stats()
out["type"] = type(stats).__name__
out["is_sglangs"] = isinstance(stats, StorageMetrics)
out["stats"] = {k: getattr(stats, k) for k in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")}
out["drained"] = backend.get_stats().prefetch_pgs
StorageMetricsCollector(labels={"model_name": "test/metrics"}).log_storage_metrics(stats)  # SGLang's own path
out["exposed"] = generate_latest(REGISTRY).decode()
backend.close()
print("RESULT " + json.dumps(out))
"""


def test_sglang_get_stats_through_its_factory_and_collector(tmp_path: Path) -> None:
    """SGLang's storage factory builds the adapter over SGLang's real host pool (CPU, subprocess: the pool's
    and the metrics collector's modules need a torchvision placeholder, see tests/test_adapter_sglang.py)."""
    pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")
    root = Path(__file__).resolve().parent.parent
    extra = {"backend_name": "agentstate", "module_path": "agentstate.adapters.sglang", "class_name": "AgentStateStorage",
             "interface_v1": 1, "lmdb_map_size": 64 << 20, "host_capacity_bytes": 64 << 20}  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "kv"), json.dumps(extra)], check=False, cwd=root,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    lines = proc.stdout.splitlines()
    if lines and lines[-1].startswith("SKIP "):
        from tests.requires import skip_or_fail

        skip_or_fail(f"SGLang's host pool or metrics module needs {json.loads(lines[-1][5:])!r}")
    assert proc.returncode == 0 and lines and lines[-1].startswith("RESULT "), proc.stderr[-4000:]
    out = json.loads(lines[-1][7:])
    assert out["set"] == [True] * 3 and out["again"] == [True] * 3 and out["get"] == [True] * 3 + [False]
    assert out["is_sglangs"], out["type"]
    stats = out["stats"]
    assert stats["backup_pgs"] == [3]  # the second set wrote nothing new: no backup figure
    assert stats["prefetch_pgs"] == [4]  # pages asked, the missing one included
    assert len(stats["backup_bandwidth"]) == 1 and stats["backup_bandwidth"][0] > 0
    assert len(stats["prefetch_bandwidth"]) == 1 and stats["prefetch_bandwidth"][0] > 0
    assert out["drained"] == []
    fam = parse(out["exposed"])
    assert value(fam, "sglang:prefetch_pgs", "_count", model_name="test/metrics") == 1
    assert value(fam, "sglang:prefetch_pgs", "_sum", model_name="test/metrics") == 4
    assert value(fam, "sglang:backup_pgs", "_sum", model_name="test/metrics") == 3
    assert value(fam, "sglang:backup_bandwidth", "_count", model_name="test/metrics") == 1


MULTIPROC_CHILD = r"""
import asyncio, sys
import httpx
from agentstate import StateStore, StoreConfig
from agentstate.server.gate import Limits
from agentstate.server.service import create_app
from tests.conftest import SPEC4

async def main(path):
    async with StateStore.open(StoreConfig(path=path, chunk_tokens=64, lmdb_map_size=64 << 20), SPEC4) as store:
        app = create_app(store, {"t" * 24: "alice"}, Limits(handle_secret="metrics-test-handle-secret-0123"))
        async with httpx.AsyncClient(base_url="http://svc", transport=httpx.ASGITransport(app=app)) as c:
            assert (await c.get("/healthz")).status_code == 200
            print((await c.get("/metrics")).text)

asyncio.run(main(sys.argv[1]))
"""


def test_multiprocess_dir_is_honoured(tmp_path: Path) -> None:
    """With PROMETHEUS_MULTIPROC_DIR set, request metrics are written there and read back by prometheus_client's
    MultiProcessCollector; the store collector (live figures of this process) is exported beside them."""
    root = Path(__file__).resolve().parent.parent
    multiproc = tmp_path / "prom"
    multiproc.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", MULTIPROC_CHILD, str(tmp_path / "data")], check=False, cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert any(multiproc.glob("counter_*.db")) and any(multiproc.glob("histogram_*.db"))
    fam = parse(proc.stdout)
    assert value(fam, "agentstate_http_requests", "_total", method="GET", route="/healthz", status="200") == 1
    assert fam["agentstate_resume_duration_seconds"].type == "histogram"
    assert value(fam, "agentstate_tier_chunks", tier="lmdb") == 0 and value(fam, "agentstate_sessions") == 0


async def test_a_redis_cluster_tier_is_reported_per_node_without_scan(
    app_client: Any, tmp_path: Path, redis_cluster: RedisCluster
) -> None:
    tier = TierConfig(
        kind="redis", url=redis_cluster.url, cluster=True, prefix="metrics-cluster:"
    )  # fixed: the slots are too
    config = StoreConfig(path=tmp_path / "data", chunk_tokens=64, lmdb_map_size=64 << 20,
                         tiers=[TierConfig(kind="host"), TierConfig(kind="lmdb"), tier])  # fmt: skip
    _, sdk, scrape = await app_client(config)
    await sdk.snapshot("c1", random_tokens(700, seed=6), random_kv(SPEC4, 700, seed=6))  # chunks on every node
    admins = [redis.Redis(port=n.port) for n in redis_cluster.nodes]

    def scans() -> list[int]:
        return [int(a.info("commandstats").get("cmdstat_scan", {}).get("calls", 0)) for a in admins]

    before = scans()
    fam = await scrape()
    assert scans() == before
    nodes = {f"127.0.0.1:{n.port}" for n in redis_cluster.nodes}
    assert {s.labels["node"] for s in fam["agentstate_remote_memory_used_bytes"].samples} == nodes
    breakers = {s.labels["node"] for s in fam["agentstate_breaker_trips"].samples}
    assert breakers == nodes | {"cluster"}  # every node written to, and the cluster-wide one (key listing)
    for a in admins:
        a.close()
