"""A minimal RESP2 client for the Redis tier's read path: GET replies land in the caller's memory.

Why not redis-py here: even with hiredis it builds a bytes object per reply, which the tier then
copies into its destination, and one connection carries one pipeline at a time. Here an asyncio
BufferedProtocol parses the `$<len>\\r\\n` header of a bulk reply and then hands the destination
memoryview itself to the transport as its receive buffer, so the kernel copies the value bytes
straight into it (recv_into); a few connections per node carry the GETs of every caller, pipelined.
Only GET (and AUTH/SELECT when connecting) is spoken; every other command stays with redis-py.

Exactness, since a wrong byte served is worse than a miss: a nil reply is a miss; a value longer
than its destination is read into scratch and dropped (TOO_BIG, the destination untouched); an
error reply is a typed ReplyError for that request alone; a reply no GET returns (an integer, an
array, a status, a malformed header) is a BadReplyError for the request it answered, and the
connection is dropped (its stream can no longer be trusted: the requests behind it fail with a plain
WireError, which the pool retries on a fresh connection). A request whose caller gave up (timeout,
cancel) never writes into its destination afterwards.

Memory, since the length in a bulk header is the server's word: a request may carry a `limit`, the
largest valid value for its key (the caller knows it: a chunk's encoded size). A longer declared
length is a BadReplyError before a byte of it is received or allocated. A value for a sink is staged
in a buffer of the declared length only when the caller bounded it; otherwise the buffer grows with
the bytes that actually arrive. A staging buffer larger than `_KEEP_STAGING` (and than the request's
own bound) is given back once its value is delivered, and every one when the connection drops.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
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
_STAGE_STEP = 1 << 20  # an unbounded value's staging starts this large and doubles as its bytes arrive
_KEEP_STAGING = 8 << 20  # staging kept for the next value when no larger bound asked for it

Sink = Callable[[memoryview], None]
"""Takes a complete value; the view is valid only during the call (it is the connection's staging buffer)."""
Target = memoryview | Sink


class WireError(BackendError):
    """The connection failed, timed out or was refused: an outage of that node (retryable)."""


class WireProtocolError(WireError):
    """The server sent something no GET returns: the stream is out of sync and is dropped."""


class BadReplyError(WireProtocolError):
    """This request's reply was malformed, of a type its command never returns, or declared a value
    longer than the request's bound. The connection is dropped; the request is a miss, never asked
    again (a server that answers so once would answer so again, and a retry elsewhere would take its
    word for the length)."""


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


def handshake(cfg: WireConfig) -> list[bytes]:
    """The commands a new connection sends first (AUTH, SELECT), each answered `+OK` when accepted."""
    hello = []
    if cfg.password is not None:
        creds = (cfg.username, cfg.password) if cfg.username else (cfg.password,)
        hello.append(pack(b"AUTH", *(c.encode() for c in creds)))
    if cfg.db:
        hello.append(pack(b"SELECT", str(cfg.db).encode()))
    return hello


class Request:
    """One command on a connection: where its value goes, and the future its caller awaits."""

    __slots__ = ("cancelled", "conn", "future", "limit", "reply", "target")

    def __init__(
        self, target: Target | None, future: asyncio.Future[int], reply: bytes = b"$", limit: int | None = None
    ) -> None:
        """`reply`: the reply type this command returns: `$` a bulk string (GET), `+` a status, `:` an integer.
        `limit`: the longest value this request accepts (its key's largest valid value); None: any
        value up to Redis's own bulk limit, staged as it arrives."""
        self.target, self.future, self.reply, self.cancelled = target, future, reply, False
        self.limit = limit
        self.conn: RespProtocol | None = None

    def cancel(self) -> None:
        self.cancelled = True
        self.future.cancel()


class RespProtocol(asyncio.BufferedProtocol):
    """One connection; replies answer `pending` in order."""

    def __init__(self, window: int = 8) -> None:
        self.transport: asyncio.Transport | None = None
        self.pending: deque[Request] = deque()  # sent, awaiting their replies in order
        self.waiting: deque[tuple[bytes, Request]] = deque()  # not sent yet: the window is full
        self.window = window
        self.closed: BaseException | None = None
        self._buf = bytearray(_SCRATCH)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._staging = bytearray(0)
        self._body: memoryview | None = None  # where the current value goes; None: dropped
        self._size = 0  # the current value's declared length
        self._staged = False  # the current value lands in `_staging` (for a sink), which may grow
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

    def send(self, commands: list[bytes], reqs: list[Request]) -> None:
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
        self._body, self._left, self._crlf, self._direct = None, 0, False, False
        self._staging, self._staged = bytearray(0), False  # a dropped connection keeps no memory

    def _room(self) -> memoryview:
        """Where the current value's next bytes go: its body past what arrived, the staging grown
        first (double, at most the declared length) when an unbounded value has filled it."""
        assert self._body is not None
        at = self._size - self._left
        if at == len(self._body):  # only a staged value's body is ever shorter than its length
            grown = bytearray(min(self._size, max(2 * len(self._body), _STAGE_STEP)))
            grown[:at] = self._body
            self._staging = grown
            self._body = memoryview(grown)[: len(grown)]
        return self._body[at:]

    def get_buffer(self, sizehint: int) -> memoryview:
        self._direct = False  # a recv that failed never reached buffer_updated: decide afresh
        if self._left and self._body is not None:
            if not self.pending[0].cancelled:
                self._direct = True
                return self._room()
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
        except BadReplyError as exc:  # its request fails with it; those behind it may be asked again
            if self.pending and not self.pending[0].future.done():
                self.pending.popleft().future.set_exception(exc)
            self.abort(WireError("connection dropped after a bad reply to an earlier request"))
        except WireError as exc:
            self.abort(exc)

    def _parse(self) -> None:
        buf = self._buf
        while self._start < self._end and self.closed is None:
            if self._left:  # value bytes that arrived with its header (or are being dropped)
                n = min(self._left, self._end - self._start)
                if self._body is not None and not self.pending[0].cancelled:
                    room = self._room()
                    n = min(n, len(room))
                    room[:n] = self._view[self._start : self._start + n]
                self._start += n
                self._left -= n
                self._crlf = not self._left
            elif self._crlf:
                if self._end - self._start < 2:
                    return
                if buf[self._start : self._start + 2] != b"\r\n":
                    raise BadReplyError("a value not followed by CRLF")
                self._start += 2
                self._crlf = False
                self._complete()
            else:
                eol = buf.find(b"\r\n", self._start, self._end)
                if eol < 0:
                    if self._end - self._start > _MAX_LINE:
                        raise (BadReplyError if self.pending else WireProtocolError)("a reply line without an end")
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
        elif req.reply != kind:
            raise BadReplyError(f"a {kind[:1]!r} reply where {req.reply!r} belongs")
        elif kind == b"+":
            self._finish(0)
        elif kind == b":":
            try:
                self._finish(int(line[1:]))
            except ValueError:
                raise BadReplyError("a bad integer") from None
        else:
            try:
                n = int(line[1:])
            except ValueError:
                raise BadReplyError("a bad bulk length") from None
            if n == -1:
                return self._finish(MISS)
            if not 0 <= n <= _MAX_BULK:
                raise BadReplyError("a bad bulk length")
            if req.limit is not None and n > req.limit and not req.cancelled:
                raise BadReplyError(f"a value of {n} bytes where at most {req.limit} belong")
            target, self._big, self._staged = req.target, n >= 65536, False
            if req.cancelled:
                self._body, self._result = None, MISS
            elif isinstance(target, memoryview):
                self._body, self._result = (target[:n], n) if n <= len(target) else (None, TOO_BIG)
            else:
                # Staged for the sink. A bounded request's length is at most what the caller vouched
                # for: staged whole. An unbounded one's is the server's word: the buffer starts small
                # and grows only with bytes that arrive. A new buffer, never a resize.
                need = n if req.limit is not None else min(n, _STAGE_STEP)
                if len(self._staging) < need:
                    self._staging = bytearray(need)
                self._body = memoryview(self._staging)[: min(n, len(self._staging))]
                self._result, self._staged = n, True
            self._size, self._left, self._crlf = n, n, not n

    def _complete(self) -> None:
        req, body = self.pending[0], self._body
        self._body = None
        if self._staged:  # staging past what this workload's bounds ask for is given back
            self._staged = False
            if len(self._staging) > max(_KEEP_STAGING, req.limit or 0):
                self._staging = bytearray(0)
        if callable(req.target) and body is not None and not req.cancelled:
            try:
                req.target(body[: self._size])
            except Exception as exc:  # noqa: BLE001  # the caller's sink failed: its request fails, the stream is fine
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
