"""Backend registry: tier kind -> a factory that builds its backend from a TierConfig.

Each backend module is imported only when a tier of its kind is configured, so `import
agentstate` never needs redis, mooncake or CUDA. A new backend is one module in `backends/` plus
one entry here. A tier with `compression` set is its backend wrapped in a CompressedBackend (the
codec is imported only then, so zstandard and lz4 are needed only by tiers that use them).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from agentstate.backends.base import Backend
from agentstate.config import StoreConfig, TierConfig
from agentstate.errors import InvalidArgumentError

Factory = Callable[[TierConfig, StoreConfig], Backend]


def _host(cfg: TierConfig, store: StoreConfig) -> Backend:
    from agentstate.backends.host import HostBackend

    return HostBackend()


def _device(cfg: TierConfig, store: StoreConfig) -> Backend:
    from agentstate.backends.device import DeviceBackend

    return DeviceBackend(cfg.device)


def _lmdb(cfg: TierConfig, store: StoreConfig) -> Backend:
    from agentstate.backends.lmdb import LMDBBackend

    return LMDBBackend(
        Path(store.path) / (cfg.path or cfg.tier_name), map_size=store.lmdb_map_size,
        max_map_size=store.lmdb_max_map_size, threads=store.io_threads,
        value_log_min_bytes=store.lmdb_value_log_min_bytes, segment_bytes=store.lmdb_segment_bytes,
    )  # fmt: skip


def _file(cfg: TierConfig, store: StoreConfig) -> Backend:
    from agentstate.backends.file import FileBackend

    return FileBackend(Path(store.path) / (cfg.path or cfg.tier_name), threads=store.io_threads, o_direct=cfg.o_direct)


def _redis(cfg: TierConfig, store: StoreConfig) -> Backend:
    from agentstate.backends.redis import RedisBackend

    return RedisBackend(
        cfg.url, cluster=cfg.cluster, ttl_seconds=cfg.ttl_seconds, prefix=cfg.prefix, timeout_s=cfg.timeout_s,
        breaker_threshold=cfg.breaker_threshold, breaker_cooldown_s=cfg.breaker_cooldown_s,
        connections=cfg.connections,
    )  # fmt: skip


def _mooncake(cfg: TierConfig, store: StoreConfig) -> Backend:
    from agentstate.backends.mooncake import MooncakeBackend

    return MooncakeBackend(
        cfg.master, metadata_url=cfg.metadata_url, admin_url=cfg.admin_url, local_host=cfg.local_host,
        protocol=cfg.protocol, rdma_devices=cfg.rdma_devices, segment_bytes=cfg.segment_bytes,
        buffer_bytes=cfg.buffer_bytes, prefix=cfg.prefix, timeout_s=cfg.timeout_s,
        breaker_threshold=cfg.breaker_threshold, breaker_cooldown_s=cfg.breaker_cooldown_s,
    )  # fmt: skip


BACKENDS: dict[str, Factory] = {
    "host": _host,
    "device": _device,
    "lmdb": _lmdb,
    "file": _file,
    "redis": _redis,
    "mooncake": _mooncake,
}
CAPACITY_MANAGED = {"host", "device", "file"}
"""Kinds whose byte capacity the chunk layer enforces (LRU); the others fill or evict by themselves."""


def build_backend(cfg: TierConfig, store: StoreConfig) -> Backend:
    factory = BACKENDS.get(cfg.kind)
    if factory is None:
        raise InvalidArgumentError(f"unknown tier kind {cfg.kind!r}; known: {sorted(BACKENDS)}")
    backend = factory(cfg, store)
    if cfg.compression != "none":
        from agentstate.backends.compressed import CompressedBackend

        backend = CompressedBackend(backend, cfg.compression, threads=store.io_threads)
    backend.name = cfg.tier_name
    return backend
