"""Operator tools behind the admin CLI: ls, inspect, stats, evict, gc (`admin`), verify and repair
(`verify`), export and import (`archive`). Each takes an open StateStore, uses its public API only,
and returns a pydantic report the CLI prints as a table or as JSON (`reports` holds those a remote
CLI parses; it needs no torch, so nothing here is imported before it is asked for).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["QUIET", "Progress", "open_store", "read_spec_file", "record_spec", "recorded_spec"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'agentstate.ops' has no attribute {name!r}")
    return getattr(importlib.import_module("agentstate.ops.admin"), name)
