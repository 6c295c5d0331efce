"""Mooncake Store tier: chunks in a Mooncake distributed store (a master plus storage segments).

The store's Python client is a blocking pybind object, and it fails quietly, so this module wraps
every call in what its failure modes need:

- Calls run on a small executor of our own, each under `timeout_s`, behind the circuit breaker
  the Redis tier uses: with the master down every call blocks ~4.3 s and returns -900, and a
  first `setup()` against a dead master blocks for ~90 s. The client is set up lazily, on a
  worker, so opening a store never hangs on it.
- Writes use upsert: `put` of an existing key returns 0 and keeps the old value.
- A missing key and a failed transfer look alike through plain `get` (both `b''`): reads go
  through `batch_get_into`, whose per-key codes tell a miss (-704) from a failure.
- Zero-copy: one host arena is registered with the transfer engine and split into one slot per
  worker. Reads land straight in a slot and the sink decodes from there (one copy, into the
  destination, as LMDB's mmap gives); writes are packed into a slot and sent from it with
  `batch_upsert_from`. A value larger than a slot falls back to plain `upsert`/`get` (staged
  through the client's own local buffer, so it must fit `local_buffer_bytes`).
- A full segment evicts the oldest objects silently and a killed storage process takes its
  values with it: this tier is a shared cache, never `durable`, so sessions never commit to it.

Keys are listed through the master's admin HTTP port (`/get_all_keys`, every key of the
cluster, filtered here by prefix): a full scan, for gc and admin, never on a hot path.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from agentstate.backends.base import Backend, BackendStats, ReadSink
from agentstate.backends.mooncake_io import Arena, DaemonPool, Guard, Slot
from agentstate.backends.mooncake_ops import INVALID, NO_SPACE, Value, fetch, outage, store
from agentstate.backends.redis import CircuitBreaker

from agentstate.errors import BackendError, BackendRefusedError, CapacityError, InvalidArgumentError

if TYPE_CHECKING:
    from agentstate.config import MooncakeTier, StoreConfig

log = logging.getLogger("agentstate.backends.mooncake")
T = TypeVar("T")


class MooncakeBackend(Backend):
    name = "mooncake"
    durable = False
    trusted = False
    remote = True

    def __init__(
        self,
        master: str = "127.0.0.1:50051",
        *,
        metadata_url: str = "http://127.0.0.1:8080/metadata",
        admin_url: str = "http://127.0.0.1:9003",
        local_host: str = "127.0.0.1",
        protocol: str = "tcp",
        rdma_devices: str = "",
        segment_bytes: int = 0,
        buffer_bytes: int = 256 << 20,
        local_buffer_bytes: int = 64 << 20,
        prefix: str = "agentstate:",
        timeout_s: float = 2.0,
        breaker_threshold: int = 3,
        breaker_cooldown_s: float = 5.0,
        threads: int = 4,
    ) -> None:
        try:
            import mooncake.store as mooncake_store  # optional dependency: loaded only when chosen
        except ImportError as exc:
            raise ImportError(
                "the mooncake tier needs mooncake-transfer-engine-non-cuda (pip install 'agentstate-kv[mooncake]')"
            ) from exc
        self._module = mooncake_store
        if protocol == "tcp":
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_host)  # else the engine may bind off-loopback
        self._setup_args = (local_host, metadata_url, segment_bytes, local_buffer_bytes, protocol, rdma_devices, master)
        self.admin_url, self.prefix, self.timeout_s = admin_url.rstrip("/"), prefix, timeout_s
        self.breaker = CircuitBreaker(breaker_threshold, breaker_cooldown_s)
        self._counts: Counter[str] = Counter()
        self._threads = threads
        self._pool = DaemonPool(threads, "agentstate-mooncake")
        self._gate: asyncio.Semaphore | None = None
        self._client: Any = None
        self._setup_lock = threading.Lock()
        self._lock = threading.Lock()
        self._inflight, self._closed = 0, False
        self._arena = Arena(buffer_bytes, threads)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def breakers(self) -> dict[str, CircuitBreaker]:
        """The one breaker of this tier (the master and its storage nodes as one)."""
        return {"server": self.breaker}

    @property
    def trips(self) -> int:
        return self.breaker.trips

    # -- plumbing ------------------------------------------------------------------------------

    def _connect(self) -> Any:
        """The set-up client (on a worker thread). One setup at a time: against a dead master it
        blocks for ~90 s, and later calls must fail within their own timeout, not queue behind it."""
        if self._client is not None:
            return self._client
        if not self._setup_lock.acquire(timeout=self.timeout_s):
            raise BackendError("mooncake client setup still in progress")
        try:
            if self._client is None:
                client = self._module.MooncakeDistributedStore()
                rc = client.setup(*self._setup_args)
                if rc != 0:
                    raise BackendError(f"mooncake setup failed ({rc}); master {self._setup_args[-1]}")
                rc = client.register_buffer(self._arena.addr, self._arena.size)
                if rc != 0:
                    client.close()
                    raise BackendError(f"mooncake register_buffer failed ({rc})")
                self._client = client
            return self._client
        finally:
            self._setup_lock.release()

    def _work(self, fn: Callable[[Any, Slot, Guard], T], guard: Guard) -> T:
        """Run `fn` on a worker. Calls in flight are counted: closing the client under one of them
        crashes the process when it returns, so the last call out closes a client `close` left."""
        with self._lock:
            if self._closed:
                raise BackendError("mooncake tier is closed")
            self._inflight += 1
        try:
            client = self._connect()
            with self._arena.slot() as slot:
                return fn(client, slot, guard)
        finally:
            with self._lock:
                self._inflight -= 1
                last = self._closed and self._inflight == 0
            if last:
                self._close_client()

    def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    async def _run(self, what: str, fn: Callable[[Any, Slot, Guard], T], guard: Guard | None = None) -> T:
        """One blocking call on a worker, bounded by `timeout_s`. A timeout, an exception or an
        open breaker raise BackendError (counted); the caller judges the return codes."""
        if self.breaker.open:
            self._counts["errors"] += 1
            raise BackendError("mooncake tier unavailable (circuit open)")
        guard = guard or Guard()
        if self._gate is None:
            self._gate = asyncio.Semaphore(self._threads)  # the timeout covers the call, not a queue
        loop = asyncio.get_running_loop()
        returned = False
        try:
            async with self._gate:
                result = await asyncio.wait_for(loop.run_in_executor(self._pool, self._work, fn, guard), self.timeout_s)
            returned = True
            return result
        except Exception as exc:
            self._failed(1)
            reason = "timed out" if isinstance(exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {exc}"
            log.warning("mooncake %s failed (%s)", what, reason)
            raise BackendError(f"mooncake {what} failed: {reason}") from exc
        finally:
            if not returned:  # timed out, failed or cancelled: the worker must not touch caller memory
                guard.abandon()

    def _failed(self, count: int) -> None:
        """Record `count` failed keys (one breaker failure per call), or a healthy call when 0."""
        if count:
            self._counts["errors"] += count
            self.breaker.failure()
        else:
            self.breaker.success()

    # -- reads ---------------------------------------------------------------------------------

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        names = [self._k(k) for k in keys]
        try:
            codes = await self._run("exists", lambda c, s, g: c.batch_is_exist(names))
        except BackendError:
            return [False] * len(keys)  # an unreachable store holds nothing we can use
        self._failed(sum(code < 0 for code in codes))
        return [code == 1 for code in codes]

    async def read(self, keys: Sequence[str], sink: ReadSink) -> list[bool]:
        if not keys:
            return []
        found = [False] * len(keys)
        guard = Guard()
        try:
            names = [self._k(k) for k in keys]
            failed = await self._run("get", lambda c, s, g: fetch(c, s, g, names, sink, found), guard)
            self._failed(failed)
        except BackendError:
            pass  # counted already; sinks that ran before the timeout delivered whole values
        hits = sum(found)
        self._counts.update(reads=hits, misses=len(keys) - hits)
        return found

    async def sizes(self, keys: Sequence[str]) -> list[int]:
        if not keys:
            return []
        names = [self._k(k) for k in keys]
        try:
            codes = await self._run("get_size", lambda c, s, g: [c.get_size(n) for n in names])
        except BackendError:
            return [0] * len(keys)
        self._failed(sum(outage(code) for code in codes))
        return [max(code, 0) for code in codes]

    async def keys(self, prefix: str | None = None) -> AsyncIterator[str]:
        """Every key under `prefix`, from the master's key list (the whole cluster's: a scan)."""
        if self.breaker.open:
            raise BackendError("mooncake tier unavailable (circuit open)")
        loop = asyncio.get_running_loop()
        url = f"{self.admin_url}/get_all_keys"
        try:
            body = await asyncio.wait_for(
                loop.run_in_executor(self._pool, lambda: urllib.request.urlopen(url, timeout=self.timeout_s).read()),
                self.timeout_s * 2,
            )
        except Exception as exc:
            self._failed(1)
            raise BackendError(f"mooncake key listing from {url} failed: {type(exc).__name__}: {exc}") from exc
        want = self._k(prefix or "")
        for line in body.decode("utf-8", "replace").splitlines():
            if line.startswith(want):
                yield line[len(self.prefix) :]

    # -- writes --------------------------------------------------------------------------------

    async def put(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        if not keys:
            return
        if len(keys) != len(values):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(values)} values")
        names = [self._k(k) for k in keys]
        codes = await self._run("put", lambda c, s, g: store(c, s, g, names, values), Guard())
        bad = [code for code in codes if code != 0]
        self._failed(sum(outage(code) and code not in (NO_SPACE, INVALID) for code in bad))
        self._counts["writes"] += len(keys) - len(bad)
        if not bad:
            return
        if NO_SPACE in bad:
            raise CapacityError(f"mooncake: no segment can hold {bad.count(NO_SPACE)} of {len(keys)} values")
        if INVALID in bad:
            raise BackendRefusedError(
                f"mooncake refused {bad.count(INVALID)} values (empty, or larger than a slot and the local buffer)"
            )
        raise BackendError(f"mooncake put failed for {len(bad)} of {len(keys)} keys (codes {sorted(set(bad))})")

    async def delete(self, keys: Sequence[str]) -> None:
        """Forced removal: a plain remove fails for 10 s after any read (the read lease)."""
        if not keys:
            return
        names = [self._k(k) for k in keys]
        codes = await self._run("delete", lambda c, s, g: c.batch_remove(names, True))
        failed = sum(outage(code) for code in codes)
        self._failed(failed)
        self._counts["deletes"] += sum(code == 0 for code in codes)
        if failed:
            raise BackendError(f"mooncake delete failed for {failed} of {len(keys)} keys")

    # -- admin ---------------------------------------------------------------------------------

    async def stats(self) -> BackendStats:
        """Counts and value bytes under this backend's prefix (a full key listing: admin only)."""
        try:
            keys = [k async for k in self.keys()]
        except BackendError:
            keys = []
        return BackendStats(
            name=self.name, items=len(keys), bytes_used=sum(await self.sizes(keys)), capacity_bytes=None,
            **{k: self._counts[k] for k in ("reads", "writes", "deletes", "misses", "errors")},
        )  # fmt: skip

    async def close(self) -> None:
        """Close without waiting on a call stuck in the client (a dead master holds one ~4.3 s):
        that call, once it returns, closes the client itself."""
        with self._lock:
            self._closed = True
            idle = self._inflight == 0
        self._pool.shutdown(wait=False, cancel_futures=True)
        if idle:  # on a thread of its own, bounded: close may block on a dead master too
            closer = DaemonPool(1, "agentstate-mooncake-close")
            try:
                await asyncio.wait_for(asyncio.wrap_future(closer.submit(self._close_client)), self.timeout_s)
            except (asyncio.TimeoutError, RuntimeError, BackendError) as exc:  # best effort: we may be exiting
                log.warning("mooncake close failed (%s: %s)", type(exc).__name__, exc)
            closer.shutdown(wait=False)

    @property
    def busy(self) -> int:
        """Calls still running in the client (some may have outlived their caller's timeout)."""
        return self._inflight


def from_config(cfg: MooncakeTier, store: StoreConfig) -> MooncakeBackend:
    """The Mooncake tier of a store."""
    return MooncakeBackend(
        cfg.master, metadata_url=cfg.metadata_url, admin_url=cfg.admin_url, local_host=cfg.local_host,
        protocol=cfg.protocol, rdma_devices=cfg.rdma_devices, segment_bytes=cfg.segment_bytes,
        buffer_bytes=cfg.buffer_bytes, prefix=cfg.prefix, timeout_s=cfg.timeout_s,
        breaker_threshold=cfg.breaker_threshold, breaker_cooldown_s=cfg.breaker_cooldown_s,
    )  # fmt: skip
