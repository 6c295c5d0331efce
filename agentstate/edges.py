"""What the core knows of its edges (engine adapters), as they declare it: the core names no engine.

An edge that reads its own keys from a config file declares the table they live in; one that
writes keys into the store's tiers outside the catalog (keys no session manifest names, such as an
engine's own pages) declares their key space, so that `verify` checks them with the codec,
never reports them missing or orphaned, and `stats` counts them. Declarations are plain data:
reading them imports no engine. The adapters that ship with agentstate declare theirs in the
`agentstate.adapters` package (imported here on first use); another calls `declare` when imported.
"""

from __future__ import annotations

import importlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from agentstate.errors import InvalidArgumentError
from agentstate.keys import CHUNK_PREFIX, TAIL_PREFIX

CORE_PREFIXES = (CHUNK_PREFIX, TAIL_PREFIX)


@dataclass(frozen=True)
class KeySpace:
    """Keys an edge stores outside the catalog: `<prefix><fingerprint>/...`, each one codec value."""

    prefix: str
    report: str
    """the field `agentstate stats --json` counts them under (the CLI prints `label`)"""
    label: str


@dataclass(frozen=True)
class KeyScheme:
    """How an edge's engine names a shared prefix's chunks from its tokens, so that the store can key
    prefixes the same way and share them with that engine (`StoreConfig.key_scheme = "<name>[:<argument>]"`).

    `keys(tokens, fingerprint, chunk_tokens, argument, salt)` gives the keys of the full chunks;
    `base(fingerprint, chunk_tokens, argument)` the keys' prefix before their last part (what a data-plane
    handle carries). `salt` is None for the store's own tenant, else the tenant's id."""

    name: str
    keys: Callable[[array, str, int, str, str | None], list[str]]
    base: Callable[[str, int, str], str]


@dataclass(frozen=True)
class Edge:
    """One edge: `name` is its config-file table; `key_spaces` the keys it stores outside the catalog;
    `key_schemes` how its engine names prefixes, for stores that share them with it."""

    name: str
    key_spaces: tuple[KeySpace, ...] = ()
    key_schemes: tuple[KeyScheme, ...] = ()


_EDGES: dict[str, Edge] = {}
_loaded = False


def declare(edge: Edge) -> Edge:
    """Add `edge` (again: replaced). A key space must not overlap the core's or another edge's."""
    taken = [*CORE_PREFIXES, *(s.prefix for e in _EDGES.values() if e.name != edge.name for s in e.key_spaces)]
    for space in edge.key_spaces:
        if any(space.prefix.startswith(p) or p.startswith(space.prefix) for p in taken):
            raise InvalidArgumentError(f"edge {edge.name}: key space {space.prefix!r} overlaps one taken ({taken})")
    _EDGES[edge.name] = edge
    return edge


def withdraw(name: str) -> None:
    """Forget the edge `name` (an adapter unloaded); a name never declared is ignored."""
    _EDGES.pop(name, None)


def edges() -> list[Edge]:
    """Every declared edge, the shipped adapters' included."""
    global _loaded
    if not _loaded:
        _loaded = True
        try:
            importlib.import_module("agentstate.adapters")  # declares the shipped adapters; imports no engine
        except ImportError:  # a checkout never installed: its adapters folder is not mapped (tests/conftest.py)
            pass
    return list(_EDGES.values())


def tables() -> tuple[str, ...]:
    """The config-file tables the edges own."""
    return tuple(e.name for e in edges())


def key_spaces() -> list[KeySpace]:
    """Every key space the edges store outside the catalog."""
    return [s for e in edges() for s in e.key_spaces]


DEFAULT_SCHEME = "agentstate"


def key_scheme(scheme: str) -> tuple[KeyScheme | None, str]:
    """The declared scheme named by `scheme` ("<name>[:<argument>]") and its argument; (None, "") for
    agentstate's own chunk chain. An undeclared name is an InvalidArgumentError naming the known ones."""
    name, _, argument = scheme.partition(":")
    if name == DEFAULT_SCHEME and not argument:
        return None, ""
    known = {s.name: s for e in edges() for s in e.key_schemes}
    if name not in known:
        raise InvalidArgumentError(f"key_scheme {scheme!r}: no such scheme (known: {sorted([DEFAULT_SCHEME, *known])})")
    return known[name], argument
