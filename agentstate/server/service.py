"""`agentstate serve`: the session resume service (FastAPI on uvicorn, loopback by default).

One process opens a data directory once and serves every tenant through `StateStore.for_tenant`
views. A bearer token maps to a tenant; every `/v1` route acts as that tenant only, so another
tenant's session is 404 exactly like one that never existed (never 403: existence does not
leak). KV travels as binary frames (`agentstate.wire`), chunks in the codec format
(`agentstate.server.dataplane`). Ops routes: `/healthz`, `/metrics` (Prometheus text), `/openapi.json`;
`/v1/admin/sessions[/{id}]` are the tenant's sessions as `agentstate ls`/`inspect --url` print them.

Agent hints (`POST /v1/sessions/{id}/hints`, an `agentstate.hints.Hint`: paused / resuming / done)
hold or release a session in the fast tiers; accounting (`GET /v1/sessions/{id}/usage`,
`GET /v1/usage`) is `agentstate.usage.Usage`, the session's or the whole tenant's.

Chunk handles are MACs under `Limits.handle_secret` (or `handle_secret_file`): replicas given the
same secret accept each other's handles; without one each process makes its own, and its handles
stop working when it exits.

Under load (see `agentstate.server.gate`): request heads and bodies have deadlines, connections a
cap, and KV in flight a byte budget; a resume reserves its session's size before it reads a chunk,
and what does not fit is answered 503 `overloaded` with Retry-After (the SDK retries it).
"""

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from agentstate import codec
from agentstate import model_state as model_state_codec
from agentstate._version import __version__
from agentstate.config import StoreConfig
from agentstate.errors import AgentStateError, BackendError, InvalidArgumentError, NotFoundError
from agentstate.hints import Hint, HintResult
from agentstate.manifest import SessionManifest
from agentstate.ops import admin
from agentstate.datadir import adopt_spec, directory_spec
from agentstate.server import logcut
from agentstate.server.dataplane import Handles, register
from agentstate.server.gate import (
    Budget,
    Gate,
    Limits,
    ServiceContext,
    admit,
    error_response,
    frame_response,
    guarded_h11,
    off_loop,
    read_body,
)
from agentstate.server.metrics import CONTENT_TYPE, Metrics
from agentstate.spec import ModelSpec
from agentstate.store import StateStore
from agentstate.usage import Usage
from agentstate.wire import (
    FRAME_TYPE,
    ErrorBody,
    ForkRequest,
    RecordNames,
    RecordsBody,
    RecordsDelete,
    RecordsRemoved,
    ResumeHeader,
    SessionInfo,
    SnapshotHeader,
    SpecInfo,
    TenantStats,
    kv_from,
    kv_payload,
    split_frame,
    state_from,
)

__all__ = ["Limits", "create_app", "run", "serve"]
log = logging.getLogger("agentstate.server.service")
DEFAULT_PORT = 8470
"""No engine listens here by default (vLLM 8000, SGLang 30000, TGI 8080/3000, Ollama 11434, llama.cpp 8080)."""
_FRAME_BODY = {
    "requestBody": {"required": True, "content": {FRAME_TYPE: {"schema": {"type": "string", "format": "binary"}}}}
}
_ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": ErrorBody} for s in (401, 404, 409, 413, 422, 503)}


def create_app(
    store: StateStore, tokens: dict[str, str], limits: Limits | None = None, *, tenant_metrics: bool | None = None
) -> FastAPI:
    """The service over one open store. `tokens` maps bearer token -> tenant. `tenant_metrics`:
    export the per-tenant usage counters on /metrics (they name tenants); None: when /metrics
    needs a token (`limits.metrics_token`). Its log lines (uvicorn's access lines included) cut
    client-sent ids and paths to ~100 characters (`agentstate.server.logcut`)."""
    logcut.install()
    limits = limits or Limits()
    ctx = ServiceContext(store, limits)
    metrics = Metrics(tenants=limits.metrics_token is not None if tenant_metrics is None else tenant_metrics)
    app = FastAPI(
        title="agentstate", version=__version__, summary="Session resume service for LLM KV state", responses=_ERRORS
    )
    chunk_bytes = codec.encoded_size(store.chunk_tokens * store.spec.token_bytes)
    budget = Budget(limits.max_inflight_bytes)
    app.add_middleware(Gate, tokens=tokens, limits=limits, metrics=metrics, chunk_bytes=chunk_bytes, budget=budget)
    _handlers(app)
    _sessions(app, ctx, metrics)
    register(app, ctx, Handles(limits.secret()))

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str | int]:
        """Up, the spec served, and the KV bytes in flight now (of `max_inflight_bytes`)."""
        return {"status": "ok", "fingerprint": store.fingerprint, "inflight_bytes": budget.used}

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse)
    async def prometheus() -> Response:
        """Prometheus text exposition: requests, latencies, the store's tiers, counters and breakers (no
        store is listed to answer it); per-tenant usage counters too when tenant metrics are on."""
        return Response(await metrics.render(store, budget.used), media_type=CONTENT_TYPE)

    return app


def _handlers(app: FastAPI) -> None:
    """Every error leaves as `{"error": code, "detail": ...}`; AgentStateError codes come from `wire.ERRORS`."""

    @app.exception_handler(AgentStateError)
    async def typed(request: Request, exc: AgentStateError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        detail = jsonable_encoder(exc.errors(), exclude={"input", "ctx"})
        return JSONResponse(ErrorBody(error="validation_error", detail=detail).model_dump(), status_code=422)

    @app.exception_handler(ValidationError)
    async def invalid_header(request: Request, exc: ValidationError) -> JSONResponse:
        detail = jsonable_encoder(exc.errors(include_url=False, include_context=False, include_input=False))
        return JSONResponse(ErrorBody(error="validation_error", detail=detail).model_dump(), status_code=422)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, f"http_{exc.status_code}")
        body = ErrorBody(error=code, detail=exc.detail).model_dump()
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def _sessions(app: FastAPI, ctx: ServiceContext, metrics: Metrics) -> None:
    Store = Annotated[StateStore, Depends(ctx.tenant_store)]
    max_header = ctx.limits.max_json_bytes

    @app.get("/v1/spec", response_model=SpecInfo, tags=["sessions"])
    async def spec(store: Store) -> SpecInfo:
        """The model spec this service stores KV for (a snapshot must carry its fingerprint)."""
        return SpecInfo(spec=store.spec, fingerprint=store.fingerprint, chunk_tokens=store.chunk_tokens)

    @app.get("/v1/stats", response_model=TenantStats, tags=["sessions"])
    async def stats(store: Store) -> TenantStats:
        """This tenant's sessions and what sharing saves them (operators see every tier and counter
        on /metrics). The same figures as the tenant's part of `agentstate stats`."""
        found = [m async for m in store.sessions()]
        chunks = {k: m.chunk_tokens for m in found for k in m.chunk_keys}
        tails = [m.tail_tokens for m in found if m.tail_key]

        def size(tokens: int) -> int:
            return admin.stored_size(store.spec, tokens)

        return TenantStats(
            tenant=store.tenant, fingerprint=store.fingerprint, chunk_tokens=store.chunk_tokens,
            sessions=len(found), session_tokens=sum(m.num_tokens for m in found), unique_chunks=len(chunks),
            tails=len(tails), unique_bytes=sum(map(size, [*chunks.values(), *tails])),
            logical_bytes=sum(len(m.chunk_keys) * size(m.chunk_tokens) + (size(m.tail_tokens) if m.tail_key else 0)
                              for m in found),
        )  # fmt: skip

    @app.get("/v1/admin/sessions", response_model=list[admin.SessionRow], tags=["admin"])
    async def admin_sessions(store: Store) -> list[admin.SessionRow]:
        """This tenant's sessions as `agentstate ls` lists them (chunks, tail, stored size)."""
        return await admin.list_sessions(store)

    @app.get("/v1/admin/sessions/{session_id}", response_model=admin.SessionDetail, tags=["admin"])
    async def admin_session(session_id: str, store: Store) -> admin.SessionDetail:
        """A session as `agentstate inspect` shows it: its manifest, and every chunk's key, size and
        the tiers holding it."""
        return await admin.inspect_session(store, session_id)

    @app.get("/v1/sessions", response_model=list[SessionInfo], tags=["sessions"])
    async def list_sessions(store: Store) -> list[SessionInfo]:
        return sorted([SessionInfo.of(m) async for m in store.sessions()], key=lambda s: s.session_id)

    @app.get("/v1/sessions/{session_id}", response_model=SessionManifest, tags=["sessions"])
    async def get_session(session_id: str, store: Store) -> SessionManifest:
        """The manifest: tokens, application state, version, parent, timestamps."""
        return await store.session(session_id)

    @app.get("/v1/sessions/{session_id}/info", response_model=SessionInfo, tags=["sessions"])
    async def session_info(session_id: str, store: Store) -> SessionInfo:
        """The session without its tokens and state: version, size, and its retention (TTL,
        `guaranteed_until`, when it expires, when it was last hit)."""
        return SessionInfo.of(await store.session(session_id))

    @app.post("/v1/sessions/{session_id}/hints", response_model=HintResult, tags=["sessions"])
    async def hint(session_id: str, body: Hint, store: Store) -> HintResult:
        """What comes next for the session: `paused` (a tool call, back in `expected_s` seconds:
        held in the fast tiers), `resuming` (its next turn is imminent: brought up into host memory
        now), `done` (released). Advice only: it never changes what is stored; a bad hint is
        refused (422) and changes nothing."""
        return await store.hint(session_id, body)

    @app.get("/v1/sessions/{session_id}/usage", response_model=Usage, tags=["sessions"])
    async def session_usage(session_id: str, store: Store) -> Usage:
        """The session's accounting: tokens read, written, deduped and recomputed, bytes per tier,
        operations, its last hit, and where its chunks are stored now."""
        return await store.usage(session_id)

    @app.get("/v1/usage", response_model=Usage, tags=["sessions"])
    async def tenant_usage(store: Store) -> Usage:
        """This tenant's accounting: all its sessions, loads and prefixes, deleted sessions included."""
        return await store.usage()

    @app.post(
        "/v1/sessions/{session_id}/snapshot", response_model=SessionInfo, tags=["sessions"], openapi_extra=_FRAME_BODY
    )
    async def snapshot(session_id: str, request: Request, store: Store) -> SessionInfo:
        """Durably store a new version (frame: SnapshotHeader + KV of every token); 409 when
        `expected_version` is stale. Nothing is stored unless the whole body arrived and its
        fingerprint, dtype, shape and checksum hold."""
        head, payload = split_frame(await read_body(request), max_header)
        header = SnapshotHeader.model_validate_json(head)
        bare, kv_bytes, model_state = await off_loop(state_from, header, payload, store.spec, len(header.tokens))
        kv = await off_loop(kv_from, bare, kv_bytes, store.spec)
        elapsed = metrics.timer()
        manifest = await store.snapshot(
            session_id, header.tokens, kv, header.state, ttl_seconds=header.ttl_seconds,
            guaranteed_until=header.guaranteed_until, pinned=header.pinned, expected_version=header.expected_version,
            force=header.force, model_state=model_state,
        )  # fmt: skip
        metrics.snapshot_seconds.observe(elapsed())
        return SessionInfo.of(manifest)

    @app.post("/v1/sessions/{session_id}/resume", tags=["sessions"], responses={200: {"content": {FRAME_TYPE: {}}}})
    async def resume(session_id: str, request: Request, store: Store) -> Response:
        """The session as a frame: ResumeHeader (manifest, restored_tokens, exact) + KV of the restored tokens.
        503 `overloaded` (Retry-After) when the service has no room for its KV now."""
        size = (await store.session(session_id)).num_tokens * store.spec.token_bytes
        admit(request, size, f"session {session_id}")
        elapsed = metrics.timer()
        result = await store.resume(session_id)
        metrics.resume_seconds.observe(elapsed())
        assert result.kv is not None  # no `into`: the store allocates the tensor
        trailer = memoryview(b"")
        if result.model_state is not None:  # a hybrid model's: its state after the restored tokens, after the KV
            trailer = kv_payload(model_state_codec.pack(store.spec, result.model_state, result.restored_tokens))
        header = ResumeHeader(
            fingerprint=store.fingerprint, dtype=store.spec.dtype, shape=list(result.kv.shape),
            manifest=result.manifest, restored_tokens=result.restored_tokens, exact=result.exact,
            model_state_bytes=len(trailer),
        )  # fmt: skip
        return await frame_response(header, kv_payload(result.kv), trailer)

    @app.post("/v1/sessions/{session_id}/fork", response_model=SessionInfo, status_code=201, tags=["sessions"])
    async def fork(session_id: str, req: ForkRequest, store: Store) -> SessionInfo:
        """A new session sharing every chunk of this one; 409 if `new_id` exists."""
        return SessionInfo.of(await store.fork(session_id, req.new_id))

    @app.put("/v1/sessions/{session_id}/records", status_code=204, tags=["records"])
    async def put_records(session_id: str, body: RecordsBody, store: Store) -> Response:
        """Keep a framework's state beside the session (`agentstate.records`): every record of the
        body, all or none; a name already there is replaced. Bodies are bounded by `max_json_bytes`."""
        await store.put_records(session_id, body.records)
        return Response(status_code=204)

    @app.get("/v1/sessions/{session_id}/records", response_model=RecordsBody, tags=["records"])
    async def get_records(session_id: str, store: Store, prefix: str = "") -> RecordsBody:
        """The session's records whose name starts with `prefix`, each checked (500 `corrupt_data`
        for a damaged one: never its bytes)."""
        return RecordsBody(records=await store.records(session_id, prefix))

    @app.post("/v1/sessions/{session_id}/records/get", response_model=RecordsBody, tags=["records"])
    async def get_named_records(session_id: str, body: RecordNames, store: Store) -> RecordsBody:
        """The session's records of these names that exist, each checked."""
        return RecordsBody(records=await store.records(session_id, names=body.names))

    @app.get("/v1/sessions/{session_id}/record-names", response_model=RecordNames, tags=["records"])
    async def record_names(session_id: str, store: Store, prefix: str = "") -> RecordNames:
        """The names of the session's records whose name starts with `prefix`, in name order."""
        return RecordNames(names=await store.record_names(session_id, prefix))

    @app.post("/v1/sessions/{session_id}/records/delete", response_model=RecordsRemoved, tags=["records"])
    async def delete_records(session_id: str, body: RecordsDelete, store: Store) -> RecordsRemoved:
        """Remove the named records (`names`: null for all of them); the session's KV stays."""
        return RecordsRemoved(removed=await store.delete_records(session_id, body.names))

    @app.delete("/v1/sessions/{session_id}", status_code=204, tags=["sessions"])
    async def delete(session_id: str, store: Store) -> Response:
        await store.delete(session_id)
        return Response(status_code=204)


# -- running it -----------------------------------------------------------------------------------


async def serve(
    config: StoreConfig,
    spec: ModelSpec,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    tokens: dict[str, str],
    limits: Limits | None = None,
    writer: str = "agentstate serve",
) -> None:
    """Open the store and serve it until SIGINT/SIGTERM; then finish requests in flight, close the
    store, and return (uvicorn re-raises the signal when it stops, which would end the process
    before the store is closed: here that re-raise is caught). A directory that records another
    spec is refused (SpecMismatchError naming the fields); the spec and `config` are recorded in it
    as `writer`'s. The port is bound first: one in use is a BackendError before anything is written."""
    limits = limits or Limits()
    sock = listening_socket(host, port)  # before the store opens: a port in use leaves no directory behind
    try:
        await _serve(config, spec, sock, host=host, port=port, tokens=tokens, limits=limits, writer=writer)
    finally:
        sock.close()


async def _serve(
    config: StoreConfig, spec: ModelSpec, sock: Any, *, host: str, port: int, tokens: dict[str, str], limits: Limits,
    writer: str,
) -> None:  # fmt: skip
    import uvicorn

    async with StateStore.open(config, spec, writer=writer) as store:
        app = create_app(store, tokens, limits)
        server = uvicorn.Server(uvicorn_config(app, limits, host=host, port=port))
        log.info(
            "serving %s (spec %s) on http://%s:%d, %d tokens", config.path, spec.fingerprint, host, port, len(tokens)
        )
        if not limits.has_handle_secret:
            log.info(
                "chunk handles are signed with a secret made for this process: they stop working when it exits and"
                " other replicas refuse them (set --handle-secret-file or AGENTSTATE_SERVICE_HANDLE_SECRET)"
            )
        with _signals_caught():
            await server.serve(sockets=[sock])
        log.info("stopped serving %s; closing the store", config.path)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` and listening; a port in use (or an address this host does not
    have) is a BackendError saying so and what to do, raised before anything else starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
        raise BackendError(f"port {port} on {host} {why}: give another with --port (or [service] port)") from None
    sock.setblocking(False)
    return sock


def uvicorn_config(app: Any, limits: Limits, **kw: Any) -> Any:
    """uvicorn settings that bound what a client can hold: keep-alive, connections, head deadline.
    uvicorn's own logging setup is skipped when its loggers are configured already (the CLI's
    `--log-level`/`--log-json` do), so its lines keep that format."""
    import uvicorn

    if logging.getLogger("uvicorn").handlers:
        kw.setdefault("log_config", None)
    return uvicorn.Config(
        app, lifespan="off", log_level="info", http=guarded_h11(limits.header_timeout_s),
        timeout_keep_alive=limits.keep_alive_s, limit_concurrency=limits.max_connections, **kw,
    )  # fmt: skip


@contextlib.contextmanager
def _signals_caught() -> Iterator[list[int]]:
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = {sig: signal.signal(sig, lambda s, _: caught.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(
    path: Path,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    tokens_file: Path | None = None,
    spec: ModelSpec | None = None,
    limits: Limits | None = None,
) -> None:
    """Blocking entry point of `agentstate serve`: serves until SIGINT/SIGTERM, then returns
    once requests in flight are answered and the store is closed.

    - tokens: `tokens_file`, a JSON object {"<bearer token>": "<tenant>"}; else the same JSON
      object in env `AGENTSTATE_TOKENS`; neither is an error (the service never runs open).
    - spec: the one given, recorded as `<path>/spec.json` if none is recorded yet; else the one
      recorded there; neither refuses to start (NotFoundError), as `agentstate serve` does. Clients
      see the served spec on `GET /v1/spec`; KV of any other spec is refused with 409.
    - store: `StoreConfig(path=path)`, so `AGENTSTATE_*` env vars configure tiers and the rest;
      limits and the chunk-handle secret: `limits`, else `AGENTSTATE_SERVICE_*` (see `Limits`).
    """
    limits = limits or Limits()
    limits.secret()  # a bad secret file is refused before the store opens
    asyncio.run(
        serve(
            StoreConfig(path=path),
            resolve_spec(path, spec),
            host=host,
            port=port,
            tokens=load_tokens(tokens_file),
            limits=limits,
        )
    )


def load_tokens(tokens_file: Path | None) -> dict[str, str]:
    """The bearer tokens of `tokens_file` (else env AGENTSTATE_TOKENS); a file that is missing or
    cannot be read is NotFoundError / InvalidArgumentError, one line, never a traceback."""
    if tokens_file is not None:
        source = str(tokens_file)
        try:
            raw = Path(tokens_file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise NotFoundError(f"no tokens file {tokens_file} (--tokens-file takes JSON: {{token: tenant}})") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidArgumentError(f"cannot read tokens file {tokens_file}: {exc}") from None
    elif os.environ.get("AGENTSTATE_TOKENS"):
        source, raw = "AGENTSTATE_TOKENS", os.environ["AGENTSTATE_TOKENS"]
    else:
        raise InvalidArgumentError(
            "no bearer tokens: pass a tokens file or set AGENTSTATE_TOKENS to {token: tenant} JSON"
        )
    try:
        tokens = json.loads(raw)
    except ValueError as exc:
        raise InvalidArgumentError(f"{source} is not JSON: {exc}") from None
    if not isinstance(tokens, dict) or not all(isinstance(v, str) for v in tokens.values()):
        raise InvalidArgumentError(f"{source} must be a JSON object mapping bearer token to tenant id")
    return tokens


def resolve_spec(path: Path, spec: ModelSpec | None) -> ModelSpec:
    """The spec given (recorded in `path` if none is yet; refused, naming the fields that differ, if
    another is), else the recorded one; neither is a NotFoundError, never a guess."""
    hint = (
        "none given: pass one the first time (it is recorded and used from then on); a guessed spec would serve the"
        " directory's sessions as missing"
    )
    found = directory_spec(path, spec, source="the spec to serve", hint=hint)
    if spec is not None:
        adopt_spec(path, spec, source="the spec to serve")
    return found
