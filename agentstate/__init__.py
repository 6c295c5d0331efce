"""agentstate: KV-state persistence for LLM agents (sessions and shared prefixes over tiers).

The names below load on first use, so `import agentstate` (and the CLI's `--help`, and the SDK in
`agentstate.client`) does not import torch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agentstate._version import __version__ as __version__
from agentstate.errors import AgentStateError

# `agentstate.backends` and `agentstate.adapters` live in the checkout's top-level `backends/` and
# `adapters/` folders and are mapped by packaging alone (pyproject's package-dir): a wheel ships them
# under agentstate/, an editable install's finder maps them. This package's __path__ is never
# widened, so no other name (such as `agentstate.agentstate`) can resolve to a second copy.

if TYPE_CHECKING:
    from agentstate.client import AsyncClient as AsyncClient
    from agentstate.client import Client as Client
    from agentstate.config import StoreConfig
    from agentstate.manifest import MatchResult, ResumeResult, SessionManifest
    from agentstate.spec import ModelSpec
    from agentstate.store import StateStore, StoreStats

_LAZY = {
    "AsyncClient": "agentstate.client",
    "Client": "agentstate.client",
    "MatchResult": "agentstate.manifest",
    "ModelSpec": "agentstate.spec",
    "ResumeResult": "agentstate.manifest",
    "SessionManifest": "agentstate.manifest",
    "StateStore": "agentstate.store",
    "StoreConfig": "agentstate.config",
    "StoreStats": "agentstate.store",
}

__all__ = [  # the SDK's clients are reached as agentstate.client.*, so `import *` never needs httpx
    "AgentStateError",
    "MatchResult",
    "ModelSpec",
    "ResumeResult",
    "SessionManifest",
    "StateStore",
    "StoreConfig",
    "StoreStats",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agentstate' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
