"""The Backend protocol: what every storage tier implements (see DESIGN.md, Backend protocol)."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import sys
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel

if TYPE_CHECKING:
    from agentstate.memory import Buffer

log = logging.getLogger(__name__)
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT}


def disk_full(path: str | os.PathLike[str], exc: BaseException, need: int = 0) -> bool:
    """Whether a failed write means the filesystem under `path` ran out of room.

    ENOSPC and EDQUOT say so. LMDB turns a short page write into EIO, so an EIO counts too when
    the filesystem has less than `need` bytes (plus 1 MiB of slack) left: a real disk fault on a
    disk with room stays an I/O error.
    """
    code = getattr(exc, "errno", None)
    text = str(exc)
    if code in _NO_ROOM or os.strerror(errno.ENOSPC) in text or os.strerror(errno.EDQUOT) in text:
        return True
    if code != errno.EIO and os.strerror(errno.EIO) not in text:
        return False
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < need + (1 << 20)


def io_pool(threads: int, name: str) -> ThreadPoolExecutor:
    """A pool for blocking IO and for the copies that sinks run on it, whose workers run torch on
    one intra-op thread each. The pool is the parallelism: N workers each fanning a copy out over
    torch's default threads oversubscribe the cores, and OpenMP's spinning workers then take the
    core another worker (or a local redis-server) needs. OpenMP's thread count is per calling
    thread, so the engine's own threads keep theirs."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name, initializer=_one_torch_thread)


def _one_torch_thread() -> None:
    """Never raises: a pool whose initializer failed refuses every later task (BrokenThreadPool),
    so a tuning knob would otherwise take the tier's IO down with it."""
    if "torch" not in sys.modules:  # imported by whoever copies tensors here; never imported for it
        return
    try:
        # Another thread may be halfway through importing torch (codecs import it on first use, while
        # the pool's first task starts this worker): sys.modules already holds the half-built module,
        # without set_num_threads yet. The import statement waits on that import's lock; a lookup in
        # sys.modules does not.
        import torch

        torch.set_num_threads(1)
    except Exception:  # noqa: BLE001 - see the docstring
        log.warning("io pool worker keeps torch's default thread count", exc_info=True)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries durable (a file created or renamed in it)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Breaker(Protocol):
    """A circuit breaker as operators see it (backends.redis.CircuitBreaker)."""

    @property
    def state(self) -> str: ...

    trips: int


ReadSink = Callable[[int, memoryview], None]
"""Called as `sink(i, view)` with the stored bytes of `keys[i]`. The view is valid only during the
call: the backend may reuse or unmap the memory right after, so a sink copies what it keeps."""


class BackendStats(BaseModel):
    name: str
    items: int
    bytes_used: int
    capacity_bytes: int | None
    reads: int = 0
    writes: int = 0
    deletes: int = 0
    misses: int = 0
    errors: int = 0
    evictions: int = 0
    arena_free_bytes: int = 0
    """host tier: touched buffers of dropped values kept for reuse (agentstate.arena)"""
    arena_reused: int = 0
    arena_fresh: int = 0


class InMemory:
    """The parts of a tier that keeps values in a dict of this process: lookups, deletes, listing.

    Subclasses set `_items`, `_used` and `_counts`, and say what a value weighs in `_size`.
    """

    _items: dict[str, Any]
    _used: int
    _counts: Counter[str]

    @staticmethod
    def _size(value: Any) -> int:
        return len(value)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return [key in self._items for key in keys]

    async def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            if key in self._items:
                self._used -= self._size(self._items[key])
                self._counts["deletes"] += 1
                self._dropped(self._items.pop(key))  # no name for it here: `_dropped` may hold the last one

    def _dropped(self, value: Any) -> None:
        """A value just left the tier, `value` its last name here (the host tier hands its buffer to its
        arena, which reuses it only if nothing else references it); default nothing."""

    async def keys(self, prefix: str | None = None) -> AsyncIterator[str]:
        for key in list(self._items):
            if prefix is None or key.startswith(prefix):
                yield key

    async def sizes(self, keys: Sequence[str]) -> list[int]:
        return [self._size(self._items[k]) if k in self._items else 0 for k in keys]


class Backend(ABC):
    """One storage tier. Async; blocking work runs off the event loop inside the backend.

    Keys are opaque strings (chunk keys `c/...`, tail keys `t/...`). Values are immutable once
    written: `put` of an existing key may keep either copy, since equal keys mean equal content.
    """

    name: str = "backend"
    durable: bool = False
    """True when a completed `put` survives a process crash (the tier sessions commit to)."""
    trusted: bool = False
    """True when stored bytes never left this process's memory, so reads may skip the checksum."""
    remote: bool = False
    """True for a store shared with other hosts: never scanned on open; asked with batched `exists`."""
    compresses: bool = False
    """True when `put` stores other bytes than it is given (`compress` says which): the chunk layer
    then spends a tier's capacity in stored bytes."""
    ttl_seconds: int | None = None
    """How long the tier keeps a value nobody asks for again (a Redis tier's expiry); None: until deleted."""

    # -- capabilities the chunk layer and the operator tools read; the defaults fit a local tier --

    def value_buffer(self, nbytes: int) -> Buffer | None:
        """A touched buffer of `nbytes` this tier recycles for values headed its way (the host tier's
        arena), or None: the caller allocates. Contents are stale: the caller overwrites every byte."""
        return None

    def peek(self, key: str) -> bytes | bytearray | memoryview | mmap.mmap | None:
        """From any thread, without the event loop: the value object an in-process memory tier holds
        for `key`, or None (every other tier: read it with `read`). Values are immutable, and a
        reference held keeps the buffer from reuse even if the tier drops the key meanwhile."""
        return None

    def prefault(self, nbytes: int, count: int) -> None:
        """Touch up to `count` buffers of `nbytes` for `value_buffer` in the background (host tier)."""

    @property
    def location(self) -> str | os.PathLike[str] | None:
        """The local directory the tier keeps its data in (free disk space is reported), or None."""
        return None

    @property
    def limit_bytes(self) -> int | None:
        """A hard limit on what the tier may hold that its `stats().capacity_bytes` reports, or None."""
        return None

    def breakers(self) -> dict[str, Breaker]:
        """Circuit breakers of a remote tier by node (a single server: one); none for a local tier."""
        return {}

    def counters(self) -> dict[str, int] | None:
        """What this process counted of a remote tier's calls (errors, ...), without calling it;
        None for a tier that keeps no such counts (its `stats` say it all)."""
        return None

    async def server_memory(self) -> dict[str, tuple[int, int]]:
        """A remote tier's servers' memory, used and limit, by node; {} when it cannot say."""
        return {}

    async def compress(self, keys: Sequence[str], values: Sequence[Any]) -> list[Any]:
        """The values `put` would store for `values` (a compressing tier's frames); as given by default."""
        return list(values)

    @abstractmethod
    async def exists(self, keys: Sequence[str]) -> list[bool]: ...

    async def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        """Copy each value into the caller's buffer; bytes written, 0 for a miss or a value that does not fit.

        The default copies out of `read`; backends that can read straight into the buffer override it.
        """
        written = [0] * len(keys)

        def copy(i: int, view: memoryview) -> None:
            if len(view) <= len(buffers[i]):
                buffers[i][: len(view)] = view
                written[i] = len(view)

        await self.read(keys, copy)
        return written

    @abstractmethod
    async def put(self, keys: Sequence[str], values: Sequence[bytes | bytearray | memoryview]) -> None:
        """Store all values; batched into one transaction where the backend can."""

    @abstractmethod
    async def delete(self, keys: Sequence[str]) -> None: ...

    @abstractmethod
    def keys(self, prefix: str | None = None) -> AsyncIterator[str]: ...

    @abstractmethod
    async def stats(self) -> BackendStats: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def read(self, keys: Sequence[str], sink: ReadSink) -> list[bool]:
        """Hand each stored value to `sink(i, view)`, copying nothing on the way where the backend can.

        This is the restore fast path: LMDB passes views of its mmap, the host tier its own bytes,
        so a value is copied once, straight into its destination. `sink` may run on a worker
        thread and must not raise. Returns which keys were found.
        """

    async def read_bounded(self, keys: Sequence[str], sink: ReadSink, limits: Sequence[int]) -> list[bool]:
        """`read`, where the caller knows the largest valid value of each key (`limits[i]` bytes: a
        chunk's encoded size): a longer value is a miss, and `sink` never sees it.

        Why the caller passes it: a tier that receives values from another host (Redis) must not take
        a peer's word for a value's length, or one forged header makes it allocate hundreds of MiB per
        read; with the bound it refuses the value before allocating or receiving it. Local tiers hold
        what this process wrote, so the default only drops a longer value after the read.
        """
        found = [False] * len(keys)

        def bounded(i: int, view: memoryview) -> None:
            if view.nbytes <= limits[i]:
                found[i] = True
                sink(i, view)

        got = await self.read(keys, bounded)
        return [hit and ok for hit, ok in zip(got, found)]

    async def sizes(self, keys: Sequence[str]) -> list[int]:
        """Stored size of each value, 0 where missing (for capacity accounting after a restart).

        The default reads through `read`; backends that know sizes cheaply (stat) override it.
        """
        out = [0] * len(keys)

        def size(i: int, view: memoryview) -> None:
            out[i] = len(view)

        await self.read(keys, size)
        return out

    async def touch(self, keys: Sequence[str]) -> list[bool]:
        """Which keys exist, marking them as just used, so a shared store's gc keeps them.

        A snapshot that reuses chunks another host wrote touches them before it commits: gc on
        any host deletes an unreferenced chunk only if it has not been used for a grace period.
        """
        return await self.exists(keys)

    async def delete_idle(self, keys: Sequence[str], idle_seconds: float) -> list[str]:
        """Delete the keys unused for at least `idle_seconds` (atomically per key); returns those deleted.

        Stores without a notion of use time delete them all: only shared stores need the guard.
        """
        present = [k for k, hit in zip(keys, await self.exists(keys)) if hit]
        await self.delete(present)
        return present

    async def reclaim(self) -> None:
        """Give back the space of deleted values now (gc calls it). Only tiers that delete by
        marking (LMDB's value log) have anything to do; the others free space as they delete."""

    async def aclose(self) -> None:
        await self.close()
