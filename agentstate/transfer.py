"""Moving chunks between tiers and tensors: batched, bounded in flight, copied once.

Reads go to the fastest tier the index says holds each chunk; each value is checked (the codec)
and copied straight from the backend's memory into its destination slice. A chunk that is
missing or fails its checks on one tier is retried on the next; a corrupt copy is deleted so a
later store rewrites it. Writes encode on a thread pool and put each batch to every target tier.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from agentstate import codec
from agentstate.backends.base import Backend
from agentstate.errors import AgentStateError, CapacityError
from agentstate.index import ChunkIndex
from agentstate.memory import copy_bytes, host_buffer

log = logging.getLogger("agentstate.transfer")
T = TypeVar("T")


async def bounded_gather(factories: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    """Run coroutine factories with at most `limit` in flight; results in order."""
    gate = asyncio.Semaphore(limit)

    async def one(factory: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await factory()

    return await asyncio.gather(*(one(f) for f in factories))


def batches(sizes: Sequence[int], target_bytes: int) -> list[list[int]]:
    """Split indices into consecutive runs of about `target_bytes` (at least one item each)."""
    out: list[list[int]] = []
    run: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if run and total + size > target_bytes:
            out.append(run)
            run, total = [], 0
        run.append(i)
        total += size
    if run:
        out.append(run)
    return out


class Transfer:
    def __init__(
        self,
        *,
        fingerprint: str,
        tiers: Sequence[Backend],
        index: ChunkIndex,
        pool: ThreadPoolExecutor,
        io_depth: int,
        batch_bytes: int,
        promote_to: Backend | None,
    ) -> None:
        self.fingerprint = fingerprint
        self.tiers = list(tiers)
        self.index = index
        self.pool = pool
        self.io_depth = io_depth
        self.batch_bytes = batch_bytes
        self.promote_to = promote_to
        self.counts: Counter[str] = Counter()

    # -- reads ---------------------------------------------------------------------------------

    async def read_into(self, keys: Sequence[str], dests: Sequence[torch.Tensor]) -> list[bool]:
        """Fill `dests[i]` with chunk `keys[i]`; which ones arrived intact."""
        ok = [False] * len(keys)
        pending = list(range(len(keys)))
        for tier in self.tiers:
            todo = [i for i in pending if self.index.holds(keys[i], tier.name)]
            if todo:
                for i, good in zip(todo, await self._read_tier(tier, [keys[i] for i in todo], [dests[i] for i in todo])):
                    ok[i] = good
                pending = [i for i in pending if not ok[i]]
        self.counts.update(chunks_read=sum(ok), chunk_misses=len(keys) - sum(ok))
        return ok

    async def _read_tier(self, tier: Backend, keys: list[str], dests: list[torch.Tensor]) -> list[bool]:
        status: list[str] = ["missing"] * len(keys)
        promote: dict[int, bytearray | mmap.mmap] = {}
        do_promote = self.promote_to is not None and tier is not self.promote_to
        verify = not tier.trusted

        def reader(run: list[int]) -> Callable[[], Awaitable[list[bool]]]:
            def sink(j: int, view: memoryview) -> None:
                i = run[j]
                try:
                    codec.decode_into(view, dests[i], fingerprint=self.fingerprint, verify=verify)
                except AgentStateError as exc:
                    status[i] = f"corrupt: {exc}"
                    return
                status[i] = "ok"
                if do_promote:
                    promote[i] = copy_bytes(view)

            return lambda: tier.read([keys[i] for i in run], sink)

        sizes = [d.numel() * d.element_size() for d in dests]
        await bounded_gather([reader(run) for run in batches(sizes, self.batch_bytes)], self.io_depth)

        missing = [keys[i] for i, s in enumerate(status) if s == "missing"]
        corrupt = [keys[i] for i, s in enumerate(status) if s.startswith("corrupt")]
        for i, s in enumerate(status):
            if s.startswith("corrupt"):
                log.warning("tier %s: chunk %s is %s; treating it as a miss and dropping it", tier.name, keys[i], s)
        if corrupt:
            self.counts["corrupt"] += len(corrupt)
            await tier.delete(corrupt)
        self.index.discard(missing + corrupt, tier.name)
        self.index.touch(keys[i] for i, s in enumerate(status) if s == "ok")
        if promote and self.promote_to is not None:
            order = sorted(promote)
            await self.put_tier(self.promote_to, [keys[i] for i in order], [promote[i] for i in order])
        return [s == "ok" for s in status]

    # -- writes --------------------------------------------------------------------------------

    async def write(self, keys: Sequence[str], chunks: Sequence[torch.Tensor], tiers: Sequence[Backend]) -> int:
        """Encode `chunks` and put them to every tier in `tiers`; returns encoded bytes written."""
        sizes = [codec.encoded_size(c.numel() * c.element_size()) for c in chunks]
        loop = asyncio.get_running_loop()

        def writer(run: list[int]) -> Callable[[], Awaitable[None]]:
            async def go() -> None:
                values = await loop.run_in_executor(
                    self.pool,
                    lambda: [codec.encode(chunks[i], self.fingerprint, host_buffer(sizes[i])) for i in run],
                )
                run_keys = [keys[i] for i in run]
                await asyncio.gather(*(self.put_tier(tier, run_keys, values) for tier in tiers))

            return go

        await bounded_gather([writer(run) for run in batches(sizes, self.batch_bytes)], 2)
        self.counts["bytes_written"] += sum(sizes)
        return sum(sizes)

    async def put_tier(self, tier: Backend, keys: list[str], values: Sequence[bytes | bytearray | mmap.mmap]) -> None:
        """Put to one tier. A full non-durable tier is a cache miss later, not a failed store."""
        try:
            await tier.put(keys, values)
        except CapacityError as exc:
            if tier.durable:
                raise
            self.counts["cache_full"] += 1
            log.debug("tier %s full, not caching all of %d chunks: %s", tier.name, len(keys), exc)
        if not tier.durable:  # a cache may have evicted some of them again to fit the rest
            keys = [k for k, s in zip(keys, await tier.exists(keys)) if s]
        self.index.add(keys, tier.name)
