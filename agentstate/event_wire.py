"""KV events on the wire: msgspec structs shaped as vLLM's (`vllm.distributed.kv_events`), so that its
decoder, and the routers built on it, read our batches as they read an engine's.

The batch is an array `[ts, events, data_parallel_rank]`; each event a map tagged `type` with the
struct's name (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`); fields that hold their default are
left out, the required ones (`lora_id`, `medium`, `lora_name`) are always there, null or not.
"""

from __future__ import annotations

from typing import Any

import msgspec


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    pass


class DecodedBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """A batch as a consumer decodes it: its events typed."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder[DecodedBatch]:
    return msgspec.msgpack.Decoder(type=DecodedBatch)
