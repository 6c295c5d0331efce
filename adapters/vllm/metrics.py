"""The connector's counts: totals per role, the interval's stats vLLM sums over workers, its Prometheus metrics.

Both roles count (the scheduler: lookups and malformed params; the worker: loads, saves, hints),
each in its own `Counts`; vLLM collects each role's interval through `get_kv_connector_stats` and
shows the sums as `vllm:agentstate_*`. `Counts.failed` is where every swallowed error is counted
and logged: the connector never raises into vLLM's threads, so this line is all an operator sees.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from agentstate.adapters.vllm.params import clip_message
from agentstate.errors import AgentStateError

log = logging.getLogger("vllm.agentstate")  # under vLLM's logger: shown with the engine's logs

STAT_KEYS = (
    "hit_tokens", "loaded_tokens", "stored_tokens", "load_error_blocks", "sessions_saved", "saves_dropped",
    "saves_revoked", "errors", "hints", "hint_moved_bytes", "hint_errors", "hints_invalid", "hints_skipped",
    "loads", "load_ms", "load_wait_ms", "load_read_ms", "hint_ms", "saves_skipped_window", "states_saved",
    "states_loaded",
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


class Counts:
    """One role's counts: `totals` since it started (tests, logs) and the interval's `AgentStateStats`
    (vLLM's metrics), updated together under one lock (the worker counts from its loop too)."""

    def __init__(self) -> None:
        self.totals: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stats = AgentStateStats()

    def add(self, **amounts: int) -> None:
        with self._lock:
            self.totals.update(amounts)
            for k, v in amounts.items():
                if _stat(k):
                    self._stats.data[k] = self._stats.data.get(k, 0) + v

    def take(self) -> AgentStateStats | None:
        """This interval's stats (None when nothing was counted), and a new interval."""
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, AgentStateStats()
        return stats

    def failed(self, call: str, exc: BaseException) -> None:
        """Count an error that the connector swallowed, and log it (cut: it may quote a request's values)."""
        self.add(errors=1)
        if isinstance(exc, (AgentStateError, TimeoutError, OSError)) or len(str(exc)) > 300:
            log.warning("agentstate %s failed: %s", call, clip_message(exc))
        else:
            log.exception("agentstate %s failed", call)


HELPS = {
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
    "saves_skipped_window": "hybrid models: chunks not saved because a sliding-window group no longer held them",
    "states_saved": "hybrid models: Mamba states stored at chunk boundaries",
    "states_loaded": "hybrid models: Mamba states loaded into the engine's state blocks",
}


class AgentStatePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for key, doc in HELPS.items():
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
