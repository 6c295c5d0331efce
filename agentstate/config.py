"""Store configuration (pydantic): one object, from code, `AGENTSTATE_*` env vars or a config file
(`agentstate.settings` layers a file under the env; docs/config.md lists every key).

Byte sizes (`Bytes` fields) take an int or a string with a unit, read as pydantic's `ByteSize`
reads it: "512MiB", "32GiB" (powers of 1024), "32GB" (powers of 1000), "1.5TiB", 1073741824.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel, BeforeValidator, ByteSize, ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator,
)  # fmt: skip
from pydantic_settings import BaseSettings, SettingsConfigDict

from agentstate.events import KVEventsConfig
from agentstate.keys import validate_id

GiB = 1 << 30
MiB = 1 << 20
MAX_MAP_BYTES = 1 << 46 if sys.maxsize > 1 << 32 else 1 << 30
"""Largest `lmdb_map_size`: LMDB maps its whole map at open, one range of virtual address space.
A 64-bit Linux process has 128 TiB of it (47 bits), part in use, so 64 TiB; a 32-bit one 4 GiB,
so 1 GiB. Past it the open fails (ENOMEM), or, past 2^64, cannot even be asked for."""
MAX_LIMIT_BYTES = sys.maxsize
"""Largest `lmdb_max_map_size`: a byte count the platform can hold (the value log is not mapped)."""
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*((?:[kmgtpe]i?)?b|[kmgtpe])?\s*", re.IGNORECASE)


def parse_size(value: object) -> object:
    """A byte size from an int or a string like "32GiB" (units as pydantic's ByteSize: KiB..EiB are
    powers of 1024, KB..EB and K..E powers of 1000, B bytes); anything else goes on to int validation."""
    if isinstance(value, bool):
        raise ValueError("a byte size is a number or a string like '32GiB', not a boolean")  # noqa: TRY004
    if not isinstance(value, str):
        return value
    found = _SIZE.fullmatch(value)
    if found is None:
        raise ValueError(f"{value!r} is not a byte size: use a number of bytes or a number and a unit"
                         " (512MiB, 32GiB, 1.5TB)")  # fmt: skip
    number, unit = found.groups()
    return ByteSize(int(float(number) * ByteSize.byte_sizes[(unit or "b").lower()]))


SIZE = BeforeValidator(parse_size)
Bytes = Annotated[int, SIZE]
"""A byte size: an int, or a string with a unit ("32GiB"); stored as an int."""


class TierConfig(BaseModel):
    """One storage tier: the keys every kind has. Order in `StoreConfig.tiers` is fast to slow.

    Each kind has a model of its own below, picked by `kind` (`HostTier`, `LMDBTier`, ...), so a
    key another kind takes is refused, not ignored; `TierConfig(kind=...)` and
    `TierConfig.model_validate({...})` build that model. A kind not listed is a backend outside the
    repository (`ExternalTier`): `module_path` names the module that builds it. A kind's model says
    where its backend lives (`backend_module`, imported only when a tier of that kind is opened,
    whose `from_config(cfg, store)` builds it) and whether the chunk layer enforces its capacity.
    """

    model_config = ConfigDict(extra="forbid")
    backend_module: ClassVar[str] = ""
    """the module whose `from_config(cfg, store)` builds this kind's backend"""
    capacity_managed: ClassVar[bool] = False
    """the chunk layer enforces `capacity_bytes` (evicts); other kinds fill or evict by themselves"""

    kind: str = Field(description="the backend: device, host, lmdb, file, redis, mooncake, or one outside the repository")
    name: str | None = Field(default=None, description="unique tier name; defaults to the kind")
    capacity_bytes: Bytes | None = Field(default=None, ge=0, description="cache tiers: evict beyond this")
    compression: Literal["none", "zstd", "lz4", "fp8", "fp8+zstd"] = Field(
        default="none",
        description="store this tier's values compressed: zstd/lz4 lossless (byte planes), fp8 lossy (e4m3 with"
        " per-head scales), fp8+zstd; capacity counts compressed bytes; needs agentstate-kv[compress]",
    )

    def __new__(cls, *args: Any, **data: Any) -> Any:
        """`TierConfig(kind=...)` is the model of that kind (the base is never built itself)."""
        return super().__new__(tier_model(data.get("kind")) if cls is TierConfig else cls)

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """On `TierConfig` itself: the model of `obj`'s kind."""
        if cls is TierConfig:
            return _ANY_TIER.validate_python(obj, **kwargs)
        return super().model_validate(obj, **kwargs)

    @property
    def tier_name(self) -> str:
        return self.name or self.kind

    @property
    def lossy(self) -> bool:
        """This tier keeps a lossy encoding (fp8): what it gives back is not bit-exact."""
        return self.compression.startswith("fp8")


class DeviceTier(TierConfig):
    """A torch device buffer (the engine's own pool is the adapters' business); a cache tier."""

    backend_module: ClassVar[str] = "agentstate.backends.device"
    capacity_managed: ClassVar[bool] = True
    kind: Literal["device"] = Field(default="device", description="the backend")
    device: str = Field(default="cpu", description="device tier: torch device")

    @model_validator(mode="after")
    def _plain(self) -> DeviceTier:
        if self.compression != "none":
            raise ValueError("the device tier serves chunks to the engine as they are; it cannot be compressed")
        return self


class HostTier(TierConfig):
    """DRAM of this process; a cache tier."""

    backend_module: ClassVar[str] = "agentstate.backends.host"
    capacity_managed: ClassVar[bool] = True
    kind: Literal["host"] = Field(default="host", description="the backend")


class LMDBTier(TierConfig):
    """LMDB in the data directory (sizes: the store's `lmdb_*` keys); durable."""

    backend_module: ClassVar[str] = "agentstate.backends.lmdb"
    kind: Literal["lmdb"] = Field(default="lmdb", description="the backend")
    path: Path | None = Field(default=None, description="lmdb/file: directory, relative to the store path")


class FileTier(TierConfig):
    """One file per chunk on a local disk; durable, or a cache tier with `capacity_bytes`."""

    backend_module: ClassVar[str] = "agentstate.backends.file"
    capacity_managed: ClassVar[bool] = True
    kind: Literal["file"] = Field(default="file", description="the backend")
    path: Path | None = Field(default=None, description="lmdb/file: directory, relative to the store path")
    o_direct: bool = Field(default=False, description="file tier: O_DIRECT reads")


class RemoteTier(TierConfig):
    """The keys every remote tier has: a deployment's key prefix, call bounds, a circuit breaker."""

    prefix: str = Field(default="agentstate:", description="redis/mooncake tier: key prefix of this deployment")
    timeout_s: float = Field(default=2.0, gt=0, description="remote tiers: bound of each call")
    breaker_threshold: int = Field(default=3, gt=0, description="remote tiers: failures in a row that open the breaker")
    breaker_cooldown_s: float = Field(default=5.0, gt=0, description="remote tiers: skip an open node this long")


class RedisTier(RemoteTier):
    """Redis or Redis Cluster, shared by every host; durable."""

    backend_module: ClassVar[str] = "agentstate.backends.redis"
    kind: Literal["redis"] = Field(default="redis", description="the backend")
    url: str = Field(default="redis://127.0.0.1:6379/0", description="redis tier: server or cluster URL")
    cluster: bool = Field(default=False, description="redis tier: use the Redis Cluster client")
    ttl_seconds: int | None = Field(default=None, gt=0, description="redis tier: expire chunks after this")
    connections: int = Field(
        default=4, gt=0, le=256, description="redis tier: connections per node that read values straight into buffers"
    )


class MooncakeTier(RemoteTier):
    """Mooncake Store, shared by every host; evicts by itself when full, so only a cache."""

    backend_module: ClassVar[str] = "agentstate.backends.mooncake"
    kind: Literal["mooncake"] = Field(default="mooncake", description="the backend")
    master: str = Field(default="127.0.0.1:50051", description="mooncake tier: master RPC address host:port")
    metadata_url: str = Field(
        default="http://127.0.0.1:8080/metadata", description="mooncake tier: transfer-engine metadata server"
    )
    admin_url: str = Field(
        default="http://127.0.0.1:9003", description="mooncake tier: master's metrics/admin HTTP port (key listing)"
    )
    protocol: Literal["tcp", "rdma"] = Field(default="tcp", description="mooncake tier: transfer protocol")
    rdma_devices: str = Field(default="", description="mooncake tier: RDMA devices, comma separated")
    local_host: str = Field(default="127.0.0.1", description="mooncake tier: this client's address as peers see it")
    segment_bytes: Bytes = Field(
        default=0, ge=0, description="mooncake tier: memory this process contributes to the store (0: client only)"
    )
    buffer_bytes: Bytes = Field(
        default=256 * MiB, gt=0, description="mooncake tier: registered arena for zero-copy reads and writes"
    )

    @model_validator(mode="before")
    @classmethod
    def _no_expiry(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("ttl_seconds") is not None:
            raise ValueError("the mooncake tier has no expiry (ttl_seconds); it evicts by itself when full")
        return data


class ExternalTier(TierConfig):
    """A backend outside the repository: `kind` is its own name, `module_path` the module (a dotted
    name on sys.path, or a .py file) whose `from_config(cfg, store)` returns its `Backend`, and
    `options` whatever else it reads. The chunk layer enforces `capacity_bytes` when one is set."""

    capacity_managed: ClassVar[bool] = True
    module_path: str | None = Field(
        default=None, description="external tier: module with from_config(cfg, store): a dotted name or a .py file"
    )
    options: dict[str, Any] = Field(default_factory=dict, description="external tier: passed to its from_config")

    @model_validator(mode="after")
    def _located(self) -> ExternalTier:
        if not self.module_path:
            raise ValueError(
                f"unknown tier kind {self.kind!r}; known: {sorted(TIER_KINDS)}, or a backend outside the"
                " repository named by module_path"
            )
        return self


TIER_KINDS: dict[str, type[TierConfig]] = {
    "device": DeviceTier, "host": HostTier, "lmdb": LMDBTier, "file": FileTier, "redis": RedisTier,
    "mooncake": MooncakeTier,
}  # fmt: skip
"""Every kind in the repository -> its config model (which names the module of its backend)."""


def tier_model(kind: object) -> type[TierConfig]:
    """The config model of `kind`: a listed kind's, else ExternalTier (a backend outside the repository)."""
    return TIER_KINDS.get(kind, ExternalTier) if isinstance(kind, str) else ExternalTier


def _kind_tag(value: Any) -> str:
    kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    return kind if isinstance(kind, str) and kind in TIER_KINDS else "external"


AnyTier = Annotated[
    Annotated[DeviceTier, Tag("device")] | Annotated[HostTier, Tag("host")] | Annotated[LMDBTier, Tag("lmdb")]
    | Annotated[FileTier, Tag("file")] | Annotated[RedisTier, Tag("redis")] | Annotated[MooncakeTier, Tag("mooncake")]
    | Annotated[ExternalTier, Tag("external")],
    Discriminator(_kind_tag),
]  # fmt: skip
"""One tier's config, as its kind's model (a pydantic union discriminated by `kind`)."""
_ANY_TIER: TypeAdapter[TierConfig] = TypeAdapter(AnyTier)


class StoreConfig(BaseSettings):
    """Embedded default: a host (DRAM) tier over LMDB in `path`; no server to start."""

    model_config = SettingsConfigDict(env_prefix="AGENTSTATE_", extra="forbid")

    path: Path = Field(default=Path("agentstate-data"), description="data directory (catalog, LMDB files, spec.json)")
    tenant: str = Field(default="default", description="sessions and the key namespace are scoped to it")
    shared_namespace: bool = Field(
        default=False, description="opt in to one global key namespace, so tenants share prefix chunks"
    )
    chunk_tokens: int = Field(default=256, gt=0, le=1 << 16, description="tokens per chunk")
    host_capacity_bytes: Bytes = Field(default=4 * GiB, ge=0, description="0 disables the host tier")
    host_arena_bytes: Bytes = Field(
        default=GiB, ge=0, description="host tier: buffers of dropped values kept, touched, for the next values"
        " written there (at most the tier's capacity; process memory on top of what the tier stores)",
    )  # fmt: skip
    host_prefault_bytes: Bytes = Field(
        default=0, ge=0, description="host tier: full-chunk buffers touched in the background at open, so the first"
        " snapshots and promotions write into touched memory (within host_arena_bytes)",
    )  # fmt: skip
    restore_pool_bytes: Bytes = Field(
        default=2 * GiB, ge=0, description="freed restore buffers kept, touched, for the next resume"
    )
    promote_on_read: bool = Field(default=True, description="copy chunks read from LMDB into the host tier")
    lmdb_map_size: Bytes = Field(
        default=GiB, gt=0, le=MAX_MAP_BYTES, description="initial LMDB map; it grows when full"
    )  # at most MAX_MAP_BYTES: the map is one range of the process's address space
    lmdb_max_map_size: Bytes | None = Field(
        default=None, gt=0, le=MAX_LIMIT_BYTES,
        description="hard limit of the LMDB tier: its map and its value log's segment files together",
    )  # fmt: skip
    lmdb_value_log_min_bytes: Bytes | None = Field(
        default=256 * 1024, ge=0,
        description="LMDB values at least this large (KV chunks) go to the value log: appended to segment files,"
        " synced once per group commit, LMDB keeping a pointer; None keeps every value in LMDB's map",
    )  # fmt: skip
    lmdb_segment_bytes: Bytes = Field(
        default=GiB, ge=1 << 20, description="LMDB value log: a segment file rolls over past this size"
    )
    io_depth: int = Field(default=8, gt=0, le=1024, description="chunk reads/writes in flight per call")
    io_threads: int = Field(default=4, gt=0, le=256, description="threads for blocking IO and copies")
    batch_bytes: Bytes = Field(default=16 * MiB, gt=0, description="target bytes per backend call")
    tiers: list[AnyTier] | None = Field(
        default=None, description="tiers fast to slow; default: host (host_capacity_bytes) over lmdb"
    )
    record_tier: str | None = Field(
        default=None, description="durable tier sessions commit to; default lmdb, or the remote tier with catalog_url"
    )
    catalog_url: str | None = Field(
        default=None,
        description="Redis URL of a catalog shared by every host (manifests, prefix records); None: local LMDB",
    )
    catalog_cluster: bool = Field(default=False, description="the shared catalog is a Redis Cluster")
    catalog_prefix: str = Field(default="agentstate:", description="key prefix of the shared catalog")
    gc_step_keys: int = Field(
        default=4096, ge=1, le=1 << 20,
        description="gc sweeps the stored keys in steps of this many (each step's memory and pause are bounded by it)",
    )  # fmt: skip
    gc_grace_seconds: float = Field(
        default=600.0, ge=0, description="shared stores: gc keeps an unreferenced chunk used this recently"
    )
    write_policy: Literal["write_through", "write_back", "write_through_selective"] = Field(
        default="write_through",
        description="write_through: to every tier down to the record tier; write_back: the first cache tier, lower"
        " tiers on eviction; write_through_selective: write_back, plus a write-down after write_through_threshold hits",
    )
    write_through_threshold: int = Field(default=2, ge=1, description="hits before a selective write-down")
    eviction: str = Field(
        default="lru", min_length=1,
        description="order in which cache tiers evict unheld chunks: lru, fifo, or 'package.module:Class' for a policy"
        " outside the repository (agentstate.chunks.eviction)",
    )  # fmt: skip
    exclusive: bool = Field(default=False, description="a promoted chunk leaves the cache tier it came from")
    prefetch_policy: Literal["wait_complete", "best_effort", "timeout"] = Field(
        default="wait_complete",
        description="what load() waits for of a prefetch: all of it, what arrived, or until the timeout below",
    )
    prefetch_timeout_base_s: float = Field(default=0.05, ge=0, description="timeout policy: fixed part of the wait")
    prefetch_timeout_per_1k_tokens_s: float = Field(
        default=0.02, ge=0, description="timeout policy: added per 1000 tokens of the prefix"
    )

    hint_tenant_share: float = Field(
        default=0.5, gt=0, le=1,
        description="most of a cache tier that one tenant's hints and retention contracts may hold; beyond it, plain LRU",
    )  # fmt: skip
    hint_max_hold_s: float = Field(
        default=900.0, gt=0, description="longest a paused() hint keeps a session in the fast tiers"
    )
    hint_resuming_hold_s: float = Field(
        default=120.0, gt=0, description="how long a resuming() hint keeps a session warm if its request never comes"
    )
    hint_reload_bytes_per_s: Bytes = Field(
        default=GiB, gt=0,
        description="paused(): the read rate a reload from the slow tiers is assumed to get; a session that takes"
        " longer to reload is held longer past its expected return",
    )  # fmt: skip
    usage_flush_s: float = Field(
        default=1.0, gt=0, le=60,
        description="accounting and hit times reach the catalog in one transaction this often (and at close)",
    )  # fmt: skip
    max_record_bytes: Bytes = Field(
        default=64 * MiB, gt=0, le=GiB,
        description="largest record a framework may keep beside a session (a checkpoint, a conversation item;"
        " agentstate.records): bounds what one write can ask of the catalog",
    )  # fmt: skip
    key_scheme: str = Field(
        default="agentstate", pattern=r"^[a-z][a-z0-9_]{0,31}(:[A-Za-z0-9_.-]{1,128})?$",
        description="how shared prefixes are keyed: agentstate's chunk chain, or an engine's own scheme as its"
        " adapter declares it (\"<name>[:<argument>]\"; docs/design.md), so that engine shares them",
    )  # fmt: skip
    state_boundary_chunks: int = Field(
        default=4, ge=1, le=1 << 20,
        description="hybrid models (SSM, linear attention, sliding windows): a prefill that stores a prefix keeps"
        " the model's state every this many chunks, the points a later prompt can resume from. Smaller: hits"
        " nearer the prompt's end; larger: fewer state bytes (a boundary holds every SSM layer's state)",
    )  # fmt: skip
    kv_events: KVEventsConfig | None = Field(
        default=None,
        description="publish what the tiers hold as vLLM KV events over ZMQ (agentstate.events), for routers;"
        " keys as vLLM's --kv-events-config, plus the routed engines' block_size and hash_algo",
    )  # fmt: skip
    disk_reserve_bytes: Bytes = Field(
        default=MiB, ge=0, le=GiB,
        description="room held free on the disk of the data directory (an unnamed preallocated file), spent only"
        " when a delete or gc meets a full disk: freeing space needs free pages first (LMDB copies what it"
        " changes), so without it a full disk could refuse the very deletes that make room; 0 holds none",
    )  # fmt: skip

    @model_validator(mode="after")
    def _key_scheme_declared(self) -> StoreConfig:
        """A key scheme is an adapter's declaration: an unknown name is refused here, before anything opens."""
        from agentstate import edges

        edges.key_scheme(self.key_scheme)
        return self

    @model_validator(mode="after")
    def _events_fit_chunks(self) -> StoreConfig:
        """A chunk is announced as whole blocks of the routed engines: it must hold a whole number of them."""
        ev = self.kv_events
        if ev is not None and ev.enable_kv_cache_events and self.chunk_tokens % ev.block_size:
            raise ValueError(
                f"kv_events.block_size ({ev.block_size}) must divide chunk_tokens ({self.chunk_tokens}):"
                " a chunk is announced as whole blocks"
            )
        return self

    @property
    def lossy(self) -> bool:
        """Some tier keeps a lossy encoding: a chunk may come back not bit-exact (see ResumeResult.exact)."""
        return any(t.lossy for t in self.tier_list())

    def tier_list(self) -> list[TierConfig]:
        if self.tiers is not None:
            return list(self.tiers)
        host = [TierConfig(kind="host", capacity_bytes=self.host_capacity_bytes)] if self.host_capacity_bytes else []
        return host + [TierConfig(kind="lmdb", path=Path("chunks"))]

    def model_post_init(self, __context: object) -> None:
        validate_id(self.tenant, "tenant")
