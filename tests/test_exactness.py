"""Exactness is visible: a resume through a lossy (fp8) tier says `exact=False` (its bytes are within
e4m3's bound, not the snapshotted ones) while a lossless tier's says `exact=True` and is bit-exact;
the same through the service and the SDK, and `ls` / `inspect` mark sessions stored lossy.

Real LMDB, real compression, real uvicorn on loopback; KV is normal random bf16 (finite, so fp8
holds it; an fp8 round trip changes most values). A chunk fp8 cannot hold (inf/nan) is stored
lossless, and its resume is exact: the last test.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from agentstate import StateStore, codec, compress
from agentstate.client import AsyncClient
from agentstate.config import TierConfig
from agentstate.manifest import encode_manifest
from agentstate.ops.admin import inspect_session, list_sessions
from tests.conftest import SPEC4, bits_equal, random_tokens
from tests.conftest import random_kv as random_bits
from tests.test_service import ALICE, serving

TOKENS = 150  # two 64-token chunks and a 22-token tail
HOST = TierConfig(kind="host", capacity_bytes=1 << 30)
FP8 = [HOST, TierConfig(kind="lmdb", compression="fp8")]
ZSTD = [HOST, TierConfig(kind="lmdb", compression="zstd")]


def random_kv(spec: Any, tokens: int, seed: int = 0) -> torch.Tensor:
    """Finite KV, as a model computes it: normal values of a few magnitudes."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(spec.kv_shape(tokens), generator=g) * 3).to(spec.torch_dtype)


def within_fp8(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Every value of `got` is the e4m3 reconstruction of `want`'s, per chunk (and tail): its scale
    is per (layer, plane, head) of each chunk."""
    for lo, hi in ((0, 64), (64, 128), (128, TOKENS)):
        w, g = want[:, :, lo:hi].float(), got[:, :, lo:hi].float()
        amax = w.abs().amax(dim=(2, 4), keepdim=True)
        bound = (2**-4 + 2**-8 + 2**-12) * w.abs() + amax / compress.FP8_MAX * 2**-9
        if not bool(((g - w).abs() <= bound).all()):
            return False
    return True


async def test_fp8_record_tier_resumes_complete_but_not_exact(open_store: Callable[..., Any]) -> None:
    kv, tokens = random_kv(SPEC4, TOKENS), random_tokens(TOKENS)
    async with open_store(SPEC4, tiers=FP8) as store:
        manifest = await store.snapshot("agent", tokens, kv)
        fresh = await store.resume("agent")  # the host tier holds what was written: the bytes themselves
    assert manifest.lossy
    assert fresh.complete and fresh.exact and bits_equal(fresh.kv, kv)
    async with open_store(SPEC4, tiers=FP8) as store:  # a new process: only the fp8 LMDB tier holds it
        first = await store.resume("agent")
        await store.flush()
        assert store.chunks.where(manifest.chunk_keys[0]) == ["host", "lmdb"]  # promoted: the lossy copy
        again = await store.resume("agent")  # from host memory now; the copy still says it is lossy
    for result in (first, again):
        assert result.complete and not result.exact and result.manifest.lossy
        assert result.kv is not None and not bits_equal(result.kv, kv) and within_fp8(result.kv, kv)


async def test_lossless_tier_resumes_exact_and_bit_exact(open_store: Callable[..., Any]) -> None:
    kv, tokens = random_kv(SPEC4, TOKENS), random_tokens(TOKENS)
    async with open_store(SPEC4, tiers=ZSTD) as store:
        manifest = await store.snapshot("agent", tokens, kv)
    assert not manifest.lossy and b'"lossy"' not in encode_manifest(manifest)  # stored as before
    async with open_store(SPEC4, tiers=ZSTD) as store:
        result = await store.resume("agent")
    assert result.complete and result.exact and bits_equal(result.kv, kv)


async def test_a_partial_resume_says_exact_about_what_it_restored(open_store: Callable[..., Any]) -> None:
    """Only restored chunks count: a lossy chunk after a missing one is not served, so not counted."""
    kv, tokens = random_kv(SPEC4, TOKENS), random_tokens(TOKENS)
    async with open_store(SPEC4, tiers=[TierConfig(kind="lmdb", compression="fp8")]) as store:
        manifest = await store.snapshot("agent", tokens, kv)
        await store.chunks.backend("lmdb").delete([manifest.chunk_keys[0]])
    async with open_store(SPEC4, tiers=[TierConfig(kind="lmdb", compression="fp8")]) as store:
        result = await store.resume("agent")
    assert result.restored_tokens == 0 and result.exact and not result.complete


def test_the_lossy_flag_is_in_the_codec_header_and_checked() -> None:
    kv = random_kv(SPEC4, 64)
    plain = codec.encode(kv, SPEC4.fingerprint, key="c/k")
    lossy = codec.encode(kv, SPEC4.fingerprint, key="c/k", lossy=True)
    assert not codec.read_header(plain).lossy and codec.read_header(lossy).lossy and codec.is_lossy(lossy)
    assert bytes(plain[:52]) == bytes(lossy[:52]) and bytes(plain[64:]) == bytes(lossy[64:])
    frame = compress.compress(plain, "c/k", "fp8")
    assert codec.is_lossy(compress.decompress(frame, "c/k"))  # what an fp8 tier gives back says so
    bad = bytearray(plain)
    bad[52] |= 0x80  # an unknown flag: refused like any malformed header
    with pytest.raises(codec.CorruptDataError):
        codec.read_header(bad)


@pytest.mark.parametrize(("tiers", "exact"), [(FP8, False), (ZSTD, True)])
async def test_exactness_through_the_service_and_sdk(
    open_store: Callable[..., Any], tiers: list[TierConfig], exact: bool
) -> None:
    kv, tokens = random_kv(SPEC4, TOKENS), random_tokens(TOKENS)
    async with open_store(SPEC4, tiers=tiers) as store:
        await store.for_tenant("alice").snapshot("agent", tokens, kv)
    async with open_store(SPEC4, tiers=tiers) as store, serving(store) as url:
        async with AsyncClient(url, ALICE, spec=SPEC4) as client:
            result = await client.resume("agent")
            listed = [s for s in await client.list() if s.session_id == "agent"]
    assert result.complete and result.exact is exact and result.manifest.lossy is not exact
    assert bits_equal(result.kv, kv) is exact and within_fp8(result.kv, kv)
    assert [s.lossy for s in listed] == [not exact]


async def test_ls_and_inspect_mark_sessions_stored_lossy(open_store: Callable[..., Any]) -> None:
    kv, tokens = random_kv(SPEC4, TOKENS), random_tokens(TOKENS)
    async with open_store(SPEC4, tiers=ZSTD) as store:
        await store.snapshot("plain", tokens, kv)
    async with open_store(SPEC4, tiers=FP8) as store:  # the same directory, fp8 turned on
        await store.snapshot("fp8", tokens, kv)
        fork = await store.fork("fp8", "fork")
        rows = {r.session_id: r.lossy for r in await list_sessions(store)}
        lossy, plain = await inspect_session(store, "fp8"), await inspect_session(store, "plain")
    assert rows == {"plain": False, "fp8": True, "fork": True} and fork.lossy
    assert lossy.lossy and lossy.lossy_tiers == ["lmdb"] and not plain.lossy
    assert json.loads(lossy.model_dump_json())["lossy"] is True


async def test_a_store_opened_read_only_reports_lossy_sessions(open_store: Callable[..., Any]) -> None:
    kv, tokens = random_kv(SPEC4, TOKENS), random_tokens(TOKENS)
    async with open_store(SPEC4, tiers=FP8) as store:
        await store.snapshot("agent", tokens, kv)
    store = await StateStore.open(store.config, SPEC4, read_only=True)
    try:
        assert [r.lossy for r in await list_sessions(store)] == [True]
    finally:
        await store.close()


async def test_a_chunk_fp8_cannot_hold_is_stored_lossless_and_resumes_exact(open_store: Callable[..., Any]) -> None:
    """KV with infs and NaNs (arbitrary bit patterns): fp8 stores it as it is, and says so."""
    kv, tokens = random_bits(SPEC4, TOKENS), random_tokens(TOKENS)
    async with open_store(SPEC4, tiers=FP8) as store:
        await store.snapshot("agent", tokens, kv)
    async with open_store(SPEC4, tiers=FP8) as store:
        result = await store.resume("agent")
    assert result.complete and result.exact and bits_equal(result.kv, kv) and result.manifest.lossy
