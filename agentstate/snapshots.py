"""What a snapshot commits: its checks, its manifest, its write and its retention hold.

`StateStore.snapshot` and an archive import (`agentstate.ops.archive`) both store sessions, and an
import must refuse exactly what `snapshot` refuses and write exactly what it writes, so both go
through these functions: `check_snapshot` (every argument, before anything is written),
`snapshot_manifest` (the manifest that commits over `prev`), `write_session` (the chunks the
record tier lacks, and the tail) and `hold_retained` (the fast-tier hold of a retention contract).
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

import agentstate.manifest as manifests  # its clock read through the module: a test that sets it sets it here
from agentstate.catalog import named_keys
from agentstate.errors import InvalidArgumentError
from agentstate import model_state
from agentstate.keys import ChunkKey, state_key, tail_key, token_array, validate_id
from agentstate.manifest import SessionManifest

if TYPE_CHECKING:
    import torch

    from agentstate.chunks import ChunkStore
    from agentstate.config import StoreConfig
    from agentstate.spec import ModelSpec

NO_KV: Any = object()
"""`check_snapshot`'s `kv` when there is no tensor to check (None is a bad `kv`, refused)."""
MAX_STATE_DEPTH = 128
"""Deepest nesting of application state: the manifest parser stops at 200 levels of JSON."""


class Scope(Protocol):
    """Where a session is stored: a StateStore (or a tenant view of one), or its StoreScope."""

    @property
    def tenant(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def spec(self) -> ModelSpec: ...
    @property
    def chunk_tokens(self) -> int: ...
    @property
    def chunks(self) -> ChunkStore: ...
    @property
    def config(self) -> StoreConfig: ...
    def prefix_keys(self, tokens: Sequence[int]) -> list[ChunkKey]: ...


@dataclass(frozen=True)
class SnapshotRequest:
    """A snapshot's arguments once checked, with the chunk keys of its tokens in the scope."""

    session_id: str
    tokens: array
    keys: list[ChunkKey]
    state: dict[str, Any]
    ttl_seconds: float | None
    guaranteed_until: float | None
    pinned: bool
    model_state: torch.Tensor | None = None
    """a hybrid model's state after the last token, packed (`agentstate.model_state`)"""


def check_snapshot(
    scope: Scope,
    session_id: str,
    tokens: Sequence[int] | torch.Tensor,
    state: dict[str, Any] | None,
    *,
    kv: Any = NO_KV,
    ttl_seconds: Any = None,
    guaranteed_until: Any = None,
    pinned: Any = False,
    expected_version: Any = None,
    force: Any = False,
    state_tensors: Any = None,
) -> SnapshotRequest:
    """Every check `snapshot` makes on its arguments (InvalidArgumentError; KVShapeError for `kv`,
    unless left out: an import checks its chunks by decoding them, and for `state_tensors`, a hybrid
    model's state after the last token: required by a spec with a state layout, refused by others)."""
    validate_id(session_id)
    packed = token_array(tokens)
    if not packed:
        raise InvalidArgumentError("a session needs at least one token")
    if kv is not NO_KV:
        scope.spec.check_kv(kv, len(packed))
    state = json_object(state)
    _check_seconds("ttl_seconds", ttl_seconds)
    if not isinstance(pinned, bool) or not isinstance(force, bool):
        raise InvalidArgumentError("pinned and force must be booleans")
    if expected_version is not None and (
        isinstance(expected_version, bool) or not isinstance(expected_version, int) or expected_version < 0
    ):
        raise InvalidArgumentError(f"expected_version must be an int >= 0, got {expected_version!r}")
    _check_seconds("guaranteed_until", guaranteed_until)
    record_ttl, stamp = scope.chunks.record_ttl_s, manifests.now()
    if guaranteed_until is not None and record_ttl is not None and guaranteed_until > stamp + record_ttl:
        raise InvalidArgumentError(
            f"guaranteed_until is {guaranteed_until - stamp:.0f}s away, but the record tier"
            f" {scope.chunks.record_tier!r} expires chunks after {record_ttl:g}s: the contract could not be kept"
        )
    payload = model_state.checked(scope.spec, state_tensors, len(packed))
    keys = scope.prefix_keys(packed)  # a session's chunks are the prefix's: stored once (see key_scheme)
    return SnapshotRequest(session_id, packed, keys, state, ttl_seconds, guaranteed_until, pinned, payload)


def snapshot_manifest(scope: Scope, request: SnapshotRequest, prev: SessionManifest | None) -> SessionManifest:
    """The manifest that commits `request` over `prev` (the session's current manifest, if any):
    the next version, a tail key of its own, `prev`'s parent and creation time kept."""
    version = (prev.version if prev else 0) + 1
    full = len(request.keys) * scope.chunk_tokens
    tkey = None
    if len(request.tokens) > full:
        tkey = tail_key(scope.fingerprint, scope.tenant, request.session_id, version)
    skey = None
    if request.model_state is not None:
        skey = state_key(scope.fingerprint, scope.tenant, request.session_id, version)
    stamp = manifests.now()
    try:
        return SessionManifest(
            session_id=request.session_id, tenant=scope.tenant, fingerprint=scope.fingerprint,
            chunk_tokens=scope.chunk_tokens, tokens=request.tokens.tolist(), chunk_keys=request.keys, tail_key=tkey,
            state_key=skey, state=request.state, version=version, parent=prev.parent if prev else None,
            created_at=prev.created_at if prev else stamp, updated_at=stamp, ttl_seconds=request.ttl_seconds,
            guaranteed_until=request.guaranteed_until, pinned=request.pinned, lossy=scope.config.lossy,
        )  # fmt: skip
    except ValidationError as exc:
        raise InvalidArgumentError(f"invalid session: {exc}") from None


@dataclass(frozen=True)
class SessionWrite:
    """What `write_session` wrote: the indices of the chunks the record tier lacked, and the bytes."""

    new: list[int]
    nbytes: int

    def usage(self, manifest: SessionManifest) -> dict[str, int]:
        """What a snapshot of `manifest` counts for this write."""
        full = len(manifest.chunk_keys) * manifest.chunk_tokens
        return {
            "snapshots": 1, "tokens_written": len(self.new) * manifest.chunk_tokens + manifest.num_tokens - full,
            "tokens_deduped": (len(manifest.chunk_keys) - len(self.new)) * manifest.chunk_tokens,
            "bytes_written": self.nbytes,
        }  # fmt: skip


async def write_session(
    chunks: ChunkStore,
    manifest: SessionManifest,
    kv: torch.Tensor,
    before_write: Callable[[list[str]], None] | None = None,
    state: torch.Tensor | None = None,
    spec: ModelSpec | None = None,
) -> SessionWrite:
    """Durably write the chunks of `manifest` the record tier lacks, and its tail, from canonical
    `kv`, and a hybrid model's `state` (the packed payload, `spec` the store's: its `state_spec`
    encodes it) under `manifest.state_key` (the caller pins the keys). `before_write` hears the
    keys about to be written."""
    keys, c = manifest.chunk_keys, manifest.chunk_tokens
    full = len(keys) * c
    new = await chunks.missing(keys, durable=True)
    write_keys = [keys[i] for i in new] + ([manifest.tail_key] if manifest.tail_key else [])
    write_kv = [kv[:, :, i * c : (i + 1) * c] for i in new] + ([kv[:, :, full:]] if manifest.tail_key else [])
    nbytes = 0
    if write_keys:
        if before_write is not None:
            before_write(write_keys)
        nbytes = await chunks.write(write_keys, write_kv, durable=True)
    if manifest.state_key is not None:
        if state is None or spec is None or spec.state_spec is None:
            raise InvalidArgumentError("a manifest naming a model state needs the state and a hybrid spec to write it")
        if before_write is not None:
            before_write([manifest.state_key])
        nbytes += await chunks.write([manifest.state_key], [state], durable=True, spec=spec.state_spec)
    return SessionWrite(new, nbytes)


def hold_retained(chunks: ChunkStore, manifest: SessionManifest) -> None:
    """Hold a session's chunks in the fast tiers while its retention contract is in force."""
    name = f"retain:{manifest.tenant}/{manifest.session_id}"
    stamp = manifests.now()
    until = manifest.retained_until(stamp)
    if until is None:
        chunks.release(name)
    else:
        chunks.hold(name, manifest.tenant, named_keys(manifest), for_s=until - stamp, kind="retention")


def json_object(state: dict[str, Any] | None) -> dict[str, Any]:
    """`state` as the JSON the manifest will hold, or InvalidArgumentError before anything is written.

    Refused: what JSON cannot say (NaN, bytes, objects), lone surrogates (not UTF-8), and nesting
    deeper than MAX_STATE_DEPTH, which the manifest's JSON parser would refuse on every resume.
    """
    if state is None:
        return {}
    if not isinstance(state, dict):
        raise InvalidArgumentError(f"state must be a JSON object (dict), got {type(state).__name__}")
    if _depth(state, MAX_STATE_DEPTH) > MAX_STATE_DEPTH:
        raise InvalidArgumentError(f"state is nested deeper than {MAX_STATE_DEPTH} levels")
    try:
        return json.loads(json.dumps(state, allow_nan=False, ensure_ascii=False).encode())  # type: ignore[no-any-return]
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgumentError(f"state is not JSON-serializable: {exc}") from None


def _check_seconds(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgumentError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"{name} must be finite and > 0, got {value!r}")


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of dicts and lists in `value`, counted up to `limit + 1` (cycles included)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict | list | tuple):
            deepest = max(deepest, level)
            if level <= limit:
                todo.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest
