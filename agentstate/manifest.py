"""Wire and storage models of sessions: the manifest, and what a resume returns."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import xxhash
from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationError, model_serializer

from agentstate.errors import CorruptDataError
from agentstate.keys import ChunkKey, TailKey

if TYPE_CHECKING:
    import torch

MANIFEST_MAGIC = b"ASM1"
_HEAD = len(MANIFEST_MAGIC) + 8


def now() -> float:
    """Wall clock for timestamps and TTLs (one place, so tests can move time)."""
    return time.time()


class SessionManifest(BaseModel):
    """Everything needed to resume a session exactly; committed last, atomically, after its data."""

    model_config = ConfigDict(extra="forbid")

    session_id: str
    tenant: str
    fingerprint: str
    chunk_tokens: int = Field(gt=0)
    tokens: list[int]
    chunk_keys: list[ChunkKey]
    tail_key: TailKey | None = None
    state_key: TailKey | None = None
    """a hybrid model's state after the last token (`agentstate.model_state`), written with the tail.
    Left out of the stored form when None, so manifests of dense models read as before everywhere."""
    state: dict[str, Any] = Field(default_factory=dict)
    version: int = Field(ge=1)
    parent: str | None = None
    created_at: float
    updated_at: float
    ttl_seconds: float | None = Field(default=None, gt=0)
    """retention TTL: the session expires this long after its last write or hit (a resume, a hint),
    as hosted prompt caches refresh theirs on every hit"""
    guaranteed_until: float | None = Field(default=None, gt=0)
    """retention contract: wall-clock time before which the session never expires, whatever its TTL"""
    pinned: bool = False
    lossy: bool = False
    """stored where a tier keeps a lossy encoding (fp8): a resume may give back KV within that
    encoding's error bound instead of the bytes snapshotted (`ResumeResult.exact` says, per resume).
    Left out of the stored form when False, so lossless manifests read as before everywhere."""
    last_hit_at: float | None = Field(default=None, exclude=True)
    """when it was last resumed or hinted: filled by the catalog from its hit record, never part of
    the committed manifest (a hit is not a new version)"""

    @model_serializer(mode="wrap")
    def _lossless_as_before(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if not self.lossy:
            data.pop("lossy", None)
        if self.state_key is None:
            data.pop("state_key", None)
        return data

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tail_tokens(self) -> int:
        return len(self.tokens) - len(self.chunk_keys) * self.chunk_tokens

    def expires_at(self) -> float | None:
        """When the session expires (None: never): its TTL after the last write or hit, and never
        before `guaranteed_until`."""
        if self.ttl_seconds is None or self.pinned:
            return None
        end = max(self.updated_at, self.last_hit_at or 0.0) + self.ttl_seconds
        return max(end, self.guaranteed_until or 0.0)

    def retained_until(self, at: float | None = None) -> float | None:
        """Until when a retention contract (a TTL or `guaranteed_until`) is in force; None when none is."""
        at = now() if at is None else at
        end = max(self.expires_at() or 0.0, self.guaranteed_until or 0.0)
        return end if end > at else None

    def expired(self, at: float | None = None) -> bool:
        end = self.expires_at()
        return end is not None and (now() if at is None else at) >= end


class MatchResult(BaseModel):
    """How much of a token sequence is cached: `tokens` leading tokens, in `chunks` chunks."""

    model_config = ConfigDict(frozen=True)

    tokens: int
    chunks: int
    tiers: list[str] = Field(description="the fastest tier holding each matched chunk")


class ResumeResult(BaseModel):
    """A restored session. `kv` holds the KV of the first `restored_tokens` tokens of `tokens`
    (None when the KV was restored into a caller's KVTarget instead, such as a paged pool).

    `exact` says whether those bytes are bit-exact, the very bytes the snapshot stored. It is False
    when any restored chunk or the tail came back through a lossy encoding (a tier with fp8
    compression): every value is then the fp8 (e4m3, per-layer/plane/head scale) reconstruction of
    the stored one x, within e4m3's rounding: |x' - x| <= 2^-4 |x| + 2^-10 s, s = amax / 448 the
    scale of x's (layer, plane, head) in its chunk, plus the rounding of x' to the KV dtype; never
    corrupt (each chunk passed its checksum). `complete` says
    only that every token was restored, not that it is bit-exact: an engine that needs the original
    bytes (a bitwise-reproducible decode) checks `exact` and recomputes when it is False.

    `restored_tokens < len(tokens)` only when stored data was missing or corrupt: the engine
    recomputes the rest from `tokens`, which are always complete.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    manifest: SessionManifest
    if TYPE_CHECKING:
        kv: torch.Tensor | None
    else:
        kv: Any  # a torch.Tensor or None; not validated, so that the SDK imports without torch
    restored_tokens: int
    exact: bool
    """every restored byte is the byte stored (no chunk or tail came from a lossy encoding)"""
    if TYPE_CHECKING:
        model_state: dict[str, torch.Tensor] | None = None
    else:
        model_state: Any = None
    """a hybrid model's state after the last token (the spec's `state` layout), None for a dense
    model; a hybrid session resumes whole (its state with all its KV) or not at all"""

    @property
    def tokens(self) -> list[int]:
        return self.manifest.tokens

    @property
    def state(self) -> dict[str, Any]:
        return self.manifest.state

    @property
    def complete(self) -> bool:
        """Every token's KV was restored (bit-exact only when `exact` is also True)."""
        return self.restored_tokens == len(self.manifest.tokens)


def encode_manifest(manifest: SessionManifest) -> bytes:
    """Stored form of a manifest: magic, xxh3_64 of the JSON, the JSON.

    The checksum is what makes a damaged manifest a detected error: a flipped digit in a token id
    or a chunk key still parses as JSON, and would resume a session the engine never saw.
    """
    body = manifest.model_dump_json().encode()
    return MANIFEST_MAGIC + xxhash.xxh3_64_digest(body) + body


def decode_manifest(raw: bytes | memoryview) -> SessionManifest:
    """The manifest in `raw` (from `encode_manifest`), or CorruptDataError; never a partial one."""
    raw = bytes(raw)
    if len(raw) < _HEAD or raw[: len(MANIFEST_MAGIC)] != MANIFEST_MAGIC:
        raise CorruptDataError("stored manifest has no agentstate header")
    body = raw[_HEAD:]
    if xxhash.xxh3_64_digest(body) != raw[len(MANIFEST_MAGIC) : _HEAD]:
        raise CorruptDataError("stored manifest fails its checksum")
    try:
        return SessionManifest.model_validate_json(body)
    except ValidationError as exc:
        raise CorruptDataError(f"stored manifest does not parse: {exc.error_count()} errors") from None
