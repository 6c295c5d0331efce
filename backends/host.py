"""Host (DRAM) tier: encoded chunks in process memory.

It only stores bytes: capacity, eviction order and pins belong to the chunk layer
(`agentstate.chunks.tiers`, `agentstate.chunks.eviction`), which tells the index of every chunk it
drops. A second LRU here would evict behind the index's back.
"""

from __future__ import annotations

import asyncio
import mmap
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from agentstate.backends.base import Backend, BackendStats, InMemory, ReadSink, io_pool

from agentstate.arena import ValueArena
from agentstate.memory import Buffer

if TYPE_CHECKING:
    from agentstate.config import HostTier, StoreConfig


class HostBackend(InMemory, Backend):
    """Encoded chunks in a dict of this process.

    `put` keeps the caller's `bytes`/`bytearray`/`mmap` object itself (values are immutable by contract),
    so storing a freshly encoded chunk copies nothing. Reads copy on a small thread pool so that
    copies of several chunks use several cores. A value it drops goes to its `arena` for reuse by the
    next encode or copy headed here (agentstate.arena): at most `arena_bytes` of free buffers, on top
    of the stored bytes the chunk layer keeps within the tier's capacity.
    """

    name = "host"
    durable = False
    trusted = True

    def __init__(self, *, threads: int = 2, arena_bytes: int = 0) -> None:
        self._items: dict[str, bytes | bytearray | mmap.mmap] = {}
        self._used = 0
        self.arena_bytes = arena_bytes
        self.arena = ValueArena()
        self._pool = io_pool(threads, "agentstate-host")
        self._counts: Counter[str] = Counter()

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def _lookup(self, keys: Sequence[str]) -> list[bytes | bytearray | mmap.mmap | None]:
        found: list[bytes | bytearray | mmap.mmap | None] = []
        for key in keys:
            value = self._items.get(key)
            if value is None:
                self._counts["misses"] += 1
            else:
                self._counts["reads"] += 1
            found.append(value)
        return found

    async def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        written = []
        for value, buf in zip(self._lookup(keys), buffers, strict=True):
            if value is None or len(value) > len(buf):
                written.append(0)
                continue
            buf[: len(value)] = value
            written.append(len(value))
        return written

    async def read(self, keys: Sequence[str], sink: ReadSink) -> list[bool]:
        values = self._lookup(keys)

        def run() -> None:
            for i, value in enumerate(values):
                if value is not None:
                    sink(i, memoryview(value))

        # The values are referenced here, so an eviction during the copy cannot free them.
        await asyncio.get_running_loop().run_in_executor(self._pool, run)
        return [v is not None for v in values]

    async def put(self, keys: Sequence[str], values: Sequence[bytes | bytearray | memoryview]) -> None:
        for key, value in zip(keys, values, strict=True):
            if key in self._items:
                continue
            owned = value if isinstance(value, (bytes, bytearray, mmap.mmap)) else bytes(value)
            self._items[key] = owned
            self._used += len(owned)
            self._counts["writes"] += 1

    def peek(self, key: str) -> bytes | bytearray | mmap.mmap | None:
        return self._items.get(key)  # one dict lookup: atomic under the GIL, from any thread

    def value_buffer(self, nbytes: int) -> Buffer:
        return self.arena.take(nbytes)

    def prefault(self, nbytes: int, count: int) -> None:
        self.arena.grow(nbytes, count, self.arena_bytes)

    def _dropped(self, value: bytes | bytearray | mmap.mmap) -> None:
        self.arena.give(value, self.arena_bytes)  # kept only if nothing else references it

    async def stats(self) -> BackendStats:
        arena = self.arena.stats()
        return BackendStats(
            name=self.name, items=len(self._items), bytes_used=self._used, capacity_bytes=None,
            arena_free_bytes=arena.free_bytes, arena_reused=arena.reused, arena_fresh=arena.fresh,
            **{k: self._counts[k] for k in ("reads", "writes", "deletes", "misses", "errors")},
        )  # fmt: skip

    async def close(self) -> None:
        self._items.clear()
        self._used = 0
        self.arena.clear()
        self._pool.shutdown(wait=True)


def from_config(cfg: HostTier, store: StoreConfig) -> HostBackend:
    """The host tier of a store (its capacity is the chunk layer's: `HostTier.capacity_managed`)."""
    return HostBackend(arena_bytes=min(store.host_arena_bytes, cfg.capacity_bytes or 0))
