"""`agentstate serve`: the session resume API over HTTP (routes, auth and limits, the chunk data
plane, Prometheus metrics). Needs the `service` extra (fastapi, uvicorn); loaded lazily so that
`import agentstate` never needs it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Limits", "create_app", "run", "serve"]


def __getattr__(name: str) -> Any:
    if name in ("create_app", "run", "serve"):
        from agentstate.server import service

        return getattr(service, name)
    if name == "Limits":
        from agentstate.server.gate import Limits

        return Limits
    raise AttributeError(name)
