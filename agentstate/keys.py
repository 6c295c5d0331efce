"""Chunk keys (a blake2b hash chain over token ids), tail keys, and id validation.

`key[i] = H(key[i-1], tokens of chunk i)` with `key[-1] = H(namespace, fingerprint)`: equal
prefixes under one namespace and spec give equal keys in every process, with no coordination and
no dependence on PYTHONHASHSEED. blake2b because a forged collision would serve one tenant
another's state, so collision resistance matters more than speed (keys hash token ids, not KV).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from array import array
from collections.abc import Iterable, Sequence
from typing import NewType

from agentstate.errors import InvalidArgumentError, InvalidSessionIdError

ChunkKey = NewType("ChunkKey", str)
"""Storage key of one full chunk: `c/<fingerprint>/<64 hex digest>`."""

TailKey = NewType("TailKey", str)
"""Storage key of a session's partial last chunk: `t/<fingerprint>/<tenant>/<session>/<version>`."""

CHUNK_PREFIX = "c/"
TAIL_PREFIX = "t/"
STATE_SUFFIX = ".state"
"""Ends a tail-space key holding a hybrid model's state rather than KV (`state_key`)."""
"""Adapters may store keys of their own outside these prefixes, each declaring its key space (`agentstate.edges`)."""
_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@-]{0,127}")
_MAX_TOKEN = 2**63 - 1


def validate_id(value: object, what: str = "session id") -> str:
    """Return `value` if it is a valid session/tenant id, else raise InvalidSessionIdError.

    1-128 chars of `[A-Za-z0-9_.:@-]`, not starting with `.`, `-`, `:` or `@`: never a path
    component like `..`, never a separator, safe in keys, URLs and file names.
    """
    if not isinstance(value, str) or _ID_RE.fullmatch(value) is None:
        raise InvalidSessionIdError(
            f"invalid {what} {_shown(value)}: 1-128 chars of [A-Za-z0-9_.:@-], starting with a letter, digit or _"
        )
    return value


def _shown(value: object) -> str:
    """A rejected value as an error message shows it: its repr, cut at 100 characters (a client
    chooses it, and a 100,000-character id must not become a 100,000-character log line)."""
    text = repr(value)
    return text if len(text) <= 100 else f"{text[:100]}...(+{len(text) - 100} chars)"


def token_array(tokens: Iterable[int]) -> array:
    """Token ids as a packed int64 array (the exact bytes the hash chain covers)."""
    if hasattr(tokens, "tolist"):  # torch / numpy
        tokens = tokens.tolist()  # type: ignore[union-attr]
    try:
        packed = array("q", tokens)  # type: ignore[arg-type]
    except (TypeError, OverflowError) as exc:
        raise InvalidArgumentError(f"tokens must be a sequence of non-negative ints: {exc}") from None
    if packed and min(packed) < 0:
        raise InvalidArgumentError("token ids must be non-negative")
    return packed


def namespace_for(tenant: str, shared: bool = False) -> str:
    """The sharing scope: per tenant by default; `shared=True` is the operator's opt-in global scope."""
    return "global" if shared else f"tenant:{validate_id(tenant, 'tenant')}"


def chain_root(namespace: str, fingerprint: str) -> bytes:
    h = hashlib.blake2b(digest_size=32, person=b"agentstate-root")
    for part in (namespace.encode(), fingerprint.encode()):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def chunk_keys(
    tokens: Sequence[int] | array, *, namespace: str, fingerprint: str, chunk_tokens: int, chain: str | None = None
) -> list[ChunkKey]:
    """Keys of every full chunk of `tokens` (a partial last chunk gets none: it is a tail).

    The digest chain starts from `chain` (the model's fingerprint, `ModelSpec.model_fingerprint`;
    default `fingerprint`), the key's spec segment is `fingerprint` (the slice of heads the value
    holds): one prefix has one digest at every TP size, and each slice of it its own key."""
    packed = tokens if isinstance(tokens, array) else token_array(tokens)
    raw = memoryview(packed).cast("B")
    step = chunk_tokens * packed.itemsize
    prev = chain_root(namespace, chain or fingerprint)
    keys: list[ChunkKey] = []
    for start in range(0, (len(packed) // chunk_tokens) * step, step):
        prev = hashlib.blake2b(prev + raw[start : start + step], digest_size=32, person=b"agentstate-chunk").digest()
        keys.append(ChunkKey(f"{CHUNK_PREFIX}{fingerprint}/{prev.hex()}"))
    return keys


def respec(key: str, fingerprint: str, other: str) -> str:
    """`key` (a chunk's, a tail's or an engine scheme's: `<kind>/<fingerprint>/...`) with its spec
    segment `fingerprint` replaced by `other`: the same chunk as another slice of heads holds it.
    InvalidArgumentError when `key` does not name `fingerprint` there."""
    kind, sep, rest = key.partition("/")
    if not sep or not rest.startswith(fingerprint + "/"):
        raise InvalidArgumentError(f"key {key[:120]!r} does not belong to spec {fingerprint}")
    return f"{kind}/{other}{rest[len(fingerprint):]}"


def boundary_key(chunk_key: str) -> str:
    """The key of a hybrid model's state after chunk `chunk_key`'s last token (a shared prefix's
    boundary: `agentstate.model_state`), beside the chunk in its key space."""
    return chunk_key + STATE_SUFFIX


def is_state_key(key: str) -> bool:
    """`key` holds a hybrid model's state (a session's end, a prefix boundary), not KV."""
    return key.endswith(STATE_SUFFIX)


def state_key(fingerprint: str, tenant: str, session_id: str, version: int) -> TailKey:
    """The key of one written hybrid state (`agentstate.model_state`): a tail's, marked `.state`, so
    it lives, is listed and is collected where tails are."""
    return TailKey(tail_key(fingerprint, tenant, session_id, version) + STATE_SUFFIX)


def tail_key(fingerprint: str, tenant: str, session_id: str, version: int, writer: str | None = None) -> TailKey:
    """The key of one written tail. `writer` is unique per write attempt, so two hosts writing the
    same session version never overwrite each other's tail before one of them loses the commit."""
    writer = secrets.token_hex(8) if writer is None else writer
    return TailKey(f"{TAIL_PREFIX}{fingerprint}/{tenant}/{session_id}/{version}.{writer}")
