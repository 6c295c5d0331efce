"""What the scheduler side tells the worker side each step (vLLM pickles it across processes).

The scheduler plans, the worker executes: every job names its request's blocks, so the worker
never needs the scheduler's view of a request. Released and preempted requests are how the worker
learns when blocks stop being a request's: copies out of released ones are waited for (their
blocks are held), copies out of preempted ones revoked (their blocks may be reused at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from agentstate.hints import HintKind


@dataclass
class LoadJob:
    """Read stored chunks (`keys`, each covering `spans[i]` = (start token, tokens)) into the request's
    blocks, tokens `first .. end` (vLLM holds those before `first`)."""

    req_id: str
    keys: list[str]
    spans: list[tuple[int, int]]
    block_ids: list[int]
    first: int
    end: int
    tenant: str = ""
    stored: list[int] | None = None
    """tokens each chunk holds, where a span takes only its first ones (a session matched part way)"""
    tails: list[str] | None = None
    """at TP > 1, when the last key is a session's tail: each rank's own (a rank's tail is its own value)"""
    groups: list[list[int]] | None = None
    """a hybrid model's block ids per KV cache group (`block_ids` is then its first attention group's)"""
    state_block: int | None = None
    """a Mamba model's: the block its state after `end` tokens goes into (the block holding token `end - 1`)"""
    state_key: str | None = None
    """a Mamba model's session: the key of its state after `end` tokens (else the boundary after the last chunk)"""


@dataclass
class SaveJob:
    """Store chunks `chunks` (indices into `tokens`' whole chunks, keys `keys`) out of the request's blocks."""

    req_id: str
    tenant: str
    tokens: list[int]
    keys: list[str]
    chunks: list[int]
    block_ids: list[int]
    salt: str | None = None
    """the request's cache_salt: vLLM's block hashes carry it, and so do the KV events of these chunks"""
    groups: list[list[int]] | None = None
    """a hybrid model's block ids per KV cache group; its chunks are copied out on the step (a group's
    blocks may leave the request before a copy off the step would run)"""
    state_block: int | None = None
    """a Mamba model's: the block holding its state after the last chunk (the step ended there)"""


@dataclass
class SessionJob:
    """Snapshot a finished request as session `session_id` (its blocks are held until copied)."""

    req_id: str
    tenant: str
    session_id: str
    state: dict[str, Any]
    tokens: list[int]
    block_ids: list[int]
    groups: list[list[int]] | None = None
    """a hybrid model's block ids per KV cache group (`block_ids` is its first attention group's)"""
    state_block: int | None = None
    """a Mamba model's: the block holding its state after the session's last token"""


@dataclass
class HintJob:
    """An agent hint for the worker to apply: `paused`/`done` of a finished request (after its saves
    and snapshot are written), `resuming` of one that just arrived (sent over the lookup channel)."""

    req_id: str
    tenant: str
    name: str
    session: bool
    hint: HintKind
    expected_s: float | None
    tokens: list[int]
    local: int = 0  # resuming: leading tokens vLLM's own prefix cache holds (nothing to bring up for them)


@dataclass
class AgentStateMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    sessions: list[SessionJob] = field(default_factory=list)
    hints: list[HintJob] = field(default_factory=list)  # of finished requests
    released: list[str] = field(default_factory=list)  # finished, blocks held until their copies are done
    preempted: list[str] = field(default_factory=list)  # blocks freed this step: copies in flight revoked
