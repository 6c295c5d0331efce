"""Least recently used: a hit moves a key to the back of the line."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping

from agentstate.chunks.eviction import EvictionPolicy


class LRU(EvictionPolicy):
    """Keys in one OrderedDict (key -> bytes), oldest use first: O(1) per insert, touch and remove."""

    name = "lru"

    def __init__(self) -> None:
        self._keys: OrderedDict[str, int] = OrderedDict()

    @property
    def sizes(self) -> Mapping[str, int]:
        return self._keys

    def insert(self, key: str, size: int) -> None:
        self._keys.setdefault(key, size)

    def remove(self, key: str) -> int:
        return self._keys.pop(key, 0)

    def touch(self, keys: Iterable[str]) -> None:
        lru = self._keys
        for key in keys:
            if key in lru:
                lru.move_to_end(key)

    def release(self, key: str) -> None:
        if key in self._keys:
            self._keys.move_to_end(key, last=False)

    def order(self) -> Iterator[str]:
        return iter(self._keys)
