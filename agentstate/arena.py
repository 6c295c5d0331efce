"""The host tier's arena: value buffers reused as chunks leave, so writes into host memory stay off fresh pages.

On these VMs freed memory goes back to the hypervisor and the next first touch faults it in at
0.8-1.5 GB/s, slower than the copy that fills it: a snapshot, a promotion or a restore into fresh
buffers runs at the fault rate, not at memcpy's. So the buffer of a value the host tier drops
(evicted, deleted) is kept, already touched, and handed to the next encode or copy of the same
size instead of a new allocation; `grow` fills the arena ahead of time in a background thread.

A buffer is reused only when nothing else can still see it: the tier hands its value over when it
drops it, and the arena keeps it only if CPython's reference count says the tier held the last
reference (a reader's memoryview, a staged prefetch, a torch view all hold one). So no reader ever
sees a buffer rewritten under it; a buffer still referenced is simply left to the allocator.

Bounded: the caller gives the room (the host tier: `host_arena_bytes`, at most its capacity); the
tier's process memory is its stored bytes (within its capacity, accounted exactly by the chunk
layer) plus the arena's free bytes (reported in stats and metrics). Oldest free buffers go first.
The bound is separate from the capacity on purpose: a full tier evicts to make room for values
already encoded, so the buffers it frees serve the next batch, not this one.
"""

from __future__ import annotations

import mmap
import sys
import threading
from collections import OrderedDict

import numpy as np
from pydantic import BaseModel

from agentstate.memory import Buffer, host_buffer

MIN_BYTES = 64 << 10
"""Smaller buffers are cheap from malloc's own free lists: not worth a slot here."""
_SOLE = 3
"""References to a buffer inside `give` when nothing else holds one: the caller's name for it, `give`'s
parameter and getrefcount's argument (tests/test_arena.py checks it against a held view)."""


class ArenaStats(BaseModel):
    free_bytes: int
    """touched buffers waiting for reuse (process memory beyond the tier's stored bytes)"""
    free_buffers: int
    reused: int
    """buffers handed out again instead of fresh memory"""
    fresh: int
    """buffers of arena size allocated because none of that size was free"""
    shared: int
    """dropped values not kept because something else still referenced them"""


class ValueArena:
    """Free, touched buffers by exact size; thread-safe (encodes run in engine threads and pools)."""

    def __init__(self) -> None:
        self._free: OrderedDict[int, Buffer] = OrderedDict()  # id -> buffer, oldest first
        self._sizes: dict[int, list[int]] = {}  # size -> ids of free buffers of that size, newest last
        self._bytes = 0
        self._lock = threading.Lock()
        self._counts = {"reused": 0, "fresh": 0, "shared": 0}
        self._stop = threading.Event()

    def take(self, nbytes: int) -> Buffer:
        """A writable buffer of exactly `nbytes`: a reused one (stale contents: the caller overwrites
        every byte) or a fresh zeroed one."""
        if nbytes >= MIN_BYTES:
            with self._lock:
                ids = self._sizes.get(nbytes)
                if ids:
                    buf = self._free.pop(ids.pop())
                    self._bytes -= nbytes
                    self._counts["reused"] += 1
                    return buf
                self._counts["fresh"] += 1
        return host_buffer(nbytes)

    def give(self, buf: object, room: int) -> bool:
        """Keep a value the tier dropped for reuse, if it is a buffer nobody else references and the
        arena stays within `room` bytes (the host tier's `host_arena_bytes`), older free buffers
        leaving first to make way. Returns whether kept. The caller must hold no other name for `buf`
        than the argument it passes."""
        if not isinstance(buf, (bytearray, mmap.mmap)) or not MIN_BYTES <= len(buf) <= room:
            return False
        if sys.getrefcount(buf) > _SOLE:
            with self._lock:
                self._counts["shared"] += 1
            return False
        size = len(buf)
        with self._lock:
            self._shrink(room - size)
            self._free[id(buf)] = buf
            self._sizes.setdefault(size, []).append(id(buf))
            self._bytes += size
        return True

    def _shrink(self, room: int) -> None:
        while self._free and self._bytes > max(room, 0):
            key, buf = self._free.popitem(last=False)
            ids = self._sizes[len(buf)]
            ids.remove(key)
            if not ids:
                del self._sizes[len(buf)]
            self._bytes -= len(buf)

    def grow(self, nbytes: int, count: int, room: int) -> threading.Thread:
        """Allocate and touch up to `count` buffers of `nbytes` in a background thread (within `room`
        bytes of free buffers), so the first writes after startup find touched memory too."""

        def run() -> None:
            for _ in range(count):
                buf = host_buffer(nbytes)
                np.frombuffer(buf, dtype=np.uint8)[::4096] = 0  # the OS maps pages lazily: touch each one
                with self._lock:
                    if self._stop.is_set() or self._bytes + nbytes > room:
                        return
                    self._free[id(buf)] = buf
                    self._sizes.setdefault(nbytes, []).append(id(buf))
                    self._bytes += nbytes

        thread = threading.Thread(target=run, name="agentstate-arena", daemon=True)
        thread.start()
        return thread

    def stats(self) -> ArenaStats:
        with self._lock:
            return ArenaStats(free_bytes=self._bytes, free_buffers=len(self._free), **self._counts)

    def clear(self) -> None:
        """Drop every free buffer and stop a `grow` in progress (the tier is closing)."""
        self._stop.set()
        with self._lock:
            self._free.clear()
            self._sizes.clear()
            self._bytes = 0
