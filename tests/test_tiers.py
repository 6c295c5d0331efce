"""Tier manager: exact capacity accounting, LRU, demotion, write policies, promotion."""

from __future__ import annotations

import pytest
import torch

from agentstate import StateStore, codec
from agentstate.config import TierConfig
from agentstate.errors import InvalidArgumentError
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens

CHUNK = 64
CHUNK_BYTES = codec.encoded_size(CHUNK * SPEC4.token_bytes)  # 131,136 bytes


def tiers(host_chunks: float, device_chunks: float | None = None) -> list[TierConfig]:
    out = [TierConfig(kind="device", capacity_bytes=int(device_chunks * CHUNK_BYTES))] if device_chunks else []
    return out + [TierConfig(kind="host", capacity_bytes=int(host_chunks * CHUNK_BYTES)), TierConfig(kind="lmdb")]


async def assert_within_capacity(store: StateStore) -> None:
    for tier in store.chunks._manager.tiers:  # while writes are in flight, their bytes are reserved already
        if tier.capacity is not None:
            assert tier.used <= tier.capacity, tier.name
    await store.flush()
    for tier in store.chunks._manager.tiers:  # once settled, accounting matches what the backend holds exactly
        if tier.capacity is not None:
            assert (await tier.backend.stats()).bytes_used == tier.used <= tier.capacity, tier.name


async def test_filling_every_tier_past_capacity_never_overshoots_or_loses_a_chunk(open_store) -> None:  # type: ignore[no-untyped-def]
    async with open_store(tiers=tiers(host_chunks=5.5, device_chunks=2.5), write_policy="write_back") as store:
        prefixes = [(random_tokens(256, seed=s), random_kv(SPEC4, 256, seed=s)) for s in range(6)]
        for tokens, kv in prefixes:  # 24 chunks into a host tier that holds 5
            await store.put_prefix(tokens, kv)
            await assert_within_capacity(store)
        for tokens, kv in prefixes:  # every load promotes into device and host: more pressure
            into = torch.zeros_like(kv)
            assert await store.load(tokens, into) == 256
            assert bits_equal(into, kv)
            await store.flush()
            await assert_within_capacity(store)
        counts = (await store.stats()).counters
        assert counts["demotions"] > 0 and counts["evictions"] > 0 and counts["promotions"] > 0
        held = [store.chunks._manager.holders(k) for t, _ in prefixes for k in store.chunk_keys(t)]
        assert all(held)  # every chunk still lives somewhere


async def test_write_policies_place_chunks(open_store) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = random_tokens(128), random_kv(SPEC4, 128)
    async with open_store(write_policy="write_through") as store:
        await store.put_prefix(tokens, kv)
        assert [set(set(store.chunks.where(k))) for k in store.chunk_keys(tokens)] == [{"host", "lmdb"}] * 2
    async with open_store(write_policy="write_back") as store:
        other = random_tokens(128, seed=9)
        await store.put_prefix(other, kv)
        assert [set(set(store.chunks.where(k))) for k in store.chunk_keys(other)] == [{"host"}] * 2
        man = await store.snapshot("s", other + [1], torch.cat([kv, kv[:, :, :1]], dim=2))
        assert all("lmdb" in store.chunks.where(k) for k in man.chunk_keys)  # sessions are durable anyway


async def test_selective_write_through_writes_down_hot_chunks(open_store) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = random_tokens(128), random_kv(SPEC4, 128)
    async with open_store(write_policy="write_through_selective", write_through_threshold=2) as store:
        await store.put_prefix(tokens, kv)
        keys = store.chunk_keys(tokens)
        assert not any("lmdb" in store.chunks.where(k) for k in keys)
        await store.load(tokens, torch.empty_like(kv))
        assert not any("lmdb" in store.chunks.where(k) for k in keys)
        await store.load(tokens, torch.empty_like(kv))
        assert all("lmdb" in store.chunks.where(k) for k in keys)
    async with open_store(host_capacity_bytes=0) as store:  # it really is on disk
        into = torch.zeros_like(kv)
        assert await store.load(tokens, into) == 128 and bits_equal(into, kv)


async def test_exclusive_cache_tiers_hold_no_duplicates(open_store) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = random_tokens(128), random_kv(SPEC4, 128)
    async with open_store(tiers=tiers(host_chunks=10, device_chunks=10), exclusive=True) as store:
        await store.put_prefix(tokens, kv)
        keys = store.chunk_keys(tokens)
        assert [set(store.chunks.where(k)) for k in keys] == [{"host", "lmdb"}] * 2
        await store.load(tokens, torch.empty_like(kv))
        await store.flush()
        assert [set(store.chunks.where(k)) for k in keys] == [{"device", "lmdb"}] * 2  # moved up, not copied


async def test_lru_keeps_recently_used_chunks(open_store) -> None:  # type: ignore[no-untyped-def]
    async with open_store(tiers=tiers(host_chunks=4)) as store:
        a, b, c = (random_tokens(128, seed=s) for s in (1, 2, 3))
        kv = random_kv(SPEC4, 128)
        await store.put_prefix(a, kv)
        await store.put_prefix(b, kv)
        await store.load(a, torch.empty_like(kv))  # a is now more recent than b
        await store.put_prefix(c, kv)
        assert (await store.match(a)).tiers == ["host", "host"]
        assert (await store.match(b)).tiers == ["lmdb", "lmdb"]


async def test_bad_tier_configs_are_rejected(open_store) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgumentError):
        open_store(tiers=[TierConfig(kind="host", capacity_bytes=1), TierConfig(kind="host")])
    with pytest.raises(InvalidArgumentError):
        open_store(tiers=[TierConfig(kind="host", capacity_bytes=1 << 20)])  # nothing durable


async def test_eviction_under_pressure_keeps_every_session_resumable(open_store) -> None:  # type: ignore[no-untyped-def]
    """Host and file caches far smaller than the working set, write-back: evictions write down first."""
    layout = [
        TierConfig(kind="host", capacity_bytes=3 * CHUNK_BYTES),
        TierConfig(kind="file", capacity_bytes=6 * CHUNK_BYTES),
        TierConfig(kind="lmdb"),
    ]
    system, sys_kv = random_tokens(192, seed=1), random_kv(SPEC4, 192, seed=1)
    sessions = {}
    async with open_store(tiers=layout, write_policy="write_back") as store:
        await store.put_prefix(system, sys_kv)
        doc, doc_kv = random_tokens(128, seed=2), random_kv(SPEC4, 128, seed=2)
        await store.put_prefix(doc, doc_kv)  # write-back: a prefix no session shares lives only in host ...
        assert all(set(store.chunks.where(k)) == {"host"} for k in store.chunk_keys(doc))
        for i in range(12):
            own = random_tokens(100 + 10 * i, seed=100 + i)
            kv = torch.cat([sys_kv, random_kv(SPEC4, len(own), seed=200 + i)], dim=2)
            sessions[f"s{i}"] = kv
            await store.snapshot(f"s{i}", system + own, kv)
            await assert_within_capacity(store)
        for sid, kv in sessions.items():
            r = await store.resume(sid)
            assert r.complete and bits_equal(r.kv, kv)
            await assert_within_capacity(store)
        into = torch.zeros_like(doc_kv)
        assert await store.load(doc, into) == 128 and bits_equal(into, doc_kv)  # ... and survived its eviction
        assert (await store.stats()).counters["demotions"] >= 2
    async with open_store(tiers=layout) as store:  # and after a restart, from whatever tier holds it
        for sid, kv in sessions.items():
            assert bits_equal((await store.resume(sid)).kv, kv)


@pytest.mark.parametrize("value_log", [False, True], ids=["lmdb-map", "lmdb-value-log"])
async def test_a_key_twice_in_one_put_keeps_its_first_value_in_every_tier(open_store, value_log: bool) -> None:  # type: ignore[no-untyped-def]
    """Values are immutable per key: a batch naming a key twice (an engine's torn or repeated batch)
    stores the first value everywhere, so what a read returns never depends on which tier serves it."""
    first, second = bytes(CHUNK_BYTES), b"\x01" * CHUNK_BYTES
    async with open_store(tiers=tiers(host_chunks=8), lmdb_value_log_min_bytes=4096 if value_log else None) as store:
        with store.chunks.pinned(["c/twice"]):
            await store.chunks.put_values(["c/twice", "c/twice"], [first, second], durable=True)
        for name in ("host", "lmdb"):
            assert bytes(await store.chunks.raw_value(name, "c/twice")) == first, name
