"""The in-memory chunk index: which tiers hold which chunk, and longest-prefix match.

Chunk keys form a hash chain, so a key names its whole prefix: the radix tree over keys is the
map `key -> node`, and a longest-prefix match is a walk down the chain that stops at the first
key no tier holds. The index is rebuilt from the persistent tier when a store opens, so a store
reopened after a restart finds everything it had.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class IndexListener(Protocol):
    def added(self, keys: list[str], tier: str) -> None: ...

    def discarded(self, keys: list[str], tier: str) -> None: ...


@dataclass
class Residency:
    tiers: set[str] = field(default_factory=set)
    last_access: float = 0.0
    hits: int = 0


class ChunkIndex:
    """Residency of every chunk this process knows, plus in-flight pins.

    A pin marks a chunk that an unfinished store or load depends on: garbage collection never
    deletes a pinned chunk, even when no committed manifest references it yet.
    """

    def __init__(self) -> None:
        self._nodes: dict[str, Residency] = {}
        self._pins: Counter[str] = Counter()
        self.listener: IndexListener | None = None
        """told of every change of residency (the store's KV events)"""

    def __len__(self) -> int:
        return len(self._nodes)

    def add(self, keys: Iterable[str], tier: str) -> None:
        keys = list(keys)
        for key in keys:
            self._nodes.setdefault(key, Residency()).tiers.add(tier)
        if self.listener is not None and keys:
            self.listener.added(keys, tier)

    def discard(self, keys: Iterable[str], tier: str) -> None:
        keys = list(keys)
        for key in keys:
            node = self._nodes.get(key)
            if node is not None:
                node.tiers.discard(tier)
                if not node.tiers:
                    del self._nodes[key]
        if self.listener is not None and keys:
            self.listener.discarded(keys, tier)

    def tiers_of(self, key: str) -> set[str]:
        node = self._nodes.get(key)
        return set(node.tiers) if node else set()

    def holds(self, key: str, tier: str) -> bool:
        node = self._nodes.get(key)
        return node is not None and tier in node.tiers

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys of the chain some tier holds."""
        for i, key in enumerate(keys):
            if key not in self._nodes:
                return i
        return len(keys)

    def touch(self, keys: Iterable[str]) -> None:
        now = time.monotonic()
        for key in keys:
            node = self._nodes.get(key)
            if node is not None:
                node.last_access = now
                node.hits += 1

    def hits(self, key: str) -> int:
        node = self._nodes.get(key)
        return node.hits if node else 0

    def pin(self, keys: Iterable[str]) -> None:
        self._pins.update(keys)

    def unpin(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._pins[key] -= 1
            if self._pins[key] <= 0:
                del self._pins[key]

    def pinned(self, key: str) -> bool:
        return key in self._pins
