"""The reports of `ls`, `inspect` and `gc`, apart from the operations that build them: the service
sends these models and the CLI's remote mode (`--url`) parses them, so this module imports
neither torch nor the store (a client-only install, `agentstate-kv[client]`, reads them)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel

from agentstate.usage import Usage

__all__ = ["ChunkInfo", "GcReport", "SessionDetail", "SessionRow", "dumps"]


class SessionRow(BaseModel):
    """One line of `ls`. `bytes` is the stored size of what the session names (shared chunks count
    in every session that names them; `stats` has the deduplicated total)."""

    session_id: str
    tenant: str
    version: int
    tokens: int
    chunks: int
    tail_tokens: int
    bytes: int
    parent: str | None
    pinned: bool
    ttl_seconds: float | None
    created_at: float
    updated_at: float
    guaranteed_until: float | None = None
    """retention contract: never expires before this (wall clock)"""
    expires_at: float | None = None
    """when it expires: its sliding TTL after the last write or hit, never before `guaranteed_until` (None: never)"""
    last_hit_at: float | None = None
    """its last resume or hint"""
    lossy: bool = False
    """stored where a tier keeps a lossy encoding (fp8): a resume may give back KV within fp8's error
    bound, not the bytes snapshotted (ResumeResult.exact says, per resume)"""


class ChunkInfo(BaseModel):
    index: int
    kind: Literal["chunk", "tail", "state"]
    """`state`: a hybrid model's state after the session's last token (SSM/conv states, sliding windows)"""
    key: str
    first_token: int
    tokens: int
    bytes: int
    tiers: list[str]
    """tiers holding a copy, fastest first; empty: the chunk is missing (a resume stops before it)"""


class SessionDetail(BaseModel):
    session_id: str
    tenant: str
    fingerprint: str
    version: int
    parent: str | None
    chunk_tokens: int
    num_tokens: int
    tail_tokens: int
    tail_key: str | None
    created_at: float
    state_key: str | None = None
    """a hybrid model's state after the last token (None: a dense model's session)"""
    updated_at: float
    ttl_seconds: float | None
    pinned: bool
    state: dict[str, object]
    bytes: int
    missing: int
    chunks: list[ChunkInfo]
    guaranteed_until: float | None = None
    expires_at: float | None = None
    last_hit_at: float | None = None
    hint: str | None = None
    """the hint holding it in the fast tiers now (paused, resuming), as the serving process knows it"""
    hint_held_until: float | None = None
    usage: Usage | None = None
    """its accounting: tokens read, written, recomputed; bytes per tier"""
    lossy: bool = False
    """stored where a tier keeps a lossy encoding (fp8): a resume may not be bit-exact (see SessionRow)"""
    lossy_tiers: list[str] = []
    """this store's tiers that keep a lossy encoding: a copy a chunk has there (or was promoted from
    there) is fp8's reconstruction, not the stored bytes"""
    records: int = 0
    """records a framework keeps beside the session (`agentstate.records`: checkpoints, items)"""


class GcReport(BaseModel):
    removed: int
    """expired sessions, plus chunks and tails no manifest or prefix references"""


def dumps(model: BaseModel | Sequence[BaseModel]) -> str:
    """JSON of a report (a list of rows included) for `--json`."""
    if isinstance(model, BaseModel):
        return model.model_dump_json(indent=2)
    return json.dumps([m.model_dump(mode="json") for m in model], indent=2)
