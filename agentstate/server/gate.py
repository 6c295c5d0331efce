"""The service's front door: bearer-token auth, request size limits, request metrics, and the
helpers routes use to read bodies and stream frames.

`Gate` is plain ASGI and runs before FastAPI parses anything, so a request without a valid token
is answered 401 without its body being read, and a body over its limit is refused 413 from its
Content-Length alone, or, when it streams past the limit (chunked, or lying), as soon as it does:
whatever the route would have answered is replaced by the 413. Routes store nothing until they
hold the whole body, so a refused request changes nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import secrets
import time
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentstate.errors import AgentStateError, InvalidArgumentError
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
        description="key of chunk-handle MACs; None: random, so handles die with the process",
    )
    metrics_token: str | None = Field(
        default=None, min_length=1, description="bearer token /metrics asks for; None: open"
    )
    drain_bytes: int = Field(
        default=64 << 20, ge=0, description="of a refused body, read and dropped so the client gets the answer"
    )

    def secret(self) -> bytes:
        raw = self.handle_secret.encode() if self.handle_secret else secrets.token_bytes(32)
        return hashlib.blake2b(raw, digest_size=32, person=b"agentstate-hsec").digest()


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


def error_response(exc: AgentStateError, *, close: bool = False) -> JSONResponse:
    status, code = status_of(exc)
    headers = {"www-authenticate": "Bearer"} if status == 401 else {}
    if close:
        headers["connection"] = "close"
    return JSONResponse(ErrorBody(error=code, detail=str(exc)).model_dump(), status_code=status, headers=headers)


class Gate:
    def __init__(self, app: ASGIApp, *, tokens: dict[str, str], limits: Limits, metrics: Metrics) -> None:
        self.app = app
        self.tenants = tenant_table(tokens)
        self.limits = limits
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        call = _Call(self, scope, receive, send)
        start = time.perf_counter()
        try:
            await call.run()
        finally:
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
        self.overflow = self.replaced = self.started = self.rejected = False

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
        try:
            await self.gate.app(self.scope, self.receive, self.send)
        except RequestTooLargeError as exc:
            if self.started:
                raise
            await self.reject(exc)

    def _too_large(self) -> RequestTooLargeError:
        return RequestTooLargeError(f"request body over the {self.limit}-byte limit of this route")

    async def reject(self, exc: AgentStateError) -> None:
        """Answer `exc` in place of the route."""
        self.rejected = self.started = True
        close = await self._drain()
        response = error_response(exc, close=close)
        self.status = response.status_code
        await response(self.scope, self._receive, self._send)

    async def _drain(self) -> bool:
        """Read and drop what is left of a body nobody will read (up to `drain_bytes`) before an
        answer goes out: closing a socket with unread data resets it, the answer with it. True
        when a body was left over (the connection is then closed after the answer)."""
        if self.body_done:
            return False
        budget = self.gate.limits.drain_bytes
        if self.declared is not None and _digits(self.declared) and int(self.declared) - self.received > budget:
            return True
        while not self.body_done and budget > 0:
            message = await self._receive()
            budget -= len(message.get("body", b""))
            self.body_done = message["type"] != "http.request" or not message.get("more_body", False)
        return True

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self.body_done = not message.get("more_body", False)
            if self.received > self.limit:
                self.overflow = True
                raise self._too_large()
        else:
            self.body_done = True
        return message

    async def send(self, message: Message) -> None:
        if self.replaced:
            return
        if message["type"] == "http.response.start":
            if self.overflow:  # the route answered something else about a body it never got whole
                self.replaced = True
                await self.reject(self._too_large())
                return
            self.status, self.started = message["status"], True
            if await self._drain():
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await self._send(message)


async def read_body(request: Request) -> bytearray:
    """The whole body (the gate has bounded it), into one buffer sized from Content-Length.

    A client that goes away mid-body is MalformedRequestError, like any incomplete body (the
    answer reaches nobody, but the request is logged and counted as the 400 it is, not a 500)."""
    try:
        return await _read_body(request)
    except ClientDisconnect:
        raise MalformedRequestError("the client disconnected before the body was complete") from None


async def _read_body(request: Request) -> bytearray:
    declared = request.headers.get("content-length")
    if declared is None:
        buf = bytearray()
        async for part in request.stream():
            buf += part
        return buf
    buf, pos = bytearray(int(declared)), 0
    async for part in request.stream():
        if pos + len(part) > len(buf):
            raise MalformedRequestError("body longer than its Content-Length")
        buf[pos : pos + len(part)] = part
        pos += len(part)
    if pos != len(buf):
        raise MalformedRequestError("body shorter than its Content-Length")
    return buf


async def off_loop(fn: Any, *args: Any) -> Any:
    """Run a CPU-bound step (checksums, copies of large payloads) off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def frame_response(header: KVHeader, payload: memoryview) -> Response:
    """A frame sent from `payload` without copying it; the header gets the payload's xxh3."""
    header.xxh3 = await off_loop(checksum, payload) if len(payload) > _STEP else checksum(payload)
    return _FrameResponse(frame_prefix(header), payload)


class _FrameResponse(Response):
    """Header, then the payload in 1 MiB slices (each send waits for the socket to drain). Not a
    StreamingResponse: that one reads the request concurrently to notice disconnects, which would
    race the gate draining an unread body."""

    def __init__(self, prefix: bytes, payload: memoryview) -> None:
        super().__init__(media_type=FRAME_TYPE, headers={"content-length": str(len(prefix) + len(payload))})
        self.prefix, self.payload = prefix, payload

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.prefix, "more_body": True})
        for i in range(0, len(self.payload), _STEP):
            await send({"type": "http.response.body", "body": self.payload[i : i + _STEP], "more_body": True})
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
