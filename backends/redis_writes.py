"""The Redis tier's writes: pipelined SETs sent from the encoded buffers themselves.

Why not redis-py here: on Python before 3.12 its asyncio connection joins a command's pieces into
one bytes object (a copy of every value) and the transport copies again whatever the socket does not
take at once; with values of MiBs that is most of a snapshot's client-side cost beside the encode.
Here each connection is a plain non-blocking socket: a batch of SETs goes out through `sendmsg` over
[header, value, CRLF + next header, value, ...], so the kernel reads each value from the memory the
encoder wrote it into, and the batch's replies (`+OK` or an error line each) are then read in order.
A few connections per node carry a call's values side by side, as on the read path (redis_pool).

Exactness: a write is confirmed only by its own `+OK`. A dropped connection, a timeout or a reply
that is not a status or error line (the stream is out of sync: the connection is dropped) leaves the
unconfirmed SETs of the batch in doubt; SET of a key to its value is idempotent (values are content
addressed, or whole records written again), so they are sent again on a fresh connection, `retries`
times, then reported as an outage. An error reply settles its own key alone: a refusal (OOM is a
full store), or for MOVED/ASK and other replies about where or as whom to ask, a key for redis-py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from typing import TYPE_CHECKING

from agentstate.backends.redis_wire import WireConfig, WireError, WireProtocolError, handshake
from agentstate.errors import AgentStateError, BackendError, BackendRefusedError, CapacityError

if TYPE_CHECKING:
    from agentstate.backends.redis import RedisBackend
    from agentstate.backends.redis_pool import WireReader

log = logging.getLogger("agentstate.backends.redis")
OK = None
"""A confirmed SET."""
_MAX_LINE = 64 << 10  # a reply line longer than this is not Redis answering a SET
_IOV = max(16, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024))


@dataclass(frozen=True)
class Item:
    """One SET: the stored key and the value's bytes (a flat byte view, read by the kernel as it is)."""

    key: bytes
    value: memoryview


class HandshakeRefused(WireProtocolError):
    """AUTH or SELECT answered with an error: redis-py's path says why (and is never asked to guess)."""


class TimedOut(WireError):
    """The node took longer than the tier's timeout for one lane: an outage, not retried in this call."""


class SetConnection:
    """One socket to one node; one batch at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.closed = False
        self._buf = bytearray(64 << 10)
        self._lines: deque[bytes] = deque()
        self._pending = b""

    @classmethod
    async def open(cls, cfg: WireConfig) -> SetConnection:
        loop = asyncio.get_running_loop()
        host = cfg.host
        infos = await loop.getaddrinfo(host, cfg.port, type=socket.SOCK_STREAM)
        if not infos:
            raise WireError(f"cannot resolve {host}")
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = cls(sock)
        try:
            await loop.sock_connect(sock, addr)
            hello = handshake(cfg)
            if hello:
                await conn._send([memoryview(b"".join(hello))])
                for _ in hello:
                    line = await conn._line()
                    if line != b"+OK":
                        raise HandshakeRefused(f"handshake refused: {line[:100].decode('utf-8', 'replace')}")
        except BaseException as exc:
            conn.close()
            if isinstance(exc, OSError):
                raise WireError(f"cannot connect ({type(exc).__name__}: {exc})") from None
            raise
        return conn

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    async def _writable(self) -> None:
        loop = asyncio.get_running_loop()
        fd = self.sock.fileno()
        ready = loop.create_future()
        loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_writer(fd)

    async def _send(self, pieces: list[memoryview]) -> None:
        """Every byte of `pieces`, in order, scatter-gathered: nothing is copied in Python."""
        todo = deque(p for p in pieces if len(p))
        while todo:
            try:
                n = self.sock.sendmsg([todo[i] for i in range(min(len(todo), _IOV))])
            except (BlockingIOError, InterruptedError):
                await self._writable()
                continue
            except OSError as exc:
                raise WireError(f"connection lost ({type(exc).__name__})") from None
            while n:
                head = todo[0]
                if n >= len(head):
                    n -= len(head)
                    todo.popleft()
                else:
                    todo[0] = head[n:]
                    n = 0

    async def _line(self) -> bytes:
        """The next reply line, without its CRLF."""
        loop = asyncio.get_running_loop()
        while not self._lines:
            try:
                n = await loop.sock_recv_into(self.sock, self._buf)
            except OSError as exc:
                raise WireError(f"connection lost ({type(exc).__name__})") from None
            if not n:
                raise WireError("connection lost (closed by the server)")
            data = self._pending + bytes(self._buf[:n])
            *lines, self._pending = data.split(b"\r\n")
            if len(self._pending) > _MAX_LINE:
                raise WireProtocolError("a reply line without an end")
            self._lines.extend(lines)
        return self._lines.popleft()

    def _quiet(self) -> None:
        """Before a batch: an idle connection has nothing to read. Bytes there are replies nobody asked
        for (the stream is out of sync: they must never confirm this batch's SETs); an end of stream is
        a server that closed it while idle."""
        if self._lines or self._pending:
            raise WireProtocolError("replies nobody asked for")
        try:
            data = self.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            raise WireError(f"connection lost ({type(exc).__name__})") from None
        if not data:
            raise WireError("connection lost (closed by the server while idle)")
        raise WireProtocolError("replies nobody asked for")

    async def set_many(self, items: Sequence[Item], ttl: int | None, out: list[str | None]) -> None:
        """SET each item; appends to `out` per item, in order, OK (None) or its error reply. Raises
        WireError when the connection fails: the items past those in `out` are then in doubt (the
        connection is closed)."""
        ex = b"" if ttl is None else b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl)), ttl)
        argc = b"*3\r\n" if ttl is None else b"*5\r\n"
        pieces: list[memoryview] = []
        tail = b""
        for item in items:
            head = b"%s%s$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (tail, argc, len(item.key), item.key, len(item.value))
            pieces += [memoryview(head), item.value]
            tail = b"\r\n" + ex
        pieces.append(memoryview(tail))
        start = len(out)
        try:
            self._quiet()
            await self._send(pieces)
            for _ in items:
                line = await self._line()
                if line == b"+OK":
                    out.append(OK)
                elif line[:1] == b"-":
                    out.append(line[1:].decode("utf-8", "replace"))
                else:  # no SET answers so: the stream is out of sync, nothing after it can be trusted
                    raise WireProtocolError(f"a {line[:1]!r} reply to SET")
            if self._lines or self._pending:  # more than was asked: which reply answered what is unknown
                del out[start:]
                raise WireProtocolError("replies nobody asked for")
        except BaseException:
            self.close()  # half a command may be on the wire, or replies in doubt: never reused
            raise


class NodeWriters:
    """Up to `size` connections to one node, opened on first use; a call's values are spread over them
    by bytes, each connection carrying one batch at a time."""

    def __init__(self, config: WireConfig, size: int) -> None:
        self.config, self.size = config, max(1, size)
        self.idle: list[SetConnection] = []
        self.opened = 0  # connections open now, idle or carrying a batch
        self._slots: asyncio.Semaphore | None = None  # at most `size` lanes at once, over all callers

    async def _take(self) -> SetConnection:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
            self.opened -= 1
        self.opened += 1
        try:
            return await SetConnection.open(self.config)
        except BaseException:
            self.opened -= 1
            raise

    def _give(self, conn: SetConnection) -> None:
        if conn.closed:
            self.opened -= 1
        else:
            self.idle.append(conn)

    async def _one(self, items: list[Item], ttl: int | None, out: list[str | None], timeout: float) -> None:
        """One lane on one connection. The timeout starts once the connection is this lane's: a wait for
        one of the node's connections (other callers' values ahead) is not the node being slow."""
        self._slots = self._slots or asyncio.Semaphore(self.size)
        async with self._slots:
            conn = await self._take()
            try:
                await asyncio.wait_for(conn.set_many(items, ttl, out), timeout)
            except asyncio.TimeoutError:
                raise TimedOut(f"timed out after {timeout:.1f} s") from None
            finally:
                self._give(conn)

    async def put(
        self, items: Sequence[Item], ttl: int | None, *, timeout: float, retries: int = 2
    ) -> list[str | None | Exception]:
        """SET every item. Per item: OK (None), the server's error reply (a str), or the error that left
        it unconfirmed after `retries` fresh connections: WireError (down, dropped, slower than
        `timeout`), WireProtocolError (a reply no SET gives) or HandshakeRefused (not retried)."""
        out: list[str | None | Exception] = [WireError("not sent")] * len(items)
        todo = list(range(len(items)))
        for attempt in range(retries + 1):
            lanes: list[list[int]] = [[] for _ in range(min(self.size, len(todo)))]
            load = [0] * len(lanes)
            for i in sorted(todo, key=lambda i: -len(items[i].value)):  # the largest first, each to the lightest lane
                j = min(range(len(lanes)), key=load.__getitem__)
                lanes[j].append(i)
                load[j] += len(items[i].value) + 64
            for lane in lanes:
                lane.sort()  # in the caller's order on each connection
            answers: list[list[str | None]] = [[] for _ in lanes]
            calls = [asyncio.ensure_future(self._one([items[i] for i in lane], ttl, got, timeout))
                     for lane, got in zip(lanes, answers)]  # fmt: skip
            try:
                await asyncio.wait(calls)
            except BaseException:
                for call in calls:
                    call.cancel()  # each closes its connection: half a command may be on the wire
                raise
            again: list[int] = []
            slow = False
            for lane, call, got in zip(lanes, calls, answers):
                for i, result in zip(lane, got):  # answered before anything failed: settled
                    out[i] = result
                rest = lane[len(got) :]
                failed = call.exception()
                if failed is None:
                    continue
                if not isinstance(failed, WireError):
                    raise failed
                for i in rest:
                    out[i] = failed
                slow = slow or isinstance(failed, TimedOut)
                if not isinstance(failed, HandshakeRefused | TimedOut):
                    again += rest
            if slow or not (todo := sorted(again)) or attempt == retries:
                break
            await asyncio.sleep(0.01 * 2**attempt)
        return out

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle, self.opened = [], 0




def refusal(reply: str) -> AgentStateError:
    """The typed error for a SET the server refused: a full store is a CapacityError (retrying cannot help)."""
    if "OOM" in reply or "maxmemory" in reply:
        return CapacityError(f"remote store is full: {reply[:200]}")
    return BackendRefusedError(f"redis refused the command: {reply[:200]}")


class WireWriter:
    """The tier's writes over `SetConnection`s: one pool per node (routed as the reads are), each node
    behind its breaker and the tier's gate on calls in flight."""

    def __init__(self, backend: RedisBackend, reader: WireReader, connections: int, retries: int) -> None:
        self.backend, self.reader, self.connections, self.retries = backend, reader, connections, retries
        self.pools: dict[str, NodeWriters] = {}

    async def put(
        self, keys: Sequence[str], values: Sequence[memoryview], ttl: int | None
    ) -> tuple[list[AgentStateError | None], list[int]]:
        """SET each key. Per key: None (confirmed by its own +OK) or the typed error that left it
        unwritten; and the keys this client cannot settle (MOVED, ASK, a refused handshake, no slot
        map), for redis-py."""
        from agentstate.backends.redis_pool import FOR_REDIS_PY

        b = self.backend
        out: list[AgentStateError | None] = [BackendError("not sent")] * len(keys)
        doubt: list[int] = []
        try:
            if b.cluster:
                await b.load_slot_map()
            groups = self.reader.route(keys)
        except b.client_errors:
            return out, list(range(len(keys)))

        async def run(node: str, cfg: WireConfig, idx: list[int]) -> None:
            breaker = b.breaker_of(node if b.cluster else None)
            if breaker.open:
                b.count(errors=1)
                for i in idx:
                    out[i] = BackendError(f"redis {node} unavailable (circuit open)")
                return
            pool = self.pools.get(node)
            if pool is None or pool.config != cfg:
                if pool is not None:
                    pool.close()
                pool = self.pools[node] = NodeWriters(cfg, self.connections)
            items = [Item(b.stored_key(keys[i]).encode(), values[i]) for i in idx]
            async with b.gate():
                got = await pool.put(items, ttl, timeout=b.timeout_s, retries=self.retries)
            if down := next((g for g in got if isinstance(g, WireError) and not isinstance(g, HandshakeRefused)), None):
                breaker.failure()
                b.count(errors=1)
                log.warning("redis SET on %s failed (%s)", node, down)
            else:
                breaker.success()
            refused = 0
            for i, g in zip(idx, got):
                if g is OK:
                    out[i] = None
                elif isinstance(g, HandshakeRefused) or (isinstance(g, str) and g.startswith(FOR_REDIS_PY)):
                    doubt.append(i)  # where or as whom to ask: redis-py decides, as it always did
                elif isinstance(g, str):
                    out[i], refused = refusal(g), refused + 1
                else:
                    out[i] = BackendError(f"redis write failed: {g}")
            if refused:
                b.count(refused=refused)

        if len(groups) == 1:
            await run(*next((node, *group) for node, group in groups.items()))
        else:
            await asyncio.gather(*(run(node, cfg, idx) for node, (cfg, idx) in groups.items()))
        return out, sorted(doubt)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools = {}
