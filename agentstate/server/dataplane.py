"""The binary data plane for engines on other hosts: match, shared prefixes, and single chunks.

Chunks are addressed by *handles*, not raw chunk keys. A chunk key is a hash chain over token
ids salted by the tenant's namespace, but the namespace (`tenant:<id>`) is public, so anyone who
knows or guesses another tenant's tokens (a popular system prompt) could compute that tenant's
keys: keys are not secrets. Only keys the server derives itself are trusted. `POST /v1/match`
derives the keys of the caller's tokens in the caller's namespace and returns, per full chunk, a
handle `<digest>.<mac>`: the key's digest and a blake2b MAC, under the service's secret, of
(tenant, key). GET/HEAD/PUT `/v1/chunks/{handle}` check the MAC first; a handle issued to another
tenant, or forged, is 404 exactly like an absent chunk, so nothing says whether it exists.

A chunk PUT alone is cache content (like a chunk whose session was deleted): it is matched and
served while it lasts, and `StateStore.gc` may sweep it. `POST /v1/prefixes` stores a registered
shared prefix (kept until removed), and `POST /v1/prefixes/load` returns the cached prefix of
tokens as one frame.
"""

import hashlib
import hmac
import logging
import re
from typing import Annotated

from fastapi import Depends, FastAPI, Request, Response

from agentstate import codec
from agentstate.errors import CorruptDataError, InvalidArgumentError
from agentstate.keys import ChunkKey, token_array
from agentstate.server.gate import ServiceContext, admit, frame_response, off_loop, read_body
from agentstate.store import StateStore
from agentstate.wire import (
    CHUNK_TYPE,
    FRAME_TYPE,
    ChunkMatch,
    ChunkNotFoundError,
    ChunkStored,
    LoadHeader,
    PrefixHeader,
    PrefixStored,
    TokensRequest,
    kv_from,
    kv_payload,
    split_frame,
)

log = logging.getLogger("agentstate.server.dataplane")
_HANDLE = re.compile(r"([0-9a-f]{64})\.([0-9a-f]{32})")
_BINARY_BODY = {
    "requestBody": {"required": True, "content": {FRAME_TYPE: {"schema": {"type": "string", "format": "binary"}}}}
}
_CHUNK_BODY = {
    "requestBody": {"required": True, "content": {CHUNK_TYPE: {"schema": {"type": "string", "format": "binary"}}}}
}


class Handles:
    """Tenant-bound capabilities for chunk keys (see the module docstring)."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _mac(self, tenant: str, key: str) -> str:
        data = f"{tenant}\x00{key}".encode()
        return hashlib.blake2b(data, key=self._secret, digest_size=16, person=b"agentstate-hdl").hexdigest()

    def issue(self, tenant: str, key: str) -> str:
        return f"{key.rsplit('/', 1)[1]}.{self._mac(tenant, key)}"

    def key(self, store: StateStore, handle: str) -> ChunkKey:
        """The key `handle` names for this tenant; ChunkNotFoundError if it names none."""
        m = _HANDLE.fullmatch(handle)
        key = ChunkKey(f"{store.prefix_key_base()}{m.group(1)}") if m else None  # as prefix_keys names them
        if m is None or key is None or not hmac.compare_digest(m.group(2), self._mac(store.tenant, key)):
            raise ChunkNotFoundError(f"no chunk {handle[:100]!r}")
        return key


async def _held(store: StateStore, key: str) -> bool:
    return (await store.chunks.present([key]))[0]


async def read_chunk(store: StateStore, key: str) -> memoryview | None:
    """The codec bytes of `key` from the fastest tier holding an intact copy, checked; None if none."""
    return await store.chunks.read_value(key, store.chunk_tokens)


def register(app: FastAPI, ctx: ServiceContext, handles: Handles) -> None:
    Store = Annotated[StateStore, Depends(ctx.tenant_store)]
    max_header = ctx.limits.max_json_bytes

    @app.post("/v1/match", response_model=ChunkMatch, tags=["data plane"])
    async def match(req: TokensRequest, store: Store) -> ChunkMatch:
        """How much of `tokens` is cached for this tenant, and a handle for every full chunk."""
        packed = token_array(req.tokens)
        found = await store.match(packed)
        keys = store.prefix_keys(packed)
        return ChunkMatch(
            tokens=found.tokens,
            chunks=found.chunks,
            tiers=found.tiers,
            handles=[handles.issue(store.tenant, k) for k in keys],
        )

    @app.post("/v1/prefixes", response_model=PrefixStored, tags=["data plane"], openapi_extra=_BINARY_BODY)
    async def put_prefix(request: Request, store: Store) -> PrefixStored:
        """Store a shared prefix (frame: PrefixHeader + KV of every token); kept until removed."""
        head, payload = split_frame(await read_body(request), max_header)
        header = PrefixHeader.model_validate_json(head)
        kv = await off_loop(kv_from, header, payload, store.spec)
        return PrefixStored(stored_tokens=await store.put_prefix(header.tokens, kv))

    @app.post("/v1/prefixes/load", tags=["data plane"], responses={200: {"content": {FRAME_TYPE: {}}}})
    async def load(req: TokensRequest, request: Request, store: Store) -> Response:
        """The cached prefix of `tokens` as a frame (LoadHeader + KV of its leading whole chunks)."""
        packed = token_array(req.tokens)
        found = await store.match(packed)
        admit(request, found.tokens * store.spec.token_bytes, "prefix load")  # before allocating it
        kv = store.spec.empty_kv(found.tokens)
        n = await store.load(packed, kv) if found.tokens else 0
        kv = kv[:, :, :n]
        header = LoadHeader(fingerprint=store.fingerprint, dtype=store.spec.dtype, shape=list(kv.shape), tokens=n)
        return await frame_response(header, kv_payload(kv))

    @app.head("/v1/chunks/{handle}", tags=["data plane"], responses={404: {}})
    async def has_chunk(handle: str, store: Store) -> Response:
        """200 with the chunk's size when held, else 404."""
        if not await _held(store, handles.key(store, handle)):
            raise ChunkNotFoundError(f"no chunk {handle[:100]!r}")
        size = codec.encoded_size(store.chunk_tokens * store.spec.token_bytes)
        return Response(status_code=200, headers={"content-length": str(size)}, media_type=CHUNK_TYPE)

    @app.get("/v1/chunks/{handle}", tags=["data plane"], responses={200: {"content": {CHUNK_TYPE: {}}}})
    async def get_chunk(handle: str, store: Store) -> Response:
        """The chunk in the codec format (self-describing, checksummed)."""
        value = await read_chunk(store, handles.key(store, handle))
        if value is None:
            raise ChunkNotFoundError(f"no chunk {handle[:100]!r}")
        return Response(value, media_type=CHUNK_TYPE)

    @app.put("/v1/chunks/{handle}", response_model=ChunkStored, tags=["data plane"], openapi_extra=_CHUNK_BODY)
    async def put_chunk(handle: str, request: Request, response: Response, store: Store) -> ChunkStored:
        """Store one chunk (codec format, this spec, `chunk_tokens` tokens, encoded under the key
        `c/<fingerprint>/<digest of the handle>`); 201 if new, 200 if held."""
        key = handles.key(store, handle)
        body = await read_body(request)
        shape = store.spec.kv_shape(store.chunk_tokens)
        try:
            await off_loop(
                lambda: codec.decode(
                    body, key=key, fingerprint=store.fingerprint, dtype=store.spec.torch_dtype, shape=shape
                )
            )
        except CorruptDataError as exc:
            raise InvalidArgumentError(f"chunk rejected: {exc}") from None
        if await _held(store, key):
            return ChunkStored(stored=False)
        with store.chunks.pinned([key]):
            await store.chunks.put_values([key], [body])
        response.status_code = 201
        return ChunkStored(stored=True)
