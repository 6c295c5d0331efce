"""Holds: soft claims on the fast tiers that tell eviction what is coming back, and when.

A pin (ChunkIndex) is hard: an unfinished read or write depends on the chunk. A hold is advice
from whoever knows the workload, an agent framework above all: "this session paused for a tool
call and returns in about 30 s" (`paused`), "its next turn is imminent" (`resuming`), or a
retention contract in force. LRU alone evicts exactly the sessions about to come back, since a
session waiting on a tool is the least recently used thing in the cache.

Eviction from a cache tier takes, in order:

1. chunks no live hold names (plain LRU), including the holds a tenant placed beyond its share of
   the tier (`share`): hints from one tenant never claim more of a tier than that;
2. then held chunks, the one expected back last first (`back_at`): a retention contract with no
   hint says nothing about when, so it goes before any hinted session.

A held chunk is never lost: eviction from a cache tier writes it down first when no lower tier
holds it (TierManager), so a hold decides only where a session's chunks wait, never whether they
exist. Holds live in memory and end by themselves (`until`); a restart starts with none, the data
being in the durable tiers by then anyway.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Hold:
    """One claim: `owner` (a tenant) expects `keys` back at `back_at` and keeps them until `until`
    (both `time.monotonic()`); `back_at` is +inf when unknown (a bare retention contract)."""

    owner: str
    keys: tuple[str, ...]
    until: float
    back_at: float
    kind: str = ""
    """what placed it (a hint's kind, "retention"), for operators"""


class Holds:
    """Every live hold of one ChunkStore, by name (one per session and kind)."""

    def __init__(self, share: float = 1.0) -> None:
        self.share = share
        self._by_name: dict[str, Hold] = {}
        self._by_key: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    def set(
        self, name: str, owner: str, keys: Iterable[str], *, for_s: float, back_in_s: float = math.inf, kind: str = ""
    ) -> Hold:
        """Hold `keys` for `for_s` seconds, expected back in `back_in_s`; replaces `name`'s hold."""
        self.drop(name)
        now = time.monotonic()
        hold = Hold(owner, tuple(dict.fromkeys(k for k in keys if k)), now + for_s, now + back_in_s, kind)
        self._by_name[name] = hold
        for key in hold.keys:
            self._by_key.setdefault(key, set()).add(name)
        return hold

    def get(self, name: str) -> Hold | None:
        hold = self._by_name.get(name)
        if hold is not None and hold.until <= time.monotonic():
            self.drop(name)
            return None
        return hold

    def drop(self, name: str) -> Hold | None:
        hold = self._by_name.pop(name, None)
        if hold is not None:
            for key in hold.keys:
                names = self._by_key.get(key)
                if names is not None:
                    names.discard(name)
                    if not names:
                        del self._by_key[key]
        return hold

    def held(self, key: str) -> bool:
        """Whether some live hold names `key`."""
        now = time.monotonic()
        return any(self._by_name[n].until > now for n in self._by_key.get(key, ()))

    def expire(self) -> None:
        """Forget holds whose time is up."""
        now = time.monotonic()
        for name in [n for n, h in self._by_name.items() if h.until <= now]:
            self.drop(name)

    def owned(self, owner: str) -> dict[str, Hold]:
        """The live holds of one tenant, by name."""
        self.expire()
        return {n: h for n, h in self._by_name.items() if h.owner == owner}

    def plan(self, sizes: Mapping[str, int], capacity: int | None) -> dict[str, float]:
        """The held keys of one tier that count, each with when it is expected back.

        `sizes` is what the tier holds (key -> bytes). A key held several times counts with its
        soonest return, for the owner of that hold. Each owner's held bytes in the tier are capped
        at `share` of `capacity`: its keys expected back soonest count, the rest are plain LRU.
        """
        if not self._by_name:
            return {}
        self.expire()
        best: dict[str, tuple[float, str]] = {}
        # walk the smaller side: a put into a big tier with few holds, or many holds over a small tier
        held = (k for k in sizes if k in self._by_key) if len(sizes) < len(self._by_key) else self._by_key
        for key in held:
            if key in sizes:
                back, owner = min((self._by_name[n].back_at, self._by_name[n].owner) for n in self._by_key[key])
                best[key] = (back, owner)
        if capacity is None or self.share >= 1.0:
            return {k: back for k, (back, _) in best.items()}
        cap = self.share * capacity
        spent: dict[str, int] = {}
        counted: dict[str, float] = {}
        for key, (back, owner) in sorted(best.items(), key=lambda item: item[1][0]):
            size = sizes[key]
            if spent.get(owner, 0) + size <= cap:
                spent[owner] = spent.get(owner, 0) + size
                counted[key] = back
        return counted

    def held_bytes(self, owner: str, sizes: Mapping[str, int], capacity: int | None) -> int:
        """Bytes of one tier the holds of `owner` claim and that count (within its share)."""
        counted = self.plan(sizes, capacity)
        mine = {k for h in self.owned(owner).values() for k in h.keys}
        return sum(sizes[k] for k in counted if k in mine)


def victim(lru: Iterable[str], can_go: Callable[[str], bool], plan: Mapping[str, float]) -> str | None:
    """The key eviction takes from a tier whose keys are `lru` (oldest first): the oldest one `plan`
    does not hold, else the held one expected back last; only keys `can_go` (not pinned, not in
    flight) are taken."""
    latest: tuple[float, str] | None = None
    for key in lru:
        if not can_go(key):
            continue
        back = plan.get(key)
        if back is None:
            return key
        if latest is None or back > latest[0]:
            latest = (back, key)
    return latest[1] if latest else None
