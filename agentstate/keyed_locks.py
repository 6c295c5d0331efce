"""KeyedLocks: one asyncio lock per name, alive exactly while someone holds or waits for it.

Why not `dict.setdefault(name, Lock())` and drop the entry once `not lock.locked()`: a release
that wakes a waiter leaves the lock unlocked until the waiter runs, so the entry was dropped
while that waiter still counted on it, and the next caller made a second lock for the same name.
Two writers of one session then ran at once (ConflictError without expected_version). Here an
entry counts its users (holders and waiters) and goes only when the last one leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class _Entry:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class KeyedLocks:
    """Mutual exclusion per name; memory bounded by the names in use right now."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @contextlib.asynccontextmanager
    async def hold(self, name: str) -> AsyncIterator[None]:
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = _Entry()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0 and self._entries.get(name) is entry:
                del self._entries[name]
