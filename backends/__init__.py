"""Storage tiers: one module per backend, all implementing `agentstate.backends.base.Backend`.

Installed as `agentstate.backends`; import backends lazily by name so optional dependencies
(lmdb today; redis, mooncake later) load only when chosen.
"""

from __future__ import annotations

from agentstate.backends.base import Backend, BackendStats, ReadSink

__all__ = ["Backend", "BackendStats", "ReadSink"]
