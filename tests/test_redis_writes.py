"""The Redis tier's write path: pipelined SETs sent from the values' own memory.

Against a real redis-server (and a cluster) for round trips, and against a scripted server for each
class of broken answer: a write is confirmed only by its own +OK; anything else is a typed error
(or a key handed to redis-py, for replies about where to ask), never a write counted as done.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import torch

from agentstate.backends.redis import RedisBackend
from agentstate.backends.redis_wire import WireConfig
from agentstate.backends.redis_writes import HandshakeRefused, Item, NodeWriters, WireProtocolError
from agentstate.errors import AgentStateError, BackendError, BackendRefusedError
from tests.redis_server import RedisCluster, RedisServer

SIZES = [0, 1, 4095, 65536, (1 << 20) + 3, (9 << 20) + 1]
"""Empty, small, and past what one sendmsg takes (the kernel's send buffer): partial sends resume."""


async def test_assorted_values_are_stored_bit_exact_with_their_ttl(redis_server: RedisServer) -> None:
    b = RedisBackend(redis_server.url, prefix="writes-ttl:", ttl_seconds=300, connections=3)
    admin = redis.Redis(port=redis_server.port)
    try:
        values = [os.urandom(n) for n in SIZES]
        fp16 = torch.randn(3, 1000, dtype=torch.float16)  # a typed buffer: its bytes, not its elements
        keys = [f"c/{i}" for i in range(len(values))] + ["c/fp16"]
        await b.put(keys, [*values, memoryview(fp16.numpy())])
        for key, value in zip(keys, [*values, fp16.numpy().tobytes()]):
            assert admin.get(f"writes-ttl:{key}") == value
            assert 290 < admin.ttl(f"writes-ttl:{key}") <= 300
        assert b.counters()["writes"] == len(keys) and b._writer is not None and b._writer.pools
        await b.put(keys[:2], values[:2])  # again: idempotent, on the pooled connections
        assert admin.get("writes-ttl:c/1") == values[1]
    finally:
        await b.close()
        admin.close()


async def test_concurrent_puts_share_the_pool_and_each_value_lands_under_its_key(redis_server: RedisServer) -> None:
    b = RedisBackend(redis_server.url, prefix="writes-conc:", connections=2)
    admin = redis.Redis(port=redis_server.port)
    try:
        values = {f"c/{i}": os.urandom(10_000 + 997 * i) for i in range(48)}
        items = list(values.items())
        await asyncio.gather(*(b.put([k for k, _ in items[j::6]], [v for _, v in items[j::6]]) for j in range(6)))
        assert all(admin.get(f"writes-conc:{k}") == v for k, v in values.items())
        assert b._writer.pools[b.server].opened <= 2  # bounded by `connections`, whatever the callers
    finally:
        await b.close()
        admin.close()


async def test_killed_connections_are_reopened_and_a_dead_server_is_a_typed_outage(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    b = RedisBackend(server.url, timeout_s=0.5, breaker_threshold=1, breaker_cooldown_s=60, retries=1)
    admin = redis.Redis(port=server.port)
    try:
        await b.put(["c/a"], [b"first"])
        admin.client_kill_filter(_type="normal", skipme=True)  # the pooled write connections are dead
        value = os.urandom(3 << 20)
        await b.put(["c/a", "c/b"], [b"second", value])  # resent on fresh connections inside the call
        assert admin.get("agentstate:c/a") == b"second" and admin.get("agentstate:c/b") == value
        assert b.trips == 0
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)  # hung: the call gives up at its timeout
        try:
            with pytest.raises(BackendError) as err:
                await asyncio.wait_for(b.put(["c/c"], [os.urandom(8 << 20)]), 10)  # a hang guard, not a figure
            assert isinstance(err.value, AgentStateError) and err.value.retryable and b.breaker.open
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        with pytest.raises(BackendError):  # the breaker is open: nothing is sent
            await b.put(["c/d"], [b"x"])
        assert admin.exists("agentstate:c/d") == 0
    finally:
        await b.close()
        admin.close()
        server.stop()


async def test_a_cancelled_put_never_reuses_its_half_sent_connection(redis_server: RedisServer) -> None:
    b = RedisBackend(redis_server.url, prefix="writes-cancel:", connections=1)
    admin = redis.Redis(port=redis_server.port)
    try:
        big = [os.urandom(16 << 20) for _ in range(4)]
        task = asyncio.ensure_future(b.put([f"c/{i}" for i in range(4)], big))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        pool = b._writer.pools[b.server]
        assert pool.opened == 0 and not pool.idle  # closed, not handed to the next caller mid-command
        await b.put(["c/after"], [b"exact"])
        assert admin.get("writes-cancel:c/after") == b"exact"
        for i, value in enumerate(big):  # each is whole or absent: SET is atomic per key
            assert admin.get(f"writes-cancel:c/{i}") in (None, value)
    finally:
        await b.close()
        admin.close()


async def test_a_cluster_gets_each_key_on_its_node_and_redirects_go_to_redis_py(redis_cluster: RedisCluster) -> None:
    b = RedisBackend(redis_cluster.url, cluster=True, prefix="writes-cluster:")
    try:
        values = {f"c/{i}": os.urandom(1000 + 37 * i) for i in range(60)}
        await b.put(list(values), list(values.values()))
        assert set(b._writer.pools) == {b.node_of(k).name for k in values} and len(b._writer.pools) == 3
        got: dict[int, bytes] = {}
        assert all(await b.read(list(values), lambda i, v: got.__setitem__(i, bytes(v))))
        assert [got[i] for i in range(len(values))] == list(values.values())

        route = b._wire.route  # a stale slot map: every key sent to a node that does not own it (MOVED)

        def stale(keys: list[str]) -> dict[str, tuple[WireConfig, list[int]]]:
            groups = route(keys)
            names = sorted(groups)
            return {names[(j + 1) % len(names)]: (groups[names[(j + 1) % len(names)]][0], groups[n][1])
                    for j, n in enumerate(names)}  # fmt: skip

        b._wire.route = stale  # type: ignore[method-assign]
        asked: list[str] = []
        py_put = b.put_via_client

        async def spy(keys: list[str], vals: list[memoryview]) -> None:
            asked.extend(keys)
            await py_put(keys, vals)

        b.put_via_client = spy  # type: ignore[method-assign]
        fresh = {k: os.urandom(500) for k in values}
        await b.put(list(fresh), list(fresh.values()))
        assert sorted(asked) == sorted(fresh) and b.counters().get("refused", 0) == 0  # MOVED is not a refusal
        b._wire.route = route  # type: ignore[method-assign]
        got.clear()
        assert all(await b.read(list(fresh), lambda i, v: got.__setitem__(i, bytes(v))))
        assert [got[i] for i in range(len(fresh))] == list(fresh.values())
    finally:
        await b.close()


async def test_a_refused_handshake_goes_to_redis_py_which_says_why(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    redis.Redis(port=server.port).config_set("requirepass", "s3cret")
    good = RedisBackend(f"redis://:s3cret@127.0.0.1:{server.port}/3")
    bad = RedisBackend(f"redis://:wrong@127.0.0.1:{server.port}/0", breaker_threshold=1)
    try:
        await good.put(["c/a"], [b"abc"])
        assert redis.Redis(port=server.port, password="s3cret", db=3).get("agentstate:c/a") == b"abc"
        with pytest.raises(AgentStateError):  # redis-py's answer to a wrong password, typed
            await bad.put(["c/a"], [b"other"])
        assert redis.Redis(port=server.port, password="s3cret", db=3).get("agentstate:c/a") == b"abc"
    finally:
        await good.close()
        await bad.close()
        server.stop()


# -- a scripted server: each class of broken answer --------------------------------------------------

Script = Callable[[int, bytes], tuple[bytes, bool]]
"""The answer to the n-th SET the server receives (and its key), and whether the connection stays open."""


async def fake_server(script: Script, stored: dict[bytes, bytes] | None = None) -> tuple[asyncio.Server, int]:
    count = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                args = []
                for _ in range(int(line[1:])):
                    n = int((await reader.readline())[1:])
                    args.append((await reader.readexactly(n + 2))[:n])
                answer, keep = script(count[0], args[1])
                count[0] += 1
                if stored is not None and answer == b"+OK\r\n":
                    stored[args[1]] = args[2]
                writer.write(answer)
                await writer.drain()
                if not keep:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


BROKEN = {
    "integer reply": b":1\r\n",
    "bulk reply": b"$2\r\nOK\r\n",
    "array reply": b"*1\r\n$2\r\nOK\r\n",
    "other status": b"+QUEUED\r\n",
    "a line that never ends": b"+" + b"O" * (70 << 10),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
async def test_an_answer_no_set_gives_is_never_a_confirmed_write(kind: str) -> None:
    server, port = await fake_server(lambda n, key: (BROKEN[kind], True))
    pool = NodeWriters(WireConfig("127.0.0.1", port), 1)
    try:
        out = await pool.put([Item(b"k", memoryview(b"v" * 100))], None, timeout=2.0, retries=1)
        assert isinstance(out[0], WireProtocolError) and isinstance(out[0], AgentStateError)
        assert pool.opened == 0  # every connection that heard it was dropped
    finally:
        pool.close()
        server.close()


@pytest.mark.parametrize("keep", [0, 1, 3])
async def test_a_connection_dropped_mid_batch_resends_only_what_is_unconfirmed(keep: int) -> None:
    stored: dict[bytes, bytes] = {}
    first, heard = [True], []

    def script(n: int, key: bytes) -> tuple[bytes, bool]:
        heard.append(key)
        if n == keep and first[0]:  # the first connection dies after confirming `keep` SETs
            first[0] = False
            return b"", False
        return b"+OK\r\n", True

    server, port = await fake_server(script, stored)
    pool = NodeWriters(WireConfig("127.0.0.1", port), 1)
    try:
        values = [os.urandom(5000 + i) for i in range(4)]
        out = await pool.put([Item(b"k%d" % i, memoryview(v)) for i, v in enumerate(values)], None, timeout=2.0)
        assert out == [None] * 4
        assert stored == {b"k%d" % i: v for i, v in enumerate(values)}
        assert heard == [b"k%d" % i for i in range(keep + 1)] + [b"k%d" % i for i in range(keep, 4)]
    finally:
        pool.close()
        server.close()


async def test_error_replies_settle_their_own_key_and_typed_through_the_backend() -> None:
    answers = {b"agentstate:c/bad": b"-ERR boom\r\n", b"agentstate:c/full": b"-OOM command not allowed\r\n"}
    stored: dict[bytes, bytes] = {}
    server, port = await fake_server(lambda n, key: (answers.get(key, b"+OK\r\n"), True), stored)
    b = RedisBackend(f"redis://127.0.0.1:{port}/0", connections=1)
    try:
        with pytest.raises(BackendRefusedError) as err:
            await b.put(["c/a", "c/bad", "c/b"], [b"1", b"2", b"3"])
        assert not err.value.retryable and "boom" in str(err.value)
        assert stored == {b"agentstate:c/a": b"1", b"agentstate:c/b": b"3"} and b.counters()["writes"] == 2
        from agentstate.errors import CapacityError

        with pytest.raises(CapacityError):  # the most specific reason wins
            await b.put(["c/bad", "c/full"], [b"2", b"4"])
        assert b.trips == 0  # answers, not outages
    finally:
        await b.close()
        server.close()


async def test_a_server_that_refuses_auth_is_a_handshake_refusal_not_retried() -> None:
    attempts = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        attempts[0] += 1
        await reader.readline()
        writer.write(b"-WRONGPASS invalid username-password pair\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    pool = NodeWriters(WireConfig("127.0.0.1", server.sockets[0].getsockname()[1], password="x"), 2)
    try:
        out = await pool.put([Item(b"k", memoryview(b"v"))], None, timeout=2.0, retries=2)
        assert isinstance(out[0], HandshakeRefused) and attempts[0] == 1
    finally:
        pool.close()
        server.close()


async def test_replies_nobody_asked_for_never_confirm_a_write() -> None:
    """A server that answers twice, or speaks while the connection is idle: its extra +OK must not be
    taken for the next SET's confirmation."""
    stored: dict[bytes, bytes] = {}
    server, port = await fake_server(lambda n, key: (b"+OK\r\n+OK\r\n", True), stored)
    pool = NodeWriters(WireConfig("127.0.0.1", port), 1)
    try:
        out = await pool.put([Item(b"a", memoryview(b"1")), Item(b"b", memoryview(b"2"))], None, timeout=2.0, retries=1)
        assert all(isinstance(o, WireProtocolError) for o in out) and pool.opened == 0
    finally:
        pool.close()
        server.close()

    connections = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        first = connections[0] == 1
        try:
            while line := await reader.readline():
                args = []
                for _ in range(int(line[1:])):
                    n = int((await reader.readline())[1:])
                    args.append((await reader.readexactly(n + 2))[:n])
                stored[args[1]] = args[2]
                writer.write(b"+OK\r\n")
                if first:  # then, while the connection is idle, one more nobody asked for
                    await asyncio.sleep(0.05)
                    writer.write(b"+OK\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    pool = NodeWriters(WireConfig("127.0.0.1", server.sockets[0].getsockname()[1]), 1)
    try:
        assert await pool.put([Item(b"c", memoryview(b"3"))], None, timeout=2.0) == [None]
        first_conn = pool.idle[0]
        await asyncio.sleep(0.2)  # the unsolicited reply arrives
        assert await pool.put([Item(b"d", memoryview(b"4"))], None, timeout=2.0) == [None]
        assert first_conn.closed and connections[0] == 2 and stored[b"d"] == b"4"  # sent again, on a fresh one
    finally:
        pool.close()
        server.close()
