"""Wire and storage models of sessions: the manifest, and what a resume returns."""

from __future__ import annotations

import time
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from agentstate.keys import ChunkKey, TailKey


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
    state: dict[str, Any] = Field(default_factory=dict)
    version: int = Field(ge=1)
    parent: str | None = None
    created_at: float
    updated_at: float
    ttl_seconds: float | None = Field(default=None, gt=0)
    pinned: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tail_tokens(self) -> int:
        return len(self.tokens) - len(self.chunk_keys) * self.chunk_tokens

    def expired(self, at: float | None = None) -> bool:
        if self.ttl_seconds is None or self.pinned:
            return False
        return (now() if at is None else at) >= self.updated_at + self.ttl_seconds


class MatchResult(BaseModel):
    """How much of a token sequence is cached: `tokens` leading tokens, in `chunks` chunks."""

    model_config = ConfigDict(frozen=True)

    tokens: int
    chunks: int
    tiers: list[str] = Field(description="the fastest tier holding each matched chunk")


class ResumeResult(BaseModel):
    """A restored session. `kv` holds the first `restored_tokens` tokens of `tokens`, bit-exact
    (None when the KV was restored into a caller's KVTarget instead, such as a paged pool).

    `restored_tokens < len(tokens)` only when stored data was missing or corrupt: the engine
    recomputes the rest from `tokens`, which are always complete.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    manifest: SessionManifest
    kv: torch.Tensor | None
    restored_tokens: int

    @property
    def tokens(self) -> list[int]:
        return self.manifest.tokens

    @property
    def state(self) -> dict[str, Any]:
        return self.manifest.state

    @property
    def complete(self) -> bool:
        return self.restored_tokens == len(self.manifest.tokens)
