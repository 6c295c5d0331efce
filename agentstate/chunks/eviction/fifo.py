"""First in, first out: keys leave in the order they came, hits or not (the worked example of a
policy added as one file plus one line in `POLICIES`; docs/design.md, Tiers)."""

from __future__ import annotations

from collections.abc import Iterable

from agentstate.chunks.eviction.lru import LRU


class FIFO(LRU):
    """LRU's bookkeeping, without moving a key on a hit."""

    name = "fifo"

    def touch(self, keys: Iterable[str]) -> None:
        """A hit does not change a key's place."""
