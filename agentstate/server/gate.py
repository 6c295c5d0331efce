"""The service's front door: bearer-token auth, request size limits, request metrics, and the
helpers routes use to read bodies and stream frames.

`Gate` is plain ASGI and runs before FastAPI parses anything, so a request without a valid token
is answered 401 without its body being read, and a body over its limit is refused 413 from its
Content-Length alone, or, when it streams past the limit (chunked, or lying), as soon as it does:
whatever the route would have answered is replaced by the 413. Routes store nothing until they
hold the whole body, so a refused request changes nothing.

What the service holds under load is bounded:

- Bodies are read as they arrive: the buffer grows with the bytes received, never with what
  Content-Length declares, and the whole body must arrive within `body_timeout_s` of the request
  reaching the gate (else 400 `malformed`, BodyTimeoutError, and the connection is closed
  without reading further).
- A request's head (request line and headers) must arrive within `header_timeout_s` of the
  connection opening or of the previous response, else the connection is closed: uvicorn has no
  such timeout, so `guarded_h11` adds it to uvicorn's h11 protocol. Its size is bounded by h11
  (`h11_max_incomplete_event_size`, 16 KiB), idle connections by `keep_alive_s`, connections and
  requests in flight by `max_connections` (uvicorn's `limit_concurrency`: 503 beyond it).
- KV in flight (upload bodies, resume/load frames, single chunks) draws on one byte budget,
  `max_inflight_bytes`: an upload reserves its Content-Length before its body is read (a body
  without one, as it arrives), a route that answers KV reserves its size before it reads
  anything; what does not fit is answered 503 `overloaded` with `Retry-After` (OverloadedError),
  having read and stored nothing. Reservations end when the answer has been sent. One request
  larger than the whole budget is let in when nothing else is in flight (else it could never be
  served), so memory held for KV is at most max(budget, the largest single request).
- A client that stops reading its answer cannot hold its reservation for long: each part of an
  answer (1 MiB of a frame) must be taken within `send_timeout_s`, else the connection is dropped
  (ResponseStalledError, logged by uvicorn) and the reservation given back.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentstate.errors import AgentStateError, BackendError, InvalidArgumentError
from agentstate.keys import validate_id
from agentstate.server.metrics import Metrics
from agentstate.store import StateStore
from agentstate.wire import (
    FRAME_TYPE,
    ErrorBody,
    KVHeader,
    MalformedRequestError,
    RequestTooLargeError,
    UnauthorizedError,
    checksum,
    frame_prefix,
    status_of,
)

TENANT_KEY = "agentstate.tenant"
TICKET_KEY = "agentstate.ticket"
_BINARY = re.compile(r"/v1/(sessions/[^/]+/snapshot|prefixes|chunks/[^/]+)")
_STEP = 1 << 20


class Limits(BaseSettings):
    """Service limits and secrets (env `AGENTSTATE_SERVICE_*` when `agentstate serve` builds them)."""

    model_config = SettingsConfigDict(env_prefix="AGENTSTATE_SERVICE_", extra="forbid")

    max_body_bytes: int = Field(default=1 << 30, gt=0, description="KV uploads: snapshot, prefix and chunk bodies")
    max_json_bytes: int = Field(default=16 << 20, gt=0, description="other bodies, and the JSON header of a frame")
    handle_secret: str | None = Field(
        default=None,
        min_length=16,
        description="key of chunk-handle MACs (replicas given the same one accept each other's handles);"
        " None: random, so handles die with the process",
    )
    handle_secret_file: Path | None = Field(
        default=None, description="a file holding handle_secret (surrounding whitespace dropped), in its place"
    )
    metrics_token: str | None = Field(
        default=None, min_length=1, description="bearer token /metrics asks for; None: open"
    )
    drain_bytes: int = Field(
        default=64 << 20, ge=0, description="of a refused body, read and dropped so the client gets the answer"
    )
    body_timeout_s: float = Field(default=30.0, gt=0, description="a request body must arrive whole within this")
    header_timeout_s: float = Field(
        default=10.0, gt=0, description="a request head must arrive within this of the connection or the last answer"
    )
    keep_alive_s: int = Field(default=5, gt=0, description="idle keep-alive connections are closed after this")
    max_connections: int | None = Field(
        default=1000, gt=0, description="connections or requests in flight beyond which uvicorn answers 503"
    )
    max_inflight_bytes: int = Field(
        default_factory=lambda: _default_inflight(), gt=0,
        description="KV bytes in flight (uploads, resumes, chunks) beyond which requests get 503 + Retry-After;"
        " default: a quarter of RAM, at most 2 GiB",
    )  # fmt: skip
    retry_after_s: int = Field(default=1, ge=0, description="the Retry-After of a 503 overloaded answer")
    send_timeout_s: float = Field(
        default=30.0, gt=0, description="each part of an answer must be taken by the client within this"
    )

    @property
    def has_handle_secret(self) -> bool:
        return self.handle_secret is not None or self.handle_secret_file is not None

    def secret(self) -> bytes:
        """The key chunk handles are MACed with: from `handle_secret` or `handle_secret_file`
        (InvalidArgumentError if both are set, or the file is unreadable or holds under 16 bytes),
        else random bytes made now."""
        if self.handle_secret is not None and self.handle_secret_file is not None:
            raise InvalidArgumentError("set handle_secret or handle_secret_file, not both")
        if self.handle_secret_file is not None:
            try:
                raw = self.handle_secret_file.read_bytes().strip()
            except OSError as exc:
                raise InvalidArgumentError(f"cannot read the handle secret file: {exc}") from None
            if len(raw) < 16:
                raise InvalidArgumentError(
                    f"the handle secret in {self.handle_secret_file} is {len(raw)} bytes; it needs at least 16"
                )
        else:
            raw = self.handle_secret.encode() if self.handle_secret else secrets.token_bytes(32)
        return hashlib.blake2b(raw, digest_size=32, person=b"agentstate-hsec").digest()


def _default_inflight() -> int:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 << 30
    return max(64 << 20, min(2 << 30, ram // 4))


class OverloadedError(BackendError):
    """The service has no room for this request now (KV bytes in flight at their limit); nothing
    was read or stored. Answered 503 `overloaded` with Retry-After; retrying later may succeed."""

    retryable = True


class BodyTimeoutError(MalformedRequestError):
    """The request body did not arrive whole within the service's body deadline."""


class ResponseStalledError(AgentStateError):
    """The client stopped taking its answer (a part was not sent within `send_timeout_s`)."""


class Budget:
    """KV bytes in flight across the service (one event loop: no lock needed)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self, n: int, mine: int = 0) -> bool:
        """Reserve `n` more bytes for a request already holding `mine`."""
        if n > 0 and self.used > mine and self.used + n > self.limit:
            return False  # one request over the whole budget gets in when nothing else is in flight
        self.used += max(n, 0)
        return True

    def give(self, n: int) -> None:
        self.used -= n


class Ticket:
    """One request's share of the budget, given back when its answer has been sent."""

    def __init__(self, budget: Budget) -> None:
        self.budget, self.held = budget, 0

    def take(self, n: int, what: str) -> None:
        if not self.budget.take(n, self.held):
            raise OverloadedError(
                f"service busy: {what} needs {n} bytes, {self.budget.used} of {self.budget.limit} are in flight"
            )
        self.held += max(n, 0)

    def force(self, n: int) -> None:
        """Count `n` bytes already held (an answer being sent), over the limit if need be."""
        self.budget.used += n
        self.held += n

    def release(self) -> None:
        self.budget.give(self.held)
        self.held = 0


def admit(request: Request, nbytes: int, what: str) -> None:
    """Reserve `nbytes` of KV in flight for this request (until its answer is sent), or raise
    OverloadedError (503 + Retry-After) before the route reads or allocates anything."""
    ticket = request.scope.get(TICKET_KEY)
    if ticket is not None:
        ticket.take(nbytes, what)


def tenant_table(tokens: dict[str, str]) -> dict[bytes, str]:
    """Tokens are looked up by their SHA-256, so lookup time says nothing about a token's bytes."""
    if not isinstance(tokens, dict) or not tokens:
        raise InvalidArgumentError("the service needs at least one bearer token (a {token: tenant} mapping)")
    table: dict[bytes, str] = {}
    for token, tenant in tokens.items():
        if not isinstance(token, str) or not token or any(c.isspace() for c in token):
            raise InvalidArgumentError("bearer tokens must be non-empty strings without whitespace")
        table[_digest(token)] = validate_id(tenant, "tenant")
    return table


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _bearer(headers: Headers) -> str | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _digits(value: str) -> bool:
    """A Content-Length as HTTP spells it: ASCII digits only (`str.isdigit` also takes '²' and '٣')."""
    return value.isascii() and value.isdigit()


def _same(token: str | None, expected: str) -> bool:
    return token is not None and hmac.compare_digest(token.encode(), expected.encode())


def error_response(exc: AgentStateError, *, close: bool = False, retry_after: int = 1) -> JSONResponse:
    status, code = status_of(exc)
    headers = {"www-authenticate": "Bearer"} if status == 401 else {}
    if isinstance(exc, OverloadedError):
        code, headers["retry-after"] = "overloaded", str(retry_after)
    if close:
        headers["connection"] = "close"
    return JSONResponse(ErrorBody(error=code, detail=str(exc)).model_dump(), status_code=status, headers=headers)


class Gate:
    def __init__(
        self, app: ASGIApp, *, tokens: dict[str, str], limits: Limits, metrics: Metrics, chunk_bytes: int = 0,
        budget: Budget | None = None,
    ) -> None:  # fmt: skip
        self.app = app
        self.tenants = tenant_table(tokens)
        self.limits = limits
        self.metrics = metrics
        self.budget = budget or Budget(limits.max_inflight_bytes)
        self.chunk_bytes = chunk_bytes
        """what a chunk GET answers (reserved before the route runs)"""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        call = _Call(self, scope, receive, send)
        start = time.perf_counter()
        try:
            await call.run()
        finally:
            call.ticket.release()
            route = scope.get("route")
            label = getattr(route, "path", None) or ("rejected" if call.rejected else "unmatched")
            self.metrics.observe(scope["method"], label, call.status, time.perf_counter() - start, call.received)


class _Call:
    """One request through the gate."""

    def __init__(self, gate: Gate, scope: Scope, receive: Receive, send: Send) -> None:
        self.gate, self.scope, self._receive, self._send = gate, scope, receive, send
        self.status = 500
        self.received = 0
        self.limit = gate.limits.max_json_bytes
        headers = Headers(scope=scope)
        self.declared = headers.get("content-length")
        self.body_done = self.declared == "0" or (self.declared is None and "transfer-encoding" not in headers)
        self.replaced = self.started = self.rejected = self.timed_out = self.metered = False
        self.refusal: AgentStateError | None = None
        """set when the body broke a limit (size, budget) while the route read it"""
        self.ticket = Ticket(gate.budget)
        scope[TICKET_KEY] = self.ticket
        self.deadline = time.monotonic() + gate.limits.body_timeout_s

    async def run(self) -> None:
        path, headers, limits = self.scope["path"], Headers(scope=self.scope), self.gate.limits
        token = _bearer(headers)
        if path == "/v1" or path.startswith("/v1/"):
            tenant = self.gate.tenants.get(_digest(token)) if token else None
            if tenant is None:
                return await self.reject(UnauthorizedError("missing or unknown bearer token"))
            self.scope[TENANT_KEY] = tenant
        elif path == "/metrics" and limits.metrics_token is not None and not _same(token, limits.metrics_token):
            return await self.reject(UnauthorizedError("/metrics needs the metrics token"))
        if self.scope["method"] in ("POST", "PUT") and _BINARY.fullmatch(path):
            self.limit = limits.max_body_bytes
        if self.declared is not None and (not _digits(self.declared) or int(self.declared) > self.limit):
            bad = not _digits(self.declared)
            return await self.reject(MalformedRequestError("bad Content-Length") if bad else self._too_large())
        self.metered = self.limit == limits.max_body_bytes  # a KV upload: its body draws on the budget
        try:
            if self.metered and self.declared is not None:
                self.ticket.take(int(self.declared), "this upload")
            elif self.scope["method"] == "GET" and path.startswith("/v1/chunks/"):
                self.ticket.take(self.gate.chunk_bytes, "a chunk")
        except OverloadedError as exc:
            return await self.reject(exc)
        try:
            await self.gate.app(self.scope, self.receive, self.send)
        except (RequestTooLargeError, OverloadedError) as exc:
            if self.started or exc is not self.refusal:
                raise
            await self.reject(exc)

    def _too_large(self) -> RequestTooLargeError:
        return RequestTooLargeError(f"request body over the {self.limit}-byte limit of this route")

    async def reject(self, exc: AgentStateError) -> None:
        """Answer `exc` in place of the route."""
        self.rejected = self.started = True
        close = await self._drain()
        response = error_response(exc, close=close, retry_after=self.gate.limits.retry_after_s)
        self.status = response.status_code
        await response(self.scope, self._receive, self._send)

    async def _drain(self) -> bool:
        """Read and drop what is left of a body nobody will read (up to `drain_bytes`) before an
        answer goes out: closing a socket with unread data resets it, the answer with it. True
        when a body was left over (the connection is then closed after the answer)."""
        if self.body_done:
            return False
        budget = self.gate.limits.drain_bytes
        if self.timed_out or (
            self.declared is not None and _digits(self.declared) and int(self.declared) - self.received > budget
        ):
            return True
        while not self.body_done and budget > 0:
            try:
                message = await _within(self.deadline, self._receive())
            except asyncio.TimeoutError:
                self.timed_out = True
                return True
            budget -= len(message.get("body", b""))
            self.body_done = message["type"] != "http.request" or not message.get("more_body", False)
        return True

    async def receive(self) -> Message:
        if self.body_done:  # nothing more to read: wait for a disconnect as the ASGI server would
            return await self._receive()
        try:
            message = await _within(self.deadline, self._receive())
        except asyncio.TimeoutError:
            self.timed_out = True
            raise BodyTimeoutError(
                f"request body incomplete after {self.gate.limits.body_timeout_s:g} s"
                f" ({self.received} bytes of {self.declared or 'a chunked body'})"
            ) from None
        if message["type"] == "http.request":
            size = len(message.get("body", b""))
            self.received += size
            self.body_done = not message.get("more_body", False)
            if self.received > self.limit:
                self.refusal = self._too_large()
                raise self.refusal
            if self.metered and self.declared is None:
                try:
                    self.ticket.take(size, "this upload")
                except OverloadedError as exc:
                    self.refusal = exc
                    raise
        else:
            self.body_done = True
        return message

    async def send(self, message: Message) -> None:
        if self.replaced:
            return
        if message["type"] == "http.response.start":
            if self.refusal is not None:  # the route answered something else about a body it never got whole
                self.replaced = True
                await self.reject(self.refusal)
                return
            self.status, self.started = message["status"], True
            if not self.ticket.held:  # KV answered by a route that reserved nothing: counted while it is sent
                length = Headers(raw=message.get("headers", [])).get("content-length", "")
                self.ticket.force(int(length) if _digits(length) and int(length) > _STEP else 0)
            if await self._drain():
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        timeout = self.gate.limits.send_timeout_s
        try:
            await _within(time.monotonic() + timeout, self._send(message))
        except asyncio.TimeoutError:
            raise ResponseStalledError(f"the client took no part of its answer for {timeout:g} s") from None


async def _within(deadline: float, aw: Any) -> Any:
    """`await aw`, or asyncio.TimeoutError once `time.monotonic()` passes `deadline` (no task per
    call where asyncio.timeout exists: bodies arrive in many small messages)."""
    remaining = max(deadline - time.monotonic(), 0.0)
    timeout = getattr(asyncio, "timeout", None)  # Python >= 3.11
    if timeout is None:
        return await asyncio.wait_for(aw, remaining)
    async with timeout(remaining):
        return await aw


async def read_body(request: Request) -> bytearray:
    """The whole body (the gate has bounded its size and time), into one buffer that grows with
    the bytes received: a Content-Length is checked, never allocated ahead.

    A client that goes away mid-body is MalformedRequestError, like any incomplete body (the
    answer reaches nobody, but the request is logged and counted as the 400 it is, not a 500)."""
    try:
        return await _read_body(request)
    except ClientDisconnect:
        raise MalformedRequestError("the client disconnected before the body was complete") from None


async def _read_body(request: Request) -> bytearray:
    declared = request.headers.get("content-length")
    size = int(declared) if declared is not None and _digits(declared) else None
    buf = bytearray()
    async for part in request.stream():
        if size is not None and len(buf) + len(part) > size:
            raise MalformedRequestError("body longer than its Content-Length")
        buf += part
    if size is not None and len(buf) != size:
        raise MalformedRequestError("body shorter than its Content-Length")
    return buf


async def off_loop(fn: Any, *args: Any) -> Any:
    """Run a CPU-bound step (checksums, copies of large payloads) off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def frame_response(header: KVHeader, payload: memoryview, trailer: memoryview | bytes = b"") -> Response:
    """A frame sent from `payload` without copying it, then `trailer` (a hybrid model's state); the
    header gets the xxh3 of both."""
    header.xxh3 = await off_loop(checksum, payload, trailer) if len(payload) > _STEP else checksum(payload, trailer)
    return _FrameResponse(frame_prefix(header), payload, memoryview(trailer))


class _FrameResponse(Response):
    """Header, then the payload in 1 MiB slices (each send waits for the socket to drain). Not a
    StreamingResponse: that one reads the request concurrently to notice disconnects, which would
    race the gate draining an unread body."""

    def __init__(self, prefix: bytes, payload: memoryview, trailer: memoryview) -> None:
        size = len(prefix) + len(payload) + len(trailer)
        super().__init__(media_type=FRAME_TYPE, headers={"content-length": str(size)})
        self.prefix, self.payload, self.trailer = prefix, payload, trailer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.prefix, "more_body": True})
        for part in (self.payload, self.trailer):
            for i in range(0, len(part), _STEP):
                await send({"type": "http.response.body", "body": part[i : i + _STEP], "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class ServiceContext:
    """What routes share: the open store, one view per tenant, limits."""

    def __init__(self, store: StateStore, limits: Limits) -> None:
        self.store = store
        self.limits = limits
        self._views: dict[str, StateStore] = {}

    def tenant_store(self, request: Request) -> StateStore:
        tenant: str = request.scope[TENANT_KEY]
        view = self._views.get(tenant)
        if view is None:
            view = self._views[tenant] = self.store.for_tenant(tenant)
        return view


def guarded_h11(header_timeout_s: float) -> type[Any]:
    """uvicorn's h11 protocol with a deadline on request heads: the request line and headers must
    arrive within `header_timeout_s` of the connection opening or of the previous answer, else
    the connection is closed (uvicorn itself waits forever for a head that stalls, and its
    keep-alive timer only runs while no byte of the next request has come). A request in
    progress is never cut by it: bodies have the gate's deadline."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):  # type: ignore[misc]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's head arrived
                self._disarm_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm_head()

        def _arm_head(self) -> None:
            self._disarm_head()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_late)

        def _disarm_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self.logger.info("closing a connection: no complete request head within %g s", header_timeout_s)
                self.transport.close()

    return GuardedH11Protocol
