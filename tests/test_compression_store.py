"""Stores with compressed tiers (the StateStore face): lossless tiers resume bit-exact across a restart
and from the promoted (compressed) host tier, a damaged frame is recomputed instead of raised, an fp8
tier serves the dequantized KV with a valid codec checksum within its bound, a compressed cache's
capacity is spent in compressed bytes, and turning compression on or off keeps a directory usable.
KV comes from a tiny Qwen2-shaped model with random weights (tests/test_compression.py builds it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from agentstate import ModelSpec, codec, compress
from agentstate.adapters import transformers as tfa
from agentstate.config import TierConfig
from tests.conftest import bits_equal
from tests.test_compression import canonical, model, model_kv, read_all


@pytest.mark.parametrize(("record", "method"), [("lmdb", "zstd"), ("file", "lz4")])
async def test_store_with_compressed_tiers_resumes_bit_exact_across_a_restart(
    open_store: Callable[..., Any], record: str, method: str
) -> None:
    m = model()
    spec = tfa.spec_for(m, model_id="test/tiny-qwen2")
    ids, cache = model_kv(m, 150)  # two 64-token chunks and a 22-token tail
    host = TierConfig(kind="host", capacity_bytes=1 << 30, compression="lz4")
    tiers = [host, TierConfig(kind=record, compression=method)]
    async with open_store(spec, tiers=tiers) as store:
        await tfa.snapshot(store, "agent", ids, cache, state={"turn": 3})
        assert all(compress.is_frame(memoryview(v)) for v in (await read_all(store.chunks.backend(record).inner,
                   [k async for k in store.chunks.backend(record).keys("c/")]))[1].values())  # fmt: skip
    async with open_store(spec, tiers=tiers) as store:  # a new process's view: the host tier is empty
        tokens, restored, state, n = await tfa.resume(store, "agent", m)
        await store.chunks.flush()
        first = (await store.session("agent")).chunk_keys[0]
        assert store.chunks.where(first) == ["host", record]  # promoted into the compressed host tier
        again = await tfa.resume(store, "agent", m)  # now from the host tier
    assert tokens == ids[0].tolist() and state == {"turn": 3} and n == 150
    for got in (restored, again.cache):
        pairs = zip(got.layers, cache.layers)
        assert all(bits_equal(a.keys, b.keys) and bits_equal(a.values, b.values) for a, b in pairs)


async def test_damaged_frame_in_a_store_is_recomputed_not_raised(open_store: Callable[..., Any]) -> None:
    m = model()
    spec = tfa.spec_for(m, model_id="test/tiny-qwen2")
    ids, cache = model_kv(m, 150)
    tiers = [TierConfig(kind="lmdb", compression="zstd")]
    async with open_store(spec, tiers=tiers) as store:
        manifest = await tfa.snapshot(store, "agent", ids, cache)
        lmdb = store.chunks.backend("lmdb")
        _, raw = await read_all(lmdb.inner, [manifest.chunk_keys[1]])
        await lmdb.inner.put([manifest.chunk_keys[1]], [raw[0][:-1] + bytes([raw[0][-1] ^ 1])])
    async with open_store(spec, tiers=tiers) as store:
        result = await store.resume("agent")
    assert result.restored_tokens == 64 and result.kv is not None  # the first chunk; the engine recomputes the rest
    assert bits_equal(result.kv[:, :, :64], canonical(cache)[:, :, :64])


async def test_capacity_counts_compressed_bytes(open_store: Callable[..., Any]) -> None:
    spec = ModelSpec(model_id="test/c", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    capacity = 1 << 20
    chunk = codec.encoded_size(64 * spec.token_bytes)  # 128 KiB of logical KV per 64-token chunk
    tiers = [TierConfig(kind="host", capacity_bytes=capacity, compression="zstd"), TierConfig(kind="lmdb")]
    g = torch.Generator().manual_seed(3)
    kv = torch.randint(-8, 8, tuple(spec.kv_shape(64 * 24)), generator=g).to(torch.bfloat16) / 4  # KV that compresses
    tokens = list(range(64 * 24))
    async with open_store(spec, tiers=tiers) as store:
        await store.put_prefix(tokens, kv)
        host = next(t for t in store.chunks.tier_info() if t.name == "host")
        stats = await store.chunks.backend("host").stats()
        assert host.used_bytes <= capacity and stats.bytes_used == host.used_bytes
        assert host.chunks == stats.items and host.chunks * chunk > 2 * capacity  # over 2x C of logical KV
        assert store.chunks.backend("host").ratio() > 2
        out = torch.empty_like(kv)
        assert await store.load(tokens, out) == len(tokens) and bits_equal(out, kv)


async def test_store_with_an_fp8_tier_serves_dequantized_kv_with_a_valid_checksum(
    open_store: Callable[..., Any],
) -> None:
    m = model()
    spec = tfa.spec_for(m, model_id="test/tiny-qwen2")
    ids, cache = model_kv(m, 150)
    kv = canonical(cache)
    tiers = [TierConfig(kind="lmdb", compression="fp8+zstd")]
    async with open_store(spec, tiers=tiers) as store:
        await tfa.snapshot(store, "agent", ids, cache)
    async with open_store(spec, tiers=tiers) as store:  # LMDB is not trusted: every chunk's checksum is verified
        result = await store.resume("agent")
        assert (await store.stats()).counters.get("corrupt", 0) == 0
    assert result.restored_tokens == 150 and result.kv is not None
    for lo, hi in ((0, 64), (64, 128), (128, 150)):  # per chunk (and tail): scales are per chunk
        want, got = kv[:, :, lo:hi].float(), result.kv[:, :, lo:hi].float()
        amax = want.abs().amax(dim=(2, 4), keepdim=True)
        bound = (2**-4 + 2**-8 + 2**-12) * want.abs() + amax / compress.FP8_MAX * 2**-9
        assert bool(((got - want).abs() <= bound).all())


async def test_turning_compression_on_keeps_old_chunks_readable_and_off_makes_frames_misses(
    open_store: Callable[..., Any],
) -> None:
    m = model()
    spec = tfa.spec_for(m, model_id="test/tiny-qwen2")
    ids, cache = model_kv(m, 150)
    plain, zstd = [TierConfig(kind="lmdb")], [TierConfig(kind="lmdb", compression="zstd")]
    async with open_store(spec, tiers=plain) as store:
        await tfa.snapshot(store, "old", ids, cache)
    async with open_store(spec, tiers=zstd) as store:
        old = await store.resume("old")  # stored uncompressed, read through the compressed tier as it is
        await tfa.snapshot(store, "new", ids[:, :140], _cropped(cache, 140))
    assert old.restored_tokens == 150 and old.kv is not None and bits_equal(old.kv, canonical(cache))
    async with open_store(spec, tiers=plain) as store:
        new = await store.resume("new")  # its tail is a frame the plain tier cannot read: a miss, recomputed
    assert new.restored_tokens == 128


def _cropped(cache: Any, tokens: int) -> Any:
    out = copy.deepcopy(cache)
    out.crop(tokens - cache.get_seq_length())
    return out


async def test_verify_reports_a_damaged_frame_as_corrupt_and_repair_lets_the_next_snapshot_heal(
    open_store: Callable[..., Any],
) -> None:
    """An operator's view of a damaged compressed value: corrupt (not missing) in verify, the session
    named; repair drops the copy and the next snapshot of the same content makes the store clean."""
    from agentstate.ops.verify import verify

    m = model()
    spec = tfa.spec_for(m, model_id="test/tiny-qwen2")
    ids, cache = model_kv(m, 150)
    tiers = [TierConfig(kind="lmdb", compression="zstd")]
    async with open_store(spec, tiers=tiers) as store:
        await tfa.snapshot(store, "agent", ids, cache)
        victim = (await store.session("agent")).chunk_keys[1]
        inner = store.chunks.backend("lmdb").inner
        _, raw = await read_all(inner, [victim])
        frame = bytearray(raw[0])
        frame[len(frame) // 2] ^= 0x40
        await inner.put([victim], [bytes(frame)])
        report = await verify(store)
        assert [(b.tier, b.key) for b in report.corrupt] == [("lmdb", victim)] and not report.clean
        assert [a.session_id for a in report.affected] == ["agent"]
        await verify(store, repair=True)
        await tfa.snapshot(store, "agent", ids, cache)
        assert (await verify(store)).clean
