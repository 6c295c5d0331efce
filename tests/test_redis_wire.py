"""The Redis tier's wire read path: GET replies parsed straight into caller buffers.

Against a real redis-server (and a cluster) for round trips, and against a scripted fake server for
each class of broken reply: whatever the server sends, a read is the exact stored bytes, a miss, or
a typed error, never other bytes, never a write past the buffer or after the caller gave up.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from agentstate.backends import redis_wire as wire
from agentstate.backends.redis import RedisBackend
from agentstate.backends.redis_pool import NodePool

from agentstate.errors import AgentStateError, BackendRefusedError, InvalidArgumentError
from tests.redis_server import RedisCluster, RedisServer

GUARD = 4096
SIZES = [0, 1, 2, 4095, 4096, 4097, 65535, 65536, 65537, (256 << 10) - 1, 256 << 10, (256 << 10) + 1, (3 << 20) + 7]
"""Around the wire client's buffer boundaries (its 4 KiB header window, the 64 KiB large-value mark,
its 256 KiB scratch buffer) and a few MiB."""


def guarded(n: int, fill: int = 0xA5) -> tuple[bytearray, memoryview]:
    """A buffer of `n` bytes followed by a guard region, both filled with a pattern."""
    raw = bytearray([fill]) * (n + GUARD)
    return raw, memoryview(raw)[:n]


@pytest.fixture
async def backend(redis_server: RedisServer, request: pytest.FixtureRequest) -> AsyncIterator[RedisBackend]:
    b = RedisBackend(redis_server.url, prefix=f"wire-{request.node.name}:", connections=getattr(request, "param", 2))
    yield b
    await b.close()


@pytest.mark.parametrize("backend", [1, 3], indirect=True)
async def test_assorted_sizes_round_trip_bit_exact_through_get_into_and_read(backend: RedisBackend) -> None:
    rng = random.Random(1)
    values = [rng.randbytes(n) for n in SIZES]
    keys = [f"c/{i}" for i in range(len(values))]
    await backend.put(keys, values)
    assert backend._wire is not None
    exact = [guarded(n) for n in SIZES]  # buffers exactly the value's size
    roomy = [guarded(n + 100) for n in SIZES]  # and larger ones
    for bufs in (exact, roomy):
        got = await backend.get_into(keys, [v for _, v in bufs])
        assert got == SIZES  # a 0-byte value is 0 written, like a miss: no chunk is empty
        for (raw, view), value in zip(bufs, values):
            assert bytes(view[: len(value)]) == value and raw[len(view) :] == bytearray([0xA5]) * GUARD
    seen: dict[int, bytes] = {}
    assert await backend.read(keys, lambda i, v: seen.__setitem__(i, bytes(v))) == [True] * len(keys)
    assert [seen[i] for i in range(len(keys))] == values
    assert backend.counters()["reads"] == 3 * len(keys)


async def test_misses_hits_and_values_too_big_for_their_buffers_in_one_batch(backend: RedisBackend) -> None:
    values = {f"c/{n}": os.urandom(n) for n in (1, 4097, 70_000, 300_000, 2 << 20)}
    await backend.put(list(values), list(values.values()))
    cases: list[tuple[str, int, int]] = []  # key, buffer size, bytes expected
    for key, value in values.items():
        cases += [(key, len(value) - 1, 0), (key, len(value), len(value)), (key, 0, 0)]  # too big by one, exact, none
        cases.append((key.replace("c/", "c/missing-"), len(value), 0))
    keys, want = [k for k, _, _ in cases], [n for _, _, n in cases]
    bufs = [guarded(room) for _, room, _ in cases]
    assert await backend.get_into(keys, [v for _, v in bufs]) == want
    for key, (raw, view), n in zip(keys, bufs, want):
        if n:
            assert bytes(view) == values[key]
        else:  # a miss or a value that does not fit: the buffer and its guard are untouched
            assert raw == bytearray([0xA5]) * (len(view) + GUARD)
    with pytest.raises(InvalidArgumentError):  # a caller's mistake, never an outage of the node
        await backend.get_into(keys[:1], [memoryview(b"read-only")])
    found = await backend.read(keys, lambda i, v: None)
    assert found == [not k.startswith("c/missing-") for k in keys]  # read has no buffers: every stored value
    assert await backend.exists(keys) == found  # EXISTS over the same connections
    counts = backend.counters()
    assert counts.get("errors", 0) == 0 and counts["misses"] >= 5


async def test_concurrent_calls_share_the_pool_and_each_gets_its_own_bytes(backend: RedisBackend) -> None:
    rng = random.Random(2)
    values = {f"c/{i}": rng.randbytes(rng.choice([10, 5000, 70_000, 600_000])) for i in range(40)}
    await backend.put(list(values), list(values.values()))

    async def one(seed: int) -> None:
        keys = random.Random(seed).sample(list(values), 6) + ["c/nope"]
        bufs = [memoryview(bytearray(700_000)) for _ in keys]
        got = await backend.get_into(keys, bufs)
        assert got == [len(values.get(k, b"")) for k in keys]
        assert all(bytes(b[:n]) == values[k] for k, b, n in zip(keys, bufs, got) if n)

    await asyncio.gather(*(one(s) for s in range(60)))
    pools = list(backend._wire.pools.values())
    assert len(pools) == 1 and len(pools[0].conns) == 2  # 60 callers over two connections


async def test_an_error_reply_is_a_typed_refusal_never_bytes(backend: RedisBackend, redis_server: RedisServer) -> None:
    import redis.asyncio as aioredis

    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        await admin.hset(backend.stored_key("c/hash"), "f", "v")  # GET on a hash: WRONGTYPE
        await admin.lpush(backend.stored_key("c/list"), "x")
    finally:
        await admin.aclose()
    await backend.put(["c/ok"], [b"fine"])
    raw, view = guarded(64)
    got = await backend.get_into(["c/hash", "c/ok", "c/list"], [view, memoryview(bytearray(64)), guarded(64)[1]])
    assert got == [0, 4, 0] and raw == bytearray([0xA5]) * (64 + GUARD)
    assert backend.counters()["refused"] == 2 and backend.trips == 0  # an answer, not an outage
    pool = next(iter(backend._wire.pools.values()))
    out = await pool.fetch([backend.stored_key("c/hash").encode()], [view], timeout=2.0)
    refused = out[0]
    assert isinstance(refused, wire.ReplyError) and issubclass(wire.ReplyError, BackendRefusedError)  # typed
    assert refused.reply.startswith("WRONGTYPE") and not refused.retryable


async def test_connections_killed_between_reads_are_reopened_within_the_call(
    backend: RedisBackend, redis_server: RedisServer
) -> None:
    import redis.asyncio as aioredis

    values = [os.urandom(300_000) for _ in range(6)]
    keys = [f"c/{i}" for i in range(6)]
    await backend.put(keys, values)
    bufs = [memoryview(bytearray(300_000)) for _ in keys]
    assert await backend.get_into(keys, bufs) == [300_000] * 6
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        await admin.client_kill_filter(_type="normal", skipme=True)  # the pool's connections among them
    finally:
        await admin.aclose()
    bufs = [memoryview(bytearray(300_000)) for _ in keys]
    assert await backend.get_into(keys, bufs) == [300_000] * 6 and [bytes(b) for b in bufs] == values
    assert backend.trips == 0 and backend.counters().get("errors", 0) == 0  # retried inside the call


async def test_a_cluster_reads_from_every_node_and_redirects_fall_back_to_redis_py(redis_cluster: RedisCluster) -> None:
    b = RedisBackend(redis_cluster.url, cluster=True, prefix="wire-cluster:")
    try:
        values = {f"c/{i}": os.urandom(1000 + 37 * i) for i in range(60)}
        await b.put(list(values), list(values.values()))
        nodes = {b.node_of(k).name for k in values}
        assert len(nodes) == 3  # keys on every node
        bufs = [memoryview(bytearray(4000)) for _ in values]
        assert await b.get_into(list(values), bufs) == [len(v) for v in values.values()]
        assert all(bytes(buf[: len(v)]) == v for buf, v in zip(bufs, values.values()))
        assert set(b._wire.pools) == nodes
        assert await b.exists([*values, "c/none"]) == [True] * len(values) + [False]

        route = b._wire.route  # a stale slot map: every key sent to a node that does not own it (MOVED)

        def stale(keys: list[str]) -> dict[str, tuple[wire.WireConfig, list[int]]]:
            groups = route(keys)
            names = sorted(groups)
            return {names[(j + 1) % len(names)]: (groups[names[(j + 1) % len(names)]][0], groups[n][1])
                    for j, n in enumerate(names)}  # fmt: skip

        b._wire.route = stale  # type: ignore[method-assign]
        py_read, asked = b.read_via_client, []

        async def spy(keys: list[str], sink: Callable[[int, memoryview], None]) -> list[bool]:
            asked.extend(keys)
            return await py_read(keys, sink)

        b.read_via_client = spy  # type: ignore[method-assign]
        bufs = [memoryview(bytearray(4000)) for _ in values]
        assert await b.get_into(list(values), bufs) == [len(v) for v in values.values()]
        assert sorted(asked) == sorted(values)  # every key was MOVED, and redis-py read it
        assert await b.exists([*values, "c/none"]) == [True] * len(values) + [False]  # redis-py's EXISTS too
        assert all(bytes(buf[: len(v)]) == v for buf, v in zip(bufs, values.values()))
        assert b.counters().get("refused", 0) == 0  # MOVED is not a refusal: redis-py served them
    finally:
        await b.close()


async def test_a_server_killed_or_hung_mid_read_is_a_counted_miss_within_the_timeout(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    # One connection: at most its first window (8 GETs) is answered before the kill, of 24.
    b = RedisBackend(server.url, timeout_s=0.5, breaker_threshold=2, breaker_cooldown_s=60, retries=1, connections=1)
    try:
        values = [os.urandom(1 << 20) for _ in range(24)]
        keys = [f"c/{i}" for i in range(24)]
        writer = RedisBackend(server.url, timeout_s=60)  # 24 MiB written on a busy machine: not what is timed here
        try:
            await writer.put(keys, values)
        finally:
            await writer.close()
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)  # hung: the call gives up at its timeout
        bufs = [guarded(1 << 20) for _ in keys]
        got = await asyncio.wait_for(b.get_into(keys, [v for _, v in bufs]), 10)  # a hang guard, not a figure
        assert got == [0] * 24 and b.counters()["errors"] == 1
        os.kill(server.proc.pid, signal.SIGCONT)  # its replies now arrive: dropped, never written
        await asyncio.sleep(0.2)
        assert all(raw == bytearray([0xA5]) * len(raw) for raw, _ in bufs)

        killed: list[int] = []

        def kill_after_first(i: int, view: memoryview) -> None:
            assert bytes(view) == values[i]
            if not killed:
                killed.append(i)
                server.stop()  # dies while the rest of the batch is in flight

        found = await asyncio.wait_for(b.read(keys, kill_after_first), 10)
        assert found[killed[0]] and not all(found)
        assert b.breaker.open and b.counters()["errors"] == 2  # counted, and the breaker stops asking
        assert await b.get_into(keys[:1], [bufs[0][1]]) == [0]
        assert await b.exists(keys[:1]) == [False]  # the breaker is open: nothing is asked
    finally:
        await b.close()
        server.stop()


def test_urls_the_wire_client_does_not_speak_stay_on_redis_py() -> None:
    assert wire.wire_config("redis://h:7000/3") == wire.WireConfig("h", 7000, None, None, 3)
    assert wire.wire_config("redis://:p%40ss@h") == wire.WireConfig("h", 6379, None, "p@ss", 0)
    assert wire.wire_config("redis://u:pw@h:1/0") == wire.WireConfig("h", 1, "u", "pw", 0)
    for url in ("rediss://h:6380/0", "unix:///tmp/r.sock", "redis://h/0?socket_timeout=1", "redis://h/x"):
        assert wire.wire_config(url) is None
    assert RedisBackend("rediss://127.0.0.1:1/0")._wire is None


async def test_a_password_in_the_url_is_sent_and_a_wrong_one_is_not_silent(tmp_path: Path) -> None:
    import redis

    server = RedisServer(tmp_path).start()
    redis.Redis(port=server.port).config_set("requirepass", "s3cret")  # after start: its probe has no password
    good = RedisBackend(f"redis://:s3cret@127.0.0.1:{server.port}/2")
    bad = RedisBackend(f"redis://:wrong@127.0.0.1:{server.port}/0", breaker_threshold=1)
    none = RedisBackend(f"redis://127.0.0.1:{server.port}/0", breaker_threshold=1)  # every GET answers NOAUTH
    try:
        await good.put(["c/a"], [b"abc"])
        assert await good.get_into(["c/a"], [memoryview(bytearray(8))]) == [3] and good._wire.pools
        assert await bad.get_into(["c/a"], [memoryview(bytearray(8))]) == [0]  # redis-py: an outage, counted
        assert bad.counters()["errors"] >= 1
        assert await none.get_into(["c/a"], [memoryview(bytearray(8))]) == [0] and await none.exists(["c/a"]) == [False]
        assert none.counters()["errors"] >= 1 and "refused" not in none.counters()  # not the key's fault
    finally:
        await good.close()
        await bad.close()
        await none.close()
        server.stop()


# -- a scripted server: each class of broken reply -------------------------------------------------

Script = Callable[[int], tuple[bytes, bool]]
"""The reply to the n-th GET the server receives, and whether the connection stays open after it."""


async def fake_server(script: Script) -> tuple[asyncio.Server, int]:
    count = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readline():  # *2, $3, GET, $n, key: five lines a command
                for _ in range(4):
                    await reader.readline()
                reply, keep = script(count[0])
                count[0] += 1
                writer.write(reply)
                await writer.drain()
                if not keep:
                    break
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


BROKEN = {
    "status reply": b"+OK\r\n",
    "integer reply": b":5\r\n",
    "array reply": b"*1\r\n$1\r\na\r\n",
    "non-numeric length": b"$abc\r\n",
    "negative length": b"$-5\r\n",
    "length past the bulk limit": b"$999999999999\r\n",
    "value without CRLF": b"$3\r\nabcXY",
    "a line that never ends": b"$" + b"1" * (70 << 10),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
async def test_a_reply_no_get_returns_fails_the_connection_never_writes_past_the_buffer(kind: str) -> None:
    server, port = await fake_server(lambda n: (BROKEN[kind] if n % 2 == 0 else b"$3\r\nabc\r\n", True))
    pool = NodePool(wire.WireConfig("127.0.0.1", port), 1)
    try:
        raw, view = guarded(3)
        out = await pool.fetch([b"k"], [view], timeout=2.0, retries=0)
        assert isinstance(out[0], wire.WireProtocolError) and isinstance(out[0], AgentStateError)
        assert raw[3:] == bytearray([0xA5]) * GUARD
        assert await pool.fetch([b"k"], [view], timeout=2.0) == [3] and bytes(view) == b"abc"  # a fresh connection
        delivered: list[bytes] = []  # read's sinks: handed a value only once its reply is whole and well formed
        out = await pool.fetch([b"k"], [lambda v: delivered.append(bytes(v))], timeout=2.0, retries=0)
        assert isinstance(out[0], wire.WireProtocolError) and delivered == []
        assert await pool.fetch([b"k"], [view], timeout=2.0) == [3] and bytes(view) == b"abc"  # a fresh connection
    finally:
        pool.close()
        server.close()


@pytest.mark.parametrize("cut", [0, 3, 6, 50, 106])
async def test_a_connection_dropped_mid_value_is_retried_then_an_outage(cut: int) -> None:
    value = os.urandom(100)
    server, port = await fake_server(lambda n: ((b"$100\r\n" + value)[:cut], False))
    pool = NodePool(wire.WireConfig("127.0.0.1", port), 2)
    try:
        delivered: list[bytes] = []
        out = await pool.fetch([b"a", b"b"], [memoryview(bytearray(100)), lambda v: delivered.append(bytes(v))],
                               timeout=2.0, retries=2)  # fmt: skip
        assert all(type(r) is wire.WireError for r in out) and delivered == []  # an outage, never half a value
    finally:
        pool.close()
        server.close()


async def test_an_error_reply_fails_only_its_request_and_a_cancelled_read_never_lands() -> None:
    replies = {0: b"-ERR boom\r\n", 1: b"$2\r\nok\r\n"}
    server, port = await fake_server(lambda n: (replies.get(n, b"$4\r\nlate\r\n"), True))
    pool = NodePool(wire.WireConfig("127.0.0.1", port), 1)
    try:
        a, b = memoryview(bytearray(8)), memoryview(bytearray(8))
        out = await pool.fetch([b"x", b"y"], [a, b], timeout=2.0)
        assert isinstance(out[0], wire.ReplyError) and out[0].reply == "ERR boom" and out[1] == 2
        conn = pool.conns[0]
        conn.transport.pause_reading()  # type: ignore[union-attr]  # the reply waits in the socket
        raw, view = guarded(4)
        task = asyncio.ensure_future(pool.fetch([b"z"], [view], timeout=2.0))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        conn.transport.resume_reading()  # type: ignore[union-attr]
        assert await pool.fetch([b"w"], [memoryview(bytearray(4))], timeout=2.0) == [4]  # same connection
        assert pool.conns == [conn] and raw == bytearray([0xA5]) * (4 + GUARD)  # the cancelled one: dropped
    finally:
        pool.close()
        server.close()
