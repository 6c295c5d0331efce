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
   hint says nothing about when, so it goes before any hinted session;
3. never a chunk that ranks before the one coming in (TierManager): an unheld chunk is not cached
   in a tier at the cost of a held one, so no burst of new chunks undoes the hints.

A key held several times counts with its soonest return (ties: the smaller owner name), for the
owner of that hold. An owner's share is filled with its keys expected back soonest first; among
keys expected back at the same time, the one held longest (since it was last unheld) first; a key
that does not fit is skipped and the fill goes on with the next.

A held chunk is never lost: eviction from a cache tier writes it down first when no lower tier
holds it (TierManager), so a hold decides only where a session's chunks wait, never whether they
exist. Holds live in memory and end by themselves (`until`); a restart starts with none, the data
being in the durable tiers by then anyway.

Cost. Hints arrive on the store's event loop, one per agent turn, and a connector places one hold
per agent id: tens of thousands of live holds are normal, and a hint must not scan them. So
nothing here is recomputed from all holds:

- per key, its holds sit in a heap by (back_at, owner) with lazy deletion (a replaced or ended
  hold is popped when it reaches the top; a heap with more dead entries than live ones is
  compacted), so its best hold is read at the top;
- ends of holds sit in one heap by `until`: expiring is popping what is due;
- per tracked tier (`track`: the tiers' LRU maps, told of every key entering or leaving through
  `tier_changed`), each owner's held keys there are kept ranked in sorted blocks with per-block
  byte sums and minima, so filling its share skips whole blocks and is cached until that owner's
  keys in the tier change; `plan` answers with a live view over these, `held_bytes` adds sums.

A hint costs O(its keys x log holds) in heap operations plus the refill of one owner's share,
which depends on the tier's size (its blocks, and the keys of the blocks where the share runs
out), never on how many holds are live. Memory: one heap entry per (hold, key) and per hold, dead
ones included until compacted (at most about twice the live ones).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field


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


Rank = tuple[float, int]
"""Where a held key stands in its owner's share: (back_at, seq); seq orders keys held since longest."""


@dataclass
class _Key:
    """The live holds naming one key: a heap of (back_at, owner, hold id, name), dead entries
    included until they surface or a compaction drops them."""

    seq: int
    heap: list[tuple[float, str, int, str]] = field(default_factory=list)
    live: int = 0
    owners: dict[str, int] = field(default_factory=dict)  # owner -> live holds of it naming the key
    best: tuple[float, str] = (math.inf, "")


class _Ranked:
    """One owner's held keys in one tier, in share order: sorted blocks of (back, seq, key, size)
    with each block's byte sum and smallest size, so a fill skips whole blocks."""

    BLOCK = 64

    def __init__(self) -> None:
        self.blocks: list[list[tuple[float, int, str, int]]] = []
        self.lasts: list[Rank] = []  # each block's greatest rank
        self.sums: list[int] = []
        self.mins: list[int] = []
        self.total = 0

    def __len__(self) -> int:
        return sum(len(b) for b in self.blocks)

    def add(self, rank: Rank, key: str, size: int) -> None:
        entry = (rank[0], rank[1], key, size)
        if not self.blocks:
            self.blocks.append([entry])
            self.lasts.append(rank)
            self.sums.append(size)
            self.mins.append(size)
        else:
            i = min(bisect_left(self.lasts, rank), len(self.blocks) - 1)
            block = self.blocks[i]
            insort(block, entry)
            self.lasts[i] = block[-1][:2]
            self.sums[i] += size
            self.mins[i] = min(self.mins[i], size)
            if len(block) > 2 * self.BLOCK:
                half = block[self.BLOCK :]
                del block[self.BLOCK :]
                self.blocks.insert(i + 1, half)
                self._refresh(i)
                self.lasts.insert(i + 1, half[-1][:2])
                self.sums.insert(i + 1, sum(e[3] for e in half))
                self.mins.insert(i + 1, min(e[3] for e in half))
                self.sums[i] -= self.sums[i + 1]
        self.total += size

    def remove(self, rank: Rank, size: int) -> None:
        i = bisect_left(self.lasts, rank)
        block = self.blocks[i]
        j = bisect_left(block, rank)
        assert block[j][:2] == rank, "a ranked key out of step with its tier"
        del block[j]
        self.total -= size
        if not block:
            del self.blocks[i], self.lasts[i], self.sums[i], self.mins[i]
            return
        self.sums[i] -= size
        self._refresh(i)

    def _refresh(self, i: int) -> None:
        block = self.blocks[i]
        self.lasts[i] = block[-1][:2]
        self.mins[i] = min(e[3] for e in block)

    def fill(self, cap: float) -> tuple[Rank | None, frozenset[str], int]:
        """The share's greedy fill: the first rank of the prefix that no longer fits (None when all
        fit), the keys past it that still fit, the bytes counted."""
        spent = 0
        bound: Rank | None = None
        extras: set[str] = set()
        for i, block in enumerate(self.blocks):
            if bound is None and spent + self.sums[i] <= cap:
                spent += self.sums[i]
                continue
            if bound is not None and self.mins[i] > cap - spent:
                continue
            for back, seq, key, size in block:
                if spent + size <= cap:
                    spent += size
                    if bound is not None:
                        extras.add(key)
                elif bound is None:
                    bound = (back, seq)
        return bound, frozenset(extras), spent


@dataclass
class _Member:
    """A held key in a tracked tier: whose share it counts in, where, and who else holds it."""

    owner: str
    rank: Rank
    size: int
    others: tuple[str, ...]


class _Tier:
    """What the holds know of one tracked tier (its LRU map: key -> bytes)."""

    def __init__(self, lru: Mapping[str, int]) -> None:
        self.lru = lru
        self.members: dict[str, _Member] = {}
        self.ranked: dict[str, _Ranked] = {}
        self.shadow: dict[str, set[str]] = {}  # owner -> keys it holds here that count for another owner
        self.fills: dict[str, tuple[float, tuple[Rank | None, frozenset[str], int]]] = {}

    def update(self, key: str, k: _Key | None) -> None:
        """Bring `key`'s entry in line with its holds and the tier."""
        old = self.members.get(key)
        new = None
        if k is not None and key in self.lru:
            back, owner = k.best
            new = _Member(owner, (back, k.seq), self.lru[key], tuple(o for o in k.owners if o != owner))
        if old == new:
            return
        if old is not None:
            self.ranked[old.owner].remove(old.rank, old.size)
            if not self.ranked[old.owner].blocks:
                del self.ranked[old.owner]
            self.fills.pop(old.owner, None)
            for o in old.others:
                self.shadow[o].discard(key)
                if not self.shadow[o]:
                    del self.shadow[o]
            del self.members[key]
        if new is not None:
            self.ranked.setdefault(new.owner, _Ranked()).add(new.rank, key, new.size)
            self.fills.pop(new.owner, None)
            for o in new.others:
                self.shadow.setdefault(o, set()).add(key)
            self.members[key] = new


class Holds:
    """Every live hold of one ChunkStore, by name (one per session and kind)."""

    def __init__(self, share: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self.clock = clock
        self._by_name: dict[str, Hold] = {}
        self._ids: dict[str, int] = {}
        self._by_owner: dict[str, dict[str, Hold]] = {}
        self._keys: dict[str, _Key] = {}
        self._ends: list[tuple[float, int, str]] = []
        self._tiers: dict[int, _Tier] = {}
        self._count = itertools.count()

    def __len__(self) -> int:
        return len(self._by_name)

    # -- holds ---------------------------------------------------------------------------------

    def set(
        self, name: str, owner: str, keys: Iterable[str], *, for_s: float, back_in_s: float = math.inf, kind: str = ""
    ) -> Hold:
        """Hold `keys` for `for_s` seconds, expected back in `back_in_s`; replaces `name`'s hold."""
        self.expire()
        self.drop(name)
        now = self.clock()
        hold = Hold(owner, tuple(dict.fromkeys(k for k in keys if k)), now + for_s, now + back_in_s, kind)
        hid = next(self._count)
        self._by_name[name] = hold
        self._ids[name] = hid
        self._by_owner.setdefault(owner, {})[name] = hold
        if len(self._ends) > 2 * len(self._by_name) + 64:  # replaced holds: drop their ends before they come
            self._ends = [e for e in self._ends if self._ids.get(e[2]) == e[1]]
            heapq.heapify(self._ends)
        heapq.heappush(self._ends, (hold.until, hid, name))
        for key in hold.keys:
            k = self._keys.get(key)
            if k is None:
                k = self._keys[key] = _Key(next(self._count))
            heapq.heappush(k.heap, (hold.back_at, owner, hid, name))
            k.live += 1
            k.owners[owner] = k.owners.get(owner, 0) + 1
            k.best = min(k.best, (hold.back_at, owner)) if k.live > 1 else (hold.back_at, owner)
            self._tier_update(key, k)
        return hold

    def get(self, name: str) -> Hold | None:
        self.expire()
        return self._by_name.get(name)

    def drop(self, name: str) -> Hold | None:
        hold = self._by_name.pop(name, None)
        if hold is None:
            return None
        del self._ids[name]
        mine = self._by_owner[hold.owner]
        del mine[name]
        if not mine:
            del self._by_owner[hold.owner]
        for key in hold.keys:
            k = self._keys[key]
            k.live -= 1
            if k.live == 0:
                del self._keys[key]
                self._tier_update(key, None)
                continue
            k.owners[hold.owner] -= 1
            if not k.owners[hold.owner]:
                del k.owners[hold.owner]
            if len(k.heap) > 2 * k.live + 8:  # mostly dead: keep memory in step with the live holds
                k.heap = [e for e in k.heap if self._ids.get(e[3]) == e[2]]
                heapq.heapify(k.heap)
            while self._ids.get(k.heap[0][3]) != k.heap[0][2]:
                heapq.heappop(k.heap)
            k.best = k.heap[0][:2]
            self._tier_update(key, k)
        return hold

    def held(self, key: str) -> bool:
        """Whether some live hold names `key`."""
        self.expire()
        return key in self._keys

    def back_at(self, key: str) -> float:
        """When `key` is expected back by its soonest live hold; +inf when no hold names it."""
        self.expire()
        k = self._keys.get(key)
        return math.inf if k is None else k.best[0]

    def expire(self) -> None:
        """Forget holds whose time is up."""
        now = self.clock()
        while self._ends and self._ends[0][0] <= now:
            _, hid, name = heapq.heappop(self._ends)
            if self._ids.get(name) == hid:
                self.drop(name)

    def owned(self, owner: str) -> dict[str, Hold]:
        """The live holds of one tenant, by name."""
        self.expire()
        return dict(self._by_owner.get(owner, {}))

    # -- tiers ---------------------------------------------------------------------------------

    def track(self, lru: Mapping[str, int]) -> None:
        """Keep a plan for the tier whose keys and sizes are `lru`, told of every key entering or
        leaving it through `tier_changed`; `plan(lru, ...)` and `held_bytes(..., lru, ...)` then
        read it instead of scanning."""
        tier = self._tiers[id(lru)] = _Tier(lru)
        for key in [k for k in self._keys if k in lru] if len(self._keys) < len(lru) else list(lru):
            if key in self._keys:
                tier.update(key, self._keys[key])

    def tier_changed(self, lru: Mapping[str, int], keys: Iterable[str]) -> None:
        """`keys` entered or left the tracked tier `lru` (a no-op for a tier not tracked)."""
        tier = self._tiers.get(id(lru))
        if tier is not None and tier.lru is lru:
            for key in keys:
                tier.update(key, self._keys.get(key))

    def _tier_update(self, key: str, k: _Key | None) -> None:
        for tier in self._tiers.values():
            tier.update(key, k)

    def _tracked(self, sizes: Mapping[str, int]) -> _Tier | None:
        tier = self._tiers.get(id(sizes))
        return tier if tier is not None and tier.lru is sizes else None

    def _cap(self, capacity: int | None) -> float | None:
        return None if capacity is None or self.share >= 1.0 else self.share * capacity

    def _fill(self, tier: _Tier, owner: str, cap: float) -> tuple[Rank | None, frozenset[str], int]:
        cached = tier.fills.get(owner)
        if cached is None or cached[0] != cap:
            cached = tier.fills[owner] = (cap, tier.ranked[owner].fill(cap))
        return cached[1]

    def _counted(self, tier: _Tier, key: str, cap: float | None) -> float | None:
        """`key`'s back_at if it is held in `tier` and counts within its owner's share, else None."""
        m = tier.members.get(key)
        if m is None:
            return None
        if cap is not None:
            bound, extras, _ = self._fill(tier, m.owner, cap)
            if bound is not None and m.rank >= bound and key not in extras:
                return None
        return m.rank[0]

    # -- what eviction reads -------------------------------------------------------------------

    def plan(self, sizes: Mapping[str, int], capacity: int | None) -> Mapping[str, float]:
        """The held keys of one tier that count, each with when it is expected back.

        `sizes` is what the tier holds (key -> bytes). A key held several times counts with its
        soonest return, for the owner of that hold. Each owner's held bytes in the tier are capped
        at `share` of `capacity`: its keys expected back soonest count, the rest are plain LRU.
        A tracked tier gets a live view (it follows the holds and the tier as they change); any
        other mapping a dict computed from it.
        """
        self.expire()
        tier = self._tracked(sizes)
        if tier is not None:
            return _Plan(self, tier, self._cap(capacity))
        best = {}
        held = (k for k in sizes if k in self._keys) if len(sizes) < len(self._keys) else self._keys
        for key in held:
            if key in sizes:
                k = self._keys[key]
                best[key] = (k.best[0], k.seq, k.best[1])
        cap = self._cap(capacity)
        if cap is None:
            return {k: b[0] for k, b in best.items()}
        spent: dict[str, int] = {}
        counted: dict[str, float] = {}
        for key, (back, _, owner) in sorted(best.items(), key=lambda item: item[1][:2]):
            if spent.get(owner, 0) + sizes[key] <= cap:
                spent[owner] = spent.get(owner, 0) + sizes[key]
                counted[key] = back
        return counted

    def held_bytes(self, owner: str, sizes: Mapping[str, int], capacity: int | None) -> int:
        """Bytes of one tier the holds of `owner` claim and that count (within its share)."""
        self.expire()
        tier = self._tracked(sizes)
        if tier is None:
            counted = self.plan(sizes, capacity)
            return sum(sizes[k] for k in counted if k in self._keys and owner in self._keys[k].owners)
        cap = self._cap(capacity)
        total = 0
        if owner in tier.ranked:
            total = tier.ranked[owner].total if cap is None else self._fill(tier, owner, cap)[2]
        for key in tier.shadow.get(owner, ()):
            if self._counted(tier, key, cap) is not None:
                total += tier.members[key].size
        return total


class _Plan(Mapping[str, float]):
    """A tracked tier's plan (see `Holds.plan`), read where eviction asks: key -> back_at."""

    def __init__(self, holds: Holds, tier: _Tier, cap: float | None) -> None:
        self._holds, self._tier, self._cap = holds, tier, cap

    def __getitem__(self, key: str) -> float:
        back = self._holds._counted(self._tier, key, self._cap)
        if back is None:
            raise KeyError(key)
        return back

    def get(self, key: str, default: float | None = None) -> float | None:  # type: ignore[override]
        back = self._holds._counted(self._tier, key, self._cap)
        return default if back is None else back

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._holds._counted(self._tier, key, self._cap) is not None

    def __iter__(self) -> Iterator[str]:
        return (k for k in list(self._tier.members) if k in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


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
