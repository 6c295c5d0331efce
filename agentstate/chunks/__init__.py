"""The chunk layer: the one owner of a chunk's life (see `ChunkStore`).

Everything above it (sessions, the catalog, adapters, the service, the admin tools) uses the
names exported here and nothing under them.
"""

from agentstate.chunks.lock import DataDirLock
from agentstate.chunks.store import ChunkStore, EvictResult, TierInfo

__all__ = ["ChunkStore", "DataDirLock", "EvictResult", "TierInfo"]
