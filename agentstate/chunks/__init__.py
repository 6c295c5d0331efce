"""The chunk layer: the one owner of a chunk's life (see `ChunkStore`).

Everything above it (sessions, the catalog, adapters, the service, the admin tools) uses the
names exported here and nothing under them: `index`, `tiers`, `transfer` and `io` are its
insides.
"""

from agentstate.chunks.io import batches
from agentstate.datadir.lock import DataDirLock
from agentstate.chunks.prefetch import PrefetchHandle, PrefetchPolicy, deadline_for
from agentstate.chunks.store import ChunkStore, EvictResult, SweepCursor, SweepStep, TierInfo
from agentstate.chunks.tiers import Value
from agentstate.chunks.transfer import Span

__all__ = [
    "ChunkStore",
    "DataDirLock",
    "EvictResult",
    "PrefetchHandle",
    "PrefetchPolicy",
    "Span",
    "SweepCursor",
    "SweepStep",
    "TierInfo",
    "Value",
    "batches",
    "deadline_for",
]
