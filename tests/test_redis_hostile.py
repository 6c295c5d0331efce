"""The Redis tier against a hostile or broken server: every odd reply is a miss, never a hang or a bomb.

A session is snapshotted into a real redis-server through a proxy written here with asyncio; a second
store (another host's view: same shared catalog, an empty local tier) then resumes it while the proxy
answers each GET of a value with one class of hostile reply. Whatever the reply, the resume returns
(a miss: fewer tokens restored, the engine recomputes the rest) without an untyped exception, the
connection that carried the reply is dropped (an error reply excepted: that is an answer), the process
grows by less than 64 MiB however long the value the server declares, and nothing stored in Redis
changes. Once the proxy is honest again the same store, on the same connection pool, resumes the
session bit-exact.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import torch

from agentstate import StateStore, codec
from agentstate.backends.redis import RedisBackend
from agentstate.config import TierConfig
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.redis_server import RedisServer

CHUNK = 64  # tokens: 64 x 2 KiB of SPEC4 KV = a 128 KiB chunk
TOKENS = 7 * CHUNK + 10  # seven chunks and a tail
MiB = 1 << 20
LIMIT = codec.encoded_size(CHUNK * SPEC4.token_bytes)  # the largest valid value of a chunk key

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]
"""A hostile reply to one GET, written to the client; returns whether the connection stays usable."""


def reply(data: bytes) -> Answer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(data)
        await writer.drain()
        return True

    return answer


def header_then(n: int, *, drip: bool) -> Answer:
    """A bulk header declaring `n` bytes, then nothing (`drip=False`) or a byte every 50 ms, until the
    client hangs up."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"$%d\r\n" % n)
        await writer.drain()
        while not reader.at_eof():
            if drip:
                writer.write(b"\x00")
                await writer.drain()
            try:
                await asyncio.wait_for(reader.read(1 << 16), 0.05)
            except TimeoutError:
                pass
        return False

    return answer


def genuine(n: int) -> Answer:
    """A well-formed value of `n` bytes (sent in slices, so this process never buffers much of it)."""
    piece = bytes(range(256)) * 1024  # 256 KiB

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"$%d\r\n" % n)
        for at in range(0, n, len(piece)):
            writer.write(piece[: min(len(piece), n - at)])
            await writer.drain()
        writer.write(b"\r\n")
        await writer.drain()
        return True

    return answer


def closed_mid_value() -> Answer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"$%d\r\n" % LIMIT + bytes(1000))
        await writer.drain()
        return False  # the server closes the connection halfway through the value

    return answer


HOSTILE: dict[str, Answer] = {
    "integer": reply(b":5\r\n"),
    "array": reply(b"*2\r\n$1\r\na\r\n$1\r\nb\r\n"),
    "nil array": reply(b"*-1\r\n"),
    "simple string": reply(b"+OK\r\n"),
    "error": reply(b"-ERR hostile\r\n"),
    "junk length": reply(b"$12ab\r\n"),
    "negative length": reply(b"$-7\r\n"),
    "512 MiB header then nothing": header_then(512 * MiB, drip=False),
    "512 MiB header then slow bytes": header_then(512 * MiB, drip=True),
    "64 MiB header then slow bytes": header_then(64 * MiB, drip=True),
    "chunk-sized header then nothing": header_then(LIMIT, drip=False),  # within the bound: the timeout ends it
    "chunk-sized header then slow bytes": header_then(LIMIT, drip=True),
    "a genuine 64 MiB value": genuine(64 * MiB),
    "a value one byte too long": genuine(LIMIT + 1),
    "closed mid-value": closed_mid_value(),
}
KEEPS_CONNECTION = {"error"}
"""An error reply answers its request alone: the stream is still in sync, the connection stays."""


async def _command(reader: asyncio.StreamReader) -> tuple[list[bytes], bytes] | None:
    """One RESP command from a client (an array of bulk strings), and its raw bytes; None at EOF."""
    head = await reader.readline()
    if not head:
        return None
    raw, args = [head], []
    for _ in range(int(head[1:])):
        length = await reader.readline()
        data = await reader.readexactly(int(length[1:]) + 2)
        raw += [length, data]
        args.append(data[:-2])
    return args, b"".join(raw)


async def _reply(reader: asyncio.StreamReader) -> bytes:
    """One reply from the real server, raw (RESP3 too: redis-py says HELLO 3 when it connects)."""
    line = await reader.readline()
    kind, n = line[:1], line[1:-2]
    if kind in b"$=!" and n != b"?" and int(n) >= 0:  # bulk string, verbatim string, bulk error
        return line + await reader.readexactly(int(n) + 2)
    items = {b"*": 1, b"~": 1, b">": 1, b"%": 2}.get(kind)
    if items is not None and int(n) >= 0:  # array, set, push; map (a key and a value per entry)
        return line + b"".join([await _reply(reader) for _ in range(items * int(n))])
    if kind == b"|":  # attributes, then the reply they describe
        return line + b"".join([await _reply(reader) for _ in range(2 * int(n) + 1)])
    return line


class HostileProxy:
    """Forwards every command to a real redis-server, except GETs of values (chunk and tail keys)
    while `answer` is set: those get the hostile answer instead. Counts the connections that got one
    and that the client has not hung up yet."""

    def __init__(self, upstream: RedisServer) -> None:
        self.upstream = upstream
        self.answer: Answer | None = None
        self.hostile_replies = 0
        self.open_after_hostile: set[int] = set()
        self.server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> HostileProxy:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream.port)
        me = id(writer)
        try:
            while (got := await _command(reader)) is not None:
                args, raw = got
                value_get = args[0].upper() == b"GET" and re.search(rb":(c|t)/", args[1]) is not None
                if self.answer is not None and value_get:
                    self.hostile_replies += 1
                    self.open_after_hostile.add(me)
                    if not await self.answer(reader, writer):
                        break
                    continue
                up_writer.write(raw)
                await up_writer.drain()
                writer.write(await _reply(up_reader))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client dropped the connection: what a bad reply must make it do
        finally:
            self.open_after_hostile.discard(me)
            up_writer.close()
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


class PeakRss:
    """The process's peak resident memory over a block, above its resident memory at the start:
    the kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs), or, where that cannot
    be reset, VmRSS sampled by a thread."""

    def __init__(self) -> None:
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) << 10  # type: ignore[union-attr]

    def __enter__(self) -> PeakRss:
        self.base = self._status("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._status("VmRSS"))

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.peak = self._status("VmHWM")

    @property
    def growth(self) -> int:
        return max(0, self.peak - self.base)


async def stored_values(server: RedisServer, prefix: str) -> dict[bytes, bytes]:
    """Every chunk and tail value under `prefix`, read from the real server directly."""
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(server.url)
    try:
        keys = [k for ns in ("c/", "t/") for k in [j async for j in r.scan_iter(match=f"{prefix}{ns}*")]]
        return {k: await r.get(k) for k in keys}
    finally:
        await r.aclose()


@pytest.fixture
async def proxy(redis_server: RedisServer) -> AsyncIterator[HostileProxy]:
    p = await HostileProxy(redis_server).start()
    yield p
    await p.stop()


@pytest.mark.parametrize("kind", list(HOSTILE))
async def test_each_hostile_reply_is_a_bounded_miss_and_the_pool_recovers(
    kind: str, proxy: HostileProxy, redis_server: RedisServer, tmp_path: Path
) -> None:
    prefix = f"hostile-{re.sub(r'[^a-z0-9]+', '-', kind)}:"
    tiers = [
        TierConfig(kind="lmdb"),
        TierConfig(kind="redis", url=proxy.url, prefix=prefix, timeout_s=1.0, breaker_threshold=50),
    ]
    opts = {"tiers": tiers, "chunk_tokens": CHUNK, "catalog_url": redis_server.url, "catalog_prefix": prefix,
            "lmdb_map_size": 64 * MiB, "promote_on_read": False}  # fmt: skip
    tokens, kv = random_tokens(TOKENS, seed=7), random_kv(SPEC4, TOKENS, seed=7)
    async with StateStore.open(tmp_path / "writer", SPEC4, **opts) as writer:
        await writer.snapshot("victim", tokens, kv, state={"turn": 1})
    before = await stored_values(redis_server, prefix)
    assert len(before) == 8 and all(len(v) <= LIMIT for v in before.values())  # seven chunks and the tail

    async with StateStore.open(tmp_path / "reader", SPEC4, **opts) as reader:  # another host: nothing local
        remote = reader.chunks.backend("redis")
        assert isinstance(remote, RedisBackend)
        proxy.answer = HOSTILE[kind]
        into = torch.zeros_like(kv)
        with PeakRss() as rss:
            result = await asyncio.wait_for(reader.resume("victim", into), 60)  # a hang guard, not a figure
        assert proxy.hostile_replies >= 1
        assert result.restored_tokens < TOKENS and result.tokens == tokens  # a miss: the engine recomputes
        n = result.restored_tokens
        assert bits_equal(into[:, :, :n], kv[:, :, :n]) and not into[:, :, n:].view(torch.uint8).any()
        assert rss.growth < 64 * MiB, f"{kind}: the process grew by {rss.growth / MiB:.0f} MiB"
        if kind not in KEEPS_CONNECTION:  # a reply out of protocol: the client hangs up on it
            for _ in range(500):  # a hang guard: the drop is immediate, its arrival here takes a loop turn or two
                if not proxy.open_after_hostile:
                    break
                await asyncio.sleep(0.01)
            assert not proxy.open_after_hostile, f"{kind}: the connection that carried it is still open"
        for conn in (c for pool in remote._wire.pools.values() for c in pool.conns):  # type: ignore[union-attr]
            assert len(conn._staging) <= 8 * MiB  # no staging kept past the bound
        assert await stored_values(redis_server, prefix) == before  # nothing stored changed

        proxy.answer = None  # honest again: the same pool serves the genuine values bit-exact
        got: dict[int, bytes] = {}
        keys = [k.decode()[len(prefix) :] for k in before]
        limits = [LIMIT] * len(keys)
        found = await remote.read_bounded(keys, lambda i, v: got.__setitem__(i, bytes(v)), limits)
        assert found == [True] * len(keys) and [got[i] for i in range(len(keys))] == list(before.values())
        async with StateStore.open(tmp_path / "again", SPEC4, **opts) as again:
            whole = await asyncio.wait_for(again.resume("victim"), 60)
        assert whole.restored_tokens == TOKENS and bits_equal(whole.kv, kv)
        assert (await reader.session("victim")).version == 1


@pytest.mark.parametrize("kind", ["512 MiB header then nothing", "512 MiB header then slow bytes"])
async def test_an_unbounded_read_stages_only_the_bytes_that_arrive(kind: str, proxy: HostileProxy) -> None:
    """`read` without bounds (the operator tools' raw reads) cannot refuse a length up front: its
    staging grows with the bytes that arrive, so a declared 512 MiB that never comes costs a MiB
    per connection, and the 1 s timeout turns it into a miss."""
    b = RedisBackend(proxy.url, prefix="unbounded:", timeout_s=1.0, connections=4)
    try:
        await b.put([f"c/{i}" for i in range(8)], [bytes([i]) * 1000 for i in range(8)])
        proxy.answer = HOSTILE[kind]
        got: list[int] = []
        with PeakRss() as rss:
            found = await asyncio.wait_for(b.read([f"c/{i}" for i in range(8)], lambda i, v: got.append(i)), 60)
        assert found == [False] * 8 and got == [] and b.counters()["errors"] >= 1
        assert rss.growth < 64 * MiB, f"{kind}: the process grew by {rss.growth / MiB:.0f} MiB"
        conns = [c for pool in b._wire.pools.values() for c in pool.conns]  # type: ignore[union-attr]
        assert all(c.closed is not None for c in conns)  # each timed out and was dropped
        proxy.answer = None
        seen: dict[int, bytes] = {}
        assert await b.read(["c/3"], lambda i, v: seen.__setitem__(i, bytes(v))) == [True] and seen == {0: b"\3" * 1000}
    finally:
        await b.delete([f"c/{i}" for i in range(8)])
        await b.close()
