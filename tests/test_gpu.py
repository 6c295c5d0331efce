"""CUDA paths of KV targets and the device tier. Marked gpu: skipped on machines without one."""

from __future__ import annotations

import pytest
import torch

from agentstate.config import TierConfig
from agentstate.target import PagedTarget
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens

pytestmark = pytest.mark.gpu


async def test_resume_into_a_cuda_tensor(open_store) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = random_tokens(300), random_kv(SPEC4, 300)
    async with open_store() as store:
        await store.snapshot("s", tokens, kv)
        into = torch.zeros(kv.shape, dtype=kv.dtype, device="cuda")
        r = await store.resume("s", into=into)
        assert r.complete and bits_equal(r.kv.cpu(), kv)  # type: ignore[union-attr]


async def test_load_into_a_cuda_paged_pool_through_a_cuda_device_tier(open_store) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = random_tokens(512), random_kv(SPEC4, 512)
    layout = [TierConfig(kind="device", device="cuda", capacity_bytes=64 << 20), TierConfig(kind="host", capacity_bytes=64 << 20), TierConfig(kind="lmdb")]
    async with open_store(tiers=layout) as store:
        await store.put_prefix(tokens, kv)
        pool = torch.zeros((4, 2, 4096, 2, 64), dtype=torch.bfloat16, device="cuda")
        target = PagedTarget(pool, torch.randperm(4096)[:512], SPEC4)
        for _ in range(2):  # cold (host) then warm (device tier)
            assert await store.load(tokens, target) == 512
            assert bits_equal(target.gather().cpu(), kv)
        assert (await store.match(tokens)).tiers == ["device"] * 8
