"""Remote outage: Redis Cluster nodes stopped and restarted while loads run against them.

Four loaders restore prefixes from the cluster the whole time. Two nodes in turn are killed and
restarted (append-only file on, so a node comes back with its data, as a production node would).
Every load must return a bit-exact prefix of the truth (past it, a chunk is exact or untouched), never
raise; once every node is back, loads are complete again.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch

from agentstate import StateStore
from agentstate.config import TierConfig
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.redis_server import RedisCluster

PREFIXES = 12
GUARD_S = 60.0  # longest wait for the cluster to do something: a hang guard, not a speed
TOKENS = 8 * 64


async def test_nodes_stopped_and_restarted_during_loads(tmp_path: Path) -> None:
    cluster = RedisCluster(tmp_path / "cluster", extra=["--appendonly", "yes", "--appendfsync", "always"]).start()
    tiers = [
        TierConfig(kind="lmdb"),
        TierConfig(kind="redis", url=cluster.url, cluster=True, timeout_s=0.5, breaker_cooldown_s=0.5),
    ]
    data = [(random_tokens(TOKENS, seed=s), random_kv(SPEC4, TOKENS, seed=s)) for s in range(PREFIXES)]
    try:
        async with StateStore.open(tmp_path / "writer", SPEC4, tiers=tiers, chunk_tokens=64) as writer:
            for tokens, kv in data:
                await writer.put_prefix(tokens, kv)
        reader_cfg = {"tiers": tiers, "chunk_tokens": 64, "promote_on_read": False}  # every load asks Redis
        async with StateStore.open(tmp_path / "reader", SPEC4, **reader_cfg) as reader:
            stop = asyncio.Event()
            loads: list[int] = []

            async def loader(worker: int) -> None:
                i = worker
                while not stop.is_set():
                    tokens, kv = data[i % PREFIXES]
                    into = torch.zeros_like(kv)
                    n = await reader.load(tokens, into)  # a failure here fails the test: it must not raise
                    assert n % 64 == 0 and bits_equal(into[:, :, :n], kv[:, :, :n]), "wrong bytes"
                    for c in range(n, TOKENS, 64):  # past the prefix: chunks that arrived anyway, or nothing
                        got = into[:, :, c : c + 64]
                        assert bits_equal(got, kv[:, :, c : c + 64]) or not got.view(torch.uint8).any(), "wrong bytes"
                    loads.append(n)
                    i += 4
                    await asyncio.sleep(0)

            workers = [asyncio.create_task(loader(w)) for w in range(4)]
            for node in (cluster.nodes[1], cluster.nodes[2]):
                await asyncio.sleep(0.8)
                node.stop()
                # down for 1.5 s, and at least until a load has come back short: on a loaded machine
                # 1.5 s may pass before any load has met the dead node
                seen, down_until = len(loads), time.monotonic() + 1.5
                while time.monotonic() < down_until or all(n == TOKENS for n in loads[seen:]):
                    assert time.monotonic() < down_until + GUARD_S, "no load met the stopped node"
                    await asyncio.sleep(0.1)
                node.start()  # same port, same nodes.conf and AOF: it rejoins with its slots and data
            stop.set()
            await asyncio.gather(*workers)
            remote = reader.chunks.backend("redis")
            assert min(loads) < TOKENS, "no load saw the outage"
            assert (await remote.stats()).errors >= 1

            deadline = time.monotonic() + GUARD_S
            while True:  # the cluster re-forms; the client refreshes its slot map
                done = [await reader.load(t, torch.zeros_like(kv)) for t, kv in data]
                if all(n == TOKENS for n in done) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            assert done == [TOKENS] * PREFIXES, f"not every prefix came back: {done}"
    finally:
        cluster.stop()
