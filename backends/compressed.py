"""A tier that compresses: wraps any Backend, compressing on put and decompressing on read.

Compression is opt-in per tier (`TierConfig.compression`, see `agentstate.compress`) and applies at
that tier's boundary only: the tiers above and below, the chunk layer and the codec see the same
encoded chunks as before. What the inner backend stores, counts and reports (`sizes`, `stats`)
is the compressed frame, so a tier's capacity is spent in compressed bytes.

Compression and decompression run on this wrapper's own thread pool (zstd, lz4 and numpy release
the GIL), never on the event loop: a remote tier's reads arrive on the loop, and decoding a chunk
there would stall every other request. A frame that fails a check is logged, counted as an error
and reported as a miss, so the chunk layer drops it and the engine recomputes it; its sink is not
called, so no damaged or partly decoded bytes reach a restore, a promotion or a demotion.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from agentstate import compress
from agentstate.backends.base import Backend, BackendStats, Breaker, ReadSink
from agentstate.errors import AgentStateError, InvalidArgumentError

log = logging.getLogger("agentstate.backends.compressed")
T = TypeVar("T")
Value = bytes | bytearray | memoryview
UNBOUNDED = compress.MAX_VALUE_BYTES
"""The bound of a frame's declared value when the caller names none (plain `read`)."""


async def _settle(jobs: dict[int, Future[T]]) -> dict[int, T]:
    """Every decode job's result, waited for even when the inner read failed, so that no sink runs
    after `read` returned or raised."""
    return {i: await asyncio.wrap_future(job) for i, job in jobs.items()}


class CompressedBackend(Backend):
    """`inner` with every value stored as a compressed frame made by `method`."""

    compresses = True
    """The tier manager calls `compress` before it reserves room, so capacity counts stored bytes."""

    def __init__(self, inner: Backend, method: str, *, threads: int = 4) -> None:
        if method == "none":
            raise InvalidArgumentError("a CompressedBackend needs a compression method, not 'none'")
        compress.require(method)
        self.inner = inner
        self.method = method
        self.durable, self.trusted, self.remote = inner.durable, inner.trusted, inner.remote
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="agentstate-compress")
        self._counts: Counter[str] = Counter()  # corrupt, logical_in, stored_out

    @property  # type: ignore[override]
    def name(self) -> str:
        return self.inner.name

    @name.setter
    def name(self, value: str) -> None:
        self.inner.name = value

    def __getattr__(self, attr: str) -> Any:
        """Anything else (a path, an LMDB env) is the inner backend's: operator tools inspect it."""
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    # -- writes --------------------------------------------------------------------------------

    async def compress(self, keys: Sequence[str], values: Sequence[Value]) -> list[Value]:
        """What `put` stores for each value: a frame, or the value itself where a frame would not be
        smaller. The tier manager calls this first, to reserve capacity in stored bytes."""
        if len(keys) != len(values):
            raise InvalidArgumentError("keys and values differ in length")
        loop = asyncio.get_running_loop()
        todo = [i for i, v in enumerate(values) if not compress.is_frame(memoryview(v))]
        done = await asyncio.gather(
            *(loop.run_in_executor(self._pool, compress.compress, values[i], keys[i], self.method) for i in todo)
        )
        framed = list(values)
        for i, frame in zip(todo, done):
            framed[i] = frame
        self._counts.update(logical_in=sum(len(values[i]) for i in todo), stored_out=sum(len(f) for f in done))
        return framed

    async def put(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Compress and store; values already framed by `compress` are stored as they are."""
        await self.inner.put(keys, await self.compress(keys, values))

    # -- reads ---------------------------------------------------------------------------------

    def _decode(
        self, key: str, frame: bytes, out: memoryview | None, limit: int = UNBOUNDED
    ) -> memoryview | None:
        try:
            return compress.decompress(frame, key, out, limit=limit)
        except Exception as exc:  # CorruptDataError, or a decoder's own error on bytes it cannot take
            self._counts["corrupt"] += 1
            log.warning("tier %s: compressed value of %s is unusable (%s); treating it as a miss", self.name, key, exc)
            return None

    @staticmethod
    def _owned(view: memoryview) -> bytes:
        """The frame kept past the sink call: an immutable bytes object as it is, anything else copied
        (the inner backend may reuse or unmap its memory once the sink returns)."""
        obj = view.obj
        return obj if isinstance(obj, bytes) and len(obj) == view.nbytes else bytes(view)

    async def read(self, keys: Sequence[str], sink: ReadSink) -> list[bool]:
        return await self._read(keys, sink, None)

    async def read_bounded(self, keys: Sequence[str], sink: ReadSink, limits: Sequence[int]) -> list[bool]:
        """`read`, where no key's value is longer than `limits[i]`: the inner tier is asked under the
        same bound (a stored frame is never longer than its value: `compress` keeps the value itself
        when a frame would not be smaller), and a frame declaring a longer value is refused before its
        decoder runs, so a forged frame costs at most the chunk's own size per decode in flight."""
        if len(limits) != len(keys):
            raise InvalidArgumentError("keys and limits differ in length")
        return await self._read(keys, sink, limits)

    async def _read(self, keys: Sequence[str], sink: ReadSink, limits: Sequence[int] | None) -> list[bool]:
        jobs: dict[int, Future[bool]] = {}

        def deliver(i: int, frame: bytes) -> bool:
            out = self._decode(keys[i], frame, None, UNBOUNDED if limits is None else limits[i])
            # A frame that does not decode is handed on as it is: no chunk check passes it (its magic
            # is not a chunk's), so the layer above sees damage, counts it, drops the copy, and
            # verify reports it as corrupt instead of missing.
            sink(i, memoryview(frame) if out is None else out)
            return True

        def inner_sink(i: int, view: memoryview) -> None:
            if compress.is_frame(view):
                jobs[i] = self._pool.submit(deliver, i, self._owned(view))
            else:  # stored before compression was on, or did not shrink: a plain chunk the codec checks
                sink(i, view)

        try:
            if limits is None:
                found = await self.inner.read(keys, inner_sink)
            else:
                found = await self.inner.read_bounded(keys, inner_sink, limits)
        finally:
            done = await _settle(jobs)
        return [hit and done.get(i, True) for i, hit in enumerate(found)]

    async def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        if len(keys) != len(buffers):
            raise InvalidArgumentError("keys and buffers differ in length")
        written = [0] * len(keys)
        jobs: dict[int, Future[int]] = {}

        def land(i: int, frame: bytes) -> int:
            dest = memoryview(buffers[i]).cast("B")
            try:
                fits = compress.original_length(frame) <= len(dest)
            except AgentStateError:
                fits = True  # let _decode count and log it
            if not fits:
                return 0
            out = self._decode(keys[i], frame, dest)
            return 0 if out is None else len(out)

        def inner_sink(i: int, view: memoryview) -> None:
            if compress.is_frame(view):
                jobs[i] = self._pool.submit(land, i, self._owned(view))
            elif len(view) <= len(buffers[i]):
                buffers[i][: len(view)] = view
                written[i] = len(view)

        try:
            await self.inner.read(keys, inner_sink)
        finally:
            landed = await _settle(jobs)
        for i, n in landed.items():
            written[i] = n
        return written

    # -- the rest is the inner backend's ---------------------------------------------------------

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self.inner.exists(keys)

    async def delete(self, keys: Sequence[str]) -> None:
        await self.inner.delete(keys)

    def keys(self, prefix: str | None = None) -> AsyncIterator[str]:
        return self.inner.keys(prefix)

    async def sizes(self, keys: Sequence[str]) -> list[int]:
        """Stored (compressed) sizes: what capacity accounting counts."""
        return await self.inner.sizes(keys)

    async def touch(self, keys: Sequence[str]) -> list[bool]:
        return await self.inner.touch(keys)

    async def delete_idle(self, keys: Sequence[str], idle_seconds: float) -> list[str]:
        return await self.inner.delete_idle(keys, idle_seconds)

    async def reclaim(self) -> None:
        await self.inner.reclaim()

    async def stats(self) -> BackendStats:
        """The inner tier's stats (bytes in compressed bytes), plus frames that failed a check as errors."""
        stats = await self.inner.stats()
        return stats.model_copy(update={"errors": stats.errors + self._counts["corrupt"]})

    # -- the inner tier's capabilities (declared on Backend, so not reached through __getattr__) --

    @property  # type: ignore[override]
    def ttl_seconds(self) -> int | None:
        return self.inner.ttl_seconds

    @property
    def location(self) -> str | os.PathLike[str] | None:
        return self.inner.location

    @property
    def limit_bytes(self) -> int | None:
        return self.inner.limit_bytes

    def breakers(self) -> dict[str, Breaker]:
        return self.inner.breakers()

    def counters(self) -> dict[str, int] | None:
        return self.inner.counters()

    async def server_memory(self) -> dict[str, tuple[int, int]]:
        return await self.inner.server_memory()

    def ratio(self) -> float:
        """Logical bytes put per stored byte, over this process's puts (1.0 before any)."""
        return self._counts["logical_in"] / self._counts["stored_out"] if self._counts["stored_out"] else 1.0

    async def close(self) -> None:
        try:
            await self.inner.close()
        finally:
            self._pool.shutdown(wait=True)
