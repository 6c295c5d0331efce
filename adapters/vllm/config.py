"""The connector's configuration, the same in both roles: its settings, the store config, the model spec.

Built once per connector instance from the engine's `VllmConfig` (`ConnectorConfig.of`), so the
scheduler and the worker of one engine compute the same chunk keys, the same data directory and
the same lookup channel name: the scheduler plans what the worker reads and writes. Bad settings
are refused here, before either role opens anything. No vLLM import: the config is only read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from agentstate.adapters.runtime import AdapterSettings
from agentstate.adapters.vllm.groups import KVGroups, groups_of
from agentstate.config import StoreConfig
from agentstate.errors import AgentStateError, InvalidArgumentError
from agentstate import edges
from agentstate.keys import chunk_keys, namespace_for, respec, token_array, validate_id
from agentstate.spec import DTYPE_NAMES, ModelSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

DEFAULT_CHUNK_TOKENS = 256


class VllmSettings(AdapterSettings):
    """The adapter's own keys of `kv_connector_extra_config`; every other key is a StoreConfig field."""

    table: ClassVar[str] = "vllm"
    path: Path = Field(default=Path("agentstate-vllm"), description="data directory (one per rank below it with TP/PP)")
    lookup_timeout_s: float = Field(default=2.0, gt=0, description="longest the scheduler waits for a lookup")
    max_pending_saves: int = Field(
        default=256, gt=0, description="chunks handed to the store and not yet written; beyond it saves are dropped"
        " (counted)",
    )
    load_mode: Literal["async", "sync"] = Field(
        default="async",
        description="async: a request waits while its chunks load between steps, other requests' forwards go on;"
        " sync: loaded before the forward of the step that computes the rest (one step less of latency)",
    )

    native_layout: bool = Field(
        default=True,
        description="store full chunks in the engine's own block layout where it has one at rest (CPU: K transposed"
        " per block), so its loads are plain copies; other readers convert them (counted: layout_conversions)."
        " false: canonical KV, as every other writer stores",
    )

    serve_port: int | None = Field(
        default=None, ge=1, le=65535,
        description="serve the session API (as `agentstate serve`) from the engine's worker on this port: what an"
        " agent framework reaches while the engine holds the directory (records, hints, inspect, usage); off by default",
    )  # fmt: skip
    serve_host: str = Field(default="127.0.0.1", description="address the embedded session API binds")
    serve_tokens_file: Path | None = Field(
        default=None, description="bearer token -> tenant JSON of the embedded session API (else env AGENTSTATE_TOKENS)"
    )

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> tuple[VllmSettings, dict[str, Any]]:
        """(settings, StoreConfig overrides); `config_file` (TOML, YAML or JSON; else env
        AGENTSTATE_CONFIG_FILE) is folded in by `split`: inline keys > env vars > the file."""
        settings, rest = cls.split(extra)
        rest.pop("path", None)
        return settings, rest


def model_spec(
    vllm_config: VllmConfig, settings: VllmSettings, rank: int | None = None, groups: KVGroups | None = None
) -> ModelSpec:
    """The ModelSpec of this engine's KV at TP rank `rank` (default: this process's): the same model
    gives the same spec in every engine, and rank r of TP n the r-th of n slices of its heads
    (`agentstate.slices`: what crosses TP sizes). Where TP exceeds the KV heads vLLM replicates each
    head over `tp / heads` ranks: a rank's slice is then that of rank `r * heads // tp` of TP `heads`,
    the same bytes under the same key as an engine at TP `heads` stores.

    A hybrid model (`groups`): its chunks hold the attention layers (full and sliding), and a Mamba
    model's spec has the state layout of its Mamba layers (`groups.py`)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        raise InvalidArgumentError(f"KV cache dtype {cache_dtype}: only unquantized KV (cache_dtype auto) is stored")
    if mc.use_mla:
        raise InvalidArgumentError("MLA models are not supported by the vLLM connector yet")
    if mc.dtype not in DTYPE_NAMES:
        raise InvalidArgumentError(f"model dtype {mc.dtype} cannot be stored")
    tp = pc.tensor_parallel_size
    if rank is None:
        rank = pc.rank % tp if tp > 1 else 0
    if groups is not None and tp > 1:
        raise InvalidArgumentError(
            "a hybrid model (KV cache groups of several kinds) at tensor_parallel_size > 1 is not supported by the"
            " agentstate vLLM connector yet (its Mamba states are sharded per rank too)"
        )
    whole = ModelSpec(
        model_id=settings.model_id or str(mc.model), revision=settings.revision or mc.revision or "main",
        dtype=DTYPE_NAMES[mc.dtype], num_kv_heads=mc.get_total_num_kv_heads(), head_dim=mc.get_head_size(),
        num_layers=mc.get_num_layers(pc) if groups is None else len(groups.attention),
        state=None if groups is None else groups.state,
    )  # fmt: skip
    heads = whole.num_kv_heads
    if tp > heads and tp % heads == 0:  # replicated heads
        return whole.slicing(heads, rank * heads // tp)
    if heads % tp:
        raise InvalidArgumentError(f"{heads} KV heads do not split over tensor_parallel_size {tp}")
    spec = whole.slicing(tp, rank)
    if spec.num_kv_heads != mc.get_num_kv_heads(pc):
        raise InvalidArgumentError(f"vLLM holds {mc.get_num_kv_heads(pc)} KV heads per rank, not {spec.num_kv_heads}")
    return spec


def data_dir(vllm_config: VllmConfig, settings: VllmSettings, rank: int) -> Path:
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size == 1 and pc.pipeline_parallel_size == 1:
        return settings.path
    return settings.path / f"tp{rank}-{pc.tensor_parallel_size}.pp{pc.pipeline_parallel_size}"


def engine_token(vllm_config: VllmConfig) -> str:
    """This engine's identity, the same in its scheduler and its workers (they get one pickled config)
    and new in every engine started: the KV transfer engine id (a uuid4 unless configured) and the
    config's instance id (its creation time in ns). Names the lookup channel, so a scheduler only
    ever asks its own workers: an older engine still holding the data directory is never asked."""
    kv = vllm_config.kv_transfer_config
    return f"{getattr(kv, 'engine_id', None) or ''}/{getattr(vllm_config, 'instance_id', '') or ''}"


def _one_stage(vllm_config: VllmConfig) -> None:
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        # A stage holds some layers: its chunks would need a layer range in their keys, as a TP
        # rank's name its heads. Not built yet; refused at startup rather than silently never hitting.
        raise InvalidArgumentError(
            f"the agentstate vLLM connector does not support pipeline parallelism yet (pipeline_parallel_size"
            f" {pc.pipeline_parallel_size}; tensor parallelism is supported)"
        )


@dataclass(frozen=True)
class ConnectorConfig:
    """What both roles of one engine agree on: settings, the store config, block and chunk sizes, the spec."""

    settings: VllmSettings
    overrides: dict[str, Any]  # StoreConfig keys of the extra config (chunk_tokens filled in)
    store: StoreConfig
    block_size: int
    spec: ModelSpec  # this process's TP rank's (the scheduler's: rank 0's)
    planned: ModelSpec  # rank 0's: the keys of the scheduler's plans (`own` turns them into a rank's)
    engine: str  # engine_token: names the lookup channel
    ranks: int  # tensor parallel ranks
    rank: int  # this process's TP rank (the scheduler's: 0)
    groups: KVGroups | None = None  # a hybrid model's KV cache groups (None: one full-attention group)

    @property
    def chunk_tokens(self) -> int:
        return self.store.chunk_tokens

    @classmethod
    def of(cls, vllm_config: VllmConfig, kv_cache_config: Any = None) -> ConnectorConfig:
        """Read and check the engine's kv_connector_extra_config (and its KV cache groups, where vLLM
        passes them); InvalidArgumentError for a bad one."""
        _one_stage(vllm_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        settings, overrides = VllmSettings.from_extra(dict(extra or {}))
        StoreConfig(path=settings.path, **overrides)  # checks every key now
        block_size = int(vllm_config.cache_config.block_size)
        if "chunk_tokens" not in overrides:
            c = DEFAULT_CHUNK_TOKENS
            overrides["chunk_tokens"] = c if c % block_size == 0 else block_size
        store = StoreConfig(path=settings.path, **overrides)
        if vllm_config.parallel_config.tensor_parallel_size > 1 and store.catalog_url is not None:
            # each rank snapshots a session's own slice of heads under the session's one name
            raise InvalidArgumentError(
                "a shared catalog (catalog_url) with tensor_parallel_size > 1 is not supported yet: each rank keeps"
                " its sessions in its own directory's catalog; prefixes are shared through the shared tiers"
            )
        if store.chunk_tokens % block_size:
            raise InvalidArgumentError(
                f"chunk_tokens {store.chunk_tokens} must be a multiple of the engine's block size {block_size}"
            )
        groups = groups_of(kv_cache_config, block_size) if kv_cache_config is not None else None
        if groups is not None and settings.load_mode == "sync":
            # vLLM takes a failed load of a model with several KV cache groups only as a whole request's
            # (failed_recving), which only an asynchronous load can report
            raise InvalidArgumentError("load_mode 'sync' is not supported for hybrid models (several KV cache groups)")
        pc = vllm_config.parallel_config
        return cls(settings, overrides, store, block_size, model_spec(vllm_config, settings, groups=groups),
                   model_spec(vllm_config, settings, 0, groups), engine_token(vllm_config), pc.tensor_parallel_size,
                   pc.rank % pc.tensor_parallel_size, groups)  # fmt: skip

    def own(self, keys: list[str]) -> list[str]:
        """Keys of the scheduler's plans (rank 0's slice of heads) as this rank's: the same chunks, its heads."""
        if self.planned == self.spec:
            return keys
        return [respec(k, self.planned.fingerprint, self.spec.fingerprint) for k in keys]

    def planned_form(self, keys: list[str]) -> list[str]:
        """This rank's keys as the scheduler's plans name them (`own`'s inverse)."""
        if self.planned == self.spec:
            return keys
        return [respec(k, self.spec.fingerprint, self.planned.fingerprint) for k in keys]

    def keys(self, tokens: list[int], tenant: str) -> list[str]:
        """The chunk keys of `tokens`' whole chunks in `tenant`'s namespace, as the store computes them."""
        scheme, argument = edges.key_scheme(self.store.key_scheme)
        if scheme is not None:  # an engine's own scheme, e.g. SGLang's pages: as StoreScope.prefix_keys keys them
            salt = None if self.store.shared_namespace or tenant == self.store.tenant else tenant
            return scheme.keys(token_array(tokens), self.spec.fingerprint, self.chunk_tokens, argument, salt)
        ns = namespace_for(tenant, self.store.shared_namespace)
        return list(chunk_keys(tokens, namespace=ns, fingerprint=self.spec.fingerprint, chunk_tokens=self.chunk_tokens,
                               chain=self.spec.model_fingerprint))  # fmt: skip

    def tenant_of(self, salt: str | None) -> str:
        """A request's tenant: its cache_salt (hashed when it is not a valid id), else the configured one."""
        if not salt:
            return self.store.tenant
        try:
            return validate_id(salt, "tenant")
        except AgentStateError:
            return "salt-" + hashlib.blake2b(salt.encode(), digest_size=16).hexdigest()
