"""Redis tier against a real redis-server on loopback: outages become misses, the breaker trips and heals."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from agentstate.backends.redis import CircuitBreaker, RedisBackend

from agentstate.errors import AgentStateError, BackendError
from tests.redis_server import RedisServer


async def test_outage_turns_into_misses_and_the_breaker_opens_then_closes(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    b = RedisBackend(server.url, timeout_s=0.5, breaker_threshold=2, breaker_cooldown_s=0.3)
    value = os.urandom(100_000)
    await b.put(["c/a"], [value])
    try:
        server.stop()
        got: list[bytes] = []
        assert await b.read(["c/a"], lambda i, v: got.append(bytes(v))) == [False]  # a miss, not an exception
        assert await b.exists(["c/a"]) == [False]
        assert b.breaker.open and b.breaker.trips == 1
        with pytest.raises(BackendError) as err:
            await b.put(["c/b"], [b"x"])
        assert isinstance(err.value, AgentStateError) and err.value.retryable
        server.start()  # same port, empty (no persistence): the tier comes back, as a cache would
        await asyncio.sleep(0.35)
        assert await b.exists(["c/a"]) == [False] and not b.breaker.open
        await b.put(["c/a"], [value])
        assert await b.read(["c/a"], lambda i, v: got.append(bytes(v))) == [True] and got == [value]
        assert (await b.stats()).errors >= 3
    finally:
        await b.close()
        server.stop()


async def test_dropped_connections_are_retried_and_refusals_are_typed_not_retried(tmp_path: Path) -> None:
    import redis.asyncio as aioredis

    from agentstate.errors import CapacityError

    server = RedisServer(tmp_path)
    server.extra = ["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"]
    server.start()
    b = RedisBackend(server.url, timeout_s=2.0, breaker_threshold=1)
    admin = aioredis.Redis.from_url(server.url)
    try:
        value = os.urandom(100_000)
        await b.put(["c/a"], [value])
        await admin.client_kill_filter(_type="normal", skipme=True)  # every pooled connection of b is dead
        got: list[bytes] = []
        assert await b.read(["c/a"], lambda i, v: got.append(bytes(v))) == [True] and got == [value]
        assert b.trips == 0  # retried inside the call: no failure seen
        await admin.execute_command("LPUSH", "agentstate:c/list", "x")  # a key of the wrong type
        with pytest.raises(CapacityError) as err:  # OOM reply: the store is full, retrying cannot help
            await b.put([f"c/big{i}" for i in range(8)], [os.urandom(1 << 20) for _ in range(8)])
        assert not err.value.retryable and b.trips == 0  # an answer, not an outage
        assert await b.read(["c/list", "c/a"], lambda i, v: None) == [False, True]  # WRONGTYPE: a miss
        assert (await b.stats()).misses >= 1 and b.trips == 0
    finally:
        await b.close()
        await admin.aclose()
        server.stop()


def test_breaker_needs_consecutive_failures_and_reopens_after_a_failed_probe() -> None:
    now = [0.0]
    br = CircuitBreaker(threshold=3, cooldown_s=10, clock=lambda: now[0])
    br.failure(), br.failure(), br.success(), br.failure(), br.failure()
    assert not br.open
    br.failure()
    assert br.open
    now[0] = 11
    assert not br.open  # one probe may go
    br.failure()
    assert br.open and br.trips == 2


async def test_ttl_and_prefix_isolation(redis_server: RedisServer) -> None:
    """The TTL is set on the server (PTTL), and the key goes when it runs out. Waiting is by polling
    (a loaded machine may stall past a 1 s TTL between any two calls, so no check races it)."""
    import redis.asyncio as aioredis

    a = RedisBackend(redis_server.url, prefix="tenant-a:", ttl_seconds=1)
    b = RedisBackend(redis_server.url, prefix="tenant-b:")
    raw = aioredis.from_url(redis_server.url)
    await a.put(["c/x", "c/y"], [b"alpha", b"beta"])
    b2 = RedisBackend(redis_server.url, prefix="tenant-a:")
    await b2.put(["c/keep"], [b"gamma"])  # no TTL: lives on
    assert await b.exists(["c/x"]) == [False] and [k async for k in b.keys()] == []
    assert await raw.pttl("tenant-a:c/keep") == -1
    for key in ("tenant-a:c/x", "tenant-a:c/y"):
        ms = await raw.pttl(key)
        assert ms == -2 or 0 < ms <= 1000  # -2: already expired on a stalled machine
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while await a.exists(["c/x", "c/y"]) != [False, False]:
        assert loop.time() < deadline, "keys with a 1 s TTL still there after 30 s"
        await asyncio.sleep(0.1)
    assert [k async for k in a.keys("c/")] == ["c/keep"]
    await raw.aclose()
    await b2.close()
    await a.close()
    await b.close()


async def test_two_hosts_share_prefixes_through_the_redis_tier(tmp_path: Path, redis_server: RedisServer) -> None:
    """Each store has its own host tier and LMDB; a prefix one stores, the other matches and loads."""
    import torch

    from agentstate import StateStore
    from agentstate.config import TierConfig
    from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens

    tiers = [TierConfig(kind="host", capacity_bytes=64 << 20), TierConfig(kind="lmdb"),
             TierConfig(kind="redis", url=redis_server.url)]  # fmt: skip
    tokens, kv = random_tokens(300, seed=77), random_kv(SPEC4, 300, seed=77)
    async with StateStore.open(tmp_path / "host-a", SPEC4, tiers=tiers, chunk_tokens=64) as a:
        assert await a.put_prefix(tokens, kv) == 256
    async with StateStore.open(tmp_path / "host-b", SPEC4, tiers=tiers, chunk_tokens=64) as b:
        m = await b.match(tokens)
        assert (m.tokens, m.tiers) == (256, ["redis"] * 4)
        import redis.asyncio as aioredis

        raw = aioredis.Redis.from_url(redis_server.url)
        gets = (await raw.info("commandstats")).get("cmdstat_get", {}).get("calls", 0)
        into = torch.zeros_like(kv)
        assert await b.load(tokens, into) == 256 and bits_equal(into[:, :, :256], kv[:, :, :256])
        await b.flush()
        assert (await b.match(tokens)).tiers == ["host"] * 4  # promoted on the way
        after = (await raw.info("commandstats"))["cmdstat_get"]["calls"]
        assert after - gets == 4, "promotion read the chunks over the network again"  # the bytes read are reused
        await raw.aclose()
        again = torch.zeros_like(kv)
        assert await b.load(tokens, again) == 256 and bits_equal(again[:, :, :256], kv[:, :, :256])
        assert set(await b.chunks.resident(b.chunk_keys(tokens))) >= {"host", "lmdb"}
        assert (await b.chunks.resident(b.chunk_keys(tokens)))["lmdb"][0] == 4  # promoted into LMDB too
    async with StateStore.open(tmp_path / "host-c", SPEC4, tiers=tiers, chunk_tokens=64) as c:
        handle = await c.prefetch(tokens)  # known only to Redis: found, then read in the background
        assert handle.keys and len(handle.keys) == 4 and await handle.wait()
        assert handle.ready(lambda k: False) == 4
        into = torch.zeros_like(kv)
        assert await c.load(tokens, into, prefetch=handle, policy="best_effort") == 256
        assert bits_equal(into[:, :, :256], kv[:, :, :256])


async def test_a_dead_remote_tier_never_fails_a_store_or_a_restore(tmp_path: Path) -> None:
    import torch

    from agentstate import StateStore
    from agentstate.config import TierConfig
    from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens

    server = RedisServer(tmp_path).start()
    tiers = [TierConfig(kind="host", capacity_bytes=64 << 20), TierConfig(kind="lmdb"),
             TierConfig(kind="redis", url=server.url)]  # fmt: skip
    tokens, kv = random_tokens(200, seed=5), random_kv(SPEC4, 200, seed=5)
    server.stop()
    async with StateStore.open(tmp_path / "data", SPEC4, tiers=tiers, chunk_tokens=64) as store:
        await store.snapshot("s", tokens, kv)  # LMDB is the record tier: the remote failure is counted only
        assert (await store.stats()).counters["redis_put_errors"] >= 1
        assert bits_equal((await store.resume("s")).kv, kv)
        other = random_tokens(128, seed=6)
        assert (await store.match(other)).tokens == 0  # unknown keys ask the dead tier: a clean miss
        assert await store.load(other, torch.zeros_like(kv)) == 0


async def test_killing_a_cluster_node_gives_correct_kv_or_clean_misses(tmp_path: Path) -> None:
    import torch

    from agentstate import StateStore
    from agentstate.config import TierConfig
    from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
    from tests.redis_server import RedisCluster

    cluster = RedisCluster(tmp_path / "cluster").start()
    try:
        tiers = [TierConfig(kind="lmdb"), TierConfig(kind="redis", url=cluster.url, cluster=True)]
        prefixes = [(random_tokens(256, seed=s), random_kv(SPEC4, 256, seed=s)) for s in range(8)]
        async with StateStore.open(tmp_path / "writer", SPEC4, tiers=tiers, chunk_tokens=64) as w:
            for tokens, kv in prefixes:
                await w.put_prefix(tokens, kv)
        import redis as sync_redis
        from redis.crc import key_slot

        dead = cluster.nodes[1]
        ranges = sync_redis.Redis(port=dead.port).execute_command("CLUSTER", "SLOTS")
        dead_slots = {s for r in ranges if int(r[2][1]) == dead.port for s in range(int(r[0]), int(r[1]) + 1)}
        dead.stop()  # a third of the slots is gone, no replicas
        async with StateStore.open(tmp_path / "reader", SPEC4, tiers=tiers, chunk_tokens=64) as r:
            remote = r.chunks.backend("redis")
            loaded = []
            for tokens, kv in prefixes:
                into = torch.zeros_like(kv)
                n = await r.load(tokens, into)  # never raises
                assert n % 64 == 0 and bits_equal(into[:, :, :n], kv[:, :, :n])
                assert not into[:, :, n:].view(torch.uint8).any()  # nothing wrong past the prefix
                loaded.append(n)
                # Never past the first chunk on the dead node. (Not always up to it: while the client
                # refreshes its slot map it may drop connections to live nodes too.)
                alive = [key_slot(f"agentstate:{k}".encode()) not in dead_slots for k in r.chunk_keys(tokens)]
                assert n <= 64 * (alive.index(False) if False in alive else len(alive))
            assert sum(loaded) > 0  # per-node pipelines: the live nodes keep serving their chunks
            assert (await remote.stats()).errors >= 1 and remote.trips >= 1  # type: ignore[attr-defined]
    finally:
        cluster.stop()
