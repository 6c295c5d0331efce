"""Host (DRAM) tier: encoded chunks in process memory, byte capacity, LRU eviction, pin counts."""

from __future__ import annotations

import asyncio
import mmap
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

from agentstate.backends.base import Backend, BackendStats, InMemory, Pinnable, ReadSink, io_pool

from agentstate.errors import CapacityError, InvalidArgumentError

EvictCallback = Callable[[list[str]], None]


class HostBackend(InMemory, Pinnable, Backend):
    """An LRU byte cache of encoded chunks.

    `put` keeps the caller's `bytes`/`bytearray`/`mmap` object itself (values are immutable by contract),
    so storing a freshly encoded chunk copies nothing. Pinned keys are never evicted; when only
    pinned keys are left and a value does not fit, `put` raises CapacityError for it.
    Reads copy on a small thread pool so that copies of several chunks use several cores.
    """

    name = "host"
    durable = False
    trusted = True

    def __init__(self, capacity_bytes: int, *, on_evict: EvictCallback | None = None, threads: int = 2) -> None:
        if capacity_bytes < 0:
            raise InvalidArgumentError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.on_evict = on_evict
        self._items: OrderedDict[str, bytes | bytearray | mmap.mmap] = OrderedDict()
        self._pins: Counter[str] = Counter()
        self._used = 0
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
                self._items.move_to_end(key)
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
        evicted: list[str] = []
        try:
            for key, value in zip(keys, values, strict=True):
                if key in self._items:
                    self._items.move_to_end(key)
                    continue
                owned = value if isinstance(value, (bytes, bytearray, mmap.mmap)) else bytes(value)
                evicted += self._make_room(len(owned))
                self._items[key] = owned
                self._used += len(owned)
                self._counts["writes"] += 1
        finally:
            if evicted and self.on_evict is not None:
                self.on_evict(evicted)

    def _make_room(self, size: int) -> list[str]:
        if size > self.capacity_bytes:
            raise CapacityError(f"value of {size} bytes exceeds host capacity {self.capacity_bytes}")
        evicted: list[str] = []
        victims = iter(list(self._items))
        while self._used + size > self.capacity_bytes:
            victim = next((k for k in victims if k not in self._pins), None)
            if victim is None:
                raise CapacityError(f"host tier full: {self._used} of {self.capacity_bytes} bytes are pinned")
            self._used -= len(self._items.pop(victim))
            evicted.append(victim)
            self._counts["evictions"] += 1
        return evicted

    async def stats(self) -> BackendStats:
        return BackendStats(
            name=self.name, items=len(self._items), bytes_used=self._used, capacity_bytes=self.capacity_bytes,
            **{k: self._counts[k] for k in ("reads", "writes", "deletes", "misses", "errors", "evictions")},
        )  # fmt: skip

    async def close(self) -> None:
        self._items.clear()
        self._used = 0
        self._pool.shutdown(wait=True)
