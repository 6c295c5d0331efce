"""agentstate: KV-state persistence for LLM agents (sessions and shared prefixes over tiers)."""

from __future__ import annotations

from pathlib import Path as _Path

# In a source checkout `backends/` and `adapters/` sit beside this package (the design card's
# layout) and install as `agentstate.backends` / `agentstate.adapters`; make the same names
# resolve when running from the checkout without an install.
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "backends").is_dir() and (_checkout / "backends" / "__init__.py").is_file():
    __path__.append(str(_checkout))  # type: ignore[name-defined]

from agentstate.config import StoreConfig
from agentstate.errors import AgentStateError
from agentstate.manifest import MatchResult, ResumeResult, SessionManifest
from agentstate.spec import ModelSpec
from agentstate.store import StateStore, StoreStats

__version__ = "0.1.0"
__all__ = [
    "AgentStateError",
    "MatchResult",
    "ModelSpec",
    "ResumeResult",
    "SessionManifest",
    "StateStore",
    "StoreConfig",
    "StoreStats",
]
