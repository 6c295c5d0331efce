"""Our KV events read by vLLM's own decoder, with block hashes equal to vLLM's own functions.

Runs in the vLLM venv (CI's .venv-ci-vllm): `vllm.distributed.kv_events` decodes what a store
publishes over a real ZMQ socket, and `vllm.v1.core.kv_cache_utils.hash_block_tokens` (after
`init_none_hash`, as the engine calls it) gives the hashes the events carry, for both of vLLM's
cryptographic schemes and with a cache salt.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

from agentstate import StateStore
from agentstate.config import StoreConfig
from agentstate.events import KVEvents, KVEventsConfig
from tests.conftest import SPEC4, random_kv, random_tokens

CHUNK = 64


def vllm_chain(tokens: list[int], algo: str, salt: str | None = None) -> list[int]:
    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    parent, out = None, []
    for i in range(0, len(tokens) - 15, 16):
        extra = (("cache_salt", salt),) if i == 0 and salt else None
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[i : i + 16], extra)
        out.append(kv_cache_utils.maybe_convert_block_hash(parent))
    return out


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_block_hashes_equal_vllms_own(algo: str, salt: str | None) -> None:
    ev = KVEvents(KVEventsConfig(enable_kv_cache_events=True, hash_algo=algo), {}, CHUNK)  # type: ignore[arg-type]
    tokens = random_tokens(3 * CHUNK + 7)
    ours = [ev._external(h) for h in ev.hasher.chain(None, tokens, 16, salt)]
    assert ours == vllm_chain(tokens, algo, salt) and len(ours) == (3 * CHUNK + 7) // 16


async def test_vllms_decoder_reads_what_a_store_publishes(tmp_path: Path) -> None:
    cfg = StoreConfig(path=tmp_path / "s", chunk_tokens=CHUNK, host_capacity_bytes=2 * CHUNK * SPEC4.token_bytes,
                      kv_events={"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "topic": "kv@agentstate"})
    ctx = zmq.Context()
    try:
        async with StateStore.open(cfg, SPEC4) as store:
            endpoint, _ = store.chunks.publisher_endpoints  # type: ignore[misc]
            sub = ctx.socket(zmq.SUB)
            sub.connect(endpoint.replace("0.0.0.0", "127.0.0.1"))
            sub.setsockopt(zmq.SUBSCRIBE, b"kv@agentstate")
            await asyncio.sleep(0.3)
            tokens = random_tokens(4 * CHUNK)
            await store.snapshot("a", tokens, random_kv(SPEC4, 4 * CHUNK))  # 4 chunks, a host tier of 2
            await store.delete("a")
            await asyncio.sleep(0.3)
        decode = msgspec.msgpack.Decoder(type=KVEventBatch)
        events = []
        while sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@agentstate" and len(seq) == 8
            batch = decode.decode(payload)
            assert isinstance(batch, KVEventBatch) and batch.ts > 0
            events += batch.events
        stored = [e for e in events if isinstance(e, BlockStored)]
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        hashes = vllm_chain(tokens, "sha256")
        assert {h for e in stored for h in e.block_hashes} == set(hashes)
        assert {e.medium for e in stored} == {"CPU", "STORAGE"} and all(e.block_size == 16 for e in stored)
        assert all(e.token_ids == tokens[hashes.index(e.block_hashes[0]) * 16 :][: 16 * len(e.block_hashes)] for e in stored)
        assert {h for e in removed if e.medium == "STORAGE" for h in e.block_hashes} == set(hashes)  # deleted
        assert not any(isinstance(e, AllBlocksCleared) for e in events)  # the open's clear came before we joined
    finally:
        ctx.destroy(linger=0)
