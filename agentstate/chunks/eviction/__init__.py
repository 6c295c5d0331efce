"""Eviction policies: the one order in which a cache tier gives up its chunks.

The chunk layer (`TierManager`) is the only thing that evicts: backends store bytes and nothing
else. Each cache tier has one `EvictionPolicy`, chosen by config (`StoreConfig.eviction`, default
"lru"), which keeps the tier's keys with their sizes and says which key goes next. Holds
(`chunks/holds.py`) and pins are applied on top of every policy in the same way (`victim`), so a
policy only orders keys; it never needs to know about agents, hints or reads in flight.

A policy is one module here and one line in `POLICIES` (the module is imported only when a tier
asks for it); a policy outside the repository is named as "package.module:Class".
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping

from agentstate.chunks.holds import victim
from agentstate.errors import InvalidArgumentError

POLICIES: dict[str, str] = {
    "lru": "agentstate.chunks.eviction.lru:LRU",
    "fifo": "agentstate.chunks.eviction.fifo:FIFO",
}
"""Policy name -> "module:class"; the module is imported when a store asks for the name."""


class EvictionPolicy(ABC):
    """The keys of one tier, their sizes, and the order eviction takes them in.

    `sizes` is a live mapping key -> stored bytes of everything the tier holds; holds track that
    very object (`Holds.track`), so a policy keeps one mapping for its whole life. The manager calls
    `insert` when a key enters the tier, `remove` when it leaves, `touch` on a hit and `release`
    when a session is done with a key; `order` is the eviction order before holds and pins.
    """

    name: str = ""

    @property
    @abstractmethod
    def sizes(self) -> Mapping[str, int]: ...

    @abstractmethod
    def insert(self, key: str, size: int) -> None:
        """`key` (`size` bytes) entered the tier; a key already there keeps its place."""

    @abstractmethod
    def remove(self, key: str) -> int:
        """`key` left the tier; its size (0 when it was not there)."""

    @abstractmethod
    def touch(self, keys: Iterable[str]) -> None:
        """`keys` were hit (read, or stored again)."""

    @abstractmethod
    def release(self, key: str) -> None:
        """Nobody needs `key` soon (a session that is done): put it first in line."""

    @abstractmethod
    def order(self) -> Iterator[str]:
        """Every key, the next to evict first (holds and pins not applied)."""

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def victim(self, can_go: Callable[[str], bool], plan: Mapping[str, float]) -> str | None:
        """The next key to evict: the first in `order` that no hold in `plan` counts, else the held
        one expected back last; only keys `can_go` (not pinned, not in flight)."""
        return victim(self.order(), can_go, plan)

    def eviction_order(self, plan: Mapping[str, float]) -> list[str]:
        """Every key in the order eviction takes them: unheld in policy order, then held, the one
        expected back last first (ties in policy order, as `victim` breaks them)."""
        keys = list(self.order())
        unheld = [k for k in keys if k not in plan]
        held = [k for k in keys if k in plan]
        return unheld + sorted(held, key=lambda k: -plan[k])


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by name ("lru", "fifo") or by "package.module:Class" for one outside the repository."""
    path = POLICIES.get(name, name if ":" in name else None)
    if path is None:
        raise InvalidArgumentError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)} or 'module:Class'")
    module, _, attr = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise InvalidArgumentError(f"eviction policy {name!r}: cannot load {path} ({exc})") from exc
    policy = cls()
    if not isinstance(policy, EvictionPolicy):
        raise InvalidArgumentError(f"eviction policy {name!r}: {path} is not an EvictionPolicy")
    return policy
