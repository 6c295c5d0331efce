"""One owner of eviction (issue 26): the chunk layer's policy decides what leaves a cache tier, by
config (`eviction`), with holds and pins on top; backends only store bytes."""

from __future__ import annotations

import asyncio
import math
import os
import random
from pathlib import Path

import pytest
import torch

from agentstate import codec
from agentstate.backends.file import FileBackend
from agentstate.backends.host import HostBackend
from agentstate.chunks.eviction import POLICIES, EvictionPolicy, make_policy
from agentstate.chunks.index import ChunkIndex
from agentstate.chunks.tiers import Tier, TierManager
from agentstate.config import TierConfig
from agentstate.errors import InvalidArgumentError
from tests.conftest import SPEC4, random_kv, random_tokens

CHUNK = 64
CHUNK_BYTES = codec.encoded_size(CHUNK * SPEC4.token_bytes)
MRU = '''
"""A policy outside the repository: most recently used goes first."""
from agentstate.chunks.eviction.lru import LRU


class MRU(LRU):
    def order(self):
        return reversed(list(self.sizes))
'''


def manager(tmp_path: Path, policy: str = "lru", capacity: int = 3000, cache: str = "host") -> TierManager:
    """A cache tier of `capacity` bytes over a durable file tier, write-back."""
    top = HostBackend() if cache == "host" else FileBackend(tmp_path / "cache", sync=False)
    record = FileBackend(tmp_path / "record", sync=False)
    record.name = "record"
    tiers = [Tier(top, capacity=capacity, policy=make_policy(policy)), Tier(record)]
    return TierManager(tiers, ChunkIndex(), record="record", policy="write_back")


@pytest.mark.parametrize(("policy", "victim"), [("lru", "b"), ("fifo", "a")])
async def test_the_policy_picks_the_victim_and_the_index_and_backend_agree(
    tmp_path: Path, policy: str, victim: str
) -> None:
    mgr = manager(tmp_path, policy)
    host = mgr.tiers[0]
    for key in "abc":
        await mgr.store([key], [key.encode() * 1000], durable=False)
    await mgr.hit(host, ["a"], {})  # a hit: LRU moves "a" back, FIFO does not
    await mgr.store(["d"], [b"d" * 1000], durable=False)
    kept = [k for k in "abcd" if k != victim]
    assert list(host.sizes) == [k for k in list(host.policy.order()) if k in kept] and set(host.sizes) == set(kept)
    assert await host.backend.exists(list("abcd")) == [k != victim for k in "abcd"]  # the backend was told
    assert mgr.index.tiers_of(victim) == {"record"}  # written down first: never the only copy lost
    assert host.used == 3000 == (await host.backend.stats()).bytes_used
    for t in mgr.tiers:
        await t.backend.close()


async def test_pinned_chunks_stay_and_what_does_not_fit_goes_down(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    host = mgr.tiers[0]
    await mgr.store(list("abc"), [k.encode() * 1000 for k in "abc"], durable=False)
    mgr.index.pin(list("abc"))
    await mgr.store(["d"], [b"d" * 1000], durable=False)
    assert set(host.sizes) == set("abc") and mgr.index.tiers_of("d") == {"record"}
    mgr.index.unpin(["b"])
    await mgr.store(["e"], [b"e" * 1000], durable=False)
    assert set(host.sizes) == {"a", "c", "e"} and await host.backend.exists(["b"]) == [False]
    for t in mgr.tiers:
        await t.backend.close()


async def test_a_file_cache_tier_never_passes_its_capacity_on_disk(tmp_path: Path) -> None:
    """The file tier's capacity is the chunk layer's: 100 concurrent puts, the disk sampled meanwhile."""
    mgr = manager(tmp_path, capacity=50_000, cache="file")
    root, peak, stop = tmp_path / "cache", 0, asyncio.Event()

    def disk() -> int:
        total = 0
        for d, _, names in os.walk(root):
            for n in names:
                try:
                    total += os.stat(os.path.join(d, n)).st_size
                except FileNotFoundError:
                    continue
        return total

    async def sampler() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, disk())
            await asyncio.sleep(0)

    watch = asyncio.create_task(sampler())
    await asyncio.gather(*(mgr.store([f"c/{i}"], [os.urandom(4000)], durable=False) for i in range(100)))
    stop.set()
    await watch
    cache = mgr.tiers[0]
    assert peak <= 50_000 and cache.used == disk() == (await cache.backend.stats()).bytes_used <= 50_000
    assert all(mgr.index.holds(f"c/{i}", "record") or mgr.index.holds(f"c/{i}", "file") for i in range(100))
    for t in mgr.tiers:
        await t.backend.close()


@pytest.mark.parametrize(("eviction", "evicted"), [("lru", 1), ("fifo", 0), ("my_policy:MRU", 0)])
async def test_the_policy_is_chosen_by_config(
    open_store, tmp_path: Path, monkeypatch, eviction: str, evicted: int
) -> None:  # type: ignore[no-untyped-def]
    """Three prefixes fill a 3-chunk host tier, the first is loaded, a fourth comes: LRU evicts the
    second, FIFO the first, and an out-of-tree MRU (one file, named "module:Class") the one just loaded."""
    (tmp_path / "my_policy.py").write_text(MRU)
    monkeypatch.syspath_prepend(str(tmp_path))
    tiers = [TierConfig(kind="host", capacity_bytes=3 * CHUNK_BYTES), TierConfig(kind="lmdb")]
    prefixes = [(random_tokens(CHUNK, seed=s), random_kv(SPEC4, CHUNK, seed=s)) for s in range(4)]
    async with open_store(tiers=tiers, eviction=eviction) as store:
        for tokens, kv in prefixes[:3]:
            await store.put_prefix(tokens, kv)
        assert await store.load(prefixes[0][0], torch.zeros_like(prefixes[0][1])) == CHUNK
        await store.put_prefix(*prefixes[3])
        where = [(await store.match(tokens)).tiers for tokens, _ in prefixes]
    assert where == [["lmdb"] if i == evicted else ["host"] for i in range(4)]


def test_unknown_policies_are_refused(open_store) -> None:  # type: ignore[no-untyped-def]
    for name in ("lfu-but-misspelled", "no_such_module:Policy", "agentstate.errors:AgentStateError"):
        with pytest.raises(InvalidArgumentError, match="eviction policy"):
            open_store(eviction=name)


def test_every_registered_policy_loads() -> None:
    for name in POLICIES:
        policy = make_policy(name)
        assert isinstance(policy, EvictionPolicy) and policy.name == name and len(policy) == 0


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", range(4))
async def test_a_new_chunk_never_displaces_one_held_for_an_earlier_return(
    tmp_path: Path, policy: str, seed: int
) -> None:
    """Random puts (batches of 1 to 7 chunks: an engine's saves grouped under load) and holds on an
    8-chunk cache tier. After every put: a held chunk that left the tier left only for chunks that
    stayed and are held for an earlier return (an unheld newcomer takes unheld room only), the tier
    is within capacity, and every chunk ever stored reads back bit-exact from its fastest tier."""
    rng = random.Random(seed)
    mgr = manager(tmp_path, policy, capacity=8 * 1000)
    host = mgr.tiers[0]
    values: dict[str, bytes] = {}
    for step in range(120):
        if rng.random() < 0.3:  # a hint: some stored and some future chunks, back in 1 s .. never
            keys = rng.sample(sorted(values), min(len(values), rng.randint(1, 3))) + [
                f"k{len(values) + rng.randint(0, 4)}"
            ]
            mgr.holds.set(f"h{rng.randint(0, 5)}", "t", keys, for_s=1e6, back_in_s=rng.choice([1, 5, 30, math.inf]))
        batch = [f"k{len(values) + i}" for i in range(rng.randint(1, 7))]
        for key in batch:
            values[key] = os.urandom(1000)
        before = dict(mgr.holds.plan(host.sizes, host.capacity))
        resident = set(host.sizes)
        await mgr.store(batch, [values[k] for k in batch], durable=False)
        after = dict(mgr.holds.plan(host.sizes, host.capacity))
        entered = set(host.sizes) - resident
        for gone in resident - set(host.sizes):
            if gone in before:
                assert entered and all(after.get(k, math.inf) < before[gone] for k in entered), (step, gone)
        assert host.used == sum(host.sizes.values()) <= 8 * 1000
    for key, value in values.items():
        (fastest,) = mgr.holders(key)[:1]
        assert await mgr.read_bytes(fastest, key) == value
    for t in mgr.tiers:
        await t.backend.close()
