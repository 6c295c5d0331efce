"""The session API served from the engine's worker (`serve_port`): the store's one writer is the engine.

An agent framework beside a vLLM server needs the session behind the engine: to keep its own state
there (records: LangGraph checkpoints, Agents SDK items), to send a hint when a tool call starts
or a thread ends (no engine request carries those), to inspect a session and its hold. The engine
holds the data directory, so no other process may open it; the worker therefore serves the same
HTTP API as `agentstate serve` (`agentstate.server.service.create_app`) over its own open store,
on the store's loop, next to the lookup channel. Tokens map to tenants as there; a request's
`cache_salt` is its tenant in the engine, so a token of that tenant sees the engine's sessions.

The port is bound here before uvicorn starts (a port in use is an error of this call, logged, and
the engine runs on without the API), and the server stops before the store closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

from agentstate.adapters.vllm.config import VllmSettings
from agentstate.adapters.vllm.metrics import log
from agentstate.errors import BackendError
from agentstate.store import StateStore


class EmbeddedService:
    """The session API of one worker's store, on the store's loop."""

    def __init__(self, server: Any, task: asyncio.Task[None], sock: socket.socket) -> None:
        self._server, self._task, self._sock = server, task, sock

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @classmethod
    async def start(cls, store: StateStore, settings: VllmSettings) -> EmbeddedService:
        """Bind, start serving, and return once the server accepts connections."""
        import uvicorn

        from agentstate.server.gate import Limits
        from agentstate.server.service import create_app, listening_socket, load_tokens, uvicorn_config

        assert settings.serve_port is not None
        tokens = load_tokens(settings.serve_tokens_file)
        limits = Limits()
        sock = listening_socket(settings.serve_host, settings.serve_port)
        server = uvicorn.Server(uvicorn_config(create_app(store, tokens, limits), limits))
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # the engine owns its signals
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                sock.close()
                raise BackendError(f"session API did not start: {task.exception()!r}")
            await asyncio.sleep(0.01)
        log.info("agentstate: session API on http://%s:%d (%d tokens)", settings.serve_host, settings.serve_port,
                 len(tokens))  # fmt: skip
        return cls(server, task, sock)

    async def stop(self, timeout_s: float) -> None:
        """Finish requests in flight (bounded), then close the socket."""
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        if not self._task.done():
            self._server.force_exit = True
            self._task.cancel()
        self._sock.close()
