"""agentstate: KV-state persistence for LLM agents (sessions and shared prefixes over tiers).

The names below load on first use, so `import agentstate` (and the CLI's `--help`, and the SDK in
`agentstate.client`) does not import torch until something needs it.
"""

from __future__ import annotations

import importlib
from pathlib import Path as _Path
from typing import TYPE_CHECKING, Any

from agentstate._version import __version__ as __version__
from agentstate.errors import AgentStateError

# In a source checkout `backends/` and `adapters/` sit beside this package (the design card's
# layout) and install as `agentstate.backends` / `agentstate.adapters`; make the same names
# resolve when running from the checkout without an install.
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "backends").is_dir() and (_checkout / "backends" / "__init__.py").is_file():
    __path__.append(str(_checkout))  # type: ignore[name-defined]

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
