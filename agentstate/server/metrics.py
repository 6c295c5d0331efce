"""Prometheus text exposition (format 0.0.4), written by hand: request counters and latency
histograms of the service, and the store's own counters and per-tier figures.

Labels are bounded: a route is its template (`/v1/sessions/{session_id}`), never a concrete path,
and no label names a tenant, so /metrics neither grows with traffic nor lists who uses the service.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable

from agentstate.store import StoreStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")
_TIER_FIELDS = ("items", "bytes_used", "capacity_bytes")
_TIER_OPS = ("reads", "writes", "deletes", "misses", "errors", "evictions")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class _Family:
    def __init__(self, name: str, kind: str, help_text: str) -> None:
        self.head = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        self.name = name
        self.samples: list[str] = []

    def add(self, value: float, suffix: str = "", **labels: str) -> None:
        self.samples.append(f"{self.name}{suffix}{_labels(labels)} {_number(value)}")

    def lines(self) -> list[str]:
        return self.head + self.samples


class Metrics:
    """Request counters and latency histograms, fed by the service's middleware."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str, str]] = Counter()
        self.body_bytes: Counter[str] = Counter()
        self._buckets: defaultdict[tuple[str, str], list[int]] = defaultdict(lambda: [0] * len(BUCKETS))
        self._sum: defaultdict[tuple[str, str], float] = defaultdict(float)
        self._count: Counter[tuple[str, str]] = Counter()

    def observe(self, method: str, route: str, status: int, seconds: float, received: int) -> None:
        self.requests[(method, route, str(status))] += 1
        self.body_bytes[route] += received
        key = (method, route)
        buckets = self._buckets[key]
        for i, bound in enumerate(BUCKETS):
            if seconds <= bound:
                buckets[i] += 1
        self._sum[key] += seconds
        self._count[key] += 1

    def render(self, stats: StoreStats) -> str:
        families = [*self._http(), *self._store(stats)]
        return "\n".join(line for f in families for line in f.lines()) + "\n"

    def _http(self) -> Iterable[_Family]:
        total = _Family("agentstate_http_requests_total", "counter", "HTTP requests answered.")
        for (method, route, status), n in sorted(self.requests.items()):
            total.add(n, method=method, route=route, status=status)
        received = _Family("agentstate_http_request_body_bytes_total", "counter", "Request body bytes received.")
        for route, n in sorted(self.body_bytes.items()):
            received.add(n, route=route)
        latency = _Family("agentstate_http_request_duration_seconds", "histogram", "Time to answer a request.")
        for (method, route), buckets in sorted(self._buckets.items()):
            for bound, n in zip(BUCKETS, buckets):
                latency.add(n, "_bucket", method=method, route=route, le=_number(bound))
            latency.add(self._count[(method, route)], "_bucket", method=method, route=route, le="+Inf")
            latency.add(self._sum[(method, route)], "_sum", method=method, route=route)
            latency.add(self._count[(method, route)], "_count", method=method, route=route)
        return [total, received, latency]

    @staticmethod
    def _store(stats: StoreStats) -> Iterable[_Family]:
        sessions = _Family("agentstate_sessions", "gauge", "Sessions in the catalog, all tenants.")
        sessions.add(stats.sessions)
        keys = _Family("agentstate_indexed_keys", "gauge", "Chunk and tail keys in the in-memory index.")
        keys.add(stats.indexed_keys)
        out = [sessions, keys]
        for field in _TIER_FIELDS:
            fam = _Family(f"agentstate_tier_{field}", "gauge", f"Tier {field.replace('_', ' ')}.")
            for tier in stats.tiers:
                value = getattr(tier, field)
                if value is not None:
                    fam.add(value, tier=tier.name)
            out.append(fam)
        ops = _Family("agentstate_tier_operations_total", "counter", "Tier operations by kind.")
        for tier in stats.tiers:
            for op in _TIER_OPS:
                ops.add(getattr(tier, op), tier=tier.name, op=op)
        events = _Family(
            "agentstate_store_events_total", "counter", "Store counters (reads, misses, corrupt chunks, ...)."
        )
        for name, value in sorted(stats.counters.items()):
            events.add(value, event=_NAME_BAD.sub("_", name))
        return [*out, ops, events]
