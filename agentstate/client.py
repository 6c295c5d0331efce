"""`AsyncClient`: what an agent framework or a remote engine calls to reach `agentstate serve`.

    async with AsyncClient("http://127.0.0.1:8470", token) as client:
        await client.snapshot("agent-42", tokens, kv, {"messages": [...]})
        await client.paused("agent-42", 30)        # a tool call, back in about 30 s: held in memory
        await client.resuming("agent-42")          # its next turn: brought up into host memory now
        r = await client.resume("agent-42")        # ResumeResult, r.kv bit-exact when r.exact
        print((await client.usage("agent-42")).tokens_read)

    with Client("http://127.0.0.1:8470", token) as client:   # the same methods, blocking
        r = client.resume("agent-42")

Same models as the service (`agentstate.wire`, `agentstate.manifest`); KV travels as binary
frames, never JSON numbers or pickle. Error responses are raised as the `agentstate.errors` type
their code names (SessionNotFoundError, SpecMismatchError, ConflictError, ...).

A 503 that says the service had no room for the request (`overloaded`, or uvicorn's connection
limit) is retried: up to `retries` more times, waiting the answer's Retry-After, else an
exponential backoff from `retry_backoff_s`, each wait at most `retry_max_wait_s` (with jitter).
Such a request was refused before anything was read or stored, so retrying it is always safe;
other errors, a backend outage's 503 included, are raised at once.

The SDK needs httpx and pydantic, not torch (`pip install 'agentstate-kv[client]'`): torch is imported
only when KV is sent or received.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import random
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

from pydantic import BaseModel, ValidationError
from typing_extensions import Self

from agentstate import model_state as model_state_codec
from agentstate.errors import (
    AgentStateError,
    BackendError,
    CorruptDataError,
    InvalidArgumentError,
    MissingDependencyError,
    NotFoundError,
)
from agentstate.hints import Hint, HintKind, HintResult
from agentstate.keys import CHUNK_PREFIX, token_array, validate_id
from agentstate.manifest import ResumeResult, SessionManifest
from agentstate.records import validate_items, validate_name, validate_names
from agentstate.spec import ModelSpec
from agentstate.usage import Usage
from agentstate.wire import (
    CHUNK_TYPE,
    FRAME_TYPE,
    ChunkMatch,
    ChunkStored,
    KVHeader,
    LoadHeader,
    PrefixHeader,
    PrefixStored,
    RecordNames,
    RecordsBody,
    RecordsRemoved,
    ResumeHeader,
    SessionInfo,
    SnapshotHeader,
    SpecInfo,
    TenantStats,
    checksum,
    error_from,
    frame_prefix,
    kv_from,
    kv_payload,
    split_frame,
    state_from,
)

try:
    import httpx
except ModuleNotFoundError as exc:
    raise (MissingDependencyError.of(exc, "agentstate.client") or exc) from None

if TYPE_CHECKING:
    import torch

M = TypeVar("M", bound=BaseModel)
H = TypeVar("H", bound=KVHeader)
T = TypeVar("T")
_STEP = 1 << 20
_MAX_HEADER = 1 << 30


class RemoteResumeResult(ResumeResult):
    """A ResumeResult whose `kv` is always a CPU tensor, the restored tokens' KV as received."""

    if TYPE_CHECKING:  # narrowed for type checkers only: a field typed here would need torch to import
        kv: torch.Tensor


class AsyncClient:
    """One connection pool to one service, as one tenant (the token's).

    `spec` is the model the caller's KV is for: its fingerprint goes with every upload and the
    service refuses KV of another spec (SpecMismatchError). Without it the service's own spec is
    used (fetched once), and uploads are still checked locally for its dtype and shape.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        spec: ModelSpec | None = None,
        timeout: float | httpx.Timeout = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
        retries: int = 6,
        retry_backoff_s: float = 0.1,
        retry_max_wait_s: float = 5.0,
    ) -> None:
        headers = {"authorization": f"Bearer {token}"}
        self._http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, transport=transport)
        self._spec = spec
        self.retries, self.retry_backoff_s, self.retry_max_wait_s = retries, retry_backoff_s, retry_max_wait_s
        self.retried = 0
        """503 overloaded answers retried so far (all calls)"""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- plumbing ------------------------------------------------------------------------------

    async def _call(
        self, method: str, path: str, *, content: Callable[[], Any] | None = None, **kw: Any
    ) -> httpx.Response:
        """One request; `content` makes its body afresh for each try (a stream is sent once)."""
        for attempt in range(self.retries + 1):
            try:
                body = {"content": content()} if content is not None else {}
                response = await self._http.request(method, path, **body, **kw)
            except httpx.TransportError as exc:
                raise self._unreachable(f"{method} {path}", exc) from exc
            if response.is_error:
                if attempt < self.retries and await self._wait_if_busy(response, attempt):
                    continue
                raise _error(response)
            return response
        raise AssertionError("unreachable")

    def _unreachable(self, what: str, exc: httpx.TransportError) -> BackendError:
        """A transport failure as one line; a refused connection says where it looked."""
        if isinstance(exc, httpx.ConnectError):
            return BackendError(f"cannot connect to {self._http.base_url} ({exc}): is the agentstate server running there?")
        return BackendError(f"{what}: {type(exc).__name__}: {exc}")

    async def _wait_if_busy(self, response: httpx.Response, attempt: int) -> bool:
        """Whether `response` is a refusal for want of room (then after waiting to retry it)."""
        if response.status_code != 503:
            return False
        try:
            code = response.json().get("error")
        except (ValueError, AttributeError):
            code = None  # not the service's error body: uvicorn's connection limit
        if code not in (None, "overloaded"):
            return False
        after = response.headers.get("retry-after", "")
        wait = float(after) if after.isascii() and after.isdigit() else self.retry_backoff_s * 2**attempt
        wait = min(max(wait, self.retry_backoff_s), self.retry_max_wait_s) * random.uniform(1.0, 1.25)
        self.retried += 1
        await asyncio.sleep(wait)
        return True

    async def _json(self, model: type[M], method: str, path: str, **kw: Any) -> M:
        return _parse(model, (await self._call(method, path, **kw)).content)

    async def _frame(self, header_type: type[H], path: str, **kw: Any) -> tuple[H, torch.Tensor]:
        """POST, and read the frame it answers straight into one buffer the returned tensor owns."""
        header, payload = await self._frame_bytes(header_type, path, **kw)
        try:
            return header, kv_from(header, payload)
        except AgentStateError as exc:
            raise CorruptDataError(f"{path}: response frame failed its checks: {exc}") from None

    async def _frame_bytes(self, header_type: type[H], path: str, **kw: Any) -> tuple[H, memoryview]:
        """POST, and the header and payload of the frame it answers (read into one buffer)."""
        for attempt in range(self.retries + 1):
            try:
                async with self._http.stream("POST", path, **kw) as response:
                    if response.is_error:
                        await response.aread()
                    else:
                        buf = await _body(response)
            except httpx.TransportError as exc:
                raise self._unreachable(f"POST {path}", exc) from exc
            if not response.is_error:
                break
            if attempt < self.retries and await self._wait_if_busy(response, attempt):
                continue
            raise _error(response)
        try:
            head, payload = split_frame(buf, _MAX_HEADER)
            return _parse(header_type, head), payload
        except AgentStateError as exc:
            raise CorruptDataError(f"{path}: response frame failed its checks: {exc}") from None

    async def _state_frame(self, path: str) -> tuple[ResumeHeader, torch.Tensor, dict[str, torch.Tensor] | None]:
        """A resume's frame: its KV and, for a hybrid model, the state after the restored tokens (the
        payload's last `model_state_bytes`; the checksum covers both)."""
        header, payload = await self._frame_bytes(ResumeHeader, path)
        try:
            spec = await self.spec()
            bare, kv_bytes, state = state_from(header, payload, spec, header.restored_tokens)
            return header, kv_from(bare, kv_bytes), state
        except AgentStateError as exc:
            raise CorruptDataError(f"{path}: response frame failed its checks: {exc}") from None

    async def _upload(self, path: str, header: KVHeader, kv: torch.Tensor, trailer: bytes = b"") -> httpx.Response:
        """POST a frame: the header, `kv`'s bytes and `trailer` (a hybrid model's packed state)."""
        payload = kv_payload(kv)
        header.xxh3 = checksum(payload, trailer)
        prefix = frame_prefix(header)

        async def body() -> AsyncIterator[Any]:  # memoryview slices: the KV is not copied
            yield prefix
            for i in range(0, len(payload), _STEP):
                yield payload[i : i + _STEP]
            if trailer:
                yield trailer

        headers = {"content-type": FRAME_TYPE, "content-length": str(len(prefix) + len(payload) + len(trailer))}
        return await self._call("POST", path, content=body, headers=headers)

    async def _kv_header(self, kv: torch.Tensor, tokens: int) -> dict[str, Any]:
        from agentstate.spec import DTYPE_NAMES

        spec = await self.spec()
        spec.check_kv(kv, tokens)
        return {"fingerprint": spec.fingerprint, "dtype": DTYPE_NAMES[kv.dtype], "shape": list(kv.shape)}

    async def spec(self) -> ModelSpec:
        """The caller's spec, or else the service's."""
        if self._spec is None:
            self._spec = (await self.service_spec()).spec
        return self._spec

    async def service_spec(self) -> SpecInfo:
        return await self._json(SpecInfo, "GET", "/v1/spec")

    # -- sessions ------------------------------------------------------------------------------

    async def snapshot(
        self,
        session_id: str,
        tokens: Sequence[int] | torch.Tensor,
        kv: torch.Tensor,
        state: dict[str, Any] | None = None,
        *,
        ttl_seconds: float | None = None,
        guaranteed_until: float | None = None,
        pinned: bool = False,
        expected_version: int | None = None,
        force: bool = False,
        model_state: Mapping[str, torch.Tensor] | None = None,
    ) -> SessionInfo:
        """Durably store a new version of the session (see StateStore.snapshot): `ttl_seconds`
        expires it that long after its last write or hit, `guaranteed_until` (wall-clock seconds)
        keeps it at least until then; `model_state`: a hybrid model's state after the last token
        (required by a spec with a state layout). Options are checked here first (InvalidArgumentError,
        KVShapeError)."""
        toks = token_array(tokens).tolist()
        kv_header = await self._kv_header(kv, len(toks))
        packed = model_state_codec.checked(await self.spec(), model_state, len(toks))
        trailer = b"" if packed is None else packed.reshape(-1).numpy().tobytes()
        try:
            header = SnapshotHeader(
                **kv_header, tokens=toks, state=state or {}, ttl_seconds=ttl_seconds,
                guaranteed_until=guaranteed_until, pinned=pinned, expected_version=expected_version, force=force,
                model_state_bytes=len(trailer),
            )  # fmt: skip
        except ValidationError as exc:
            detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise InvalidArgumentError(f"invalid snapshot options: {detail}") from None
        path = _session(session_id, "/snapshot")
        return _parse(SessionInfo, (await self._upload(path, header, kv, trailer)).content)

    async def resume(self, session_id: str) -> RemoteResumeResult:
        """The session's manifest and KV (`kv` holds its first `restored_tokens` tokens; bit-exact when
        `exact`, else within fp8's bound: see ResumeResult)."""
        header, kv, state = await self._state_frame(_session(session_id, "/resume"))
        return RemoteResumeResult(
            manifest=header.manifest, kv=kv, restored_tokens=header.restored_tokens, exact=header.exact,
            model_state=state,
        )

    async def fork(self, source_id: str, new_id: str) -> SessionInfo:
        body = {"new_id": validate_id(new_id)}
        return await self._json(SessionInfo, "POST", _session(source_id, "/fork"), json=body)

    async def delete(self, session_id: str) -> None:
        await self._call("DELETE", _session(session_id))

    async def get(self, session_id: str) -> SessionManifest:
        return await self._json(SessionManifest, "GET", _session(session_id))

    async def info(self, session_id: str) -> SessionInfo:
        """The session without its tokens and state, with its retention (`guaranteed_until`,
        `expires_at`, `last_hit_at`)."""
        return await self._json(SessionInfo, "GET", _session(session_id, "/info"))

    # -- hints and accounting ------------------------------------------------------------------

    async def put_records(self, session_id: str, items: Mapping[str, bytes]) -> None:
        """Keep a framework's state beside the session (`agentstate.records`), all or none."""
        body = {"records": {n: base64.b64encode(v).decode() for n, v in validate_items(items).items()}}
        await self._call("PUT", _session(session_id, "/records"), json=body)

    async def records(
        self, session_id: str, prefix: str = "", *, names: Sequence[str] | None = None
    ) -> dict[str, bytes]:
        """The session's records whose name starts with `prefix`, in name order, or those of
        `names` that exist (in that order); checked by the service."""
        if names is not None:
            body = {"names": validate_names(names)}
            found = await self._json(RecordsBody, "POST", _session(session_id, "/records/get"), json=body)
            return {n: found.records[n] for n in body["names"] if n in found.records}
        params = {"prefix": validate_name(prefix)} if prefix else {}
        found = await self._json(RecordsBody, "GET", _session(session_id, "/records"), params=params)
        return dict(sorted(found.records.items()))

    async def record_names(self, session_id: str, prefix: str = "") -> builtins.list[str]:
        params = {"prefix": validate_name(prefix)} if prefix else {}
        return (await self._json(RecordNames, "GET", _session(session_id, "/record-names"), params=params)).names

    async def delete_records(self, session_id: str, names: Sequence[str] | None = None) -> int:
        body = {"names": None if names is None else validate_names(names)}
        return (await self._json(RecordsRemoved, "POST", _session(session_id, "/records/delete"), json=body)).removed

    async def hint(self, session_id: str, hint: HintKind | Hint, expected_s: float | None = None) -> HintResult:
        """Tell the service what comes next for the session (see `agentstate.hints`): `paused`
        (a tool call, back in `expected_s` seconds), `resuming` (its next turn is imminent) or
        `done`. A bad hint is refused here, before anything is sent (InvalidArgumentError)."""
        body = Hint.parse(hint, expected_s).model_dump(exclude_none=True)
        return await self._json(HintResult, "POST", _session(session_id, "/hints"), json=body)

    async def paused(self, session_id: str, expected_s: float) -> HintResult:
        """A tool call started; the session is expected back in `expected_s` seconds."""
        return await self.hint(session_id, "paused", expected_s)

    async def resuming(self, session_id: str) -> HintResult:
        """The session's next turn is imminent: the service brings it up into host memory now."""
        return await self.hint(session_id, "resuming")

    async def done(self, session_id: str) -> HintResult:
        """The session will not be back soon: its place in the fast tiers is released."""
        return await self.hint(session_id, "done")

    async def usage(self, session_id: str | None = None) -> Usage:
        """Accounting of one session, or of this tenant (None: all its sessions, loads and
        prefixes, deleted sessions included)."""
        path = "/v1/usage" if session_id is None else _session(session_id, "/usage")
        return await self._json(Usage, "GET", path)

    async def list(self) -> builtins.list[SessionInfo]:
        response = await self._call("GET", "/v1/sessions")
        try:
            return [SessionInfo.model_validate(item) for item in response.json()]
        except (ValueError, ValidationError) as exc:
            raise CorruptDataError(f"/v1/sessions: unexpected response: {exc}") from None

    async def stats(self) -> TenantStats:
        return await self._json(TenantStats, "GET", "/v1/stats")

    async def get_json(self, path: str, model: type[M]) -> M:
        """GET a JSON route that has no method here, parsed as `model`, with the auth, retries and
        typed errors of every call: e.g. `/v1/admin/sessions`, which `agentstate ls --url` reads
        as `agentstate.ops.admin.SessionRow`s."""
        if not path.startswith("/") or path.startswith("//"):  # never another host: the token goes along
            raise InvalidArgumentError(f"not a path of the service: {path[:100]!r}")
        return await self._json(model, "GET", path)

    # -- data plane ----------------------------------------------------------------------------

    async def match(self, tokens: Sequence[int] | torch.Tensor) -> ChunkMatch:
        """How much of `tokens` is cached for this tenant, with a chunk handle per full chunk."""
        return await self._json(ChunkMatch, "POST", "/v1/match", json={"tokens": token_array(tokens).tolist()})

    async def put_prefix(self, tokens: Sequence[int] | torch.Tensor, kv: torch.Tensor) -> int:
        """Store a shared prefix; returns how many tokens were newly stored."""
        toks = token_array(tokens).tolist()
        header = PrefixHeader(**await self._kv_header(kv, len(toks)), tokens=toks)
        return _parse(PrefixStored, (await self._upload("/v1/prefixes", header, kv)).content).stored_tokens

    async def load(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """KV of the cached prefix of `tokens` (whole chunks; its token dim says how many)."""
        _, kv = await self._frame(LoadHeader, "/v1/prefixes/load", json={"tokens": token_array(tokens).tolist()})
        return kv

    async def has_chunk(self, handle: str) -> bool:
        response = await self._http.head(f"/v1/chunks/{quote(handle, safe='')}")
        if response.status_code == 404:
            return False
        if response.is_error:
            raise _error(response)
        return True

    async def get_chunk(self, handle: str) -> bytes | None:
        """The chunk in the codec format (`decode_chunk(handle, raw)` it), or None when absent."""
        try:
            return (await self._call("GET", f"/v1/chunks/{quote(handle, safe='')}")).content
        except NotFoundError:
            return None

    async def put_chunk(self, handle: str, chunk: bytes | bytearray | memoryview | torch.Tensor) -> bool:
        """Store one chunk: its KV (encoded here, bound to the handle's key), or bytes already
        encoded for this handle (`encode_chunk`); False when the service already held it.

        A value is bound to the key it is stored under, so bytes got under another handle (another
        tenant's, another chunk's) are refused (InvalidArgumentError): decode them, then re-encode.
        """
        if not isinstance(chunk, (bytes, bytearray, memoryview)):  # a tensor
            chunk = await self.encode_chunk(handle, chunk)
        path = f"/v1/chunks/{quote(handle, safe='')}"
        raw = bytes(chunk)
        response = await self._call("PUT", path, content=lambda: raw, headers={"content-type": CHUNK_TYPE})
        return _parse(ChunkStored, response.content).stored

    async def chunk_key(self, handle: str) -> str:
        """The storage key a handle names on the service (`c/<fingerprint>/<digest>`): the key its
        chunk's codec checksum is bound to."""
        digest, dot, mac = handle.partition(".")
        if not dot or len(digest) != 64 or len(mac) != 32 or not all(c in "0123456789abcdef" for c in digest + mac):
            raise InvalidArgumentError(f"not a chunk handle: {handle[:100]!r}")
        return f"{CHUNK_PREFIX}{(await self.spec()).fingerprint}/{digest}"

    async def encode_chunk(self, handle: str, kv: torch.Tensor) -> bytearray:
        """One chunk of canonical KV in the codec format, bound to the key `handle` names."""
        from agentstate import codec

        spec = await self.spec()
        out = codec.encode(kv, spec.fingerprint, key=await self.chunk_key(handle))
        assert isinstance(out, bytearray)
        return out

    async def decode_chunk(self, handle: str, raw: bytes | bytearray | memoryview) -> torch.Tensor:
        """Check a chunk got from `get_chunk(handle)` completely (spec, dtype, checksum bound to the
        handle's key) and return its KV (a view over `raw`)."""
        from agentstate import codec

        spec = await self.spec()
        return codec.decode(raw, key=await self.chunk_key(handle), fingerprint=spec.fingerprint, dtype=spec.torch_dtype)


async def _body(response: httpx.Response) -> bytearray:
    declared = response.headers.get("content-length")
    if declared is None or not declared.isdigit():
        return bytearray(await response.aread())
    buf, pos = bytearray(int(declared)), 0
    async for part in response.aiter_raw():
        if pos + len(part) > len(buf):
            raise CorruptDataError("response longer than its Content-Length")
        buf[pos : pos + len(part)] = part
        pos += len(part)
    if pos != len(buf):
        raise CorruptDataError("response shorter than its Content-Length")
    return buf


def _session(session_id: str, suffix: str = "") -> str:
    """The route of a session; ids are checked here, as the service would, and are URL-safe then."""
    return f"/v1/sessions/{validate_id(session_id)}{suffix}"


def _parse(model: type[M], raw: bytes) -> M:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise CorruptDataError(f"unexpected response for {model.__name__}: {exc}") from None


def _error(response: httpx.Response) -> AgentStateError:
    try:
        body = response.json()
        code, detail = body.get("error"), body.get("detail")
    except (ValueError, AttributeError):
        code, detail = None, response.text[:500]
    return error_from(response.status_code, code, detail if detail is not None else response.reason_phrase)


class Client:
    """The blocking SDK: every method of AsyncClient, with the same arguments and results.

    It runs one AsyncClient on a private event loop in a daemon thread and waits for each call,
    so frames, retries and errors are AsyncClient's own, not a second implementation over
    httpx.Client. A private thread rather than `asyncio.run` per call: httpx's connection pool
    belongs to one loop (a loop per call would reconnect every time), and `asyncio.run` refuses
    to run inside a running loop (a notebook, sync code called from async code). Calls from many
    threads at once are fine: they run concurrently on the one loop. Close it (`close()`, or
    `with Client(...) as client:`) to end the connections and the thread.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        spec: ModelSpec | None = None,
        timeout: float | httpx.Timeout = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
        retries: int = 6,
        retry_backoff_s: float = 0.1,
        retry_max_wait_s: float = 5.0,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._loop.run_forever, name="agentstate-client", daemon=True)
        thread.start()
        self._stop = weakref.finalize(self, _stop_loop, self._loop, thread)

        async def make() -> AsyncClient:
            return AsyncClient(
                base_url, token, spec=spec, timeout=timeout, transport=transport, retries=retries,
                retry_backoff_s=retry_backoff_s, retry_max_wait_s=retry_max_wait_s,
            )  # fmt: skip

        self._async = self._wait(make())

    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._stop.alive:
            coro.close()
            raise InvalidArgumentError("this Client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # an interrupted caller (KeyboardInterrupt) leaves nothing running
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._stop.alive:
            self._wait(self._async.aclose())
            self._stop()

    @property
    def retried(self) -> int:
        """503 overloaded answers retried so far (all calls)"""
        return self._async.retried

    def spec(self) -> ModelSpec:
        return self._wait(self._async.spec())

    def service_spec(self) -> SpecInfo:
        return self._wait(self._async.service_spec())

    def snapshot(
        self,
        session_id: str,
        tokens: Sequence[int] | torch.Tensor,
        kv: torch.Tensor,
        state: dict[str, Any] | None = None,
        *,
        ttl_seconds: float | None = None,
        guaranteed_until: float | None = None,
        pinned: bool = False,
        expected_version: int | None = None,
        force: bool = False,
        model_state: Mapping[str, torch.Tensor] | None = None,
    ) -> SessionInfo:
        return self._wait(self._async.snapshot(
            session_id, tokens, kv, state, ttl_seconds=ttl_seconds, guaranteed_until=guaranteed_until,
            pinned=pinned, expected_version=expected_version, force=force, model_state=model_state,
        ))  # fmt: skip

    def resume(self, session_id: str) -> RemoteResumeResult:
        return self._wait(self._async.resume(session_id))

    def fork(self, source_id: str, new_id: str) -> SessionInfo:
        return self._wait(self._async.fork(source_id, new_id))

    def delete(self, session_id: str) -> None:
        self._wait(self._async.delete(session_id))

    def get(self, session_id: str) -> SessionManifest:
        return self._wait(self._async.get(session_id))

    def info(self, session_id: str) -> SessionInfo:
        return self._wait(self._async.info(session_id))

    def put_records(self, session_id: str, items: Mapping[str, bytes]) -> None:
        return self._wait(self._async.put_records(session_id, items))

    def records(self, session_id: str, prefix: str = "", *, names: Sequence[str] | None = None) -> dict[str, bytes]:
        return self._wait(self._async.records(session_id, prefix, names=names))

    def record_names(self, session_id: str, prefix: str = "") -> builtins.list[str]:
        return self._wait(self._async.record_names(session_id, prefix))

    def delete_records(self, session_id: str, names: Sequence[str] | None = None) -> int:
        return self._wait(self._async.delete_records(session_id, names))

    def hint(self, session_id: str, hint: HintKind | Hint, expected_s: float | None = None) -> HintResult:
        return self._wait(self._async.hint(session_id, hint, expected_s))

    def paused(self, session_id: str, expected_s: float) -> HintResult:
        return self._wait(self._async.paused(session_id, expected_s))

    def resuming(self, session_id: str) -> HintResult:
        return self._wait(self._async.resuming(session_id))

    def done(self, session_id: str) -> HintResult:
        return self._wait(self._async.done(session_id))

    def usage(self, session_id: str | None = None) -> Usage:
        return self._wait(self._async.usage(session_id))

    def list(self) -> builtins.list[SessionInfo]:
        return self._wait(self._async.list())

    def stats(self) -> TenantStats:
        return self._wait(self._async.stats())

    def get_json(self, path: str, model: type[M]) -> M:
        return self._wait(self._async.get_json(path, model))

    def match(self, tokens: Sequence[int] | torch.Tensor) -> ChunkMatch:
        return self._wait(self._async.match(tokens))

    def put_prefix(self, tokens: Sequence[int] | torch.Tensor, kv: torch.Tensor) -> int:
        return self._wait(self._async.put_prefix(tokens, kv))

    def load(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        return self._wait(self._async.load(tokens))

    def has_chunk(self, handle: str) -> bool:
        return self._wait(self._async.has_chunk(handle))

    def get_chunk(self, handle: str) -> bytes | None:
        return self._wait(self._async.get_chunk(handle))

    def put_chunk(self, handle: str, chunk: bytes | bytearray | memoryview | torch.Tensor) -> bool:
        return self._wait(self._async.put_chunk(handle, chunk))

    def chunk_key(self, handle: str) -> str:
        return self._wait(self._async.chunk_key(handle))

    def encode_chunk(self, handle: str, kv: torch.Tensor) -> bytearray:
        return self._wait(self._async.encode_chunk(handle, kv))

    def decode_chunk(self, handle: str, raw: bytes | bytearray | memoryview) -> torch.Tensor:
        return self._wait(self._async.decode_chunk(handle, raw))


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """End a Client's loop thread (on close, or when the Client is collected or the process exits)."""
    if loop.is_closed():
        return
    loop.call_soon_threadsafe(loop.stop)
    if thread is not threading.current_thread():
        thread.join()
        loop.close()
