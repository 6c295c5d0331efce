"""Chunks across tensor-parallel sizes (agentstate.slices): a prefix stored at one TP size is a hit at
another, each rank getting exactly its heads, bit for bit; real LMDB per rank, one real Redis tier shared.

Each engine rank owns its data directory (one writer each); what crosses TP sizes is the shared tier,
as in a fleet where engines of several TP sizes share one remote store.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import redis
import torch

from agentstate import ModelSpec, StateStore
from agentstate.config import StoreConfig, TierConfig
from agentstate.errors import InvalidArgumentError
from agentstate.keys import respec
from tests.conftest import bits_equal, random_kv, random_tokens

WHOLE = ModelSpec(model_id="test/tp", num_layers=2, num_kv_heads=4, head_dim=32, dtype="bfloat16")
C = 32


def heads(kv: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    first, end = spec.head_range
    return kv[:, :, :, first:end]


@pytest.fixture
def opener(tmp_path: Path, redis_server) -> Callable[[ModelSpec, str], object]:  # type: ignore[no-untyped-def]
    prefix = f"tp-{uuid.uuid4().hex[:8]}:"

    def open_rank(spec: ModelSpec, name: str):  # type: ignore[no-untyped-def]
        tiers = [TierConfig(kind="host", capacity_bytes=8 << 20), TierConfig(kind="lmdb"),
                 TierConfig(kind="redis", url=redis_server.url, prefix=prefix)]  # fmt: skip
        return StateStore.open(StoreConfig(path=tmp_path / name, chunk_tokens=C, tiers=tiers, lmdb_map_size=64 << 20), spec)

    open_rank.prefix = prefix  # type: ignore[attr-defined]
    return open_rank


async def ranks(stack: AsyncExitStack, opener, size: int) -> list[StateStore]:  # type: ignore[no-untyped-def]
    return [await stack.enter_async_context(opener(WHOLE.slicing(size, r), f"tp{r}-{size}")) for r in range(size)]


def test_a_slice_is_named_by_its_heads_and_its_prefix_by_the_model() -> None:
    half = WHOLE.slicing(2, 1)
    assert half.num_kv_heads == 2 and half.head_range == (2, 4) and half.whole == WHOLE
    assert WHOLE.model_fingerprint == WHOLE.fingerprint == half.model_fingerprint != half.fingerprint
    assert [[p.head_range for p in parts] for parts in half.sources()] == [[(2, 3), (3, 4)], [(0, 4)]]
    assert [[p.head_range for p in parts] for parts in WHOLE.sources()] == [[(0, 2), (2, 4)], [(0, 1), (1, 2), (2, 3), (3, 4)]]
    with pytest.raises(InvalidArgumentError):
        WHOLE.slicing(3, 0)
    with pytest.raises(InvalidArgumentError):
        respec("c/" + "0" * 32 + "/ab", half.fingerprint, WHOLE.fingerprint)


async def test_tp1_prefix_hits_at_tp2_and_tp4_each_rank_its_heads(opener) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = random_tokens(5 * C, seed=1), random_kv(WHOLE, 5 * C, seed=1)
    async with AsyncExitStack() as stack:
        whole = await stack.enter_async_context(opener(WHOLE, "tp1"))
        assert await whole.put_prefix(tokens, kv) == 5 * C
        for size in (2, 4):
            for store in await ranks(stack, opener, size):
                assert (await store.match(tokens)).tokens == 5 * C
                into = store.spec.empty_kv(5 * C)
                assert await store.load(tokens, into) == 5 * C
                assert bits_equal(into, heads(kv, store.spec))
                assert store.chunks.counters()["chunks_resliced"] == 5
                again = store.spec.empty_kv(5 * C)  # now under its own keys: a plain read
                assert await store.load(tokens, again) == 5 * C and bits_equal(again, into)
                assert store.chunks.counters()["chunks_resliced"] == 5


async def test_tp2_prefix_hits_at_tp1_assembled_and_at_tp4_narrowed(opener) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = random_tokens(3 * C + 7, seed=2), random_kv(WHOLE, 3 * C + 7, seed=2)
    async with AsyncExitStack() as stack:
        for store in await ranks(stack, opener, 2):
            assert await store.put_prefix(tokens, heads(kv, store.spec).contiguous()) == 3 * C
        whole = await stack.enter_async_context(opener(WHOLE, "tp1"))
        into = WHOLE.empty_kv(3 * C)
        assert await whole.load(tokens, into) == 3 * C
        assert bits_equal(into, kv[:, :, : 3 * C])
        for store in await ranks(stack, opener, 4):
            into = store.spec.empty_kv(3 * C)
            assert await store.load(tokens, into) == 3 * C
            assert bits_equal(into, heads(kv, store.spec)[:, :, : 3 * C])
            assert store.chunks.counters()["chunks_resliced"] == 3


async def test_a_rank_missing_its_slice_is_a_miss_from_there_for_every_reader(opener) -> None:  # type: ignore[no-untyped-def]
    """TP 2's rank 1 stored only the first two chunks (its later saves dropped): a TP 1 reader hits
    two chunks, never a chunk with half its heads."""
    tokens, kv = random_tokens(4 * C, seed=3), random_kv(WHOLE, 4 * C, seed=3)
    async with AsyncExitStack() as stack:
        r0, r1 = await ranks(stack, opener, 2)
        await r0.put_prefix(tokens, heads(kv, r0.spec).contiguous())
        await r1.put_prefix(tokens[: 2 * C], heads(kv, r1.spec)[:, :, : 2 * C].contiguous())
        whole = await stack.enter_async_context(opener(WHOLE, "tp1"))
        assert (await whole.match(tokens)).tokens == 2 * C
        into = WHOLE.empty_kv(4 * C)
        assert await whole.load(tokens, into) == 2 * C and bits_equal(into[:, :, : 2 * C], kv[:, :, : 2 * C])


async def test_a_damaged_slice_is_never_served_and_nothing_else_is_lost(opener, redis_server) -> None:  # type: ignore[no-untyped-def]
    """One byte of rank 1's second chunk flipped in the shared tier: the TP 1 reader stops before it;
    the TP 2 ranks' own copies (their LMDB) still serve them in full."""
    tokens, kv = random_tokens(3 * C, seed=4), random_kv(WHOLE, 3 * C, seed=4)
    async with AsyncExitStack() as stack:
        r0, r1 = await ranks(stack, opener, 2)
        for store in (r0, r1):
            await store.put_prefix(tokens, heads(kv, store.spec).contiguous())
        key = opener.prefix + r1.prefix_keys(tokens)[1]
        client = redis.Redis.from_url(redis_server.url)
        value = bytearray(client.get(key))
        value[-5] ^= 0x10
        client.set(key, bytes(value))
        whole = await stack.enter_async_context(opener(WHOLE, "tp1"))
        into = WHOLE.empty_kv(3 * C)
        assert await whole.load(tokens, into) == C and bits_equal(into[:, :, :C], kv[:, :, :C])
        for store in (r0, r1):
            own = store.spec.empty_kv(3 * C)
            assert await store.load(tokens, own) == 3 * C and bits_equal(own, heads(kv, store.spec))


async def test_another_model_or_tenant_never_hits(opener) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = random_tokens(2 * C, seed=5), random_kv(WHOLE, 2 * C, seed=5)
    other = WHOLE.model_copy(update={"model_id": "test/tp-other"})
    async with AsyncExitStack() as stack:
        whole = await stack.enter_async_context(opener(WHOLE, "tp1"))
        await whole.put_prefix(tokens, kv)
        half = await stack.enter_async_context(opener(other.slicing(2, 0), "other"))
        assert (await half.match(tokens)).tokens == 0
        mine = await stack.enter_async_context(opener(WHOLE.slicing(2, 0), "tp0-2"))
        assert (await mine.for_tenant("someone-else").match(tokens)).tokens == 0
        assert (await mine.match(tokens)).tokens == 2 * C


async def test_a_session_stored_at_tp1_resumes_at_tp2_each_rank_its_heads(tmp_path: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    """One catalog (Redis) and one Redis tier for every engine: a session a TP 1 engine stored resumes
    on each rank of a TP 2 engine, its heads bit for bit, tail included; a rank's own session is not
    served to TP 1 (one writer's slice cannot be assembled): a typed error, nothing changed."""
    from agentstate.errors import SpecMismatchError

    prefix = f"tps-{uuid.uuid4().hex[:8]}:"

    def open_rank(spec: ModelSpec, name: str):  # type: ignore[no-untyped-def]
        tiers = [TierConfig(kind="host", capacity_bytes=8 << 20), TierConfig(kind="lmdb"),
                 TierConfig(kind="redis", url=redis_server.url, prefix=prefix)]  # fmt: skip
        cfg = StoreConfig(path=tmp_path / name, chunk_tokens=C, tiers=tiers, lmdb_map_size=64 << 20,
                          catalog_url=redis_server.url, catalog_prefix=prefix)  # fmt: skip
        return StateStore.open(cfg, spec)

    tokens, kv = random_tokens(2 * C + 9, seed=6), random_kv(WHOLE, 2 * C + 9, seed=6)
    async with AsyncExitStack() as stack:
        whole = await stack.enter_async_context(open_rank(WHOLE, "tp1"))
        await whole.snapshot("agent-1", tokens, kv, {"turn": 1})
        for rank in range(2):
            store = await stack.enter_async_context(open_rank(WHOLE.slicing(2, rank), f"tp{rank}-2"))
            got = await store.resume("agent-1")
            assert got.tokens == tokens and got.exact and bits_equal(got.kv, heads(kv, store.spec))
        await store.snapshot("agent-2", tokens, heads(kv, store.spec).contiguous(), {"turn": 1})
        with pytest.raises(SpecMismatchError):
            await whole.resume("agent-2")
        assert bits_equal((await store.resume("agent-2")).kv, heads(kv, store.spec))
        assert bits_equal((await whole.resume("agent-1")).kv, kv)
