"""vLLM KV connector on an agentstate store, loaded from this module by vLLM's connector factory::

    --kv-transfer-config '{"kv_connector": "AgentStateConnector",
      "kv_connector_module_path": "agentstate.adapters.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"path": "/data/kv"}}'

`{"path": DIR}` alone is the embedded default (host tier over LMDB in DIR). Other keys: `model_id`,
`revision`, `timeout_s`, `lookup_timeout_s`, `config_file` (a JSON file of StoreConfig fields), and
any StoreConfig field (`tiers`, `tenant`, `chunk_tokens`, `catalog_url`, ...), as for the SGLang
adapter. With tensor or pipeline parallelism each rank has its own directory below DIR.

How it runs. vLLM makes one instance per role. The WORKER instance (in the process that owns the
KV blocks) opens the store and owns it: a data directory has one writer. The SCHEDULER instance
(vLLM's EngineCore, another process on CPU) computes agentstate's chunk keys over a prompt's
token ids (cache_salt, where set, is the tenant namespace) and asks the worker, over a Unix socket,
how many leading chunks are stored (`adapters/vllm_blocks.py`). The socket is bound only by a worker
that opened the store (so holds the directory's lock) and is named after this engine (its KV
transfer engine id and config instance id), and every reply says whose it is: a scheduler only ever
counts hits its own worker can load. An engine whose worker cannot open the store (another process
holds the directory: an engine left running after its API server was killed) runs without it,
serving every prompt as a miss; the worker logs one line naming the holder's PID, the scheduler one
line that its worker serves no lookups. A load that failed is never offered as a hit again for that
request (it is recomputed). It reports whole chunks beyond
vLLM's own hit, leaving at least one prompt token to compute, as an asynchronous load: the
request waits while the worker's event loop copies each checked chunk straight into the
request's blocks (a KVTarget over the engine's registered caches), and other requests' forwards
go on. A chunk that is missing, corrupt or late is reported through
`get_block_ids_with_load_errors` and vLLM recomputes from there (the connector sets
`kv_load_failure_policy` to "recompute"); a store outage is a miss.

Saves: after each forward, the full chunks this step completed are handed to the store's loop,
which dedupes them against the index, copies them out of the engine's blocks straight into
canonical KV, and writes them: nothing of it runs on the step. Computed blocks never change, and
the blocks stay the request's while it runs; a finished request's blocks are held (delay-free)
until its copies are done, and a preempted request's copies still in flight are revoked (their
result is dropped, never stored: the blocks may be another request's by the next forward).

Request params are read once, when the request arrives (`adapters/vllm_params.py`): a malformed
`session_id`, `state` or hint is logged once for the request (values cut to 100 characters) and
dropped, and the request is served, looked up and stored as if that part were absent; it never costs
the request its hits, and never changes when its blocks are freed (`request_finished` holds them
whenever copies out of them may be in flight, whatever else fails).

Sessions: a request whose `kv_transfer_params` holds `{"agentstate": {"session_id": ..., "state":
{...}}}` is snapshotted when it finishes (its blocks are held until then): tokens with computed KV
(prompt and generated, the last sampled token excepted: it has no KV yet), tail included, and the
state. A later request naming the same session whose prompt extends the session's tokens loads
all of it, tail included.

Agent hints: the same `agentstate` params carry what the agent framework knows about a session's
next seconds (see `agentstate.hints`)::

    kv_transfer_params={"agentstate": {"agent_id": "agent-7", "hint": "paused", "expected_s": 30}}

- `hint`: `"resuming"` (the tool returned: this request is the agent's next turn), `"paused"`
  (this turn ends with a tool call expected to take `expected_s` seconds, a number > 0, required)
  or `"done"` (the agent will not be back soon after this turn); or a list of `"resuming"` and one
  of the other two, for a returning turn that is expected to end in another tool call
  (`["resuming", "paused"]`) or to be the last (`["resuming", "done"]`). The framework sends what
  it expects when it sends the request: most agent turns end in a tool call.
- `agent_id`: the name the hold goes under, one per name and tenant (`[A-Za-z0-9_.:@-]`, 1-128
  chars): the agent session's id. A request that names a session (`session_id`) hints that session,
  tail included; `agent_id` may then be left out (if given, it must equal `session_id`).
- `resuming` applies when the request arrives (vLLM's `on_new_request`, before it is scheduled):
  the worker starts bringing the stored prefix of the prompt (`StateStore.hint_tokens`; a named
  session: `StateStore.hint`) up from LMDB/Redis into host memory on its loop, and the request's
  load waits for that (at most half of `timeout_s`) and reads host memory. When vLLM's own prefix
  cache holds the prompt's first chunks, only the stored chunks past them are brought up (no hold:
  the load follows at once), and nothing when it holds all that is stored (`hints_skipped`).
- `paused` and `done` apply when the request finishes, once what the connector stores for it is
  written: `paused` holds the prefix stored for the request (its tokens through the end of the
  request: prompt and generated) in the fast tiers for about `2 * expected_s` (eviction takes
  unheld LRU chunks first); `done` releases the hold.
- A hint never fails or changes its request: malformed hint params (unknown hint, `paused` without
  a positive `expected_s`, an invalid or missing name, `expected_s` as a string) are logged once per
  request (InvalidArgumentError) and counted (`hints_invalid`), and the request is served as if it
  carried none; a hint that fails in the store (no such session yet) is logged and counted
  (`hint_errors`). Hints never change what is stored, only where it waits.

Metrics (`vllm:agentstate_*`): besides the counts below, `bytes_read{tier=...}` (stored bytes loads
read, per tier), `hints`, `hint_moved_bytes` (resuming: bytes brought up into host memory),
`hint_errors`, `hints_invalid`, `hints_skipped`. Loads are also counted in the store's usage (`StateStore.usage()`:
loads, tokens_read, bytes_read per tier).

Never raises into vLLM's threads: every engine-facing call answers a miss (or a failed load) and
logs instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import concurrent.futures
import hashlib
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from agentstate.adapters.sglang_pages import AdapterSettings, LoopThread, never_raises
from agentstate.adapters.vllm_blocks import (
    BlockLayout,
    BlocksTarget,
    LookupClient,
    LookupServer,
    gather,
    layout_for,
    socket_name,
)
from agentstate.adapters.vllm_params import NO_PARAMS, RequestHint, RequestParams, clip, clip_message, parse_params
from pydantic import Field
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from agentstate.config import StoreConfig
from agentstate.settings import record_config
from agentstate.errors import AgentStateError, BackendError, ConflictError, DataDirLockedError, InvalidArgumentError
from agentstate.hints import HintKind
from agentstate.keys import chunk_keys, namespace_for, validate_id
from agentstate.spec import DTYPE_NAMES, ModelSpec
from agentstate.store import StateStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.agentstate")  # under vLLM's logger: shown with the engine's logs
SPEC_FILE = "spec.json"
DEFAULT_CHUNK_TOKENS = 256


class VllmSettings(AdapterSettings):
    """The adapter's own keys of `kv_connector_extra_config`; every other key is a StoreConfig field."""

    path: Path = Field(default=Path("agentstate-vllm"), description="data directory (one per rank below it with TP/PP)")
    lookup_timeout_s: float = Field(default=2.0, gt=0, description="longest the scheduler waits for a lookup")
    table: ClassVar[str] = "vllm"
    max_pending_saves: int = Field(
        default=256, gt=0, description="chunks handed to the store and not yet written; beyond it saves are dropped"
        " (counted)",
    )
    load_mode: Literal["async", "sync"] = Field(
        default="async",
        description="async: a request waits while its chunks load between steps, other requests' forwards go on;"
        " sync: loaded before the forward of the step that computes the rest (one step less of latency)",
    )

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> tuple[VllmSettings, dict[str, Any]]:
        """(settings, StoreConfig overrides); `config_file` (TOML, YAML or JSON; else env
        AGENTSTATE_CONFIG_FILE) is folded in by `split`: inline keys > env vars > the file."""
        settings, rest = cls.split(extra)
        rest.pop("path", None)
        return settings, rest


def model_spec(vllm_config: VllmConfig, settings: VllmSettings) -> ModelSpec:
    """The ModelSpec of this engine's KV (per rank): the same model gives the same spec in every engine."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        raise InvalidArgumentError(f"KV cache dtype {cache_dtype}: only unquantized KV (cache_dtype auto) is stored")
    if mc.use_mla:
        raise InvalidArgumentError("MLA models are not supported by the vLLM connector yet")
    if mc.dtype not in DTYPE_NAMES:
        raise InvalidArgumentError(f"model dtype {mc.dtype} cannot be stored")
    tp = pc.tensor_parallel_size
    rank = pc.rank % tp if tp > 1 else 0
    return ModelSpec(
        model_id=settings.model_id or str(mc.model), revision=settings.revision or mc.revision or "main",
        dtype=DTYPE_NAMES[mc.dtype], num_layers=mc.get_num_layers(pc), num_kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(), tp_rank=rank, tp_size=tp,
    )  # fmt: skip


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


def tenant_of(salt: str | None, default: str) -> str:
    """A request's tenant: its cache_salt (hashed when it is not a valid id), else the configured one."""
    if not salt:
        return default
    try:
        return validate_id(salt, "tenant")
    except AgentStateError:
        return "salt-" + hashlib.blake2b(salt.encode(), digest_size=16).hexdigest()


# -- metadata: what the scheduler tells the worker each step ------------------------------------------


@dataclass
class LoadJob:
    req_id: str
    keys: list[str]
    spans: list[tuple[int, int]]
    block_ids: list[int]
    first: int
    end: int
    tenant: str = ""


@dataclass
class SaveJob:
    req_id: str
    tenant: str
    tokens: list[int]
    keys: list[str]
    chunks: list[int]
    block_ids: list[int]


@dataclass
class SessionJob:
    req_id: str
    tenant: str
    session_id: str
    state: dict[str, Any]
    tokens: list[int]
    block_ids: list[int]


@dataclass
class HintJob:
    """An agent hint for the worker to apply: `paused`/`done` of a finished request (after its saves
    and snapshot are written), `resuming` of one that just arrived (sent over the lookup channel)."""

    req_id: str
    tenant: str
    name: str
    session: bool
    hint: HintKind
    expected_s: float | None
    tokens: list[int]
    local: int = 0  # resuming: leading tokens vLLM's own prefix cache holds (nothing to bring up for them)


@dataclass
class AgentStateMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    sessions: list[SessionJob] = field(default_factory=list)
    hints: list[HintJob] = field(default_factory=list)  # of finished requests
    released: list[str] = field(default_factory=list)  # finished, blocks held until their copies are done
    preempted: list[str] = field(default_factory=list)  # blocks freed this step: copies in flight revoked


@dataclass
class _Tracked:
    """Scheduler-side state of one request."""

    request: Any
    tenant: str
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # chunks handed to the worker (or known stored)


# -- metrics -------------------------------------------------------------------------------------------

STAT_KEYS = (
    "hit_tokens", "loaded_tokens", "stored_tokens", "load_error_blocks", "sessions_saved", "saves_dropped",
    "saves_revoked", "errors", "hints", "hint_moved_bytes", "hint_errors", "hints_invalid", "hints_skipped",
    "loads", "load_ms", "load_wait_ms", "load_read_ms", "hint_ms",
)  # fmt: skip
BYTES_READ = "bytes_read:"  # + a tier's name: stored bytes loads read from that tier


def _stat(key: str) -> bool:
    return key in STAT_KEYS or key.startswith(BYTES_READ)


@dataclass
class AgentStateStats(KVConnectorStats):
    """Counts of one interval, summed over workers: what `vllm:agentstate_*` metrics show."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class AgentStatePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        helps = {
            "hit_tokens": "tokens the agentstate connector was asked to load",
            "loaded_tokens": "tokens loaded from agentstate into the engine's blocks",
            "stored_tokens": "tokens stored into agentstate (new chunks)",
            "load_error_blocks": "blocks whose agentstate load failed (recomputed)",
            "sessions_saved": "agentstate sessions snapshotted",
            "saves_dropped": "chunks not saved because the store fell behind",
            "saves_revoked": "chunks not saved because their request was preempted while they were copied",
            "errors": "agentstate connector errors",
            "hints": "agent hints applied (paused, resuming, done in kv_transfer_params)",
            "hint_moved_bytes": "stored bytes resuming hints brought up into host memory",
            "hint_errors": "agent hints the store could not apply (the request is unaffected)",
            "hints_invalid": "requests whose hint params were malformed (ignored, the request served without)",
            "hints_skipped": "resuming hints not needed: vLLM's own prefix cache held all that is stored",
            "loads": "loads finished (their requests waited for them)",
            "load_ms": "milliseconds loads took, from their start to vLLM hearing they finished (summed)",
            "load_wait_ms": "of loads, milliseconds waiting for their request's resuming hint (summed)",
            "load_read_ms": "of loads, milliseconds reading into the blocks (summed)",
            "hint_ms": "milliseconds agent hints took on the store's loop, writes waited for included (summed)",
        }
        self.counters = {}
        for key, doc in helps.items():
            counter = self._counter_cls(name=f"vllm:agentstate_{key}", documentation=doc, labelnames=labelnames)
            self.counters[key] = {idx: counter.labels(*values) for idx, values in self.per_engine_labelvalues.items()}
        self.bytes_read = self._counter_cls(
            name="vllm:agentstate_bytes_read", documentation="stored bytes agentstate loads read, per tier",
            labelnames=[*labelnames, "tier"],
        )  # fmt: skip

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, by_engine in self.counters.items():
            amount = transfer_stats_data.get(key, 0)
            if amount and engine_idx in by_engine:
                by_engine[engine_idx].inc(amount)
        values = self.per_engine_labelvalues.get(engine_idx)
        for key, amount in transfer_stats_data.items():
            if key.startswith(BYTES_READ) and amount and values is not None:
                self.bytes_read.labels(*values, key[len(BYTES_READ) :]).inc(amount)


# -- the connector ---------------------------------------------------------------------------------------


class AgentStateConnector(KVConnectorBase_V1):
    """KV connector over an agentstate StateStore (see the module doc)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        pc = vllm_config.parallel_config
        if pc.tensor_parallel_size * pc.pipeline_parallel_size > 1:
            # Chunk keys carry the rank's fingerprint: the scheduler would have to compute and plan
            # them per rank. Not built yet; refused at startup rather than silently never hitting.
            raise InvalidArgumentError(
                f"the agentstate vLLM connector supports one rank so far (tensor_parallel_size"
                f" {pc.tensor_parallel_size}, pipeline_parallel_size {pc.pipeline_parallel_size}; both must be 1)"
            )
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.settings, self._overrides = VllmSettings.from_extra(extra)
        self.config = StoreConfig(path=self.settings.path, **self._overrides)  # checks every key now
        self.block_size = int(vllm_config.cache_config.block_size)
        if "chunk_tokens" not in self._overrides:
            c = DEFAULT_CHUNK_TOKENS
            self._overrides["chunk_tokens"] = c if c % self.block_size == 0 else self.block_size
            self.config = StoreConfig(path=self.settings.path, **self._overrides)
        self.chunk_tokens = self.config.chunk_tokens
        if self.chunk_tokens % self.block_size:
            raise InvalidArgumentError(
                f"chunk_tokens {self.chunk_tokens} must be a multiple of the engine's block size {self.block_size}"
            )
        self.spec = model_spec(vllm_config, self.settings)
        self.counts: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        self._stats = AgentStateStats()
        pc = vllm_config.parallel_config
        self._tp = pc.tensor_parallel_size
        self._engine = engine_token(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            # A failed load falls back to recompute (vLLM's default is to fail the request).
            vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
            self._clients = [
                LookupClient(
                    socket_name(str(data_dir(vllm_config, self.settings, r).resolve()), r, self._engine),
                    self.settings.lookup_timeout_s,
                )
                for r in range(self._tp * pc.pipeline_parallel_size)
            ]
            self._lookup_logged: set[str] = set()  # kinds of lookup failure logged (once each)
            self._tracked: dict[str, _Tracked] = {}
            self._matched: dict[str, tuple[int, dict[str, Any]]] = {}
            self._loads: list[LoadJob] = []
            self._load_blocks: dict[str, set[int]] = {}  # per request whose load is in flight: its blocks
            self._no_hits: set[str] = set()  # requests whose load failed: never reported as hits again
            self._sessions: list[SessionJob] = []
            self._released: list[str] = []
            self._params: dict[str, RequestParams] = {}  # per request, checked once (logged once if bad)
            self._hinted: set[str] = set()  # requests whose resuming hint went to the worker
            self._hint_jobs: list[HintJob] = []
        else:
            self.rank = pc.rank if self._tp * pc.pipeline_parallel_size > 1 else 0
            self.path = data_dir(vllm_config, self.settings, self.rank)
            self._loop = LoopThread("agentstate-vllm")
            self.store: StateStore | None = None
            self.layout: BlockLayout | None = None
            self.planes: list[tuple[torch.Tensor, torch.Tensor]] = []
            self.caches: list[torch.Tensor] = []
            self._server: LookupServer | None = None
            self._loading: dict[str, tuple[concurrent.futures.Future[set[int]], BlocksTarget, LoadJob, float]] = {}
            self._writes: list[concurrent.futures.Future[None]] = []
            # per running request: copies out of its blocks not yet done, and the flag that revokes them
            self._reading: dict[str, list[concurrent.futures.Future[None]]] = {}
            self._revoke: dict[str, threading.Event] = {}
            self._held: dict[str, list[concurrent.futures.Future[None]]] = {}  # finished: blocks held for these
            # (tenant, session id) -> its snapshot in flight: a lookup of that session waits for it
            self._saving: dict[tuple[str, str], concurrent.futures.Future[None]] = {}
            self._errors: set[int] = set()
            self._pending = 0  # chunks handed to the loop, not yet written
            # per request, its writes in flight: a paused hint of the request waits for them
            self._req_writes: dict[str, list[concurrent.futures.Future[None]]] = {}
            # request id -> its resuming hint in flight (on the loop): the request's load waits for it
            self._warming: dict[str, asyncio.Future[None]] = {}

    # -- plumbing ----------------------------------------------------------------------------------

    def _count(self, **amounts: int) -> None:
        with self._count_lock:
            self.counts.update(amounts)
            for k, v in amounts.items():
                if _stat(k):
                    self._stats.data[k] = self._stats.data.get(k, 0) + v

    def _failed(self, call: str, exc: BaseException) -> None:
        self._count(errors=1)
        if isinstance(exc, (AgentStateError, TimeoutError, OSError)) or len(str(exc)) > 300:
            log.warning("agentstate %s failed: %s", call, clip_message(exc))  # cut: may quote a request's values
        else:
            log.exception("agentstate %s failed", call)

    def _keys(self, tokens: list[int], tenant: str) -> list[str]:
        ns = namespace_for(tenant, self.config.shared_namespace)
        return list(chunk_keys(tokens, namespace=ns, fingerprint=self.spec.fingerprint, chunk_tokens=self.chunk_tokens))

    # ==============================================================================================
    # Scheduler side
    # ==============================================================================================

    def _ask(self, request: dict[str, Any]) -> list[dict[str, Any]] | None:
        """This engine's workers' replies, or None (a miss) when one cannot be reached or is not this
        engine's: each kind of failure is logged once, and counted."""
        try:
            replies = [client.ask(request) for client in self._clients]
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            self._lookup_failed(
                "absent", f"this engine's worker serves no lookups ({exc}): its store is not open (the"
                " worker's log says why); every prompt is a miss",
            )  # fmt: skip
            return None
        except OSError as exc:  # TimeoutError and connection errors: the worker is down or slow
            self._lookup_failed(type(exc).__name__, f"{clip_message(exc)} (treated as a miss)")
            return None
        if any(r.get("engine") != self._engine for r in replies):  # the name holds the token: a stale worker
            self._lookup_failed("foreign", "the lookup channel answered for another engine (treated as a miss)")
            return None
        bad = [r["error"] for r in replies if "error" in r]
        if bad:
            self._lookup_failed("error", f"{clip(str(bad[0]), 300)} (treated as a miss)")
            return None
        return replies

    def _lookup_failed(self, kind: str, message: str) -> None:
        self._count(lookup_errors=1)
        if kind not in self._lookup_logged:
            self._lookup_logged.add(kind)
            log.warning("agentstate lookup failed (logged once, counted as lookup_errors): %s", message)

    def _params_for(self, request: Request) -> RequestParams:
        """The request's agentstate params, checked once when it is first seen; the parts that are
        malformed are dropped and logged once (values cut), so they never fail or cost the request."""
        req_id = request.request_id
        params = self._params.get(req_id)
        if params is not None:
            return params
        try:
            params = parse_params(request.kv_transfer_params)
        except Exception as exc:  # noqa: BLE001 - parse_params never raises; served without params if it did
            params = RequestParams(problems=(("agentstate params", clip_message(exc)),))
        for part, problem in params.problems:
            log.warning("agentstate: request %s is served without its %s: %s", clip(req_id), part, problem)
        if any(part == "hint" for part, _ in params.problems):
            self._count(hints_invalid=1)
        self._params[req_id] = params
        return params

    def _hint_for(self, request: Request) -> RequestHint | None:
        return self._params_for(request).hint

    def _send_resuming(self, request: Request) -> None:
        """A resuming hint goes to the worker once, as soon as the request is seen: the worker brings
        the prompt's stored prefix up into host memory on its loop (the reply does not wait for it)."""
        hint = self._hint_for(request)
        if hint is None or hint.arrival is None or request.request_id in self._hinted:
            return
        self._hinted.add(request.request_id)
        tokens = list(request.prompt_token_ids or request.all_token_ids)
        tenant = tenant_of(request.cache_salt, self.config.tenant)
        self._ask({"op": "hint", "req_id": request.request_id, "tenant": tenant, "name": hint.name,
                   "session": hint.session, "hint": hint.arrival, "expected_s": None,
                   "tokens": tokens, "local": self._local_hit(request)})  # fmt: skip

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._block_pool = gpu_block_pool  # what vLLM's own prefix cache holds (read only)

    def _local_hit(self, request: Request) -> int:
        """Leading prompt tokens vLLM's own prefix cache holds now (0 when it cannot be asked)."""
        pool, hashes = getattr(self, "_block_pool", None), getattr(request, "block_hashes", None)
        if pool is None or not hashes:
            return 0
        try:
            n = 0
            for block_hash in hashes:
                if not pool.get_cached_block(block_hash, [0]):
                    break
                n += 1
            return n * self.block_size
        except Exception:  # noqa: BLE001 - another vLLM's block pool: bring up everything stored
            return 0

    @never_raises(lambda *_, **__: None)
    def on_new_request(self, request: Request) -> None:
        """A request was added: a resuming hint starts its prefix's way up now, before it is scheduled."""
        self._send_resuming(request)

    @never_raises(lambda *_, **__: (0, False))
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Whole stored chunks beyond vLLM's own hit (at least one prompt token left to compute);
        a session named in kv_transfer_params adds its tail. Loaded asynchronously."""
        with contextlib.suppress(Exception):  # an engine without on_new_request: the hint goes now
            self._send_resuming(request)
        if request.request_id in self._no_hits:  # its load failed: recomputed, never offered again
            return 0, False
        tokens = list(request.all_token_ids[: request.num_tokens])
        limit = len(tokens) - 1
        tenant = tenant_of(request.cache_salt, self.config.tenant)
        session = self._params_for(request).session
        keys = self._keys(tokens[: limit // self.chunk_tokens * self.chunk_tokens], tenant)
        if not keys and session is None:
            return 0, False
        query: dict[str, Any] = {"op": "lookup", "keys": keys, "tenant": tenant}
        if session is not None:
            query.update(session=session[0], tokens=tokens)
        replies = self._ask(query)
        if replies is None:
            return 0, False
        hit = min(int(r.get("chunks", 0)) for r in replies) * self.chunk_tokens
        plan: dict[str, Any] = {"keys": keys, "chunks": hit // self.chunk_tokens}
        sess = [r.get("session") for r in replies]
        if session is not None and all(sess) and len({s["tail_key"] for s in sess}) == 1:
            n = min(s["tokens"] for s in sess)
            full = min(len(s["chunk_keys"]) for s in sess)
            if n > hit and sess[0]["chunk_tokens"] == self.chunk_tokens:
                hit = min(n, limit)
                plan = {"keys": sess[0]["chunk_keys"][:full], "chunks": full, "tail_key": sess[0]["tail_key"],
                        "tail_tokens": n - full * self.chunk_tokens}  # fmt: skip
        if hit <= num_computed_tokens:
            return 0, False
        self._matched[request.request_id] = (num_computed_tokens, {**plan, "end": hit})
        return hit - num_computed_tokens, self.settings.load_mode == "async"

    @never_raises(lambda *_, **__: None)
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        block_ids = list(blocks.get_block_ids()[0])
        tracked = self._tracked.get(req_id)
        if tracked is None:
            tracked = self._tracked[req_id] = _Tracked(request, tenant_of(request.cache_salt, self.config.tenant))
        if block_ids:
            tracked.block_ids = block_ids
        matched = self._matched.pop(req_id, None)
        if num_external_tokens <= 0:
            return
        if matched is None:  # cannot happen; fail the load rather than leave the request waiting
            matched = (0, {"keys": [], "chunks": 0, "end": 0})
        first = matched[0]
        try:
            job = self._plan_load(req_id, matched, num_external_tokens, block_ids, tracked.tenant)
        except Exception as exc:  # noqa: BLE001 - a load with no chunks fails: the request is recomputed
            self._failed("update_state_after_alloc", exc)
            job = LoadJob(req_id, [], [], block_ids, first, first + num_external_tokens, tracked.tenant)
        self._loads.append(job)  # always: vLLM waits for this request's load to be reported
        self._load_blocks[req_id] = set(block_ids[first // self.block_size : -(-job.end // self.block_size)])
        # `saved` stays: loaded chunks are offered for saving too, and the worker's dedupe skips them
        # unless a load found one corrupt (dropped), so the recomputed chunk is stored again.

    def _plan_load(
        self, req_id: str, matched: tuple[int, dict[str, Any]], count: int, block_ids: list[int], tenant: str
    ) -> LoadJob:
        first, plan = matched
        end = first + count
        c = self.chunk_tokens
        c0 = first // c
        n_full = min(plan["chunks"], -(-end // c))
        keys = list(plan["keys"][c0:n_full])
        spans = [(i * c, c) for i in range(c0, n_full)]
        if plan.get("tail_key") and end > n_full * c:
            keys.append(plan["tail_key"])
            spans.append((n_full * c, plan["tail_tokens"]))
        return LoadJob(req_id, keys, spans, block_ids, first, end, tenant)

    @never_raises(lambda *_, **__: AgentStateMetadata())
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = AgentStateMetadata(loads=self._loads, sessions=self._sessions, released=self._released,
                                  hints=self._hint_jobs,
                                  preempted=sorted(scheduler_output.preempted_req_ids or ()))  # fmt: skip
        self._loads, self._sessions, self._released, self._hint_jobs = [], [], [], []
        try:  # the loads, snapshots and releases above must reach the worker whatever fails here
            self._plan_saves(scheduler_output, meta)
        except Exception as exc:  # noqa: BLE001 - this step's saves are lost (a later miss), nothing else
            self._failed("build_connector_meta", exc)
        for req_id in scheduler_output.finished_req_ids:
            self._tracked.pop(req_id, None)
        return meta

    def _plan_saves(self, scheduler_output: SchedulerOutput, meta: AgentStateMetadata) -> None:
        """The full chunks this step completes, per running request, as save jobs."""
        c = self.chunk_tokens
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracked.block_ids.extend(new_ids[0])
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, done in computed.items():
            tracked = self._tracked[req_id]
            end = (done + scheduler_output.num_scheduled_tokens.get(req_id, 0)) // c
            if end <= tracked.saved:
                continue
            tokens = list(tracked.request.all_token_ids[: end * c])
            keys = self._keys(tokens, tracked.tenant)
            todo = list(range(tracked.saved, end))
            meta.saves.append(
                SaveJob(req_id, tracked.tenant, tokens, [keys[j] for j in todo], todo, list(tracked.block_ids))
            )
            tracked.saved = end

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The blocks are held while the worker still copies out of them: chunks handed over for
        saving, and a session named in kv_transfer_params (snapshotted now). The worker reports
        the request in `get_finished` once its copies are done. A paused or done hint goes to the
        worker with them, applied once they are written.

        Never answers False while copies of the request's blocks may be in flight, whatever fails
        here: vLLM would hand the blocks to the next request while the store still reads them, and
        the chunks stored under this request's keys would hold that request's KV."""
        req_id = request.request_id
        tracked = self._tracked.pop(req_id, None)
        copying = tracked is not None and tracked.saved > 0
        try:
            return self._finished(request, block_ids, copying), None
        except Exception as exc:  # noqa: BLE001 - nothing may escape into vLLM's threads
            self._failed("request_finished", exc)
            held = copying or any(job.req_id == req_id for job in self._sessions)
            if held and req_id not in self._released:
                self._released.append(req_id)  # the worker reports it once its copies are done
            return held, None
        finally:
            for table in (self._matched, self._params, self._load_blocks):
                table.pop(req_id, None)
            self._hinted.discard(req_id)
            self._no_hits.discard(req_id)

    def _finished(self, request: Request, block_ids: list[int], copying: bool) -> bool:
        """request_finished's work: whether the blocks are held. Jobs are queued last, once nothing
        else can fail."""
        req_id = request.request_id
        params = self._params_for(request)
        hint = params.hint
        n = min(int(request.num_computed_tokens), len(request.all_token_ids))
        tenant = tenant_of(request.cache_salt, self.config.tenant)
        hint_job = None
        if hint is not None and hint.finish is not None:
            hint_job = HintJob(req_id, tenant, hint.name, hint.session, hint.finish, hint.expected_s,
                               list(request.all_token_ids[:n]))  # fmt: skip
        session = params.session
        session_job = None
        if session is not None and n > 0 and block_ids:
            tokens = list(request.all_token_ids[:n])
            session_job = SessionJob(req_id, tenant, session[0], session[1], tokens, list(block_ids))
        if hint_job is not None:
            self._hint_jobs.append(hint_job)
        if session_job is not None:
            self._sessions.append(session_job)  # the worker holds the blocks until the snapshot copied them
            return True
        if copying or hint_job is not None:
            self._released.append(req_id)  # a hint alone: reported at once, the engine steps to deliver it
            return True
        return False

    @never_raises(lambda *_, **__: None)
    def update_connector_output(self, connector_output: Any) -> None:
        """Loads that failed (their blocks in `invalid_block_ids`, or the request in `failed_recving`):
        the request is recomputed, and never offered a hit again. A worker that cannot load would
        otherwise see it again at once, and the engine would reschedule it forever."""
        if not self._load_blocks:
            return
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        received = set(getattr(connector_output, "finished_recving", None) or ())
        for req_id, blocks in list(self._load_blocks.items()):
            if req_id in failed or not invalid.isdisjoint(blocks):
                self._no_hits.add(req_id)
                del self._load_blocks[req_id]
            elif req_id in received:
                del self._load_blocks[req_id]

    # -- metrics -----------------------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return AgentStateStats(data=dict(data)) if data is not None else AgentStateStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> KVConnectorPromMetrics | None:
        return AgentStatePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ==============================================================================================
    # Worker side
    # ==============================================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Choose the block layout from the engine's attention backend, open the store, serve lookups.

        An unsupported layout leaves the connector off (logged): no hits, nothing stored."""
        try:
            self.layout, self.planes = self._layout(kv_caches)
            self.caches = list(kv_caches.values())
            self.store = self._loop.run(self._open(), max(self.settings.timeout_s, 600.0))
        except Exception as exc:  # noqa: BLE001 - the engine runs on without the store
            self._count(errors=1)
            # One line, once: its scheduler finds no lookup channel of this engine and answers misses.
            # A directory held by another process (an engine left running) names that process.
            if isinstance(exc, DataDirLockedError):
                why = f"{clip(str(exc), 500)} [an engine left running? stop it, or give this one another path]"
            else:
                why = clip_message(exc, 500)
            log.warning("agentstate: this engine runs without its store (no hits, nothing stored): %s", why)
            self.layout, self.planes = None, []

    def _layout(
        self, kv_caches: dict[str, torch.Tensor]
    ) -> tuple[BlockLayout, list[tuple[torch.Tensor, torch.Tensor]]]:
        from vllm.model_executor.layers.attention import Attention  # noqa: F401 - vLLM present here

        layers = self._vllm_config.compilation_config.static_forward_context
        names = list(kv_caches)
        if len(names) != self.spec.num_layers:
            raise InvalidArgumentError(f"{len(names)} KV caches for {self.spec.num_layers} layers")
        first = layers.get(names[0])
        backend = first.attn_backend.get_name() if first is not None else "?"
        if backend == "CPU_ATTN":
            variant = getattr(first, "isa", None) or _cpu_isa(self._vllm_config, self.block_size, self.spec)
        else:
            variant = _cuda_layout()
        layout = layout_for(
            backend, variant, block_size=self.block_size, heads=self.spec.num_kv_heads, dim=self.spec.head_dim
        )
        for name in names:
            if kv_caches[name].dtype != self.spec.torch_dtype:
                raise InvalidArgumentError(f"KV cache {name} is {kv_caches[name].dtype}, the spec {self.spec.dtype}")
        log.info("agentstate: %s layout %s (%s %s) at %s", self.spec.model_id, layout.name, backend, variant, self.path)
        return layout, [layout.planes(kv_caches[n]) for n in names]

    async def _open(self) -> StateStore:
        config = StoreConfig(**{**self._overrides, "path": self.path})
        store = await StateStore.open(config, self.spec)
        try:
            _record_spec(Path(config.path), self.spec)
            record_config(config, "agentstate.adapters.vllm")  # the admin commands open what the engine wrote
            name = socket_name(str(Path(self.path).resolve()), self.rank, self._engine)
            self._server = LookupServer(name, self._answer, stamp={"engine": self._engine})
            await self._server.start()
        except BaseException:
            await store.close()
            raise
        return store

    def _ready(self) -> StateStore:
        if self.store is None or self.layout is None:
            raise BackendError("the agentstate store is not open (unsupported layout, or closed)")
        return self.store

    async def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """The scheduler's lookup: leading stored chunks, and a named session's manifest if it fits.
        A hint (`op` "hint") is started on this loop and answered at once."""
        store = self._ready()
        if request.get("op") == "hint":
            return self._hint_arrived(request)
        keys = [str(k) for k in request.get("keys", [])]
        reply: dict[str, Any] = {"chunks": await store.chunks.lookup(keys) if keys else 0}
        sid = request.get("session")
        if sid:
            reply["session"] = await self._session_hit(store.for_tenant(request["tenant"]), sid, request["tokens"])
        return reply

    async def _session_hit(self, view: StateStore, session_id: str, tokens: list[int]) -> dict[str, Any] | None:
        """The session's manifest if it covers a prefix of `tokens`. A snapshot of this session still
        being written (the previous turn, finished a moment ago) is waited for, up to half the
        scheduler's lookup timeout: the next turn then finds all of it, tail included."""
        saving = self._saving.get((view.tenant, session_id))
        if saving is not None and not saving.done():
            with contextlib.suppress(Exception):  # a failed or slow save: answer with what is stored
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(saving)), self.settings.lookup_timeout_s / 2)
        try:
            manifest = await view.session(session_id)
        except AgentStateError:
            return None
        n = manifest.num_tokens
        if n > len(tokens) or list(manifest.tokens) != tokens[:n]:
            return None
        keys = [*manifest.chunk_keys, *([manifest.tail_key] if manifest.tail_key else [])]
        if not all(await view.chunks.present(keys)):
            return None
        return {"tokens": n, "chunk_keys": list(manifest.chunk_keys), "tail_key": manifest.tail_key,
                "chunk_tokens": manifest.chunk_tokens}  # fmt: skip

    # -- loads -------------------------------------------------------------------------------------

    @never_raises(lambda *_, **__: None)
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads on the store's loop (they complete between steps), and the
        snapshots of finished session requests (their blocks are held until reported)."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, AgentStateMetadata)
        for req_id in meta.preempted:  # before this step's forward, which may reuse their blocks
            flag = self._revoke.pop(req_id, None)
            if flag is not None:
                flag.set()
            self._reading.pop(req_id, None)
        for req_id in meta.released:
            self._held[req_id] = self._reading.pop(req_id, [])
            self._revoke.pop(req_id, None)
        for job in meta.loads:
            self._start_load(job)
        for sjob in meta.sessions:
            self._start_session(sjob)
        for hjob in meta.hints:
            self._start_hint(hjob)
        for req_id in [*meta.released, *(s.req_id for s in meta.sessions)]:
            self._req_writes.pop(req_id, None)
        if self.settings.load_mode == "sync":  # this step's forward reads the loaded blocks: wait here
            for job in meta.loads:
                entry = self._loading.get(job.req_id)
                if entry is not None:
                    concurrent.futures.wait([entry[0]], timeout=self.settings.timeout_s)
                    self._finish_load(job.req_id, timed_out=not entry[0].done())

    def _start_load(self, job: LoadJob) -> None:
        if job.req_id in self._loading:
            return
        try:
            self._ready()
            assert self.layout is not None
            span_end = max([job.end, *(start + n for start, n in job.spans)])
            target = BlocksTarget(self.planes, job.block_ids, self.block_size, job.first, span_end,
                                  orders=self.layout.orders, stop=job.end)  # fmt: skip
            future = asyncio.run_coroutine_threadsafe(self._load(job, target), self._loop.loop)
        except Exception as exc:  # noqa: BLE001 - the load fails, the blocks are recomputed
            self._failed("load", exc)
            done: concurrent.futures.Future[set[int]] = concurrent.futures.Future()
            done.set_result(set())
            target = BlocksTarget(self.planes or [(torch.empty(0), torch.empty(0))], [], 1, 0, 0)
            future = done
        self._loading[job.req_id] = (future, target, job, time.monotonic())
        self._count(hit_tokens=job.end - job.first)

    async def _load(self, job: LoadJob, target: BlocksTarget) -> set[int]:
        """Read the job's chunks straight into its blocks; the span starts written in full. A resuming
        hint of the request still bringing them up into host memory is waited for first (at most
        half of timeout_s): the read then finds them there instead of reading the slow tier twice."""
        store = self._ready()
        t0 = time.perf_counter()
        warming = self._warming.pop(job.req_id, None)
        if warming is not None and not warming.done():
            await asyncio.wait({warming}, timeout=self.settings.timeout_s / 2)
        if not job.keys:
            return set()
        usage: Counter[str] = Counter()
        t1 = time.perf_counter()
        with store.chunks.pinned(job.keys):
            await store.chunks.discover(job.keys)
            await store.chunks.read(job.keys, job.spans, target, usage=usage)
        done = set(target.done)
        read = {k: v for k, v in usage.items() if k.startswith(BYTES_READ) and v}
        self._count(**read, load_wait_ms=round(1000 * (t1 - t0)), load_read_ms=round(1000 * (time.perf_counter() - t1)))
        view = store.for_tenant(job.tenant) if job.tenant else store
        view.usage_log.add(view.tenant, None, {"loads": 1, "tokens_read": self._landed(job, done) - job.first, **read})
        return done

    @staticmethod
    def _landed(job: LoadJob, written: set[int]) -> int:
        """Where the job's load ends: spans are in token order, and the first gap ends it."""
        good = job.first
        for start, n in job.spans:
            if start not in written:
                break
            good = start + n
        return min(max(good, job.first), job.end)

    def _finish_load(self, req_id: str, timed_out: bool) -> None:
        future, target, job, started = self._loading.pop(req_id)
        if timed_out:
            future.cancel()
        written = target.close()
        if not timed_out and future.done() and not future.cancelled() and future.exception() is not None:
            self._failed("load", future.exception())  # type: ignore[arg-type]
        good = self._landed(job, written)
        self._count(loads=1, load_ms=round(1000 * (time.monotonic() - started)))
        if good < job.end:
            bad = {
                job.block_ids[t // self.block_size]
                for t in range(good, job.end)
                if t // self.block_size < len(job.block_ids)
            }
            self._errors |= bad
            self._count(load_error_blocks=len(bad))
        self._count(loaded_tokens=good - job.first)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete between steps (the request waits in WAITING_FOR_REMOTE_KVS)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved per chunk after the forward (wait_for_save)

    # -- saves -------------------------------------------------------------------------------------

    @never_raises(lambda *_, **__: None)
    def wait_for_save(self) -> None:
        """Hand this step's completed chunks to the store's loop: deduped, copied out of the blocks
        into canonical KV and written there, off the step (see the module doc for why the blocks
        stay valid meanwhile). Beyond `max_pending_saves` chunks in flight, saves are dropped."""
        self._writes = [f for f in self._writes if not f.done()]
        if not self.has_connector_metadata() or self.store is None or self.layout is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, AgentStateMetadata)
        ready = self._forward_done()
        for job in meta.saves:
            if self._pending + len(job.chunks) > self.settings.max_pending_saves:
                self._count(saves_dropped=len(job.chunks))  # never stall the step behind a slow store
                continue
            with self._count_lock:
                self._pending += len(job.chunks)
            flag = self._revoke.setdefault(job.req_id, threading.Event())
            read: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._reading.setdefault(job.req_id, []).append(read)
            write = asyncio.run_coroutine_threadsafe(self._save(job, flag, read, ready), self._loop.loop)
            self._writes.append(write)
            mine = [f for f in self._req_writes.get(job.req_id, []) if not f.done()]
            self._req_writes[job.req_id] = [*mine, write]

    def _forward_done(self) -> Any:
        """What a copy off the step waits for: nothing on CPU (the forward has returned); on CUDA an
        event after this step's kernels."""
        if self.caches and self.caches[0].is_cuda:
            event = torch.cuda.Event()
            event.record()
            return event
        return None

    async def _known(self, keys: list[str]) -> list[bool]:
        store = self._ready()
        missing = set(await store.chunks.missing(keys, durable=False)) if keys else set()
        return [i not in missing for i in range(len(keys))]

    def _copy_out(self, block_ids: list[int], n: int, ready: Any, flag: threading.Event | None) -> torch.Tensor | None:
        """Canonical KV of the first `n` tokens of these blocks, or None when revoked meanwhile (the
        copy may have read blocks another request was already writing)."""
        assert self.layout is not None
        if ready is not None:
            ready.synchronize()
        if flag is not None and flag.is_set():
            return None
        kv = gather(self.planes, block_ids, self.block_size, 0, n, self.spec.empty_kv(n), self.layout.orders)
        if flag is not None and flag.is_set():
            return None
        return kv

    async def _save(self, job: SaveJob, flag: threading.Event, read: concurrent.futures.Future[None], ready: Any) -> None:
        c, per = self.chunk_tokens, self.chunk_tokens // self.block_size
        try:
            try:
                present = await self._known(job.keys)
                todo = [j for j, known in zip(job.chunks, present) if not known]
                chunks: dict[int, torch.Tensor] = {}
                if todo:
                    ids = [b for j in todo for b in job.block_ids[j * per : (j + 1) * per]]
                    kv = await asyncio.to_thread(self._copy_out, ids, len(todo) * c, ready, flag)
                    if kv is None:
                        self._count(saves_revoked=len(todo))
                        return
                    chunks = {j: kv[:, :, k * c : (k + 1) * c] for k, j in enumerate(todo)}
            finally:
                read.set_result(None)  # the blocks are no longer read: they may be freed
            if chunks:
                stored = await self.store.for_tenant(job.tenant).put_chunks(job.tokens, chunks)  # type: ignore[union-attr]
                self._count(stored_tokens=stored)
        except Exception as exc:  # noqa: BLE001 - a lost save is a later miss
            self._failed("save", exc)
        finally:
            with self._count_lock:
                self._pending -= len(job.chunks)

    # -- sessions ----------------------------------------------------------------------------------

    def _start_session(self, job: SessionJob) -> None:
        """Snapshot a finished request's session off the step; its blocks are held until copied out."""
        read: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._held.setdefault(job.req_id, []).extend([*self._reading.pop(job.req_id, []), read])
        self._revoke.pop(job.req_id, None)
        try:
            self._ready()
            saved = asyncio.run_coroutine_threadsafe(self._snapshot(job, read, self._forward_done()), self._loop.loop)
            self._writes.append(saved)
            live = {k: f for k, f in self._saving.items() if not f.done()}  # replaced whole: the loop reads it
            live[(job.tenant, job.session_id)] = saved
            self._saving = live
        except Exception as exc:  # noqa: BLE001 - the blocks must be released either way
            self._failed("snapshot", exc)
            read.set_result(None)

    async def _snapshot(self, job: SessionJob, read: concurrent.futures.Future[None], ready: Any) -> None:
        try:
            try:
                kv = await asyncio.to_thread(self._copy_out, job.block_ids, len(job.tokens), ready, None)
            finally:
                read.set_result(None)
            assert kv is not None
            view = self._ready().for_tenant(job.tenant)
            try:
                await view.snapshot(job.session_id, job.tokens, kv, job.state)
            except ConflictError:  # another writer of this id committed meanwhile: the newest turn wins
                await view.snapshot(job.session_id, job.tokens, kv, job.state, force=True)
            self._count(sessions_saved=1)
        except Exception as exc:  # noqa: BLE001
            self._failed("snapshot", exc)

    # -- agent hints -------------------------------------------------------------------------------

    def _hint_arrived(self, request: dict[str, Any]) -> dict[str, Any]:
        """A resuming hint of a request that just arrived (on the loop): started now, not awaited."""
        tokens = [int(t) for t in request.get("tokens", [])]
        job = HintJob(str(request["req_id"]), str(request["tenant"]), str(request["name"]), bool(request["session"]),
                      request["hint"], request.get("expected_s"), tokens, int(request.get("local", 0)))  # fmt: skip
        after: list[concurrent.futures.Future[None]] = []
        saving = self._saving.get((job.tenant, job.name)) if job.session else None
        if saving is not None:  # the session's previous turn is still being written: hint what it stores
            after.append(saving)
        self._warming = {k: f for k, f in self._warming.items() if not f.done()}
        self._warming[job.req_id] = asyncio.ensure_future(self._hint(job, after, self.settings.lookup_timeout_s / 2))
        return {"hint": "started"}

    def _start_hint(self, job: HintJob) -> None:
        """A finished request's paused/done hint, applied on the loop once its writes are done."""
        after = list(self._req_writes.pop(job.req_id, []))
        saving = self._saving.get((job.tenant, job.name)) if job.session else None
        if saving is not None:
            after.append(saving)
        try:
            self._ready()
            self._writes.append(asyncio.run_coroutine_threadsafe(self._hint(job, after), self._loop.loop))
        except Exception as exc:  # noqa: BLE001 - a hint is advice: the request is unaffected
            self._hint_failed(job, exc)

    async def _hint(
        self, job: HintJob, after: list[concurrent.futures.Future[None]], wait_s: float | None = None
    ) -> None:
        t0 = time.perf_counter()
        try:
            if after:  # never cancels them (asyncio.wait): they are the request's own writes
                await asyncio.wait([asyncio.wrap_future(f) for f in after], timeout=wait_s or self.settings.timeout_s)
            view = self._ready().for_tenant(job.tenant)
            if job.hint == "resuming" and not job.session and job.local >= self.chunk_tokens:
                await self._warm_past(view, job)
                return
            if job.session:
                result = await view.hint(job.name, job.hint, job.expected_s)
            else:
                result = await view.hint_tokens(job.name, job.tokens, job.hint, job.expected_s)
            self._count(hints=1, hint_moved_bytes=result.moved_bytes)
            log.debug("agentstate hint %s %s: %d chunks, %d in memory, %d bytes brought up", job.hint, job.name,
                      result.chunks, result.in_memory, result.moved_bytes)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a hint is advice: the request is unaffected
            self._hint_failed(job, exc)
        finally:
            self._count(hint_ms=round(1000 * (time.perf_counter() - t0)))

    async def _warm_past(self, view: StateStore, job: HintJob) -> None:
        """Resuming, when vLLM's own prefix cache holds the prompt's first `job.local` tokens: bring up
        only the stored chunks past them (what the load will read). `hint_tokens` would bring up the
        whole prefix, evicting for chunks the load never reads; the request's load follows at once,
        so no hold is placed (the hold of its paused hint, if any, lasts until its end)."""
        c = self.chunk_tokens
        keys = self._keys(job.tokens, job.tenant)
        stored = await view.chunks.lookup(keys)
        first = job.local // c
        if stored <= first:
            self._count(hints_skipped=1)  # vLLM's own cache holds all of it: nothing to bring up
            return
        todo = list(keys[first:stored])
        with view.chunks.pinned(todo):
            await view.chunks.discover(todo)
            _, moved_bytes = await view.chunks.warm(todo, [c] * len(todo))
        view.usage_log.add(view.tenant, None, {"hints": 1})
        self._count(hints=1, hint_moved_bytes=moved_bytes)

    def _hint_failed(self, job: HintJob, exc: BaseException) -> None:
        self._count(hint_errors=1)
        log.warning("agentstate %s hint for %s (request %s) not applied, the request is unaffected: %s",
                    job.hint, clip(job.name), clip(job.req_id), clip_message(exc))  # fmt: skip

    # -- completions -------------------------------------------------------------------------------

    @never_raises(lambda *_, **__: (None, None))
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving = set()
        now = time.monotonic()
        for req_id, (future, _, _, started) in list(self._loading.items()):
            late = now - started > self.settings.timeout_s
            if future.done() or late:
                self._finish_load(req_id, timed_out=not future.done())  # cancels it when late
                recving.add(req_id)
        sending = {r for r, reads in self._held.items() if all(f.done() for f in reads)}
        for req_id in sending:
            del self._held[req_id]
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This interval's counts (the scheduler's own too: hints_invalid), summed by vLLM over roles."""
        with self._count_lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, AgentStateStats()
        return stats

    def shutdown(self) -> None:
        """Finish writes and snapshots in flight, close the store, stop the loop. Never raises."""
        if self.role != KVConnectorRole.WORKER or self._loop.closed:
            return
        try:
            deadline = time.monotonic() + self.settings.timeout_s  # one bound for all of them
            for f in self._writes:
                try:
                    f.result(max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001, S110 - counted where it failed (or late: dropped)
                    pass
            if self._server is not None:
                self._loop.run(self._server.stop(), self.settings.timeout_s)
            if self.store is not None:
                self._loop.run(self.store.close(), max(self.settings.timeout_s, 60.0))
        except Exception as exc:  # noqa: BLE001
            self._failed("shutdown", exc)
        finally:
            self.store = None
            self._loop.stop()

    def __del__(self) -> None:
        try:
            if getattr(self, "_role", None) == KVConnectorRole.WORKER and hasattr(self, "_loop"):
                self.shutdown()
        except Exception:  # noqa: BLE001, S110
            pass


def _record_spec(path: Path, spec: ModelSpec) -> None:
    """Write `<path>/spec.json` (as `agentstate serve` does), so `agentstate ls -p DIR` opens the directory."""
    file = path / SPEC_FILE
    if file.exists():
        return
    tmp = file.with_name(f".{SPEC_FILE}.{os.getpid()}")
    tmp.write_text(spec.model_dump_json(indent=2))
    tmp.replace(file)


def _cpu_isa(vllm_config: Any, block_size: int, spec: ModelSpec) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(spec.torch_dtype, block_size, spec.head_dim, vllm_config.cache_config.cache_dtype))


def _cuda_layout() -> str:
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        return str(get_kv_cache_layout())
    except Exception:  # noqa: BLE001 - older/newer vLLM: NHD is the flash-attention default
        return "NHD"
