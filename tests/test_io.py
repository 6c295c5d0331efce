"""Overlapping reads, deadlines and prefetch policies, and loads into paged pools."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import torch
from agentstate.backends.base import Backend, BackendStats, ReadSink

from agentstate import StateStore, codec
from agentstate.config import TierConfig
from agentstate.target import PagedTarget
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens


GUARD_S = 60.0
"""Longest a gated read waits for its condition: a guard against a hang, never reached when the code works."""


class SlowBackend(Backend):
    """Wraps a real backend; every read call sleeps `delay` and records how many overlap.

    Orderings that a test relies on are made by events, not by sleeps, so that a loaded machine cannot
    reorder them: with `hold_after`, calls past the first `hold_after` wait until `gate` is set; with
    `until_peak`, every call waits until that many are in flight at once (or GUARD_S pass)."""

    def __init__(self, inner: Backend, delay: float, hold_after: int | None = None, until_peak: int = 0) -> None:
        self.inner, self.delay = inner, delay
        self.name, self.durable, self.trusted = inner.name, inner.durable, inner.trusted
        self.active = self.peak = self.calls = 0
        self.hold_after, self.until_peak = hold_after, until_peak
        self.gate, self.full = asyncio.Event(), asyncio.Event()

    async def read(self, keys: Sequence[str], sink: ReadSink) -> list[bool]:
        self.active += 1
        self.calls += 1
        self.peak = max(self.peak, self.active)
        try:
            if self.hold_after is not None and self.calls > self.hold_after:
                await asyncio.wait_for(self.gate.wait(), GUARD_S)
            if self.until_peak:
                if self.active >= self.until_peak:
                    self.full.set()
                try:
                    await asyncio.wait_for(self.full.wait(), GUARD_S)
                except asyncio.TimeoutError:
                    self.full.set()  # the peak never came: let every read go; the test's assertion fails
            await asyncio.sleep(self.delay)
            return await self.inner.read(keys, sink)
        finally:
            self.active -= 1

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self.inner.exists(keys)

    async def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        return await self.inner.get_into(keys, buffers)

    async def put(self, keys: Sequence[str], values: Sequence[bytes | bytearray | memoryview]) -> None:
        await self.inner.put(keys, values)

    async def delete(self, keys: Sequence[str]) -> None:
        await self.inner.delete(keys)

    async def keys(self, prefix: str | None = None) -> AsyncIterator[str]:
        async for key in self.inner.keys(prefix):
            yield key

    async def sizes(self, keys: Sequence[str]) -> list[int]:
        return await self.inner.sizes(keys)

    async def stats(self) -> BackendStats:
        return await self.inner.stats()

    async def close(self) -> None:
        await self.inner.close()


def slow_record(store: StateStore, delay: float, **gates: int | None) -> SlowBackend:
    slow = SlowBackend(store.chunks.backend(store.chunks.record_tier), delay, **gates)  # type: ignore[arg-type]
    store.chunks._manager.tier(store.chunks.record_tier).backend = slow
    return slow


async def test_64_reads_with_16_in_flight_overlap(open_store) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = random_tokens(64 * 64), random_kv(SPEC4, 64 * 64)
    async with open_store() as store:
        await store.put_prefix(tokens, kv)
    async with open_store(host_capacity_bytes=0, io_depth=16, batch_bytes=1) as store:
        slow = slow_record(store, delay=0.05, until_peak=16)  # the first 16 wait for each other: no sleep
        into = torch.zeros_like(kv)  # decides how many overlap, however slowly the loop issues them
        assert await store.load(tokens, into) == 64 * 64
        assert bits_equal(into, kv)
        assert slow.calls == 64  # one read per chunk ...
        assert slow.peak == 16  # ... 16 of them in flight at once, never more
        assert store.chunks.counters()["io_peak_in_flight"] == 16


async def test_best_effort_returns_a_prefix_and_the_rest_arrives_later(open_store) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = random_tokens(16 * 64), random_kv(SPEC4, 16 * 64, seed=4)
    async with open_store() as store:
        await store.put_prefix(tokens, kv)
    async with open_store(io_depth=4, batch_bytes=1) as store:  # host tier empty after the reopen
        # The first wave (4 reads) answers at once, every later read waits until the load has returned:
        # which chunks made the deadline is decided by the gate, not by how fast a loaded machine runs.
        slow = slow_record(store, delay=0.0, hold_after=4)
        handle = await store.prefetch(tokens)
        into = torch.zeros_like(kv)
        n = await store.load(tokens, into, policy="best_effort", timeout=1.5, prefetch=handle)
        assert n == 4 * 64  # the first wave made the deadline, nothing past it
        assert bits_equal(into[:, :, :n], kv[:, :, :n]) and not into[:, :, n:].view(torch.uint8).any()
        assert not handle.done
        slow.gate.set()
        assert await handle.wait(GUARD_S)
        into2 = torch.zeros_like(kv)
        assert await store.load(tokens, into2, policy="best_effort") == 16 * 64  # all in memory now
        assert bits_equal(into2, kv)
        assert (await store.match(tokens)).tiers == ["host"] * 16


async def test_timeout_policy_and_wait_complete(open_store) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = random_tokens(8 * 64), random_kv(SPEC4, 8 * 64, seed=5)
    async with open_store() as store:
        await store.put_prefix(tokens, kv)
    async with open_store(io_depth=8, batch_bytes=1, prefetch_timeout_base_s=5.0) as store:
        slow_record(store, delay=0.05)
        into = torch.zeros_like(kv)
        assert await store.load(tokens, into, policy="timeout") == 8 * 64  # 5 s allowance: all arrive
        assert bits_equal(into, kv)
    async with open_store(host_capacity_bytes=0, batch_bytes=1) as store:  # no host tier: staging buffers
        slow_record(store, delay=0.05)
        handle = await store.prefetch(tokens)
        into = torch.zeros_like(kv)
        assert await store.load(tokens, into, policy="wait_complete", prefetch=handle) == 8 * 64
        assert bits_equal(into, kv) and len(handle.staged) == 8


async def test_load_over_four_tiers_into_a_shuffled_paged_pool(open_store) -> None:  # type: ignore[no-untyped-def]
    n_chunks = 8
    tokens, kv = random_tokens(n_chunks * 64 + 10), random_kv(SPEC4, n_chunks * 64 + 10, seed=8)
    layout = [
        TierConfig(kind="device", capacity_bytes=64 << 20),
        TierConfig(kind="host", capacity_bytes=64 << 20),
        TierConfig(kind="file", capacity_bytes=64 << 20),
        TierConfig(kind="lmdb"),
    ]
    async with open_store(tiers=layout, write_policy="write_back") as store:
        keys = store.chunk_keys(tokens)
        values = [codec.encode(kv[:, :, i * 64 : (i + 1) * 64], store.fingerprint, key=k) for i, k in enumerate(keys)]
        place = ["device", "host", "file", "lmdb"] * 2  # each tier alone holds two chunks
        for key, value, tier in zip(keys, values, place):
            await store.chunks._manager.put(store.chunks._manager.tier(tier), [key], [value])
        assert [store.chunks._manager.fastest(k) for k in keys] == place
        pool = torch.zeros((4, 2, 2000, 2, 64), dtype=torch.bfloat16)
        slots = torch.randperm(2000)[: len(tokens)]
        target = PagedTarget(pool, slots, SPEC4)
        assert await store.load(tokens, target) == n_chunks * 64
        assert bits_equal(target.gather(n_chunks * 64), kv[:, :, : n_chunks * 64])
        untouched = torch.ones(2000, dtype=torch.bool)
        untouched[slots[: n_chunks * 64]] = False
        assert not pool[:, :, untouched].view(torch.uint8).any()  # nothing written outside the slots
        await store.flush()  # promotion runs in the background, off the load's critical path
        assert [store.chunks._manager.fastest(k) for k in keys] == ["device"] * n_chunks  # promoted
        pool.zero_()
        assert await store.load(tokens, target) == n_chunks * 64  # warm: all from the device tier
        assert bits_equal(target.gather(n_chunks * 64), kv[:, :, : n_chunks * 64])
        await store.snapshot("s", tokens, kv)
        r = await store.resume("s", into=PagedTarget(torch.zeros_like(pool), slots, SPEC4))
        assert r.complete and r.kv is None  # landed in the pool, not in a fresh tensor
