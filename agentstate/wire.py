"""What the service and the SDK exchange: pydantic models, the binary frame, and the error table.

KV never travels as JSON numbers and never pickled. A *frame* carries it::

    0   4s  magic b"ASWF"
    4   H   frame version (1)
    6   H   reserved (0)
    8   I   header length N (little endian)
    12  N   JSON header (one of the *Header models below)
    12+N    payload: the raw bytes of a contiguous canonical KV tensor
            [layers, planes, tokens, heads, dim], exactly its memory (layer-major)

The header names dtype and shape, the spec fingerprint the KV is for, and an xxh3_64 of the
payload; the receiver checks all of them before it reinterprets a byte. Single chunks on the data
plane travel in the codec format (`agentstate.codec`), which is self-describing and checksummed.

Errors are a JSON body `{"error": code, "detail": ...}`; `ERRORS` maps exception types to status
and code in one place, for the service (raising side) and the SDK (re-raising side).

torch is imported only by the functions that turn bytes into tensors and back, so the SDK's
models and errors import without it.
"""

from __future__ import annotations

import base64
import binascii
import struct
from typing import TYPE_CHECKING, Any

import xxhash
from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from agentstate.errors import (
    AgentStateError,
    BackendError,
    BackendRefusedError,
    CapacityError,
    ConflictError,
    CorruptDataError,
    InvalidArgumentError,
    InvalidSessionIdError,
    KVShapeError,
    NotFoundError,
    SessionNotFoundError,
    SpecMismatchError,
)
from agentstate.manifest import SessionManifest
from agentstate.spec import ModelSpec

if TYPE_CHECKING:
    import torch

FRAME_TYPE = "application/vnd.agentstate.frame"
CHUNK_TYPE = "application/vnd.agentstate.chunk"
FRAME_MAGIC = b"ASWF"
FRAME_VERSION = 1
_PREFIX = struct.Struct("<4sHHI")


# -- errors the service adds to agentstate.errors ------------------------------------------------


class MalformedRequestError(InvalidArgumentError):
    """The request could not be parsed at all (not a frame, truncated, payload checksum wrong)."""


class UnauthorizedError(AgentStateError):
    """No bearer token, or one the service does not know."""


class RequestTooLargeError(CapacityError):
    """The request body is larger than the service's configured limit."""


class ChunkNotFoundError(NotFoundError):
    """No such chunk for this tenant (absent, or a handle this tenant was never given)."""


# Most specific first: the first entry the exception is an instance of wins.
ERRORS: list[tuple[type[AgentStateError], int, str]] = [
    (MalformedRequestError, 400, "malformed"),
    (UnauthorizedError, 401, "unauthorized"),
    (SessionNotFoundError, 404, "session_not_found"),
    (ChunkNotFoundError, 404, "chunk_not_found"),
    (NotFoundError, 404, "not_found"),
    (SpecMismatchError, 409, "spec_mismatch"),
    (ConflictError, 409, "conflict"),
    (RequestTooLargeError, 413, "too_large"),
    (InvalidSessionIdError, 422, "invalid_id"),
    (KVShapeError, 422, "kv_shape"),
    (InvalidArgumentError, 422, "invalid_argument"),
    (CapacityError, 507, "capacity"),
    (CorruptDataError, 500, "corrupt_data"),
    (BackendRefusedError, 502, "backend_refused"),
    (BackendError, 503, "backend_unavailable"),
    (AgentStateError, 500, "internal"),
]
_BY_CODE = {code: cls for cls, _, code in ERRORS}
_BY_CODE["validation_error"] = InvalidArgumentError  # request bodies pydantic rejected


def status_of(exc: AgentStateError) -> tuple[int, str]:
    for cls, status, code in ERRORS:
        if isinstance(exc, cls):
            return status, code
    return 500, "internal"  # unreachable: AgentStateError is the last entry


def error_from(status: int, code: str | None, detail: object) -> AgentStateError:
    """The exception a client raises for an error response (by code; by status if the code is unknown)."""
    cls = _BY_CODE.get(code or "")
    if cls is None:
        cls = next((c for c, s, _ in ERRORS if s == status), AgentStateError)
    return cls(detail if isinstance(detail, str) else f"HTTP {status}: {detail}")


class ErrorBody(BaseModel):
    error: str
    detail: Any = None


# -- models -------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KVHeader(_Strict):
    """What every frame header says about its payload."""

    fingerprint: str = Field(description="spec fingerprint the KV belongs to")
    dtype: str = Field(description="torch dtype name of the payload")
    shape: list[int] = Field(min_length=5, max_length=5, description="[layers, planes, tokens, heads, dim]")
    xxh3: int | None = Field(default=None, ge=0, description="xxh3_64 of the payload; checked when given")


class StateTrailer(KVHeader):
    """A frame whose payload may end with a hybrid model's state (`agentstate.model_state`)."""

    model_state_bytes: int = Field(
        default=0, ge=0, description="a hybrid model's state after the last token: the payload's last bytes (the"
        " spec's state layout, its tensors' bytes one after another); xxh3 covers the whole payload",
    )  # fmt: skip


class SnapshotHeader(StateTrailer):
    tokens: list[int] = Field(min_length=1)
    state: dict[str, Any] = Field(default_factory=dict)
    ttl_seconds: float | None = Field(
        default=None, gt=0, description="sliding retention TTL: expires this long after the last write or hit"
    )
    guaranteed_until: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="wall-clock seconds: the session never expires before then, whatever its TTL",
    )  # fmt: skip
    pinned: bool = False
    expected_version: int | None = Field(
        default=None, ge=0, description="the version this writer last saw; 409 if stale"
    )
    force: bool = Field(default=False, description="commit on top of whatever version is there")


class PrefixHeader(KVHeader):
    tokens: list[int]


class ResumeHeader(StateTrailer):
    manifest: SessionManifest
    restored_tokens: int = Field(ge=0)
    exact: bool = Field(
        default=False,
        description="the KV is bit-exact, the bytes snapshotted; false when a chunk came from a lossy (fp8) tier"
        " (or from a server too old to say): within fp8's error bound, see ResumeResult.exact",
    )  # fmt: skip


class LoadHeader(KVHeader):
    tokens: int = Field(ge=0, description="leading tokens loaded (whole chunks)")


class ForkRequest(_Strict):
    new_id: str


class RecordsBody(_Strict):
    """A session's records (`agentstate.records`) on the wire: name -> standard base64 of the bytes
    (RFC 4648, padded, no line breaks; anything else is refused)."""

    records: dict[str, bytes]

    @field_validator("records", mode="before")
    @classmethod
    def _decode(cls, value: object) -> object:
        if not isinstance(value, dict):
            return value
        out = {}
        for name, text in value.items():
            if isinstance(text, bytes):
                out[name] = text  # built in Python (the service's reply): already bytes
                continue
            if not isinstance(text, str):
                raise ValueError(f"record {str(name)[:100]!r}: base64 text expected")
            try:
                out[name] = base64.b64decode(text, validate=True)
            except (ValueError, binascii.Error):
                raise ValueError(f"record {str(name)[:100]!r}: not standard base64") from None
        return out

    @field_serializer("records")
    def _encode(self, records: dict[str, bytes]) -> dict[str, str]:
        return {name: base64.b64encode(value).decode() for name, value in records.items()}


class RecordNames(_Strict):
    names: list[str]


class RecordsDelete(_Strict):
    names: list[str] | None = None
    """the records to remove; None: all of the session's"""


class RecordsRemoved(_Strict):
    removed: int


class TokensRequest(_Strict):
    tokens: list[int]


class SpecInfo(BaseModel):
    spec: ModelSpec
    fingerprint: str
    chunk_tokens: int


class SessionInfo(BaseModel):
    """A session without its tokens, state and keys (what list, snapshot and fork return)."""

    session_id: str
    fingerprint: str
    num_tokens: int
    version: int
    parent: str | None
    created_at: float
    updated_at: float
    ttl_seconds: float | None
    pinned: bool
    guaranteed_until: float | None = Field(
        default=None, description="wall clock: the session never expires before then (the snapshot's contract)"
    )
    expires_at: float | None = Field(
        default=None, description="wall clock: when it expires unless hit again (None: never); never before"
        " guaranteed_until",
    )  # fmt: skip
    last_hit_at: float | None = Field(default=None, description="wall clock: its last resume or hint (None: none yet)")
    lossy: bool = Field(
        default=False, description="stored where a tier keeps a lossy encoding (fp8): a resume may not be bit-exact"
    )

    @classmethod
    def of(cls, m: SessionManifest) -> SessionInfo:
        return cls(
            session_id=m.session_id, fingerprint=m.fingerprint, num_tokens=m.num_tokens, version=m.version,
            parent=m.parent, created_at=m.created_at, updated_at=m.updated_at, ttl_seconds=m.ttl_seconds,
            pinned=m.pinned, guaranteed_until=m.guaranteed_until, expires_at=m.expires_at(),
            last_hit_at=m.last_hit_at, lossy=m.lossy,
        )  # fmt: skip


class ChunkMatch(BaseModel):
    """`tokens` leading tokens (`chunks` chunks) are cached. `handles` address every full chunk of
    the request on the chunk data plane, cached or not, for this tenant only."""

    tokens: int
    chunks: int
    tiers: list[str]
    handles: list[str]


class PrefixStored(BaseModel):
    stored_tokens: int = Field(description="tokens newly stored (chunks already held are not rewritten)")


class ChunkStored(BaseModel):
    stored: bool = Field(description="false when the chunk was already held")


class TenantStats(BaseModel):
    """A tenant's part of `agentstate stats` (what `agentstate stats --url` prints)."""

    tenant: str
    fingerprint: str
    chunk_tokens: int
    sessions: int
    session_tokens: int
    unique_chunks: int = Field(description="distinct full chunks the sessions name")
    tails: int = Field(description="sessions with a partial last chunk (each its own)")
    logical_bytes: int = Field(description="what the sessions would take stored one by one")
    unique_bytes: int = Field(description="what they take with shared chunks stored once")


# -- frames and KV bytes --------------------------------------------------------------------------


def frame_prefix(header: BaseModel) -> bytes:
    """Everything of a frame before its payload."""
    raw = header.model_dump_json().encode()
    return _PREFIX.pack(FRAME_MAGIC, FRAME_VERSION, 0, len(raw)) + raw


def split_frame(buf: bytes | bytearray | memoryview, max_header: int) -> tuple[bytes, memoryview]:
    """(JSON header, payload) of a frame, checking its framing only."""
    view = memoryview(buf)
    if len(view) < _PREFIX.size:
        raise MalformedRequestError(f"not a frame: {len(view)} bytes")
    magic, version, _, size = _PREFIX.unpack_from(view)
    if magic != FRAME_MAGIC or version != FRAME_VERSION:
        raise MalformedRequestError(f"not an agentstate frame (magic {bytes(magic)!r}, version {version})")
    if size > max_header or _PREFIX.size + size > len(view):
        raise MalformedRequestError(f"frame header of {size} bytes is truncated or over the {max_header}-byte limit")
    return bytes(view[_PREFIX.size : _PREFIX.size + size]), view[_PREFIX.size + size :]


def kv_payload(kv: torch.Tensor) -> memoryview:
    """The bytes of `kv` as a canonical contiguous CPU tensor (no copy when it already is one)."""
    import torch

    flat = kv.detach().to("cpu").contiguous().reshape(-1)
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def checksum(payload: memoryview | bytes | bytearray, *more: memoryview | bytes | bytearray) -> int:
    """xxh3_64 of a frame's payload: its parts' bytes one after another (the KV, then a hybrid model's state)."""
    if not more:
        return xxhash.xxh3_64_intdigest(payload)
    digest = xxhash.xxh3_64(payload)
    for part in more:
        digest.update(part)
    return digest.intdigest()


def kv_from(header: KVHeader, payload: memoryview, spec: ModelSpec | None = None) -> torch.Tensor:
    """Check a frame's payload against its header (and `spec`, when given); a tensor over its bytes."""
    import torch

    from agentstate.spec import DTYPES

    if spec is not None:
        if header.fingerprint != spec.fingerprint:
            raise SpecMismatchError(f"KV is for spec {header.fingerprint}, this service serves {spec.fingerprint}")
        if header.dtype != spec.dtype:
            raise KVShapeError(f"kv dtype {header.dtype} does not match spec dtype {spec.dtype}")
    dtype = DTYPES.get(header.dtype)
    if dtype is None:
        raise KVShapeError(f"unknown dtype {header.dtype!r}")
    shape = tuple(header.shape)
    if min(shape) < 0:
        raise KVShapeError(f"negative dimension in shape {shape}")
    numel = shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
    if len(payload) != numel * dtype.itemsize:
        raise MalformedRequestError(
            f"payload is {len(payload)} bytes, shape {shape} of {header.dtype} needs {numel * dtype.itemsize}"
        )
    if header.xxh3 is not None and checksum(payload) != header.xxh3:
        raise MalformedRequestError("payload checksum mismatch")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(payload, dtype=dtype).view(shape)


def state_from(
    header: StateTrailer, payload: memoryview, spec: ModelSpec, tokens: int
) -> tuple[StateTrailer, memoryview, dict[str, torch.Tensor] | None]:
    """A frame's KV part and its hybrid model's state (`model_state_bytes` at the payload's end), the
    whole payload's checksum checked here: (the header for the KV part, its bytes, the state's
    tensors or None). KVShapeError when a hybrid spec's frame has no state or a dense one's has one,
    or the state is not the layout's size after `tokens`."""
    import torch

    from agentstate import model_state

    n = header.model_state_bytes
    if (n > 0) != (spec.state is not None and tokens > 0):  # a resume that restored nothing has no state
        raise KVShapeError(
            "this spec is a hybrid model's: the frame must end with its state (model_state_bytes)" if n == 0
            else "model_state_bytes given, but this spec has no state layout"
        )
    if header.xxh3 is not None and checksum(payload) != header.xxh3:
        raise MalformedRequestError("payload checksum mismatch")
    bare = header.model_copy(update={"xxh3": None})
    if n == 0 or spec.state is None:
        return bare, payload, None
    if n != spec.state.nbytes_at(tokens) or n > len(payload):
        raise KVShapeError(f"a state of {n} bytes; the layout holds {spec.state.nbytes_at(tokens)} after {tokens} tokens")
    cut = len(payload) - n
    state = torch.frombuffer(bytearray(payload[cut:]), dtype=torch.uint8)  # owned: the body's buffer goes
    return bare, payload[:cut], model_state.unpack(spec, state, tokens)
