"""Agent hints, retention contracts and accounting, on real tiers: a host tier too small for the
working set over real LMDB (and a real Redis on loopback), real torch tensors, bit-exact resumes."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentstate import StateStore, manifest
from agentstate.chunks.holds import Holds, victim
from agentstate.config import StoreConfig, TierConfig
from agentstate.errors import InvalidArgumentError, SessionNotFoundError
from agentstate.hints import paused_hold_s
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.redis_server import RedisCluster, RedisServer

TOKENS = 256  # 4 chunks of 64 tokens, 128 KiB each (SPEC4: 2 KiB of KV per token)
CHUNK_BYTES = 64 * SPEC4.token_bytes
HOST = int(CHUNK_BYTES * 4 * 3.5)  # the host tier holds 13 chunks (values carry a header)


def config(root: Path, *, host: int = HOST, lower: list[TierConfig] | None = None, **overrides: Any) -> StoreConfig:
    tiers = [TierConfig(kind="host", capacity_bytes=host), *(lower or [TierConfig(kind="lmdb")])]
    overrides.setdefault("lmdb_map_size", 256 << 20)
    return StoreConfig(path=root, chunk_tokens=64, tiers=tiers, **overrides)


async def put(store: StateStore, name: str, seed: int, tokens: int = TOKENS) -> None:
    await store.snapshot(name, random_tokens(tokens, seed=seed), random_kv(SPEC4, tokens, seed=seed))


async def in_host(store: StateStore, name: str) -> int:
    """How many of a session's chunks (tail included) the host tier holds."""
    m = await store.session(name)
    keys = [*m.chunk_keys, *([m.tail_key] if m.tail_key else [])]
    return sum("host" in store.chunks.where(k) for k in keys)


async def assert_resumes(store: StateStore, name: str, seed: int, tokens: int = TOKENS) -> None:
    got = await store.resume(name)
    assert got.complete and bits_equal(got.kv, random_kv(SPEC4, tokens, seed=seed))


async def pressure(store: StateStore, first_seed: int, sessions: int) -> None:
    for i in range(sessions):
        await put(store, f"filler{first_seed + i}", first_seed + i)


@pytest.mark.parametrize("hinted", [True, False])
async def test_a_paused_session_survives_pressure_that_evicts_an_unhinted_one(tmp_path: Path, hinted: bool) -> None:
    async with StateStore.open(config(tmp_path / "d"), SPEC4) as store:
        await put(store, "tool-call", 1)  # oldest: plain LRU takes it first
        await put(store, "idle", 2)
        if hinted:
            result = await store.paused("tool-call", 30)
            assert result.hint == "paused" and result.in_memory == 4 and result.expected_back_at is not None
            assert result.held_until is not None and result.held_until > result.expected_back_at
        await pressure(store, 10, 4)
        assert await in_host(store, "tool-call") == (4 if hinted else 0)
        assert await in_host(store, "idle") == 0  # evicted in both runs: the unhinted one goes
        # eviction moved, never lost: both come back bit-exact (from LMDB when evicted)
        await assert_resumes(store, "tool-call", 1)
        await assert_resumes(store, "idle", 2)


async def test_paused_sessions_are_evicted_latest_return_first(tmp_path: Path) -> None:
    async with StateStore.open(config(tmp_path / "d"), SPEC4) as store:
        await put(store, "soon", 1)
        await put(store, "later", 2)
        await put(store, "later2", 3)
        await store.paused("later2", 600)
        await store.paused("later", 300)
        await store.paused("soon", 5)
        await pressure(store, 10, 2)  # room for one and a half held sessions besides the newest filler
        assert await in_host(store, "soon") == 4
        assert await in_host(store, "later2") < await in_host(store, "later") or await in_host(store, "later") == 0
        assert await in_host(store, "later2") == 0


async def test_a_resuming_session_outranks_paused_ones_that_overran_within_the_share(tmp_path: Path) -> None:
    slow_reload = config(tmp_path / "d", hint_tenant_share=0.5, hint_reload_bytes_per_s=1000)  # holds of minutes
    async with StateStore.open(slow_reload, SPEC4) as store:
        for i in range(3):
            await put(store, f"p{i}", i)
            await store.paused(f"p{i}", 0.001)  # tools that overran: expected back already
        await put(store, "back", 9)
        await pressure(store, 10, 4)  # pushes "back" down to LMDB
        assert (await store.resuming("back")).in_memory == 4
        await pressure(store, 20, 2)  # more pressure before the request: the resuming hold counts first
        assert await in_host(store, "back") == 4
        lmdb_before = await lmdb_read_bytes(store)
        await assert_resumes(store, "back", 9)
        assert await lmdb_read_bytes(store) == lmdb_before


async def test_done_releases_a_session_first(tmp_path: Path) -> None:
    async with StateStore.open(config(tmp_path / "d"), SPEC4) as store:
        await put(store, "a", 1)
        await put(store, "b", 2)
        await store.paused("b", 60)
        result = await store.done("b")
        assert result.held_until is None and store.chunks.held("hint:default/b") is None
        await pressure(store, 10, 2)  # pressure for three chunks: b's go before the older a's
        assert await in_host(store, "b") < 4 and await in_host(store, "a") == 4
        await assert_resumes(store, "b", 2)


async def lmdb_read_bytes(store: StateStore) -> int:
    return store.chunks.tier_counters()["lmdb"].get("read_bytes", 0)


async def test_resuming_brings_a_session_up_from_lmdb_and_the_resume_reads_no_slow_tier(tmp_path: Path) -> None:
    async with StateStore.open(config(tmp_path / "d"), SPEC4) as store:
        await put(store, "agent", 1)
        await pressure(store, 10, 4)
        assert await in_host(store, "agent") == 0
        result = await store.resuming("agent")
        assert result.moved_chunks == 4 and result.moved_bytes >= 4 * CHUNK_BYTES and result.in_memory == 4
        assert await in_host(store, "agent") == 4
        before = (await store.usage("agent")).bytes_read
        lmdb_before = await lmdb_read_bytes(store)
        await assert_resumes(store, "agent", 1)
        after = (await store.usage("agent")).bytes_read
        assert after.get("lmdb", 0) == before.get("lmdb", 0)  # the resume read memory only
        assert after["host"] - before.get("host", 0) >= 4 * CHUNK_BYTES
        assert await lmdb_read_bytes(store) == lmdb_before


async def test_a_resume_during_its_prefetch_waits_for_it_instead_of_reading_the_slow_tier_twice(tmp_path: Path) -> None:
    async with StateStore.open(config(tmp_path / "d"), SPEC4) as store:
        await put(store, "agent", 1)
        await pressure(store, 10, 4)
        m = await store.session("agent")
        prefetch = asyncio.create_task(store.resuming("agent"))
        while not store.chunks.warming(m.chunk_keys[0]):
            await asyncio.sleep(0)
        lmdb_before = await lmdb_read_bytes(store)
        await assert_resumes(store, "agent", 1)  # the request arrives while the prefetch runs
        assert (await prefetch).moved_chunks == 4
        assert await lmdb_read_bytes(store) - lmdb_before == (await prefetch).moved_bytes  # each byte read once
        assert not store.chunks.warming(m.chunk_keys[0])


async def test_resuming_after_a_restart_fills_an_unbounded_host_tier(tmp_path: Path) -> None:
    cfg = config(tmp_path / "d").model_copy(update={"tiers": [TierConfig(kind="host"), TierConfig(kind="lmdb")]})
    async with StateStore.open(cfg, SPEC4) as store:
        await put(store, "agent", 1, tokens=TOKENS + 7)
    async with StateStore.open(cfg, SPEC4) as store:  # a new process: host memory is empty
        assert await in_host(store, "agent") == 0
        result = await store.resuming("agent")
        assert (result.moved_chunks, result.in_memory, result.chunks) == (5, 5, 5)  # the tail too
        lmdb_before = await lmdb_read_bytes(store)
        await assert_resumes(store, "agent", 1, tokens=TOKENS + 7)
        assert await lmdb_read_bytes(store) == lmdb_before
        assert (await store.resuming("agent")).moved_chunks == 0  # already there: nothing read


async def test_resuming_brings_a_session_up_from_redis(tmp_path: Path, redis_server: RedisServer) -> None:
    prefix = f"h{uuid.uuid4().hex[:8]}:"
    redis = TierConfig(kind="redis", url=redis_server.url, prefix=prefix)
    cfg = config(tmp_path / "d", lower=[redis], catalog_url=redis_server.url, catalog_prefix=prefix)
    async with StateStore.open(cfg, SPEC4) as store:
        await put(store, "agent", 1)
        await pressure(store, 10, 4)
        assert await in_host(store, "agent") == 0
        assert (await store.resuming("agent")).moved_chunks == 4
        before = (await store.usage("agent")).bytes_read
        await assert_resumes(store, "agent", 1)
        after = (await store.usage("agent")).bytes_read
        assert after.get("redis", 0) == before.get("redis", 0) and after["host"] > before.get("host", 0)
    # and a second host, with nothing in memory, brings it up from the shared tier on `resuming`
    async with StateStore.open(config(tmp_path / "e", lower=[redis], catalog_url=redis_server.url,
                                      catalog_prefix=prefix), SPEC4) as other:  # fmt: skip
        assert (await other.resuming("agent")).moved_chunks == 4
        await assert_resumes(other, "agent", 1)
        assert (await other.usage("agent")).resumes == 2  # both hosts' resumes, one shared account


async def test_prefix_hints_hold_and_bring_up_what_an_engine_stored_by_prefix(tmp_path: Path) -> None:
    async with StateStore.open(config(tmp_path / "d"), SPEC4) as store:
        toks, kv = random_tokens(TOKENS + 10, seed=1), random_kv(SPEC4, TOKENS + 10, seed=1)
        assert await store.put_prefix(toks, kv) == TOKENS
        await pressure(store, 10, 4)
        result = await store.hint_tokens("agent-7", toks, "resuming")
        assert result.chunks == 4 and result.moved_chunks == 4 and result.in_memory == 4
        lmdb_before = await lmdb_read_bytes(store)
        into = random_kv(SPEC4, TOKENS + 10, seed=0)
        assert await store.load(toks, into) == TOKENS
        assert bits_equal(into[:, :, :TOKENS], kv[:, :, :TOKENS]) and await lmdb_read_bytes(store) == lmdb_before
        held = await store.hint_tokens("agent-7", toks, "paused", 30)
        assert held.held_until is not None and store.chunks.held("prefix:default/agent-7") is not None
        await store.hint_tokens("agent-7", toks, "done")
        assert store.chunks.held("prefix:default/agent-7") is None
        with pytest.raises(InvalidArgumentError):
            await store.hint_tokens("../x", toks, "paused", 3)
        assert (await store.usage()).hints == 3


async def test_one_tenant_cannot_hold_more_than_its_share(tmp_path: Path) -> None:
    async with StateStore.open(config(tmp_path / "d", host=CHUNK_BYTES * 4 * 4, hint_tenant_share=0.5), SPEC4) as st:
        hog, other = st.for_tenant("hog"), st.for_tenant("other")
        for i in range(4):
            await put(hog, f"s{i}", i)
            await hog.paused(f"s{i}", 60 + i)
        result = await hog.paused("s0", 60)
        share = result.tenant_share_bytes
        assert share == CHUNK_BYTES * 8 and result.tenant_held_bytes <= share
        for i in range(4):
            await put(other, f"o{i}", 100 + i)  # pressure from a tenant with no hints at all
        held = sum([await in_host(hog, f"s{i}") for i in range(4)])
        assert held * CHUNK_BYTES <= share + CHUNK_BYTES  # the cap, not the whole tier
        assert st.chunks.held_bytes("hog")["host"] <= share
        assert sum([await in_host(other, f"o{i}") for i in range(4)]) >= 7  # the rest of the tier is LRU
        for i in range(4):
            await assert_resumes(hog, f"s{i}", i)


@pytest.mark.parametrize(
    ("hint", "expected_s"),
    [("paused", None), ("paused", 0), ("paused", -1), ("paused", math.nan), ("paused", math.inf), ("paused", "30"),
     ("paused", 1e12), ("paused", True), ("sleep", None), ("", None), (None, None), (3, None), ("PAUSED", 5)],
)  # fmt: skip
async def test_bad_hints_are_refused_and_change_nothing(store: StateStore, hint: Any, expected_s: Any) -> None:
    await put(store, "s", 1)
    before = await store.session("s")
    with pytest.raises(InvalidArgumentError):
        await store.hint("s", hint, expected_s)
    assert store.chunks.held("hint:default/s") is None
    after = await store.session("s")
    assert after.version == before.version and after.last_hit_at == before.last_hit_at
    assert (await store.usage("s")).hints == 0
    await assert_resumes(store, "s", 1)


async def test_hints_on_missing_sessions_are_typed(store: StateStore) -> None:
    with pytest.raises(SessionNotFoundError):
        await store.paused("nobody", 5)
    with pytest.raises(InvalidArgumentError):
        await store.resuming("../escape")


def test_paused_hold_covers_the_overrun_and_the_reload_and_is_capped() -> None:
    assert paused_hold_s(10, 0, reload_bytes_per_s=1 << 30, max_hold_s=900) == 20
    assert paused_hold_s(10, 5 << 30, reload_bytes_per_s=1 << 30, max_hold_s=900) == 25
    assert paused_hold_s(10_000, 0, reload_bytes_per_s=1 << 30, max_hold_s=900) == 900


def test_eviction_order_unheld_lru_first_then_latest_return() -> None:
    holds = Holds(share=1.0)
    holds.set("a", "t", ["k1"], for_s=60, back_in_s=10)
    holds.set("b", "t", ["k3"], for_s=60, back_in_s=50)
    lru = {"k1": 1, "k2": 1, "k3": 1, "k4": 1}
    plan = holds.plan(lru, 4)
    order = []
    while lru:
        key = victim(lru, lambda k: True, plan)
        assert key is not None
        order.append(key)
        del lru[key]
    assert order == ["k2", "k4", "k3", "k1"]
    holds.set("c", "t", ["k5"], for_s=-1)  # already over: ignored, then forgotten
    assert not holds.held("k5") and holds.get("c") is None


# -- retention ----------------------------------------------------------------------------------


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    at = [2_000_000_000.0]
    monkeypatch.setattr(manifest, "now", lambda: at[0])
    monkeypatch.setattr("agentstate.sessions.now", lambda: at[0])
    return at


async def test_sliding_ttl_is_refreshed_by_hits_and_survives_a_restart(
    open_store: Callable[..., Any], clock: list[float]
) -> None:
    async with open_store() as store:
        await put(store, "s", 1)
        await store.snapshot("s", random_tokens(TOKENS, seed=1), random_kv(SPEC4, TOKENS, seed=1), ttl_seconds=300)
        clock[0] += 250
        await assert_resumes(store, "s", 1)  # a hit: the TTL counts from here
        clock[0] += 250
        assert (await store.session("s")).expires_at() == clock[0] + 50
        await store.paused("s", 10)  # a hint is a hit too
    clock[0] += 250
    async with open_store() as store:  # the hit times were saved with the catalog
        assert await store.gc() == 0
        await assert_resumes(store, "s", 1)
        clock[0] += 301
        assert await store.gc() == 1
        with pytest.raises(SessionNotFoundError):
            await store.resume("s")


async def test_guaranteed_until_outlives_the_ttl_across_restarts_and_gc(
    open_store: Callable[..., Any], clock: list[float]
) -> None:
    start = clock[0]
    async with open_store() as store:
        toks, kv = random_tokens(TOKENS, seed=3), random_kv(SPEC4, TOKENS, seed=3)
        m = await store.snapshot("contract", toks, kv, ttl_seconds=60, guaranteed_until=start + 3600)
        assert m.expires_at() == start + 3600 and m.guaranteed_until == start + 3600
        assert store.chunks.held("retain:default/contract") is not None
    clock[0] = start + 3599
    async with open_store() as store:
        assert await store.gc() == 0
        assert [s.session_id async for s in store.sessions()] == ["contract"]
        await assert_resumes(store, "contract", 3)
    clock[0] = start + 3599 + 61  # past the contract and the TTL after the last hit
    async with open_store() as store:
        assert await store.gc() == 1


@pytest.mark.parametrize("bad", [0, -5, math.nan, math.inf, "soon", True, [1]])
async def test_bad_guaranteed_until_is_refused_before_anything_is_written(store: StateStore, bad: Any) -> None:
    await put(store, "s", 1)
    with pytest.raises(InvalidArgumentError):
        await store.snapshot("s", random_tokens(64, seed=9), random_kv(SPEC4, 64, seed=9), guaranteed_until=bad)
    assert (await store.session("s")).version == 1
    await assert_resumes(store, "s", 1)


async def test_a_contract_the_record_tier_cannot_keep_is_refused(tmp_path: Path, redis_server: RedisServer) -> None:
    prefix = f"g{uuid.uuid4().hex[:8]}:"
    redis = TierConfig(kind="redis", url=redis_server.url, prefix=prefix, ttl_seconds=600)
    cfg = config(tmp_path / "d", lower=[redis], catalog_url=redis_server.url, catalog_prefix=prefix)
    async with StateStore.open(cfg, SPEC4) as store:
        toks, kv = random_tokens(TOKENS, seed=4), random_kv(SPEC4, TOKENS, seed=4)
        with pytest.raises(InvalidArgumentError, match="expires chunks after 600s"):
            await store.snapshot("s", toks, kv, guaranteed_until=time.time() + 3600)
        with pytest.raises(SessionNotFoundError):
            await store.session("s")
        await store.snapshot("s", toks, kv, guaranteed_until=time.time() + 300)  # within the tier's own TTL
        await assert_resumes(store, "s", 4)


# -- accounting ---------------------------------------------------------------------------------


async def test_usage_counts_exactly_and_persists(open_store: Callable[..., Any]) -> None:
    toks, kv = random_tokens(300, seed=5), random_kv(SPEC4, 300, seed=5)
    async with open_store() as store:
        await store.snapshot("a", toks, kv)  # 4 chunks + a 44-token tail
        written = await store.snapshot("b", toks, kv)  # same chunks: deduped, only the tail is new
        await store.resume("a")
        await store.resume("a")
        await store.paused("a", 5)
        await store.put_prefix(toks[:128], kv[:, :, :128])  # stored already: all deduped
        landed = await store.load(toks, random_kv(SPEC4, 300, seed=0))
        assert landed == 256
        a = await store.usage("a")
        assert (a.snapshots, a.resumes, a.hints) == (1, 2, 1)
        assert a.tokens_written == 300 and a.tokens_deduped == 0 and a.tokens_read == 600 and a.tokens_recomputed == 0
        assert a.bytes_written >= 300 * SPEC4.token_bytes and sum(a.bytes_read.values()) >= 600 * SPEC4.token_bytes
        assert a.bytes_stored["lmdb"] >= 300 * SPEC4.token_bytes and a.last_hit_at is not None
        b = await store.usage("b")
        assert b.tokens_written == 44 and b.tokens_deduped == 256 and written.version == 1
    async with open_store() as store:  # flushed at close, read back from the catalog
        again = await store.usage("a")
        assert again.model_dump(exclude={"bytes_stored"}) == a.model_dump(exclude={"bytes_stored"})
        total = await store.usage()
        assert total.session_id is None and total.snapshots == 2 and total.resumes == 2 and total.loads == 1
        assert total.tokens_written == 344 and total.tokens_deduped == 256 + 128
        assert total.tokens_read == 600 + 256 and total.tokens_recomputed == 300 - 256
        await store.delete("a")
        with pytest.raises(SessionNotFoundError):
            await store.usage("a")
        assert (await store.usage()).resumes == 2  # the tenant's bill outlives its sessions
        await store.snapshot("a", toks, kv)
        assert (await store.usage("a")).resumes == 0  # a new session with the old name starts from zero


@pytest.mark.parametrize("cluster", [False, True])
async def test_usage_in_a_shared_catalog_is_exact(tmp_path: Path, cluster: bool, request: pytest.FixtureRequest) -> None:
    server: RedisServer | RedisCluster = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    prefix = f"u{uuid.uuid4().hex[:8]}:"
    lower = [TierConfig(kind="redis", url=server.url, prefix=prefix, cluster=cluster)]
    cfg = config(tmp_path / "d", lower=lower, catalog_url=server.url, catalog_prefix=prefix, catalog_cluster=cluster)
    async with StateStore.open(cfg, SPEC4) as store:
        await put(store, "s", 1, tokens=300)
        for _ in range(3):
            await store.resume("s")
        await store.usage_log.flush()
        await store.resume("s")  # pending in memory, counted in what usage() answers
        u = await store.usage("s")
        assert (u.snapshots, u.resumes, u.tokens_read, u.tokens_written) == (1, 4, 1200, 300)
        await store.hint("s", "paused", 5)
        store.usage_log.add("default", "s", {"resumes": 1})  # counted, not flushed, when the session goes
        await store.delete("s")
        store.usage_log.hit("default", "s", 1.0)  # and a late hit of it
        await store.usage_log.flush()
        # the session's account went with it and was not brought back by a late flush
        assert await store.catalog.usage("default", "s") == {}
        assert await store.catalog.session_count() == 0
        assert (await store.usage()).resumes == 5  # the tenant's bill kept what the session had counted


async def test_views_of_tenants_have_separate_bills(store: StateStore) -> None:
    a, b = store.for_tenant("acme"), store.for_tenant("globex")
    await put(a, "s", 1)
    await a.resume("s")
    await put(b, "s", 2)
    assert (await a.usage()).resumes == 1 and (await b.usage()).resumes == 0
    assert (await store.usage()).snapshots == 0  # the default tenant did nothing
