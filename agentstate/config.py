"""Store configuration (pydantic): one object, from code, a file or `AGENTSTATE_*` env vars."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from agentstate.keys import validate_id

GiB = 1 << 30
MiB = 1 << 20


class StoreConfig(BaseSettings):
    """Embedded default: a host (DRAM) tier over LMDB in `path`; no server to start."""

    model_config = SettingsConfigDict(env_prefix="AGENTSTATE_", extra="forbid")

    path: Path = Field(default=Path("agentstate-data"), description="data directory (LMDB files)")
    tenant: str = Field(default="default", description="sessions and the key namespace are scoped to it")
    shared_namespace: bool = Field(
        default=False, description="opt in to one global key namespace, so tenants share prefix chunks"
    )
    chunk_tokens: int = Field(default=256, gt=0, le=1 << 16, description="tokens per chunk")
    host_capacity_bytes: int = Field(default=4 * GiB, ge=0, description="0 disables the host tier")
    promote_on_read: bool = Field(default=True, description="copy chunks read from LMDB into the host tier")
    lmdb_map_size: int = Field(default=GiB, gt=0, description="initial LMDB map; it grows when full")
    lmdb_max_map_size: int | None = Field(default=None, gt=0, description="hard limit of the LMDB map")
    io_depth: int = Field(default=8, gt=0, le=1024, description="chunk reads/writes in flight per call")
    io_threads: int = Field(default=4, gt=0, le=256, description="threads for blocking IO and copies")
    batch_bytes: int = Field(default=16 * MiB, gt=0, description="target bytes per backend call")

    def model_post_init(self, __context: object) -> None:
        validate_id(self.tenant, "tenant")
