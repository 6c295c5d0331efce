"""A minimal RESP2 client for the Redis tier's read path: GET replies land in the caller's memory.

Why not redis-py here: even with hiredis it builds a bytes object per reply, which the tier then
copies into its destination, and one connection carries one pipeline at a time. Here an asyncio
BufferedProtocol parses the `$<len>\\r\\n` header of a bulk reply and then hands the destination
memoryview itself to the transport as its receive buffer, so the kernel copies the value bytes
straight into it (recv_into); a few connections per node carry the GETs of every caller, pipelined.
Only GET (and AUTH/SELECT when connecting) is spoken; every other command stays with redis-py.

Exactness, since a wrong byte served is worse than a miss: a nil reply is a miss; a value longer
than its destination is read into scratch and dropped (TOO_BIG, the destination untouched); an
error reply is a typed ReplyError for that request alone; a reply no GET returns, or a dropped
connection, fails every request still on that connection (its stream can no longer be trusted). A
request whose caller gave up (timeout, cancel) never writes into its destination afterwards.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from agentstate.errors import BackendError, BackendRefusedError

MISS = -1
"""A nil reply: no such key."""
TOO_BIG = -2
"""The value is longer than its destination: nothing was written."""
_SCRATCH = 256 << 10  # headers, small values and dropped bytes go through this buffer
_MAX_LINE = 64 << 10  # a header or error line longer than this is not Redis talking
_MAX_BULK = 512 << 20  # Redis's own proto-max-bulk-len default

Sink = Callable[[memoryview], None]
"""Takes a complete value; the view is valid only during the call (it is the connection's staging buffer)."""
Target = memoryview | Sink


class WireError(BackendError):
    """The connection failed, timed out or was refused: an outage of that node (retryable)."""


class WireProtocolError(WireError):
    """The server sent something no GET returns: the stream is out of sync and is dropped."""


class ReplyError(BackendRefusedError):
    """The server answered this request with an error reply (WRONGTYPE, MOVED, NOAUTH, ...)."""

    def __init__(self, reply: str) -> None:
        super().__init__(f"redis error reply: {reply[:200]}")
        self.reply = reply


@dataclass(frozen=True)
class WireConfig:
    """Where and how to connect, parsed from a redis:// URL; never logged (it holds the password)."""

    host: str
    port: int
    username: str | None = None
    password: str | None = None
    db: int = 0


def wire_config(url: str) -> WireConfig | None:
    """The config for a plain `redis://[user:pass@]host[:port][/db]` URL; None for anything this client
    does not speak (TLS, unix sockets, URL options), which then stays on redis-py."""
    parts = urlsplit(url)
    if parts.scheme != "redis" or parts.query or parts.fragment or not parts.hostname:
        return None
    path = parts.path.strip("/")
    if path and not path.isdigit():
        return None
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    if password is None and user is not None:  # redis://:secret@ spells only a password; redis://secret@ too
        user, password = None, user
    return WireConfig(parts.hostname, parts.port or 6379, user, password, int(path or 0))


def pack(*args: bytes) -> bytes:
    """One command in RESP: an array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class _Request:
    __slots__ = ("target", "future", "status", "cancelled", "conn")

    def __init__(self, target: Target | None, future: asyncio.Future[int], status: bool = False) -> None:
        self.target, self.future, self.status, self.cancelled = target, future, status, False
        self.conn: RespProtocol | None = None

    def cancel(self) -> None:
        self.cancelled = True
        self.future.cancel()


class RespProtocol(asyncio.BufferedProtocol):
    """One connection; replies answer `pending` in order."""

    def __init__(self, window: int = 8) -> None:
        self.transport: asyncio.Transport | None = None
        self.pending: deque[_Request] = deque()  # sent, awaiting their replies in order
        self.waiting: deque[tuple[bytes, _Request]] = deque()  # not sent yet: the window is full
        self.window = window
        self.closed: BaseException | None = None
        self._buf = bytearray(_SCRATCH)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._staging = bytearray(0)
        self._body: memoryview | None = None  # where the current value goes; None: dropped
        self._left = 0  # bytes of the current value still to come
        self._result = 0  # what the current value resolves its request to
        self._crlf = False  # the current value is complete: its CRLF comes next
        self._direct = False  # the last get_buffer handed out the value's destination
        self._big = False  # the last value was large: the next one likely is too

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(WireError(f"connection lost ({type(exc).__name__ if exc else 'closed by the server'})"))

    @property
    def load(self) -> int:
        return len(self.pending) + len(self.waiting)

    def send(self, commands: list[bytes], reqs: list[_Request]) -> None:
        """Queue requests; at most `window` are sent ahead of their replies, one while values are large:
        a deeper pipeline of MiB-sized values only makes redis-server copy them into its own output
        buffers (more work on its one thread, measured slower); other connections keep it busy."""
        if self.closed is not None or self.transport is None or self.transport.is_closing():
            raise WireError("connection closed")
        self.waiting.extend(zip(commands, reqs))
        self._pump()

    def _pump(self) -> None:
        out = []
        window = 1 if self._big else self.window
        while self.waiting and len(self.pending) < window:
            command, req = self.waiting.popleft()
            if not req.cancelled:
                self.pending.append(req)
                out.append(command)
        if out and self.transport is not None:
            self.transport.write(b"".join(out))

    def abort(self, exc: WireError) -> None:
        """Drop the connection and fail what it still carries."""
        self._fail(exc)
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: WireError) -> None:
        self.closed = self.closed or exc
        pending, self.pending = [*self.pending, *(r for _, r in self.waiting)], deque()
        self.waiting.clear()
        for req in pending:
            if not req.future.done():
                req.future.set_exception(exc)
        self._body, self._left, self._crlf = None, 0, False

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._left and self._body is not None:
            if not self.pending[0].cancelled:
                self._direct = True
                return self._body[len(self._body) - self._left :]
            self._body = None  # its caller gave up: drop the rest
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buf) - self._end < 4096:  # a partial line at the end: move it to the front
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        if self._big and not self._left:  # a header of a large value: read little past it, the value goes direct
            return self._view[self._end : self._end + 4096]
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._direct:
            self._direct = False
            self._left -= nbytes
            self._crlf = not self._left
            return
        self._end += nbytes
        try:
            self._parse()
        except WireError as exc:
            self.abort(exc)

    def _parse(self) -> None:
        buf = self._buf
        while self._start < self._end and self.closed is None:
            if self._left:  # value bytes that arrived with its header (or are being dropped)
                n = min(self._left, self._end - self._start)
                if self._body is not None and not self.pending[0].cancelled:
                    at = len(self._body) - self._left
                    self._body[at : at + n] = self._view[self._start : self._start + n]
                self._start += n
                self._left -= n
                self._crlf = not self._left
            elif self._crlf:
                if self._end - self._start < 2:
                    return
                if buf[self._start : self._start + 2] != b"\r\n":
                    raise WireProtocolError("a value not followed by CRLF")
                self._start += 2
                self._crlf = False
                self._complete()
            else:
                eol = buf.find(b"\r\n", self._start, self._end)
                if eol < 0:
                    if self._end - self._start > _MAX_LINE:
                        raise WireProtocolError("a reply line without an end")
                    return
                line = bytes(buf[self._start : eol])
                self._start = eol + 2
                self._line(line)

    def _line(self, line: bytes) -> None:
        if not self.pending:
            raise WireProtocolError("a reply nobody asked for")
        req, kind = self.pending[0], line[:1]
        if kind == b"-":
            self._finish(ReplyError(line[1:].decode("utf-8", "replace")))
        elif req.status:
            if kind != b"+":
                raise WireProtocolError("not a status reply")
            self._finish(0)
        elif kind != b"$":
            raise WireProtocolError("not a bulk string reply")
        else:
            try:
                n = int(line[1:])
            except ValueError:
                raise WireProtocolError("a bad bulk length") from None
            if n == -1:
                return self._finish(MISS)
            if not 0 <= n <= _MAX_BULK:
                raise WireProtocolError("a bad bulk length")
            target, self._big = req.target, n >= 65536
            if req.cancelled:
                self._body, self._result = None, MISS
            elif isinstance(target, memoryview):
                self._body, self._result = (target[:n], n) if n <= len(target) else (None, TOO_BIG)
            else:
                if len(self._staging) < n:  # a new buffer, never a resize: a sink may still hold a view
                    self._staging = bytearray(max(n, 2 * len(self._staging)))
                self._body, self._result = memoryview(self._staging)[:n], n
            self._left, self._crlf = n, not n

    def _complete(self) -> None:
        req, body = self.pending[0], self._body
        self._body = None
        if callable(req.target) and body is not None and not req.cancelled:
            try:
                req.target(body)
            except Exception as exc:  # the caller's sink failed: its request fails, the stream is fine
                return self._finish(exc)
        self._finish(self._result)

    def _finish(self, result: int | Exception) -> None:
        req = self.pending.popleft()
        self._pump()
        if req.future.done():
            return
        if isinstance(result, Exception):
            req.future.set_exception(result)
        else:
            req.future.set_result(result)


class NodePool:
    """Up to `size` connections to one node, opened on first use and again after a drop; the requests
    of each batch go to the least loaded ones, pipelined behind whatever they already carry."""

    def __init__(self, config: WireConfig, size: int) -> None:
        self.config, self.size = config, max(1, size)
        self.conns: list[RespProtocol] = []
        self._lock: asyncio.Lock | None = None

    async def _open(self) -> RespProtocol:
        cfg = self.config
        _, proto = await asyncio.get_running_loop().create_connection(RespProtocol, cfg.host, cfg.port)
        hello = []
        if cfg.password is not None:
            creds = (cfg.username, cfg.password) if cfg.username else (cfg.password,)
            hello.append(pack(b"AUTH", *(c.encode() for c in creds)))
        if cfg.db:
            hello.append(pack(b"SELECT", str(cfg.db).encode()))
        if hello:
            loop = asyncio.get_running_loop()
            reqs = [_Request(None, loop.create_future(), status=True) for _ in hello]
            proto.send(hello, reqs)
            try:
                await asyncio.gather(*(r.future for r in reqs))
            except BaseException as exc:
                proto.abort(WireError("handshake failed"))
                if isinstance(exc, ReplyError):  # a wrong password, a db out of range: redis-py says why
                    raise WireProtocolError(f"handshake refused: {exc.reply[:100]}") from None
                raise
        return proto

    async def _ready(self) -> list[RespProtocol]:
        self.conns = [c for c in self.conns if c.closed is None]
        if len(self.conns) < self.size:
            self._lock = self._lock or asyncio.Lock()
            async with self._lock:
                self.conns = [c for c in self.conns if c.closed is None]
                got = await asyncio.gather(*(self._open() for _ in range(self.size - len(self.conns))),
                                           return_exceptions=True)  # fmt: skip
                self.conns += [c for c in got if isinstance(c, RespProtocol)]
                if not self.conns:
                    err = next(e for e in got if isinstance(e, BaseException))
                    if isinstance(err, WireError | asyncio.CancelledError):
                        raise err
                    raise WireError(f"cannot connect ({type(err).__name__}: {err})") from err
        return self.conns

    def _submit(self, conns: list[RespProtocol], keys: Sequence[bytes], targets: Sequence[Target]) -> list[_Request]:
        loop = asyncio.get_running_loop()
        load = [c.load for c in conns]
        batches: list[tuple[list[bytes], list[_Request]]] = [([], []) for _ in conns]
        reqs = []
        for key, target in zip(keys, targets):
            j = min(range(len(conns)), key=load.__getitem__)
            load[j] += 1
            req = _Request(target, loop.create_future())
            req.conn = conns[j]
            batches[j][0].append(pack(b"GET", key))
            batches[j][1].append(req)
            reqs.append(req)
        for conn, (payload, sent) in zip(conns, batches):
            if sent:
                try:
                    conn.send(payload, sent)
                except WireError as exc:
                    for req in sent:
                        req.future.set_exception(exc)
        return reqs

    async def fetch(
        self, keys: Sequence[bytes], targets: Sequence[Target], *, timeout: float, retries: int = 2
    ) -> list[int | Exception]:
        """GET each key into its target. Per request: bytes written (or handed to the sink), MISS,
        TOO_BIG, or its error: ReplyError (refused), WireProtocolError (a stream or handshake in doubt),
        WireError (the node is down or slower than `timeout`, after `retries` reconnects). Requests that
        completed keep their result; from the moment a request fails or is cancelled, nothing more of
        its reply lands in its target."""
        deadline = time.monotonic() + timeout
        out: list[int | Exception] = [WireError("not sent")] * len(keys)
        todo = list(range(len(keys)))
        for attempt in range(retries + 1):
            try:
                conns = await asyncio.wait_for(self._ready(), max(deadline - time.monotonic(), 0))
            except (WireError, TimeoutError) as exc:
                err = exc if isinstance(exc, WireError) else WireError("connect timed out")
                for i in todo:
                    out[i] = err
                return out
            reqs = self._submit(conns, [keys[i] for i in todo], [targets[i] for i in todo])
            try:
                _, late = await asyncio.wait([r.future for r in reqs], timeout=max(deadline - time.monotonic(), 0))
            except BaseException:  # cancelled: from now on its bytes are dropped
                for req in reqs:
                    req.cancel()
                raise
            for req in reqs:
                if req.future in late:  # a node that slow is an outage: drop the connection holding it
                    req.cancel()
                    req.conn.abort(WireError("timed out"))  # type: ignore[union-attr]
            again = []
            for i, req in zip(todo, reqs):
                exc = WireError(f"timed out after {timeout:.1f} s") if req.future in late else req.future.exception()
                if type(exc) is WireError and attempt < retries and not late:
                    again.append(i)  # dropped: GET is idempotent, ask again on a fresh connection
                else:
                    out[i] = exc if exc is not None else req.future.result()  # type: ignore[assignment]
            if not (todo := again):
                break
            await asyncio.sleep(min(0.01 * 2**attempt, max(deadline - time.monotonic(), 0)))
        return out

    def close(self) -> None:
        for conn in self.conns:
            conn.abort(WireError("closed"))
        self.conns = []
