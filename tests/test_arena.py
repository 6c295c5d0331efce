"""The host tier's arena (agentstate/arena.py): dropped value buffers are reused only when nothing else can
still see them, the arena never takes the tier past its capacity, and sessions stay bit-exact under
eviction pressure with holds and pins while buffers are recycled."""

from __future__ import annotations

import asyncio
import threading

import torch

from agentstate import codec
from agentstate.arena import MIN_BYTES, ValueArena
from agentstate.backends.host import HostBackend
from agentstate.config import TierConfig
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens

SIZE = 256 << 10
CHUNK_BYTES = codec.encoded_size(64 * SPEC4.token_bytes)  # the open_store fixture's 64-token chunks


def test_a_dropped_buffer_nobody_else_holds_is_handed_out_again() -> None:
    arena = ValueArena()
    buf = arena.take(SIZE)
    assert arena.give(buf, room=1 << 30)
    again = arena.take(SIZE)
    assert again is buf and arena.stats().reused == 1
    assert arena.take(SIZE) is not buf  # handed out once: the next one is fresh
    small = bytearray(MIN_BYTES - 1)
    assert not arena.give(small, room=1 << 30) and not arena.give(b"x" * SIZE, room=1 << 30)  # small, immutable


def test_a_buffer_still_referenced_is_never_reused() -> None:
    """A reader's memoryview, a tensor over it, a second container: each keeps it out of the arena."""
    arena = ValueArena()
    for hold in (memoryview, lambda b: torch.frombuffer(b, dtype=torch.uint8), lambda b: [b]):
        buf = arena.take(SIZE)
        buf[:4] = b"keep"
        holder = hold(buf)
        assert not arena.give(buf, room=1 << 30)
        other = arena.take(SIZE)
        assert other is not buf
        other[:4] = b"over"
        assert bytes(buf[:4]) == b"keep"
        del holder
    assert arena.stats().shared == 3 and arena.stats().free_bytes == 0


def test_the_arena_stays_within_the_room_it_is_given_oldest_first() -> None:
    """Buffers are told apart by a mark in their first byte (ids of freed objects are reused)."""
    arena = ValueArena()
    bufs = [arena.take(SIZE) for _ in range(4)]
    for mark, buf in enumerate(bufs):
        buf[0] = mark
    del buf
    for _ in range(4):  # room for 3: the 4th makes the oldest go
        assert arena.give(bufs.pop(0), room=3 * SIZE)
    assert arena.stats().free_bytes == 3 * SIZE and arena.stats().free_buffers == 3
    newest = bytearray(SIZE)
    newest[0] = 99
    assert arena.give(newest, room=SIZE)  # a smaller room: only the newest stays
    del newest
    assert arena.stats().free_bytes == SIZE
    assert arena.take(SIZE)[0] == 99 and arena.stats().free_bytes == 0
    assert not arena.give(bytearray(SIZE), room=SIZE - 1)  # no room at all: not kept
    kept = [arena.take(SIZE) for _ in range(3)]
    for mark, buf in enumerate(kept, start=1):
        buf[0] = mark
    del buf
    while kept:
        assert arena.give(kept.pop(0), room=2 * SIZE)  # 1 goes when 3 arrives: 2 and 3 stay
    assert sorted(arena.take(SIZE)[0] for _ in range(2)) == [2, 3]


def test_grow_touches_buffers_ahead_within_its_room() -> None:
    arena = ValueArena()
    arena.grow(SIZE, count=8, room=5 * SIZE).join()
    assert arena.stats().free_buffers == 5 and arena.stats().free_bytes == 5 * SIZE
    assert len(arena.take(SIZE)) == SIZE and arena.stats().reused == 1
    arena.clear()  # the tier closes: a grow still running adds nothing after it
    arena.grow(SIZE, count=8, room=8 * SIZE).join()
    assert arena.stats().free_bytes == 0


async def test_host_tier_keeps_at_most_its_arena_bytes_of_free_buffers() -> None:
    bound = 5 * SIZE
    host = HostBackend(arena_bytes=bound)
    for round_ in range(3):
        keys = [f"r{round_}-{i}" for i in range(8)]
        values = []
        for i in range(8):
            buf = host.value_buffer(SIZE)
            buf[:] = bytes([i]) * SIZE
            values.append(buf)
        await host.put(keys, values)
        del values, buf
        await host.delete(keys)
        stats = await host.stats()
        assert stats.bytes_used == 0 and stats.arena_free_bytes == bound  # 8 dropped, 5 kept
    stats = await host.stats()
    assert stats.arena_reused == 10 and stats.arena_fresh == 14  # rounds 2 and 3 reused 5 each
    await host.close()
    assert (await host.stats()).arena_free_bytes == 0
    none = HostBackend()  # no arena bytes: nothing kept
    await none.put(["k"], [none.value_buffer(SIZE)])
    await none.delete(["k"])
    assert (await none.stats()).arena_free_bytes == 0
    await none.close()


async def test_a_read_in_flight_keeps_its_buffer_while_the_key_is_dropped_and_rewritten() -> None:
    """The copy out of a host value runs on a pool thread; the key is deleted and new values of the
    same size are written meanwhile: the reader still copies the bytes it was given."""
    host = HostBackend(arena_bytes=64 * SIZE)
    original = host.value_buffer(SIZE)
    original[:] = b"A" * SIZE
    await host.put(["k"], [original])
    del original
    entered, go = threading.Event(), threading.Event()
    seen: list[bytes] = []

    def slow_sink(i: int, view: memoryview) -> None:
        entered.set()
        go.wait(10)
        seen.append(bytes(view))

    reading = asyncio.ensure_future(host.read(["k"], slow_sink))
    await asyncio.to_thread(entered.wait, 10)
    await host.delete(["k"])
    for n in range(4):  # writers take whatever the arena hands out and fill it
        buf = host.value_buffer(SIZE)
        buf[:] = b"B" * SIZE
        await host.put([f"new{n}"], [buf])
    go.set()
    assert await reading == [True]
    assert seen == [b"A" * SIZE]
    assert (await host.stats()).arena_reused == 0  # the dropped buffer was still being read: not reused
    await host.close()


async def test_a_read_in_the_callers_thread_keeps_its_buffer_while_the_key_is_evicted_and_rewritten(open_store) -> None:  # type: ignore[no-untyped-def]
    """`ChunkStore.read_held` copies a host value in the caller's thread (SGLang's), with no pin and no
    hop to the loop; the loop meanwhile evicts the key and writes new values of the same size into
    recycled buffers: the reader still gets the bytes it was given, and that buffer is not recycled."""
    layout = [TierConfig(kind="host", capacity_bytes=2 * CHUNK_BYTES), TierConfig(kind="lmdb")]
    async with open_store(tiers=layout, host_arena_bytes=8 * CHUNK_BYTES) as store:
        tokens, kv = random_tokens(64, seed=1), random_kv(SPEC4, 64, seed=1)
        await store.put_prefix(tokens, kv)
        key = store.chunk_keys(tokens)[0]
        entered, go = threading.Event(), threading.Event()
        seen: list[torch.Tensor] = []

        def slow(i: int, src: torch.Tensor) -> None:
            entered.set()
            go.wait(10)
            seen.append(src.clone())

        reading = asyncio.get_running_loop().run_in_executor(None, store.chunks.read_held, [key], [64], slow)
        await asyncio.to_thread(entered.wait, 10)
        for n in range(6):  # a host tier of two chunks: the key goes, and new values take freed buffers
            await store.put_prefix(random_tokens(64, seed=10 + n), random_kv(SPEC4, 64, seed=10 + n))
        assert "host" not in store.chunks.where(key)
        go.set()
        assert await reading == [True]
        assert bits_equal(seen[0], kv)
        arena = (await store.chunks.stats())[0]
        assert arena.arena_reused > 0  # buffers were recycled meanwhile, just not the one being read
        assert store.chunks.read_held([key], [64], slow) == [False]  # not held any more: `read` it
        into = torch.zeros_like(kv)
        assert await store.load(tokens, into) == 64 and bits_equal(into, kv)


async def test_sessions_stay_bit_exact_under_eviction_with_holds_and_pins_while_buffers_recycle(open_store) -> None:  # type: ignore[no-untyped-def]
    layout = [TierConfig(kind="host", capacity_bytes=6 * CHUNK_BYTES), TierConfig(kind="lmdb")]
    sessions: dict[str, tuple[list[int], torch.Tensor]] = {}
    async with open_store(tiers=layout, host_arena_bytes=3 * CHUNK_BYTES, host_prefault_bytes=2 * CHUNK_BYTES) as store:
        pinned_tokens = random_tokens(128, seed=7)
        pinned_kv = random_kv(SPEC4, 128, seed=7)
        await store.put_prefix(pinned_tokens, pinned_kv)
        pinned_keys = store.chunk_keys(pinned_tokens)
        with store.chunks.pinned(pinned_keys):
            for i in range(10):  # 3-4 chunks each into a host tier of 6: every snapshot evicts
                tokens = random_tokens(200 + 10 * i, seed=100 + i)
                kv = random_kv(SPEC4, len(tokens), seed=200 + i)
                sessions[f"s{i}"] = (tokens, kv)
                await store.snapshot(f"s{i}", tokens, kv)
                if i % 3 == 0:
                    store.chunks.hold(f"h{i}", "test", store.chunk_keys(tokens), for_s=60, back_in_s=1)
                host = (await store.chunks.stats())[0]
                assert host.bytes_used <= 6 * CHUNK_BYTES and host.arena_free_bytes <= 3 * CHUNK_BYTES
                assert all("host" in store.chunks.where(k) for k in pinned_keys)  # pinned: never evicted
            for sid, (_, kv) in sessions.items():  # reads promote into host: more recycling
                r = await store.resume(sid)
                assert r.complete and bits_equal(r.kv, kv), sid
                await store.flush()
        into = torch.zeros_like(pinned_kv)
        assert await store.load(pinned_tokens, into) == 128 and bits_equal(into, pinned_kv)
        host = (await store.chunks.stats())[0]
        assert host.arena_reused > 2  # beyond the two prefaulted buffers: evicted ones came back
        assert host.bytes_used <= 6 * CHUNK_BYTES and host.arena_free_bytes <= 3 * CHUNK_BYTES
    async with open_store(tiers=layout) as store:  # and every byte on disk after a restart
        for sid, (_, kv) in sessions.items():
            assert bits_equal((await store.resume(sid)).kv, kv), sid


async def test_writes_to_copying_tiers_reuse_their_encode_buffers_and_stay_exact(open_store, redis_server) -> None:  # type: ignore[no-untyped-def]
    """Without a host tier (LMDB alone; Redis alone with a shared catalog) each stored value's buffer
    serves the next encode of its size; what was stored before stays bit-exact, before and after a
    reopen. With a host tier the buffers stay the tier's: none is recycled from under it."""
    sessions = {f"s{i}": (random_tokens(4 * 64, seed=i), random_kv(SPEC4, 4 * 64, seed=i)) for i in range(6)}
    layouts = {
        "lmdb": {"tiers": [TierConfig(kind="lmdb")]},
        "redis": {"tiers": [TierConfig(kind="redis", url=redis_server.url, prefix="arena-test:")],
                  "catalog_url": redis_server.url, "catalog_prefix": "arena-test-catalog:"},
        "host-lmdb": {},
    }  # fmt: skip
    for name, options in layouts.items():
        async with open_store(**options) as store:
            for sid, (tokens, kv) in sessions.items():
                await store.snapshot(f"{name}-{sid}", tokens, kv)
            counts = store.chunks.counters()
            if name == "host-lmdb":
                assert counts["scratch_reused"] == 0, "a buffer the host tier keeps was recycled"
            else:
                assert counts["scratch_reused"] >= 4 * (len(sessions) - 1), (name, counts)
            for sid, (tokens, kv) in sessions.items():
                result = await store.resume(f"{name}-{sid}")
                assert result.complete and bits_equal(result.kv, kv), (name, sid)
            scratch = store.chunks._scratch
        assert scratch.stats().free_bytes == 0, "a closed store kept its recycled buffers"
        async with open_store(**options) as store:
            for sid, (tokens, kv) in sessions.items():
                assert bits_equal((await store.resume(f"{name}-{sid}")).kv, kv), (name, sid, "reopened")
