"""ChunkStore: the one owner of a chunk's life.

Everything that decides whether a chunk's bytes exist lives here: the data directory's lock, the
tiers and their one LRU order, the index of what each tier holds, the one pin system, dedupe,
transfers into KVTargets, promotion, eviction and deletion, and gc of every tier. Sessions,
prefixes and reference counts live one layer up (`StateStore` and its catalog); engine adapters,
the service's data plane and the admin tools call the methods below and nothing under them.

The safety rule all of it keeps: a chunk is deleted only when it is not pinned and the catalog
says nothing references it, checked after the chunk is marked as being deleted, so

- a writer that pinned a key before the mark keeps it (the pin is seen);
- a writer that pins it after the mark waits for the delete (`settle`), then finds it gone from
  the index and writes it again, or (a fork, which has no bytes to write) refuses to commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from agentstate import codec
from agentstate.backends.base import Backend, BackendStats, ReadSink, io_pool
from agentstate.chunks.eviction import make_policy
from agentstate.chunks.holds import Hold, Holds
from agentstate.chunks.index import ChunkIndex
from agentstate.chunks.io import Batch, IOEngine, batches
from agentstate.chunks.prefetch import PrefetchHandle
from agentstate.chunks.registry import build_backend
from agentstate.chunks.tiers import Tier, TierManager, Value
from agentstate.chunks.transfer import Span, Transfer
from agentstate.layouts import NativeKV
from agentstate.config import StoreConfig, TierConfig
from agentstate.datadir.lock import DataDirLock
from agentstate.errors import InvalidArgumentError
from agentstate.events import KVEvents, ZmqPublisher
from agentstate.arena import ValueArena
from agentstate.memory import Buffer, BufferPool
from agentstate.spec import ModelSpec
from agentstate.target import KVTarget

if TYPE_CHECKING:
    import torch

log = logging.getLogger("agentstate.chunks")
RefCounts = Callable[[list[str]], Awaitable[list[int]]]
"""How many committed manifests and prefix records name each key (the catalog answers)."""


@dataclass(frozen=True)
class TierInfo:
    """What an operator sees of one tier."""

    name: str
    kind: str
    durable: bool
    remote: bool
    record: bool
    capacity_bytes: int | None
    used_bytes: int
    chunks: int
    """what the index knows the tier holds; for a lazy tier only what it learnt since open"""
    lazy: bool
    """`Tier.lazy`: its stored count is its backend's (`stats`), not `chunks`"""


@dataclass(frozen=True)
class BreakerInfo:
    """One circuit breaker of a remote tier (per node in a cluster)."""

    tier: str
    node: str
    state: str
    """closed, open (calls skipped) or half_open (cooled down: the next call is a probe)"""
    trips: int


class EvictResult(BaseModel):
    """What `evict` did (also the admin CLI's report)."""

    model_config = ConfigDict(frozen=True)

    tier: str
    evicted: int
    evicted_bytes: int
    demoted: int
    """evicted chunks no lower tier held, written down first (never the last copy)"""
    skipped_pinned: int
    used_before: int
    used_after: int


class SweepCursor:
    """Where one gc pass over the stored keys stands: the keys it has not reached yet."""

    def __init__(self, keys: AsyncIterator[str]) -> None:
        self._keys: AsyncIterator[str] | None = keys
        self._lock = asyncio.Lock()

    @property
    def done(self) -> bool:
        """Every key was reached."""
        return self._keys is None

    async def take(self, limit: int) -> list[str]:
        """The next `limit` keys of the pass (fewer at its end, then none)."""
        async with self._lock:  # one listing at a time: steps of one pass may overlap
            out: list[str] = []
            if self._keys is not None:
                async for key in self._keys:
                    out.append(key)
                    if len(out) >= limit:
                        break
                if len(out) < limit:
                    self._keys = None
            return out


@dataclass(frozen=True)
class SweepStep:
    """What one step of gc's sweep did."""

    removed: int
    scanned: int
    done: bool
    """the pass reached the last stored key"""


class ChunkStore:
    """Chunks of one ModelSpec over ordered tiers; open with `await ChunkStore(...).open(prefixes)`.

    `shared_catalog` says that manifests live in a catalog every host shares, so the record tier
    is the durable remote tier; `read_only` shares the directory lock with other readers instead
    of taking it alone (the caller promises not to write).
    """

    def __init__(
        self, config: StoreConfig, spec: ModelSpec, *, shared_catalog: bool = False, read_only: bool = False
    ) -> None:
        self.config = config
        self.spec = spec
        tier_configs = config.tier_list()
        self._kinds = {t.tier_name: t.kind for t in tier_configs}
        self._lock = DataDirLock.acquire(config.path, shared=read_only)
        self._read_only = read_only
        self._pool: ThreadPoolExecutor | None = None
        tiers: list[Tier] = []
        try:
            tiers = [self._tier(t) for t in tier_configs]
            if shared_catalog and not any(t.backend.remote and t.backend.durable for t in tiers):
                raise InvalidArgumentError(
                    "a shared catalog (catalog_url) needs a durable remote tier (redis) to hold the chunks it names;"
                    " mooncake evicts and loses values, so it can only cache them"
                )
            record = config.record_tier or _default_record(tiers, shared_catalog)
            self._index = ChunkIndex()
            self._holds = Holds(share=config.hint_tenant_share)
            self._manager = TierManager(
                tiers, self._index, record=record, policy=config.write_policy,
                threshold=config.write_through_threshold, exclusive=config.exclusive, holds=self._holds,
            )  # fmt: skip
        except BaseException:
            self._lock.discard()  # a directory this open made goes again: a failed open leaves no files
            raise
        self._record = self._manager.record
        self._pool = io_pool(config.io_threads, "agentstate-cpu")
        self._io = IOEngine(config.io_depth)
        self._buffers = BufferPool(config.restore_pool_bytes)
        self._scratch = ValueArena()
        """buffers of values written to tiers that copy them (LMDB, files, Redis), reused by the next
        encodes: without a host tier every snapshot would otherwise encode into fresh memory"""
        self._scratch_room = config.io_depth * config.batch_bytes
        self._transfer = Transfer(
            spec=spec, manager=self._manager, io=self._io, pool=self._pool,
            batch_bytes=config.batch_bytes, promote=config.promote_on_read and not read_only, read_only=read_only,
            buffer=self.value_buffer, recycle=self.recycle,
        )  # fmt: skip
        self._deleting: dict[str, asyncio.Future[None]] = {}
        self._warming: dict[str, asyncio.Future[None]] = {}
        """keys a `warm` is bringing up into host memory: a read of them waits for it instead of
        reading the same bytes from the slow tier a second time"""
        self._counts: Counter[str] = Counter()  # prefetch_timeouts, gc_removed
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None  # set by open: where read_held accounts its hits
        self.events: KVEvents | None = None
        """what the tiers hold, published for routers (`kv_events`); None when off"""
        self._publisher: ZmqPublisher | None = None
        ev = config.kv_events
        if ev is not None and ev.enable_kv_cache_events and ev.publisher == "zmq" and not read_only:
            mediums = _mediums(self._manager.tiers, self._kinds, ev.mediums)
            self.events = KVEvents(ev, mediums, config.chunk_tokens)
            self._index.listener = self.events

    def _tier(self, cfg: TierConfig) -> Tier:
        backend = build_backend(cfg, self.config)
        capacity = cfg.capacity_bytes if cfg.capacity_managed else None
        return Tier(backend, capacity=capacity, is_device=cfg.kind == "device", policy=make_policy(self.config.eviction))

    async def open(self, prefixes: Iterable[str]) -> ChunkStore:
        """Adopt what the local durable tiers hold under `prefixes`: a reopened store finds all it had.
        Starts touching `host_prefault_bytes` of full-chunk buffers for the host tier's arena."""
        self._loop = asyncio.get_running_loop()
        if self.events is not None:
            self.events.cleared()  # what an earlier run announced is unknown now: routers start over
            self._publisher = ZmqPublisher(self.events)
        await self.adopt(prefixes)
        if self.config.host_prefault_bytes and not self._read_only:
            size = codec.encoded_size(self.config.chunk_tokens * self.spec.token_bytes)
            for tier in self._manager.tiers:
                tier.backend.prefault(size, self.config.host_prefault_bytes // size)
        return self

    def learn(self, keys: Sequence[str], tokens: Sequence[int] | array, salt: str | None = None) -> None:
        """The tokens behind chunk `keys` (a chain from the sequence's start), for the KV events: chunks
        are announced to routers only once their tokens are known (keys are one-way hashes)."""
        if self.events is not None and keys:
            self.events.learn(keys, tokens, self._index.tiers_of, salt)

    @property
    def publisher_endpoints(self) -> tuple[str, str | None] | None:
        """Where the KV events are published and replayed (the bound addresses), when they are."""
        p = self._publisher
        return None if p is None else (p.endpoint, p.replay_endpoint)

    def value_buffer(self, nbytes: int) -> Buffer:
        """Where to write a value (an encode, a promotion's copy): a touched buffer a tier recycles
        (the host tier's arena) when one of that size is free, else one an earlier write left behind
        (`recycle`), else fresh memory."""
        for tier in self._manager.tiers:
            if (buf := tier.backend.value_buffer(nbytes)) is not None:
                return buf
        return self._scratch.take(nbytes)

    def recycle(self, value: object) -> bool:
        """Keep the buffer of an encoded value once it is stored, for the next encode of that size,
        when no tier kept it (LMDB, files and Redis copy what they store; the host tier keeps the
        buffer itself, and its reference makes this a no-op) and nothing else references it (the
        arena's rule). Bounded by `io_depth` batches of `batch_bytes`: what writes have in flight.
        Pass the value itself (`recycle(values.pop())`), holding no other name for it."""
        return self._scratch.give(value, self._scratch_room)

    # -- what is where --------------------------------------------------------------------------

    @property
    def record_tier(self) -> str:
        return self._record.name

    @property
    def remote_record(self) -> bool:
        """The record tier is shared with other hosts (chunks there may vanish or appear under us)."""
        return self._record.backend.remote

    @property
    def record_ttl_s(self) -> float | None:
        """How long the record tier keeps a chunk it is not asked for again (a Redis tier's
        `ttl_seconds`), None when it keeps chunks until they are deleted."""
        ttl = self._record.backend.ttl_seconds
        return None if ttl is None else float(ttl)

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self._manager.tiers]

    def tier_info(self) -> list[TierInfo]:
        return [
            TierInfo(
                name=t.name, kind=self._kinds[t.name], durable=t.backend.durable, remote=t.backend.remote,
                record=t is self._record, capacity_bytes=t.capacity, used_bytes=t.used, chunks=len(t.sizes),
                lazy=t.lazy,
            )  # fmt: skip
            for t in self._manager.tiers
        ]

    def _named(self, tier_name: str) -> Tier:
        if tier_name not in self.tier_names:
            raise InvalidArgumentError(f"no tier {tier_name!r}; this store has {self.tier_names}")
        return self._manager.tier(tier_name)

    def backend(self, tier_name: str) -> Backend:
        """The backend of one tier (tests and operator tools inspect it; writes go through this class)."""
        return self._named(tier_name).backend

    def where(self, key: str) -> list[str]:
        """Tiers this process knows to hold `key`, fastest first."""
        return [t.name for t in self._manager.holders(key)]

    def fastest(self, key: str) -> str | None:
        return self._manager.fastest(key)

    def in_memory(self, key: str) -> bool:
        return any(not t.backend.durable for t in self._manager.holders(key))

    def __len__(self) -> int:
        return len(self._index)

    async def discover(self, keys: Sequence[str]) -> None:
        """Ask remote tiers (one batch each) about keys this process has not seen."""
        await self._manager.discover(keys)

    async def lookup(self, keys: Sequence[str]) -> int:
        """How many leading keys of a chain some tier holds; remote tiers asked past the index."""
        n = self._index.longest_prefix(keys)
        if n < len(keys):
            await self._manager.discover(keys[n:])
            n = self._index.longest_prefix(keys)
        return n

    async def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether some tier holds each key (remote tiers asked for the unknown ones)."""
        await self._manager.discover([k for k in keys if not self._index.tiers_of(k)])
        return [bool(self._index.tiers_of(k)) for k in keys]

    # -- pins -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def pinned(self, keys: Iterable[str]) -> Generator[None, None, None]:
        """Hold `keys` against eviction and gc for the block (counted: pins nest)."""
        keys = [k for k in keys if k]
        self._index.pin(keys)
        try:
            yield
        finally:
            self._index.unpin(keys)

    # -- holds (hints and retention: what is expected back in the fast tiers) ---------------------

    def hold(
        self, name: str, owner: str, keys: Sequence[str], *, for_s: float, back_in_s: float = math.inf, kind: str = ""
    ) -> Hold:
        """Ask the cache tiers to keep `keys` for `for_s` seconds, expected back in `back_in_s`
        (replaces the hold called `name`). Soft: see `holds.py` for what eviction does with it."""
        return self._holds.set(name, owner, keys, for_s=for_s, back_in_s=back_in_s, kind=kind)

    def held(self, name: str) -> Hold | None:
        return self._holds.get(name)

    def release(self, name: str, keys: Sequence[str] = ()) -> None:
        """End the hold `name`; `keys` no other hold names go first in line for eviction."""
        self._holds.drop(name)
        self._manager.release(keys)

    def held_bytes(self, owner: str) -> dict[str, int]:
        """Per cache tier, the bytes the holds of `owner` claim there and that count (within its share)."""
        return {
            t.name: self._holds.held_bytes(owner, t.sizes, t.capacity)
            for t in self._manager.tiers
            if t.capacity is not None and t is not self._record
        }

    def tier_capacity(self, name: str) -> int | None:
        """A tier's byte capacity (None: unbounded, or managed by the backend itself)."""
        return self._manager.tier(name).capacity

    @property
    def memory_tier(self) -> str | None:
        """The host memory cache tier that `warm` fills (None when the store has none)."""
        for t in self._manager.tiers:
            if not t.is_device and not t.backend.durable and not t.backend.remote and t is not self._record:
                return t.name
        return None

    async def warm(self, keys: Sequence[str], tokens: Sequence[int]) -> tuple[int, int]:
        """Bring the chunks of `keys` (`tokens[i]` tokens each) that the host memory tier lacks up
        from the slower tiers now, so that the read that follows finds them there; returns the
        chunks and bytes moved. Keys must be pinned. A chunk no tier holds intact stays where it is."""
        name = self.memory_tier
        if name is None:
            return 0, 0
        tier = self._manager.tier(name)
        todo = [(k, n) for k, n in zip(keys, tokens) if k and not self._index.holds(k, name) and k not in self._warming]
        if not todo:
            return 0, 0
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for key, _ in todo:
            self._warming[key] = done
        try:
            await self._manager.discover([k for k, _ in todo])
            got = await self._transfer.fetch([k for k, _ in todo], [n for _, n in todo], promote=False)
            if got:
                await self._manager.put(tier, list(got), list(got.values()))
        finally:
            for key, _ in todo:
                if self._warming.get(key) is done:
                    del self._warming[key]
            done.set_result(None)
        return len(got), sum(len(v) for v in got.values())

    def warming(self, key: str) -> bool:
        """Whether a `warm` is bringing `key` up into host memory now."""
        return key in self._warming

    async def resident(self, keys: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Per tier, how many of `keys` it holds (as this process knows) and their stored bytes."""
        out: dict[str, tuple[int, int]] = {}
        for tier in self._manager.tiers:
            unique = [k for k in dict.fromkeys(keys) if k]
            held = [k for k, hit in zip(unique, await self._manager.known_in(tier, unique)) if hit]
            if tier.capacity is not None:
                sizes = [tier.sizes.get(k, 0) for k in held]
            else:
                sizes = await tier.backend.sizes(held) if held else []
            out[tier.name] = (len(held), sum(sizes))
        return out

    async def settle(self, keys: Sequence[str]) -> None:
        """Wait for deletes of any of `keys` that started before they were pinned."""
        waits = {self._deleting[k] for k in keys if k in self._deleting}
        if waits:
            await asyncio.gather(*waits)

    # -- writes ---------------------------------------------------------------------------------

    async def missing(self, keys: Sequence[str], *, durable: bool) -> list[int]:
        """Positions of the keys a store must write (dedupe). Keys must be pinned.

        Durable stores dedupe against the record tier only (a chunk held by a cache alone is
        written again, to the record tier); a shared record tier is asked every time, touching
        what it has so no host's gc takes it before this commit names it.
        """
        await self.settle(keys)
        if durable and self.remote_record:
            present = await self._record.backend.touch(keys)
            self._manager.note(self._record, keys, present)
            return [i for i, hit in enumerate(present) if not hit]
        if durable:
            held = await self._manager.known_in(self._record, keys)
            return [i for i, hit in enumerate(held) if not hit]
        await self._manager.discover(keys)
        return [i for i, k in enumerate(keys) if not self._index.tiers_of(k)]

    async def durable(self, keys: Sequence[str]) -> bool:
        """Whether the record tier holds every key, after any delete in flight (keys pinned): what a
        commit that names chunks without writing them (a fork) checks first."""
        return not await self.missing(keys, durable=True)

    async def write(
        self, keys: Sequence[str], chunks: Sequence[torch.Tensor | NativeKV], *, durable: bool,
        spec: ModelSpec | None = None,
    ) -> int:  # fmt: skip
        """Encode KV chunks (canonical, or `NativeKV` in an engine's layout) and store them where the
        write policy says, in one store call (one durable write of the record tier); returns encoded
        bytes. `spec`: the values are another spec's (a hybrid state's). Keys must be pinned."""
        return await self._transfer.write(keys, chunks, durable=durable, spec=spec)

    async def put_values(
        self, keys: Sequence[str], values: Sequence[Value], *, durable: bool = False, tiers: Sequence[str] | None = None
    ) -> None:
        """Store already encoded (and checked) values where the write policy says, or into exactly
        `tiers` (repair). Keys must be pinned."""
        if tiers is None:
            await self._manager.store(keys, values, durable=durable)
            return
        for name in tiers:
            await self._manager.put(self._named(name), keys, values)

    # -- reads ----------------------------------------------------------------------------------

    async def read(
        self, keys: Sequence[str], spans: Sequence[Span], target: KVTarget, *, staged: dict[str, Value] | None = None,
        usage: Counter[str] | None = None, lossy: set[str] | None = None, stored: Sequence[int] | None = None,
    ) -> list[bool]:  # fmt: skip
        """Restore chunk `keys[i]` into `target` at `spans[i]`; which ones arrived intact. Keys
        must be pinned. A corrupt or missing copy is dropped and the next tier tried. `usage`
        counts the bytes read from each tier (`bytes_read:<tier>`), for the caller's accounting;
        `lossy` collects the keys whose restored bytes are a lossy reconstruction (an fp8 tier's);
        `stored[i]`: the tokens chunk i holds when its span restores only its first ones.
        Keys a `warm` is bringing up are read once it is done (from host memory, then)."""
        waits = {self._warming[k] for k in keys if k in self._warming}
        if waits:
            await asyncio.wait(waits)  # not cancelled with this read: other readers wait on it too
        return await self._transfer.read(keys, spans, target, staged=staged, usage=usage, lossy=lossy, stored=stored)

    async def read_as(
        self, spec: ModelSpec, keys: Sequence[str], tokens: Sequence[int], deliver: Callable[[int, torch.Tensor], None],
        lossy: set[str] | None = None,
    ) -> list[bool]:
        """Read chunks another slice of this model's heads stored (`spec`, `agentstate.slices`):
        `deliver(i, canonical KV)` in a pool thread, a view valid during the call; `lossy` collects the
        keys whose bytes are a lossy tier's reconstruction. Keys must be pinned."""
        return await self._transfer.read_as(spec, keys, tokens, deliver, lossy)

    @property
    def read_only(self) -> bool:
        return self._read_only

    @property
    def shared(self) -> bool:
        """Some tier is shared with other processes (remote): the only place chunks of another spec
        (another TP size's slices) can be, a data directory being one spec's (`agentstate.slices`)."""
        return any(t.backend.remote for t in self._manager.tiers)

    def count(self, **amounts: int) -> None:
        """Add to this store's own counters (`counters()`)."""
        self._counts.update(amounts)

    def read_held(
        self, keys: Sequence[str], tokens: Sequence[int], deliver: Callable[[int, torch.Tensor], None]
    ) -> list[bool]:
        """From any thread, without the event loop: the chunks the host tier holds, handed to
        `deliver(i, canonical KV)` in the calling thread; False for the rest (`read` them). For an
        engine thread that would otherwise wait on two thread hand-offs, each of which waits for the
        GIL behind the engine's own Python (SGLang's controller beside its scheduler: 3x the latency
        under load). Hits are accounted on the loop afterwards, as a `read`'s are."""
        tier = self._manager.tiers[0]
        loop = self._loop
        if self._closed or loop is None or tier.backend.durable or tier.backend.remote:
            return [False] * len(keys)
        ok = self._transfer.read_held(tier, keys, tokens, deliver)
        served = [k for k, good in zip(keys, ok) if good]
        if served:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing left to account
                loop.call_soon_threadsafe(self._transfer.account_held, tier, served)
        return ok

    async def fetch(self, keys: Sequence[str], tokens: Sequence[int]) -> dict[str, Value]:
        """Read and check chunks into owned host buffers (prefetch staging)."""
        return await self._transfer.fetch(keys, tokens)

    def prefetch(self, keys: Sequence[str], chunk_tokens: int) -> PrefetchHandle:
        """Start reading the chunks of `keys` that no memory tier holds into owned host buffers,
        in the background (one task per batch; the IO engine bounds what is in flight). The keys
        stay pinned until the reads end; `load(..., prefetch=handle)` completes it."""
        handle = _CountedPrefetch(keys, self.pinned, self._counts)
        slow = [k for k in keys if not self.in_memory(k)]
        runs = batches([chunk_tokens * self.spec.token_bytes] * len(slow), self.config.batch_bytes)

        async def fetch(run: list[str]) -> None:
            handle.staged.update(await self._transfer.fetch(run, [chunk_tokens] * len(run)))

        handle.start(Batch([asyncio.ensure_future(fetch([slow[i] for i in run])) for run in runs]))
        return handle

    async def read_value(self, key: str, tokens: int) -> memoryview | None:
        """The checked codec bytes of `key` (a chunk of `tokens` tokens) from the fastest tier
        holding an intact copy; None if none does."""
        if not (await self.present([key]))[0]:
            return None
        with self.pinned([key]):
            got = await self._transfer.fetch([key], [tokens])
        value = got.get(key)
        return memoryview(value) if value is not None else None

    def host_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A restore buffer from the pool of touched host memory (reused across resumes)."""
        return self._buffers.tensor(shape, dtype)

    # -- deletes and gc -------------------------------------------------------------------------

    async def delete(self, keys: Sequence[str], tiers: Sequence[str] | None = None) -> None:
        """Delete from every tier (or the named ones), whatever references them: for keys that are
        the caller's alone (a failed commit's tail). Everything else goes through `collect`."""
        chosen = None if tiers is None else [self._named(n) for n in tiers]
        await self._manager.delete(keys, chosen)

    async def collect(self, keys: Sequence[str], refcounts: RefCounts) -> list[str]:
        """Delete the keys nothing references and nothing pins; returns the ones deleted.

        Marked first (writers that dedupe against a marked key wait for the verdict), then
        counted: a commit that names a key after the mark either wrote it again or saw it gone
        (see module doc). Readers keep reading a marked key until it is actually deleted.
        """
        candidates = [k for k in dict.fromkeys(keys) if k and not self._index.pinned(k) and k not in self._deleting]
        if not candidates:
            return []
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for key in candidates:
            self._deleting[key] = done
        dead: list[str] = []
        try:
            counts = await refcounts(candidates)
            # A key pinned since the mark is being read or named again: it stays either way (a
            # reader of an unreferenced chunk may get a miss, never wrong bytes).
            dead = [k for k, n in zip(candidates, counts) if n == 0 and not self._index.pinned(k)]
            if dead:
                await self._manager.delete(dead)
        finally:
            for key in candidates:
                del self._deleting[key]
            done.set_result(None)
        return dead

    def sweep_cursor(self, prefixes: Sequence[str]) -> SweepCursor:
        """A new gc pass over every key the local durable tiers store under `prefixes`."""
        return SweepCursor(self._stored_keys(list(prefixes)))

    async def sweep_step(self, cursor: SweepCursor, refcounts: RefCounts, limit: int) -> SweepStep:
        """One step of gc over the local durable tiers: the next `limit` keys of `cursor`'s pass,
        each deleted if nothing references or pins it. A step's cost is bounded by `limit`,
        whatever the store holds. Keys are listed page by page in key order, so keys written or
        deleted during a pass are seen or skipped, never harmed: a new key is pinned until its
        commit names it."""
        if limit < 1:
            raise InvalidArgumentError(f"a gc step takes at least one key, not {limit}")
        keys = await cursor.take(limit)
        removed = len(await self.collect(keys, refcounts)) if keys else 0
        self._counts["gc_removed"] += removed
        if removed or cursor.done:
            await self._reclaim()
        return SweepStep(removed=removed, scanned=len(keys), done=cursor.done)

    async def _stored_keys(self, prefixes: Sequence[str]) -> AsyncIterator[str]:
        for tier in self._local_durable():
            for prefix in prefixes:
                async for key in tier.backend.keys(prefix):
                    yield key

    async def _reclaim(self) -> None:
        """After gc's deletes: local durable tiers give back what they only marked deleted."""
        for tier in self._local_durable():
            await tier.backend.reclaim()

    def _local_durable(self) -> list[Tier]:
        return [t for t in self._manager.tiers if t.backend.durable and not t.backend.remote]

    async def sweep_shared(self, prefixes: Sequence[str], live: set[str]) -> int:
        """gc under a shared catalog: what no manifest or prefix names goes from this host's tiers,
        and from remote tiers once unused for `gc_grace_seconds` (another host may be about to
        name it)."""
        removed = 0
        for tier in self._manager.tiers:
            found = [k for p in prefixes async for k in tier.backend.keys(p)]
            dead = [k for k in found if k not in live and not self._index.pinned(k) and k not in self._deleting]
            if tier.backend.remote:
                dead = await tier.backend.delete_idle(dead, self.config.gc_grace_seconds)
                self._manager.note(tier, dead, [False] * len(dead))
            elif dead:
                await self._manager.delete(dead, [tier])
            removed += len(dead)
        self._counts["gc_removed"] += removed
        await self._reclaim()
        return removed

    async def adopt(self, prefixes: Iterable[str]) -> None:
        """Account for what the local durable tiers with a capacity hold under `prefixes` (after a
        restart): their eviction needs every size. The others (LMDB, files: `Tier.lazy`) are not
        listed; the index asks them about a key when it does not know it."""
        prefixes = list(prefixes)
        found: dict[str, list[str]] = {}
        for tier in self._local_durable():
            if not tier.lazy:
                found[tier.name] = [k for p in prefixes async for k in tier.backend.keys(p)]
        await self._manager.adopt_existing(found)

    async def evict(
        self, tier_name: str, *, budget_bytes: int | None = None, keys: Sequence[str] | None = None
    ) -> EvictResult:
        """Drop copies from a cache tier: in eviction order (unheld oldest first, then held) down to
        `budget_bytes`, or exactly `keys`. A copy no lower tier holds is written down first; pinned
        chunks stay."""
        tier = self._cache_tier(tier_name)
        demoted_before = self._manager.counts["demotions"]
        async with tier.lock:
            names = self._manager.eviction_order(tier)
            sizes = dict(tier.sizes) if tier.capacity is not None else dict(zip(names, await tier.backend.sizes(names)))
            used = before = sum(sizes.values())
            victims = [k for k in dict.fromkeys(keys) if k in sizes] if keys is not None else names
            evicted = evicted_bytes = skipped = 0
            for key in victims:
                if budget_bytes is not None and used <= budget_bytes:
                    break
                if self._index.pinned(key) or key in tier.inflight or key in self._deleting:
                    skipped += 1
                    continue
                await self._manager.evict(tier, key)
                evicted, evicted_bytes, used = evicted + 1, evicted_bytes + sizes[key], used - sizes[key]
        return EvictResult(
            tier=tier.name, evicted=evicted, evicted_bytes=evicted_bytes, demoted=self._manager.counts["demotions"] - demoted_before,
            skipped_pinned=skipped, used_before=before, used_after=used,
        )  # fmt: skip

    def _cache_tier(self, name: str) -> Tier:
        tier = self._named(name)
        if tier is self._record:
            raise InvalidArgumentError(
                f"{name!r} is the record tier: it holds the durable copy of every session (use delete or gc)"
            )
        if tier.backend.remote:
            raise InvalidArgumentError(f"{name!r} is shared with other hosts; evict from it there, not from here")
        return tier

    # -- raw access for the operator tools (verify, repair) -------------------------------------

    async def scan(self, tier_name: str, prefix: str) -> list[str]:
        """Every key a tier stores under `prefix` (asks the backend, not the index)."""
        return [k async for k in self._named(tier_name).backend.keys(prefix)]

    async def read_raw(self, tier_name: str, keys: Sequence[str], sink: ReadSink) -> list[bool]:
        """Hand the stored bytes of `keys` in one tier to `sink`, unchecked (verify checks them)."""
        return await self._named(tier_name).backend.read(keys, sink)

    async def raw_value(self, tier_name: str, key: str) -> Value | None:
        """An owned copy of what one tier stores under `key`, unchecked; None if it holds nothing."""
        return await self._manager.read_bytes(self._named(tier_name), key)

    # -- lifecycle ------------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        scratch = self._scratch.stats()
        events = self.events.stats() if self.events is not None else {}
        return {
            **self._transfer.counts, **self._manager.counts, **self._counts, "io_peak_in_flight": self._io.peak_in_flight,
            "scratch_reused": scratch.reused, "scratch_fresh": scratch.fresh,
            "kv_events_published": events.get("events_published", 0), "kv_events_dropped": events.get("events_dropped", 0),
            "kv_chunks_forgotten": events.get("chunks_forgotten", 0),
        }  # fmt: skip

    def tier_counters(self) -> dict[str, dict[str, int]]:
        """Per tier, what this process counted: `hits` (chunks it served), `misses` (chunks a read
        asked of it, no faster tier having served them, that it did not serve), `read_bytes`,
        `written_bytes`, `corrupt`, `evictions`, `promotions` (into it), `put_errors`."""
        out: dict[str, dict[str, int]] = {t.name: {} for t in self._manager.tiers}
        for (tier, what), n in self._manager.tier_counts.items():
            out[tier][what] = n
        return out

    def breakers(self) -> list[BreakerInfo]:
        """The circuit breakers of the remote tiers, read from memory (no call to the store)."""
        out = []
        for tier in self._manager.tiers:
            out += [BreakerInfo(tier.name, node, b.state, b.trips) for node, b in tier.backend.breakers().items()]
        return out

    async def stats(self) -> list[BackendStats]:
        """Each tier's backend figures; a cache tier's capacity and evictions are the chunk layer's
        (backends store bytes; eviction is decided here)."""
        out = []
        for t in self._manager.tiers:
            stats = await t.backend.stats()
            if t.capacity is not None:
                evictions = self._manager.tier_counts[(t.name, "evictions")]
                stats = stats.model_copy(update={"capacity_bytes": t.capacity, "evictions": evictions})
            out.append(stats)
        return out

    async def flush(self) -> None:
        """Wait until background work (promotions of chunks read from slow tiers) is done."""
        await self._transfer.flush()

    def release_lock(self) -> None:
        """Give the directory lock back now (a store whose construction failed above this layer);
        a data directory this open made is removed with it, so the failed open leaves no files."""
        self._lock.discard()

    async def close(self) -> None:
        """Flush, close every tier, release the directory lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.flush()
            for tier in self._manager.tiers:
                await tier.backend.close()
        finally:
            if self._publisher is not None:
                self._publisher.close()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._buffers.clear()
            self._scratch.clear()  # a closed store keeps no memory, whoever still references it
            self._lock.release()


class _CountedPrefetch(PrefetchHandle):
    """A prefetch handle that counts the waits its deadline cut short (`prefetch_timeouts`)."""

    def __init__(
        self, keys: Sequence[str], pinned: Callable[[Iterable[str]], contextlib.AbstractContextManager[None]],
        counts: Counter[str],
    ) -> None:  # fmt: skip
        super().__init__(keys, pinned)
        self._counts = counts

    async def wait(self, timeout: float | None = None) -> bool:
        done = await super().wait(timeout)
        if not done:
            self._counts["prefetch_timeouts"] += 1
        return done


def _mediums(tiers: Sequence[Tier], kinds: dict[str, str], chosen: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Each tier as KV events name it: (medium, locality), one medium per tier. vLLM's vocabulary first
    (GPU, CPU, STORAGE for the first local disk tier, REMOTE for the first shared one); a second tier
    of a kind gets `<medium>:<tier name>`; `chosen` (kv_events.mediums) names any tier as the operator wants."""
    out: dict[str, tuple[str, str]] = {}
    for tier in tiers:
        locality = "REMOTE" if tier.backend.remote else "LOCAL"
        if tier.name in chosen:
            medium = chosen[tier.name]
        elif tier.is_device:
            medium = "GPU"
        elif kinds.get(tier.name) == "host":
            medium = "CPU"
        else:
            medium = "REMOTE" if tier.backend.remote else "STORAGE"
        if any(m == medium for m, _ in out.values()):
            medium = f"{medium}:{tier.name}"
        out[tier.name] = (medium, locality)
    return out


def _default_record(tiers: list[Tier], shared_catalog: bool) -> str:
    """LMDB by default; with a shared catalog, the durable remote tier, since every host must find
    the chunks a shared manifest names."""
    if shared_catalog:
        return next(t.name for t in tiers if t.backend.remote and t.backend.durable)
    return next(
        (t.name for t in tiers if t.backend.durable and t.name == "lmdb"),
        next((t.name for t in reversed(tiers) if t.backend.durable), ""),
    )
