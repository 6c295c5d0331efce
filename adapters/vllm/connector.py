"""`AgentStateConnector`: the class vLLM loads, a facade over one scheduler side or one worker side.

vLLM makes one instance per role (shaped like vLLM's own OffloadingConnector): the SCHEDULER
instance (EngineCore, no KV) holds a `SchedulerSide`, the WORKER instance (the process that owns
the KV blocks) a `WorkerSide`. Each vLLM call goes to the side of its role; metrics both roles
share are built here. See the package doc (`agentstate.adapters.vllm`) for what it does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from agentstate.adapters.vllm.config import ConnectorConfig
from agentstate.adapters.vllm.metadata import AgentStateMetadata
from agentstate.adapters.vllm.metrics import AgentStatePromMetrics, AgentStateStats
from agentstate.adapters.vllm.scheduler import SchedulerSide
from agentstate.adapters.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from collections import Counter

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class AgentStateConnector(KVConnectorBase_V1, SupportsHMA):
    """KV connector over an agentstate StateStore (see the package doc). `SupportsHMA`: vLLM keeps its
    hybrid memory allocator on, and a hybrid model's requests come with block ids per KV cache group
    (`groups.py`)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        # checks every setting (and the model's KV cache groups) before either role opens anything
        config = ConnectorConfig.of(vllm_config, kv_cache_config)
        self.connector_scheduler: SchedulerSide | None = None
        self.connector_worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = SchedulerSide(config, vllm_config)
        else:
            self.connector_worker = WorkerSide(config, vllm_config)

    @property
    def scheduler(self) -> SchedulerSide:
        assert self.connector_scheduler is not None, "a scheduler call on the worker's connector"
        return self.connector_scheduler

    @property
    def worker(self) -> WorkerSide:
        assert self.connector_worker is not None, "a worker call on the scheduler's connector"
        return self.connector_worker

    @property
    def counts(self) -> Counter[str]:
        """This role's counts since it started (tests and logs; metrics are `get_kv_connector_stats`)."""
        side = self.connector_scheduler or self.connector_worker
        assert side is not None
        return side.counts.totals

    # -- scheduler ---------------------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """What vLLM's own prefix cache holds (read only: a resuming hint skips what it has)."""
        if self.connector_scheduler is not None:  # vLLM binds the scheduler's pool; a worker has none
            self.connector_scheduler.block_pool = gpu_block_pool

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # -- worker ------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            self.worker.start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete between steps (the request waits in WAITING_FOR_REMOTE_KVS)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved per chunk after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._metadata() if self.has_connector_metadata() else None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """get_finished's sets, and the loads that failed as whole requests (a hybrid model's: vLLM maps
        failed blocks back to requests for one KV cache group only)."""
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=self.worker.loads.failed_requests())  # fmt: skip

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def _metadata(self) -> AgentStateMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AgentStateMetadata)
        return meta

    # -- both --------------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This interval's counts of this role (the scheduler's too: hints_invalid), summed by vLLM."""
        side = self.connector_scheduler or self.connector_worker
        return side.get_kv_connector_stats() if side is not None else None

    def shutdown(self) -> None:
        """The worker finishes its writes and closes the store; the scheduler holds nothing to close."""
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return AgentStateStats(data=dict(data)) if data is not None else AgentStateStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> KVConnectorPromMetrics | None:
        return AgentStatePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
