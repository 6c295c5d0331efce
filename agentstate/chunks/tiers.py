"""The tier manager: ordered tiers, byte capacities, promotion, demotion, write policies.

Tiers are ordered fast to slow. Exactly one is the *record* tier (durable; sessions commit to
it); tiers above it are caches with a byte capacity, evicted over unpinned chunks in the order of
the tier's eviction policy (`chunks/eviction/`, LRU by default), except that chunks a hold names
(agent hints, retention: `holds.py`) go last. A chunk coming in never displaces one that goes
after it: an unheld chunk takes the room of unheld ones only, a held one also that of chunks held
for a later return; a chunk that finds no such room is not cached in that tier (it is in the tier
below). This is the only place that evicts: backends store bytes and never drop one by
themselves. A victim that no tier below holds is written down first (demotion), so eviction never
loses the only copy. Accounting is by value bytes and exact: a tier's used bytes never exceed its
capacity.

Write policies decide where a stored chunk goes at store time:
- `write_through`: every tier from the first non-device tier down to the record tier.
- `write_back`: only the first non-device tier; lower tiers get it on eviction.
- `write_through_selective`: like write_back, and written down once it was hit `threshold` times.
Durable stores (snapshots) always include the record tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from agentstate.backends.base import Backend
from agentstate.chunks.eviction import EvictionPolicy
from agentstate.chunks.eviction.lru import LRU
from agentstate.chunks.holds import Holds
from agentstate.chunks.index import ChunkIndex
from agentstate.errors import AgentStateError, CapacityError, InvalidArgumentError
from agentstate.memory import copy_bytes

log = logging.getLogger("agentstate.chunks.tiers")
_ABSENT_KEYS = 1 << 16
"""Misses of a lazy tier remembered (an engine asking about pages nobody stored, again and again)."""
WritePolicy = Literal["write_through", "write_back", "write_through_selective"]
Value = bytes | bytearray | mmap.mmap | memoryview


@dataclass
class Tier:
    backend: Backend
    capacity: int | None = None
    is_device: bool = False
    policy: EvictionPolicy = field(default_factory=LRU)
    """what the tier holds (key -> bytes) and the order eviction takes it in"""
    used: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    inflight: dict[str, asyncio.Future[None]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def lazy(self) -> bool:
        """A local durable tier without a capacity (LMDB, files): the index learns what it holds
        when a key is asked for (`TierManager.known_in`), never by listing it at open, so opening
        a store costs the same at a thousand chunks and at ten million. Nothing but this process
        writes it (the data directory's lock), so what the index learned stays true until this
        process deletes it."""
        return self.capacity is None and self.backend.durable and not self.backend.remote

    @property
    def sizes(self) -> Mapping[str, int]:
        """Key -> stored bytes of what the tier holds (the mapping holds track)."""
        return self.policy.sizes

    def add(self, key: str, size: int) -> None:
        """Account `key` (`size` bytes) as in the tier."""
        if key not in self.policy:
            self.policy.insert(key, size)
            self.used += size

    def drop(self, key: str) -> None:
        """Account `key` as gone from the tier."""
        self.used -= self.policy.remove(key)


class TierManager:
    def __init__(
        self,
        tiers: Sequence[Tier],
        index: ChunkIndex,
        *,
        record: str,
        policy: WritePolicy = "write_through",
        threshold: int = 2,
        exclusive: bool = False,
        holds: Holds | None = None,
    ) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"tier names must be distinct, got {names}")
        if record not in names:
            raise InvalidArgumentError(f"record tier {record!r} is not among {names}")
        self.tiers = list(tiers)
        self.index = index
        self.record = next(t for t in tiers if t.name == record)
        if not self.record.backend.durable:
            raise InvalidArgumentError(f"record tier {record!r} must be durable")
        self.policy = policy
        self.threshold = threshold
        self.exclusive = exclusive
        self.holds = holds if holds is not None else Holds()
        for t in self.tiers:
            if t.capacity is not None:  # what plans are made for: holds keep them, told below of each change
                self.holds.track(t.sizes)
        self.counts: Counter[str] = Counter()
        self.tier_counts: Counter[tuple[str, str]] = Counter()
        """(tier, what) -> amount: hits, misses, read_bytes, written_bytes, corrupt, evictions, promotions,
        put_errors (see `count`)"""
        self._pos = {t.name: i for i, t in enumerate(tiers)}
        self._absent: dict[str, OrderedDict[str, None]] = {}
        """per lazy tier, keys it was asked about and did not hold, newest last: asked again only
        once forgotten (a put adds the key to the index, which `known_in` reads first)"""

    def count(self, tier: Tier, **amounts: int) -> None:
        """Add to one tier's counters (what the service exports per tier)."""
        for what, n in amounts.items():
            self.tier_counts[(tier.name, what)] += n

    # -- lookup --------------------------------------------------------------------------------

    def tier(self, name: str) -> Tier:
        return self.tiers[self._pos[name]]

    def holders(self, key: str) -> list[Tier]:
        held = self.index.tiers_of(key)
        return [t for t in self.tiers if t.name in held]

    def fastest(self, key: str) -> str | None:
        holders = self.holders(key)
        return holders[0].name if holders else None

    def _below(self, tier: Tier) -> list[Tier]:
        return self.tiers[self._pos[tier.name] + 1 :]

    async def adopt_existing(self, keys_by_tier: dict[str, list[str]]) -> None:
        """Account for what persistent tiers with a capacity already hold (after a restart): their
        eviction needs every size. Lazy tiers are learnt key by key instead (`known_in`)."""
        for name, keys in keys_by_tier.items():
            tier = self.tier(name)
            sizes = await tier.backend.sizes(keys) if tier.capacity is not None else [0] * len(keys)
            for key, size in zip(keys, sizes):
                tier.add(key, size)
            self.holds.tier_changed(tier.sizes, keys)
            self.index.add(keys, name)

    # -- writes --------------------------------------------------------------------------------

    def store_targets(self, durable: bool) -> list[Tier]:
        """Tiers a newly stored chunk is written to under the write policy."""
        upper = [t for t in self.tiers if not t.is_device]
        if self.policy == "write_through":
            targets = [t for t in upper if t is not self.record and not t.backend.remote][: upper.index(self.record)]
            targets.append(self.record)
        else:
            targets = [upper[0]]
        if durable and self.record not in targets:
            targets.append(self.record)
        # Remote tiers are how other hosts find a chunk: they get every stored chunk.
        targets += [t for t in self.tiers if t.backend.remote and t not in targets]
        return targets

    async def store(self, keys: Sequence[str], values: Sequence[Value], *, durable: bool) -> None:
        """Put to the policy's tiers. Only the record tier's failure fails the store: a cache or a
        remote tier that errors is counted and skipped (the chunk is simply not there later)."""
        targets = self.store_targets(durable)
        results = await asyncio.gather(*(self.put(t, keys, values) for t in targets), return_exceptions=True)
        for tier, result in zip(targets, results):
            if isinstance(result, BaseException):
                if tier is self.record or not isinstance(result, AgentStateError):
                    raise result
                self.counts[f"{tier.name}_put_errors"] += 1
                self.count(tier, put_errors=1)
                log.warning(
                    "tier %s: put of %d chunks failed (%s); continuing without it", tier.name, len(keys), result
                )

    async def known_in(self, tier: Tier, keys: Sequence[str]) -> list[bool]:
        """Whether `tier` holds each key, as far as this process can tell without a remote call:
        the index, and for a lazy tier its backend about the keys the index does not list (one
        batched lookup; what it finds is learnt). Exact for keys pinned and settled (no delete of
        them in flight): what a dedupe and a fork rely on."""
        if tier.lazy:
            absent = self._absent.setdefault(tier.name, OrderedDict())
            ask = [k for k in dict.fromkeys(keys) if k and not self.index.holds(k, tier.name) and k not in absent]
            if ask:
                present = await tier.backend.exists(ask)
                self.note(tier, ask, present)
                absent.update((k, None) for k, hit in zip(ask, present) if not hit)
                while len(absent) > _ABSENT_KEYS:
                    absent.popitem(last=False)
        return [self.index.holds(k, tier.name) for k in keys]

    async def held_below(self, tier: Tier, keys: Sequence[str]) -> list[bool]:
        """Whether some tier below `tier` holds each key (what eviction asks before dropping a copy)."""
        held = [False] * len(keys)
        for below in self._below(tier):
            todo = [i for i, h in enumerate(held) if not h]
            if not todo:
                break
            for i, hit in zip(todo, await self.known_in(below, [keys[i] for i in todo])):
                held[i] = hit
        return held

    async def discover(self, keys: Sequence[str]) -> None:
        """Make the index answer for `keys`: lazy local tiers are asked about keys no durable tier
        is known to hold, remote tiers (one batched call each) about keys no tier is known to hold."""
        keys = list(dict.fromkeys(keys))
        durable = [t for t in self.tiers if t.backend.durable]
        ask = [k for k in keys if not any(self.index.holds(k, t.name) for t in durable)]
        for tier in self.tiers:
            if ask and tier.lazy:
                ask = [k for k, hit in zip(ask, await self.known_in(tier, ask)) if not hit]
        unknown = [k for k in keys if not self.index.tiers_of(k)]
        for tier in self.tiers:
            if unknown and tier.backend.remote:
                present = await tier.backend.exists(unknown)
                self.note(tier, unknown, present)
                unknown = [k for k, hit in zip(unknown, present) if not hit]

    def note(self, tier: Tier, keys: Sequence[str], present: Sequence[bool]) -> None:
        """Record what a tier the index does not list in full said it holds: a remote tier (other
        hosts write and delete there too), a lazy one (`known_in`)."""
        for key, hit in zip(keys, present):
            if hit:
                tier.add(key, 0)
            else:
                tier.drop(key)
        self.holds.tier_changed(tier.sizes, keys)
        self.index.add([k for k, hit in zip(keys, present) if hit], tier.name)
        self.index.discard([k for k, hit in zip(keys, present) if not hit], tier.name)

    async def put(self, tier: Tier, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Put into one tier, evicting (and demoting) to make room; returns once all are stored.

        A key another put is still writing is waited for, not written twice. A cache tier that
        cannot make room (everything pinned) passes its chunks down to the next tier when no
        tier below holds them yet, so nothing is lost; the record tier raises CapacityError.
        """
        waits = {tier.inflight[k] for k in keys if k in tier.inflight}
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        originals: dict[str, Value] = {}
        for key, value in zip(keys, values):
            originals.setdefault(key, value)  # a key twice in one batch: the first value stands, in every tier
        stored = dict(originals)
        if tier.backend.compresses:  # a compressing tier's capacity is spent in stored bytes
            todo = [k for k in stored if k not in tier.policy]
            stored.update(zip(todo, await tier.backend.compress(todo, [stored[k] for k in todo])))
        async with tier.lock if tier.capacity is not None else contextlib.nullcontext():
            new = [(k, stored[k]) for k in originals if k not in tier.policy]
            if tier.capacity is not None and len(new) > 1:  # held ones first, soonest back first: an
                # unheld one reserved earlier in the batch cannot make room for them (it is in flight)
                new.sort(key=lambda item: (self.holds.back_at(item[0]), not self.holds.held(item[0])))
            fits, spill = [], []
            plan = self.holds.plan(tier.sizes, tier.capacity) if tier.capacity is not None and new else {}
            for key, value in new:
                tier.add(key, len(value))  # reserved first: the holds then say whether it counts
                tier.inflight[key] = done
                if tier.capacity is None:  # untracked by the holds: nothing to evict, nothing to tell
                    fits.append((key, value))
                    continue
                self.holds.tier_changed(tier.sizes, [key])
                if await self._make_room(tier, key, plan):
                    fits.append((key, value))
                else:
                    del tier.inflight[key]
                    self._unreserve(tier, [(key, value)])
                    spill.append((key, value))
        # The record tier takes no lock: concurrent puts reach the backend together (group commit).
        try:
            if fits:
                await tier.backend.put([k for k, _ in fits], [v for _, v in fits])
        except BaseException as exc:
            self._unreserve(tier, fits)
            done.set_exception(exc)
            done.exception()  # retrieved: waiters re-raise it, nobody else needs to
            raise
        else:
            done.set_result(None)
            self.count(tier, written_bytes=sum(len(v) for _, v in fits))
        finally:
            for key, _ in fits:
                if tier.inflight.get(key) is done:
                    del tier.inflight[key]
        self.index.add([k for k, _ in fits], tier.name)
        tier.policy.touch(keys)
        if waits:
            await asyncio.gather(*waits)
        if spill:
            self.counts[f"{tier.name}_full"] += len(spill)
            below = self._below(tier)
            below_held = await self.held_below(tier, [k for k, _ in spill])
            orphans = [(k, originals[k]) for (k, _), held in zip(spill, below_held) if not held]
            if orphans and below:
                await self.put(below[0], [k for k, _ in orphans], [v for _, v in orphans])
            elif orphans:
                raise CapacityError(f"tier {tier.name} is full and nothing in it can be evicted")

    def _unreserve(self, tier: Tier, items: Sequence[tuple[str, Value]]) -> None:
        for key, _ in items:
            tier.drop(key)
        self.holds.tier_changed(tier.sizes, [k for k, _ in items])

    async def _make_room(self, tier: Tier, key: str, plan: Mapping[str, float]) -> bool:
        """Evict until `key`, reserved in `tier` already, fits: unheld chunks in the policy's order,
        then held ones expected back last (`plan`, from `Holds.plan`), but only chunks that go
        after `key` itself. An unheld newcomer displacing a held chunk would undo the hold: a large
        batch of new chunks (an engine's saves grouped under load) would push out exactly the
        paused sessions the hints kept. Caller holds `tier.lock`."""
        assert tier.capacity is not None
        if tier.sizes[key] > tier.capacity:
            return False

        def can_go(other: str) -> bool:
            return other not in tier.inflight and not self.index.pinned(other)

        while tier.used > tier.capacity:
            victim = tier.policy.victim(can_go, plan)
            if victim is None:
                return False
            back, mine = plan.get(victim), plan.get(key)  # None: unheld (or beyond its owner's share)
            if back is not None and (mine is None or mine >= back):
                return False  # only held chunks back no later than this one are left
            await self.evict(tier, victim)
        return True

    def eviction_order(self, tier: Tier) -> list[str]:
        """The keys of a cache tier in the order eviction takes them (unheld in policy order, then held)."""
        return tier.policy.eviction_order(self.holds.plan(tier.sizes, tier.capacity))

    def release(self, keys: Sequence[str]) -> None:
        """Put `keys` first in line for eviction in every cache tier (a session that is done)."""
        for tier in self.tiers:
            if tier is not self.record and tier.capacity is not None:
                for key in keys:
                    if key in tier.policy and not self.holds.held(key):
                        tier.policy.release(key)

    async def evict(self, tier: Tier, key: str) -> None:
        """Drop `key` from a cache tier, writing it down first when no tier below holds it."""
        below = self._below(tier)
        if below and not (await self.held_below(tier, [key]))[0]:
            value = await self.read_bytes(tier, key)
            if value is not None:
                self.index.pin([key])
                try:
                    await self.put(below[0], [key], [value])
                finally:
                    self.index.unpin([key])
                self.counts["demotions"] += 1
        await self._remove(tier, [key])
        self.counts["evictions"] += 1
        self.count(tier, evictions=1)

    async def _remove(self, tier: Tier, keys: Sequence[str]) -> None:
        for key in keys:
            tier.drop(key)
        self.holds.tier_changed(tier.sizes, keys)
        self.index.discard(keys, tier.name)
        await tier.backend.delete(keys)

    async def delete(self, keys: Sequence[str], tiers: Sequence[Tier] | None = None) -> None:
        """Delete from every tier (or the given ones)."""
        await asyncio.gather(*(self._remove(t, keys) for t in (tiers or self.tiers)))

    @staticmethod
    async def read_bytes(tier: Tier, key: str) -> Value | None:
        got: list[Value] = []
        await tier.backend.read([key], lambda i, view: got.append(copy_bytes(view)))
        return got[0] if got else None

    # -- reads ---------------------------------------------------------------------------------

    async def hit(self, tier: Tier, keys: Sequence[str], values: dict[str, Value], *, account: bool = True) -> None:
        """Account a read served by `tier`: LRU, hit counts, promotion, selective write-down.

        `values` holds owned copies of chunks read from below the top tier, for promotion;
        `account=False` promotes without counting another hit (a background re-read).
        """
        if account:
            tier.policy.touch(keys)
            self.index.touch(keys)
        if values:
            upper = self.tiers[: self._pos[tier.name]]
            for target in upper:
                ks = [k for k in values if not self.index.holds(k, target.name)]
                if ks:
                    await self.put(target, ks, [values[k] for k in ks])
                    self.counts["promotions"] += len(ks)
                    self.count(target, promotions=len(ks))
            if self.exclusive and tier is not self.record and upper:
                moved = [k for k in values if self.index.holds(k, upper[-1].name)]
                await self._remove(tier, moved)
        if self.policy == "write_through_selective" and account:
            warm = [k for k in keys if self.index.hits(k) >= self.threshold]
            hot = [k for k, held in zip(warm, await self.known_in(self.record, warm)) if not held]
            if hot:
                held = [(k, await self.read_bytes(tier, k)) for k in hot]
                await self.put(
                    self.record, [k for k, v in held if v is not None], [v for _, v in held if v is not None]
                )
                self.counts["selective_writes"] += len(hot)
