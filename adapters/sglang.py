"""SGLang HiCache L3 storage on an agentstate store, loaded by SGLang's own backend factory::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "agentstate",
      "module_path": "agentstate.adapters.sglang", "class_name": "AgentStateStorage", "interface_v1": 1,
      "path": "/data/kv", "tiers": [{"kind": "host", "capacity_bytes": 8589934592}, {"kind": "lmdb"}]}'

Adapter keys: `path`, `model_id`, `revision`, `timeout_s`; any other non-SGLang key is a `StoreConfig`
field. Each rank has its own data directory below `path` (one process writes an LMDB at a time);
ranks and hosts share pages only through a remote tier, which is why keys carry the rank.

SGLang calls from its prefetch, backup and scheduler threads, and an exception out of a call
silently kills the prefetch thread: every call reaches the asyncio store through one private loop
and answers per page (False / None / 0 hits, logged and counted), never raising. Construction and
pool registration do raise typed errors (startup, inside SGLang's attach rollback).

A page is one codec value (checksummed, bound to its storage key: corruption, or a page's value
under another page's key, is a detected miss), stored canonical
`[layers, planes, page_size, heads, dim]` under `p/<fingerprint>/<page size>/<shard>/<key>`. The
fingerprint covers model, revision, dtype, layers, heads, head dim, TP rank/size (SGLang's own keys
leave dtype out; MLA KV is replicated, so it has no rank); the shard covers PP, attention CP and
the pool's format tag.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar, cast

import torch
from agentstate.adapters.runtime import LoopThread, never_raises
from agentstate.adapters.sglang_pages import (
    ExtraPool,
    PageLayout,
    PagesTarget,
    SglangSettings,
    encode_page,
    size_of,
    valid_key,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, PoolTransferResult

from agentstate.config import StoreConfig
from agentstate.errors import AgentStateError, BackendError, InvalidArgumentError
from agentstate.adapters import SGLANG_PAGES
from agentstate.settings import store_config
from agentstate.spec import ModelSpec
from agentstate.store import StateStore
from agentstate.chunks import ChunkStore

log = logging.getLogger("agentstate.adapters.sglang")
IO_STATS = ("prefetch_pgs", "prefetch_bandwidth", "backup_pgs", "backup_bandwidth")
IO_STATS_KEPT = 4096
"""Per-call figures kept for `get_stats` (SGLang drains them every scheduler step; a bound all the same)."""
T = TypeVar("T")


class AgentStateStorage(HiCacheStorage):  # type: ignore[misc]
    """A HiCacheStorage over a StateStore's tiers (default: host DRAM over LMDB)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.settings, self._overrides = SglangSettings.split(dict(storage_config.extra_config or {}))
        if storage_config.dcp_size > 1 or storage_config.should_split_heads:
            raise InvalidArgumentError("decode-context-parallel and split-head storage are not supported")
        self.counts: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        self._io_stats: dict[str, deque[float]] = {k: deque(maxlen=IO_STATS_KEPT) for k in IO_STATS}
        self._loop = LoopThread("agentstate-sglang")
        self.store: StateStore | None = None
        self.layout: PageLayout | None = None
        self._pool_view: torch.Tensor | None = None  # PageLayout.pool_view of the registered pool
        self._prefix = ""
        self._shard = ""
        self._extra: dict[str, ExtraPool] = {}  # a hybrid model's extra pools, by SGLang's pool name
        pool = (kwargs or {}).get("mem_pool_host")
        if pool is not None:
            self.register_mem_pool_host(pool)

    # -- setup (raises: startup, inside SGLang's attach rollback) -------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the store for this pool: the fingerprint needs its dtype, layers, heads and page size."""
        super().register_mem_pool_host(mem_pool_host)
        layout = PageLayout.of(mem_pool_host)
        sc = self.storage_config
        model = self.settings.model_id or sc.model_name
        if not model:
            raise InvalidArgumentError("no model name: SGLang passes one, or set model_id in the extra config")
        replicated = bool(sc.is_mla_model)
        spec = layout.spec(
            model, self.settings.revision, 0 if replicated else sc.tp_rank, 1 if replicated else sc.tp_size
        )
        shard = f"pp{sc.pp_rank}-{sc.pp_size}.cp{sc.attn_cp_rank}-{sc.attn_cp_size}"
        if tag := getattr(mem_pool_host, "storage_format_tag", None):
            shard += f".{tag}"
        rank_dir = self.settings.path / f"tp{sc.tp_rank}-{sc.tp_size}.{shard}"
        config = store_config(None, **{**self._overrides, "path": rank_dir})  # bad keys: InvalidArgumentError
        if self.store is not None:
            self._run(self.store.close())
        self.store, self.layout, self._pool_view = None, None, None
        self._prefix = f"{SGLANG_PAGES.prefix}{spec.fingerprint}/{layout.page_size}/{shard}/"
        self._shard, self._extra = shard, {}
        self.store = self._loop.run(self._open(config, spec), max(self.settings.timeout_s, 600.0))  # adopts every page
        self.layout = layout
        self._pool_view = layout.pool_view(mem_pool_host)

    async def _open(self, config: StoreConfig, spec: ModelSpec) -> StateStore:
        """Open this rank's directory, adopt its pages, and record its spec and config there, so that
        `agentstate stats|verify|ls -p <rank dir>` open it under the same spec and tiers."""
        store = await StateStore.open(config, spec, writer="agentstate.adapters.sglang")  # records spec and config
        try:
            await store.chunks.adopt([self._prefix])
        except BaseException:
            await store.close()
            raise
        return store

    # -- plumbing ------------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro, self.settings.timeout_s)

    def _count(self, **amounts: int) -> None:
        with self._count_lock:
            self.counts.update(amounts)

    def _failed(self, call: str, exc: BaseException) -> None:
        self._count(errors=1, timeouts=int(isinstance(exc, TimeoutError)))
        if isinstance(exc, (AgentStateError, TimeoutError)):
            log.warning("agentstate %s failed: %s", call, exc)
        else:
            log.exception("agentstate %s failed", call)

    def _ready(self) -> tuple[StateStore, PageLayout, ChunkStore]:
        if self.store is None or self.layout is None:
            raise BackendError("no host pool registered (or the backend is closed)")
        return self.store, self.layout, self.store.chunks

    def storage_key(self, key: str) -> str:
        return self._prefix + key

    def _canonical(self, key: object, page: object) -> torch.Tensor | None:
        """The canonical view of `page` for `key`, or None (counted) where either is unusable."""
        _, layout, _ = self._ready()
        try:
            if valid_key(key) and isinstance(page, torch.Tensor):
                return layout.canonical(page)
        except (InvalidArgumentError, RuntimeError):
            pass
        self._count(bad_pages=1)
        return None

    def _pool_pages(self, keys: Sequence[str], host_indices: Any) -> list[torch.Tensor | None]:
        """Canonical views of host-pool memory: page i starts at token slot `host_indices[i * page_size]`."""
        _, layout, _ = self._ready()
        pool, ps = self.mem_pool_host, layout.page_size
        indices = torch.as_tensor(host_indices).flatten()
        if indices.numel() != len(keys) * ps:
            raise InvalidArgumentError(f"{indices.numel()} host indices for {len(keys)} pages of {ps}")
        pages: list[torch.Tensor | None] = []
        size, whole = int(pool.size), self._pool_view
        for key, start in zip(keys, indices[::ps].tolist()):
            ok = 0 <= start < size and start % ps == 0
            if whole is not None and ok and valid_key(key):
                pages.append(whole.narrow(2, start, ps))
            else:
                pages.append(self._canonical(key, pool.get_data_page(start, flat=False) if ok else None))
        return pages

    # -- the two data paths --------------------------------------------------------------------

    def _set_pages(self, keys: Sequence[str], pages: Sequence[torch.Tensor | None]) -> list[bool]:
        """Encode new pages here, in SGLang's thread, straight from pool memory; then store them.

        Encoding before handing over means no read of pool memory outlives the call, even one
        that times out: SGLang may reuse the pages as soon as it returns.
        """
        store, _, _ = self._ready()
        todo = [i for i, p in enumerate(pages) if p is not None]
        present = self._run(self._present([self.storage_key(keys[i]) for i in todo]))
        new = [i for i, hit in zip(todo, present) if not hit]
        stored = [self.storage_key(keys[i]) for i in new]
        values = [encode_page(cast(torch.Tensor, pages[i]), store.fingerprint, k, store.chunks.value_buffer)
                  for i, k in zip(new, stored)]  # fmt: skip
        ok = [p is not None for p in pages]
        start = time.perf_counter()
        try:
            self._run(self._put(stored, values))
            self._count(pages_set=len(new), pages_present=len(todo) - len(new))
            if new:
                self._record_io("backup", len(new), len(new), start)
        except Exception as exc:  # noqa: BLE001 - per page: the new pages fail, the present ones stand
            self._failed("set", exc)
            for i in new:
                ok[i] = False
        return ok

    def _get_pages(self, keys: Sequence[str], pages: Sequence[torch.Tensor | None]) -> list[bool]:
        """Read pages straight into their destinations; True only for pages written in full.

        Pages the host tier holds are copied here, in SGLang's thread (`ChunkStore.read_held`):
        beside the scheduler's Python, every hand-off to the store's loop and back waits for the
        GIL, and a 64-page read took 3x as long that way. The rest go through the loop."""
        _, layout, chunks = self._ready()
        idx = [i for i, p in enumerate(pages) if p is not None]
        stored = [self.storage_key(keys[i]) for i in idx]
        start = time.perf_counter()
        ok = [False] * len(keys)
        try:
            held = chunks.read_held(stored, [layout.page_size] * len(idx),
                                    lambda j, src: cast(torch.Tensor, pages[idx[j]]).copy_(src))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a page it did not finish is read the usual way
            self._failed("get", exc)
            held = [False] * len(idx)
        for j, i in enumerate(idx):
            ok[i] = held[j]
        rest = [j for j in range(len(idx)) if not held[j]]
        target = PagesTarget([cast(torch.Tensor, pages[idx[j]]) for j in rest], layout.page_size)
        try:
            if rest:
                self._run(self._get([stored[j] for j in rest], target))
        except Exception as exc:  # noqa: BLE001 - per page: what was written in full still counts
            self._failed("get", exc)
        finally:
            written = target.close()
        for n, j in enumerate(rest):
            ok[idx[j]] = n in written
        self._count(pages_read=sum(ok), page_misses=len(idx) - sum(ok))
        self._record_io("prefetch", len(keys), sum(ok), start)
        return ok

    async def _present(self, keys: list[str]) -> list[bool]:
        _, _, chunks = self._ready()
        return await chunks.present(keys)  # remote tiers: pages other hosts or ranks stored

    async def _put(self, keys: list[str], values: list[Any]) -> None:
        _, _, chunks = self._ready()
        with chunks.pinned(keys):
            new = await chunks.missing(keys, durable=False)
            if new:
                await chunks.put_values([keys[i] for i in new], [values[i] for i in new])

    async def _get(self, keys: list[str], target: PagesTarget) -> list[bool]:
        _, layout, chunks = self._ready()
        await self._present(keys)
        with chunks.pinned(keys):
            return await chunks.read(keys, [(i * layout.page_size, layout.page_size) for i in range(len(keys))], target)

    # -- HiCacheStorage ------------------------------------------------------------------------

    @never_raises(lambda keys, *_, **__: [False] * size_of(keys))
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Zero-copy write: each value is encoded straight from the pool page it names."""
        return self._set_pages(keys, self._pool_pages(keys, host_indices))

    @never_raises(lambda keys, *_, **__: [False] * size_of(keys))
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Zero-copy read: each checked page is copied once, from the tier straight into pool memory."""
        return self._get_pages(keys, self._pool_pages(keys, host_indices))

    @never_raises(lambda keys, *_, **__: 0)
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading keys are stored (the prefix SGLang may prefetch)."""
        keys = list(keys)
        n = next((i for i, k in enumerate(keys) if not valid_key(k)), len(keys))
        return self._run(self._leading([self.storage_key(k) for k in keys[:n]])) if n else 0

    async def _leading(self, keys: list[str]) -> int:
        """How many leading pages are stored: this rank's, or brought in from what another TP size
        stored in a shared tier (its heads of the whole page, or the slices holding them, kept
        under this rank's key: `StateStore.lookup_keys`)."""
        store, layout, _ = self._ready()
        return await store.lookup_keys(keys, layout.page_size)

    @never_raises(lambda *_, **__: False)
    def exists(self, key: str) -> bool:
        return bool(self.batch_exists([key]) == 1)

    @never_raises(lambda keys, *_, **__: [None] * size_of(keys))
    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Generic read into flat pages (`get_dummy_flat_data_page()`); a page is allocated where none is given."""
        _, layout, _ = self._ready()
        given = list(target_locations) if target_locations is not None else [None] * len(keys)
        targets = [t if t is not None else torch.empty(layout.numel, dtype=layout.dtype) for t in given]
        ok = self._get_pages(keys, [self._canonical(k, t) for k, t in zip(keys, targets, strict=True)])
        return [t if good else None for t, good in zip(targets, ok)]

    @never_raises(lambda *_, **__: None)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    @never_raises(lambda *_, **__: False)
    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Generic write of flat pages (`get_data_page(i)`); True only if every page is stored."""
        pages = [self._canonical(k, v) for k, v in zip(keys, values, strict=True)]
        return all(self._set_pages(keys, pages))

    @never_raises(lambda *_, **__: False)
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return bool(self.batch_set([key], [value]))

    # -- v2: a hybrid model's extra pools (Mamba states, sliding-window pages, sidecars) ---------

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """An extra host pool of a hybrid model (SGLang registers each after the KV pool): its pages are
        stored as opaque bytes (`ExtraPool`), under the same page keys. Raises typed errors (startup)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == "kv":  # the KV pool itself: its pages go through v1
            return
        store, layout, _ = self._ready()
        self._extra[name] = ExtraPool.of(name, host_pool, store.spec, layout.page_size, self._shard)

    @never_raises(lambda *_, **__: PoolTransferResult.empty())
    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """The longest prefix of `keys` (pages) whose KV and every extra pool's pages are stored, and
        every shorter one that is (`restorable_prefix_pages`: a Mamba state exists at some boundaries
        only, and SGLang's TP ranks agree on one they all hold). TRAILING_PAGES: a prefix of p pages
        needs the pool's objects of its last N pages (N = the transfer's key count: its placeholders);
        ALL_PAGES: of every page. A pool not registered, or another policy: no hit."""
        keys = list(keys)
        n = next((i for i, k in enumerate(keys) if not valid_key(k)), len(keys))
        kv = self._run(self._leading([self.storage_key(k) for k in keys[:n]])) if n else 0
        hits: dict[str, int] = {"kv": kv}
        restorable = set(range(1, kv + 1))
        for t in pool_transfers or []:
            name = str(t.name)
            if name == "kv":
                continue
            pool = self._extra.get(name)
            policy = str(getattr(t.hit_policy, "value", t.hit_policy))
            if pool is None or policy not in ("trailing_pages", "all_pages"):
                return PoolTransferResult(0, {**hits, name: 0}, [])
            held = self._run(self._present([pool.key(k) for k in keys[:kv]])) if kv else []
            trailing = size_of(t.keys) if policy == "trailing_pages" else kv
            ok = {p for p in range(1, kv + 1) if all(held[max(0, p - trailing) : p])}
            hits[name] = max(ok, default=0)
            restorable &= ok
        best = max(restorable, default=0)
        return PoolTransferResult(best, hits, sorted(restorable))

    @never_raises(lambda transfers, *_, **__: _all_false(transfers))
    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        """Each extra pool's pages, read into its host slots (`host_indices[i * page_size]`): True per
        page whose stored value was intact and copied in whole."""
        return {str(t.name): self._pool_io(t, write=False) for t in transfers or []}

    @never_raises(lambda transfers, *_, **__: _all_false(transfers))
    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        """Each extra pool's pages, copied out of its host slots and stored (a page already stored is kept)."""
        return {str(t.name): self._pool_io(t, write=True) for t in transfers or []}

    def _pool_io(self, transfer: Any, write: bool) -> list[bool]:
        keys = list(transfer.keys or [])
        pool = self._extra.get(str(transfer.name))
        if str(transfer.name) == "kv":  # KV through v2 (a sidecar of the anchor): as v1
            return (self.batch_set_v1 if write else self.batch_get_v1)(keys, transfer.host_indices)
        if pool is None or transfer.host_indices is None:
            return [False] * len(keys)
        slots = pool.slots(keys, transfer.host_indices)
        if slots is None:  # host indices that are not one page per key: nothing moved
            self._count(bad_pages=len(keys))
            return [False] * len(keys)
        good = [i for i, k in enumerate(keys) if valid_key(k)]
        try:
            if write:
                pages = {i: pool.page(slots[i]) for i in good}  # copied out here: SGLang reuses the slots once we return
                self._run(self._put_pool(pool, [pool.key(keys[i]) for i in good], [pages[i] for i in good]))
                self._count(pool_pages_set=len(good))
                return [i in pages for i in range(len(keys))]
            got = self._run(self._get_pool(pool, [pool.key(keys[i]) for i in good]))
            ok = [False] * len(keys)
            for i, page in zip(good, got):
                if page is not None:
                    pool.put(slots[i], page)
                    ok[i] = True
            self._count(pool_pages_read=sum(ok), pool_page_misses=len(keys) - sum(ok))
            return ok
        except Exception as exc:  # noqa: BLE001 - per call: a miss, never an exception into SGLang's thread
            self._failed("set_v2" if write else "get_v2", exc)
            return [False] * len(keys)

    async def _put_pool(self, pool: ExtraPool, keys: list[str], pages: list[torch.Tensor]) -> None:
        _, _, chunks = self._ready()
        with chunks.pinned(keys):
            new = await chunks.missing(keys, durable=False)
            if new:
                await chunks.write([keys[i] for i in new], [pages[i] for i in new], durable=False, spec=pool.spec)

    async def _get_pool(self, pool: ExtraPool, keys: list[str]) -> list[torch.Tensor | None]:
        _, _, chunks = self._ready()
        out: list[torch.Tensor | None] = [None] * len(keys)

        def land(i: int, src: torch.Tensor) -> None:
            out[i] = src.reshape(-1).clone()

        await chunks.discover(keys)
        with chunks.pinned(keys):
            await chunks.read_as(pool.spec, keys, [pool.nbytes] * len(keys), land)
        return out

    @never_raises(lambda *_, **__: False)
    def clear(self) -> bool:
        """Delete every page of this backend's fingerprint and shard, from every tier."""
        return bool(self._run(self._clear()))

    async def _clear(self) -> bool:
        _, _, chunks = self._ready()
        for tier in chunks.tier_names:
            for prefix in [self._prefix, *(pool.prefix for pool in self._extra.values())]:
                await chunks.delete(await chunks.scan(tier, prefix), [tier])
        return True

    def _record_io(self, kind: str, pages: int, moved: int, start: float) -> None:
        """One call's pages and GB/s (pages moved over its wall time) for `get_stats`, when SGLang
        asked for storage metrics (`enable_storage_metrics`; nobody drains them otherwise)."""
        if not self.storage_config.enable_storage_metrics or self.layout is None:
            return
        seconds = max(time.perf_counter() - start, 1e-9)
        gib = moved * self.layout.numel * self.layout.dtype.itemsize / (1 << 30)
        with self._count_lock:
            self._io_stats[f"{kind}_pgs"].append(pages)
            self._io_stats[f"{kind}_bandwidth"].append(gib / seconds)

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` since the last call, as its scheduler reads them every step with
        storage metrics on: pages and GB/s of each batch_get_v1 (prefetch) and of each batch_set_v1 that
        wrote new pages (backup; pages already stored are not counted), the figures SGLang's own L3
        backends report, exported by SGLang as `sglang:prefetch_pgs`, `sglang:backup_bandwidth`, ...
        Drains what it returns. None (SGLang's "no stats") where SGLang's metrics module does not
        import; never raises."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:  # noqa: BLE001 - outside a full SGLang install: no stats, not an error
            return None
        out = StorageMetrics()
        with self._count_lock:
            for name, kept in self._io_stats.items():
                getattr(out, name).extend(kept)
                kept.clear()
        return out

    def counters(self) -> dict[str, int]:
        """This backend's counts (pages set/read/missing, bad pages, errors) and the transfer's (corrupt)."""
        with self._count_lock:
            out = dict(self.counts)
        if self.store is not None and not self._loop.closed:
            out.update(self._run(self._transfer_counts()))
        return out

    async def _transfer_counts(self) -> dict[str, int]:
        return self.store.chunks.counters() if self.store is not None else {}

    def close(self) -> None:
        """Flush background promotions, close the store's tiers, stop the loop. Idempotent; never raises."""
        try:
            if self.store is not None and not self._loop.closed:
                self._run(self.store.close())
        except Exception as exc:  # noqa: BLE001 - close runs in SGLang's detach, and must stop the loop
            self._failed("close", exc)
        finally:
            self.store, self.layout, self._pool_view = None, None, None
            self._loop.stop()


def _all_false(transfers: Any) -> dict[str, list[bool]]:
    try:
        return {str(t.name): [False] * size_of(t.keys or []) for t in transfers or []}
    except Exception:  # noqa: BLE001 - transfers SGLang would never send: nothing to answer for
        return {}
