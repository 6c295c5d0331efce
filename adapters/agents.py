"""What the agent-framework integrations share: where sessions live, the loop they run on, and hints.

A framework integration (`agentstate.adapters.langgraph`, `agentstate.adapters.openai_agents`)
keeps the framework's state as records of the session its thread names and sends hints when tool
calls start and end. It reaches the session through a `SessionBackend`: a `StateStore` opened in
this process (the embedded default, an in-process engine), or an `AsyncClient` of the session API
(`agentstate serve`, or the one a vLLM engine serves itself with `serve_port`, since the engine
holds its data directory).

Frameworks call from threads and from event loops (LangGraph's `invoke` is sync, `ainvoke` async,
its background saves run in a thread pool); a store or client belongs to the loop it was opened
on. `Bridge` runs every call on that home loop, from wherever it is made.

Hints are advice: `Hinter` never raises into the agent. A hint for a session whose KV is not
stored yet (the engine writes a turn's snapshot as the request ends, so a tool call can start
before it lands) is tried again a few times in the background, then dropped (counted).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from agentstate.adapters.runtime import LoopThread
from agentstate.errors import InvalidArgumentError, SessionNotFoundError

log = logging.getLogger("agentstate.adapters.agents")
T = TypeVar("T")


class SessionBackend(Protocol):
    """What the integrations use of a StateStore or an AsyncClient (the same names on both)."""

    async def put_records(self, session_id: str, items: Mapping[str, bytes]) -> None: ...
    async def records(
        self, session_id: str, prefix: str = "", *, names: Sequence[str] | None = None
    ) -> dict[str, bytes]: ...
    async def record_names(self, session_id: str, prefix: str = "") -> list[str]: ...
    async def delete_records(self, session_id: str, names: Sequence[str] | None = None) -> int: ...
    async def delete(self, session_id: str) -> None: ...
    async def fork(self, source_id: str, new_id: str) -> Any: ...
    async def hint(self, session_id: str, hint: Any, expected_s: float | None = None) -> Any: ...


class Bridge:
    """A SessionBackend and its home loop; `call` / `call_sync` run an operation there."""

    def __init__(self, backend: SessionBackend, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise InvalidArgumentError(
                    "make this inside the event loop the store or client runs on, pass loop=, or use .connect(url, token)"
                ) from None
        self.backend = backend
        self.loop = loop
        self._thread: LoopThread | None = None
        self._pending: set[concurrent.futures.Future[Any]] = set()

    @classmethod
    def connect(cls, url: str, token: str, **client_kw: Any) -> Bridge:
        """A client of the session API at `url` on a loop thread of its own (closed by `close`)."""
        from agentstate.client import AsyncClient

        thread = LoopThread("agentstate-agents")

        async def make() -> AsyncClient:
            return AsyncClient(url, token, **client_kw)

        bridge = cls(thread.run(make(), 30.0), thread.loop)
        bridge._thread = thread
        return bridge

    async def call(self, op: Callable[[SessionBackend], Awaitable[T]]) -> T:
        """Run `op(backend)` on the home loop and wait for it from this loop."""
        if asyncio.get_running_loop() is self.loop:
            return await op(self.backend)
        future = asyncio.run_coroutine_threadsafe(_run(op, self.backend), self.loop)
        return await asyncio.wrap_future(future)

    def call_sync(self, op: Callable[[SessionBackend], Awaitable[T]], timeout: float = 300.0) -> T:
        """Run `op(backend)` on the home loop and block this thread until it is done."""
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is self.loop:
                raise InvalidArgumentError(
                    "a sync call on the store's own event loop would wait for itself: use the async method (a...)"
                )
        return asyncio.run_coroutine_threadsafe(_run(op, self.backend), self.loop).result(timeout)

    def submit(self, op: Callable[[SessionBackend], Awaitable[Any]]) -> concurrent.futures.Future[Any]:
        """Start `op(backend)` on the home loop without waiting (from any thread); `close` waits for it."""
        future = asyncio.run_coroutine_threadsafe(_run(op, self.backend), self.loop)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    def wait(self, timeout: float = 10.0) -> None:
        """Wait for what `submit` started so far (the hints of a run)."""
        concurrent.futures.wait(list(self._pending), timeout)

    def close(self) -> None:
        """Wait (10 s at most) for what `submit` started (the last hints of a run), then close a
        client made by `connect` and stop its loop thread (a backend given in is the caller's)."""
        self.wait(10.0)
        if self._thread is not None:
            closer = getattr(self.backend, "aclose", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    self._thread.run(closer(), 10.0)
            self._thread.stop()
            self._thread = None


async def _run(op: Callable[[SessionBackend], Awaitable[T]], backend: SessionBackend) -> T:
    return await op(backend)


class ToolClock:
    """How long each tool takes, as a running estimate: what a `paused` hint says when the tool
    does not say itself. A tool's first call is assumed to take `default_s`."""

    def __init__(self, default_s: float = 5.0, weight: float = 0.3, low_s: float = 0.1, high_s: float = 900.0) -> None:
        self.default_s, self.weight, self.low_s, self.high_s = default_s, weight, low_s, high_s
        self._estimate: dict[str, float] = {}
        self._started: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def expected_s(self, tool: str, declared: object = None) -> float:
        """The tool's own `expected_s` (from its metadata) if it is a positive number, else the estimate."""
        if isinstance(declared, int | float) and not isinstance(declared, bool) and 0 < declared <= self.high_s:
            return float(declared)
        with self._lock:
            return self._estimate.get(tool, self.default_s)

    def started(self, run: str, tool: str) -> None:
        with self._lock:
            self._started[run] = (tool, time.monotonic())
            if len(self._started) > 10_000:  # runs that never ended (a crashed tool): forget the oldest
                for key in list(self._started)[:5_000]:
                    del self._started[key]

    def ended(self, run: str) -> float | None:
        """Record how long the run took; its duration (None for a run never started here)."""
        with self._lock:
            found = self._started.pop(run, None)
            if found is None:
                return None
            tool, t0 = found
            took = min(max(time.monotonic() - t0, self.low_s), self.high_s)
            old = self._estimate.get(tool)
            self._estimate[tool] = took if old is None else (1 - self.weight) * old + self.weight * took
            return took


class Hinter:
    """Sends hints for sessions through a Bridge, in the background; never raises into the agent."""

    RETRIES = (0.25, 0.5, 1.0, 2.0)
    """waits before trying again a hint whose session is not stored yet"""

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge
        self.sent = 0
        self.dropped = 0

    def send(self, session_id: str, hint: str, expected_s: float | None = None) -> None:
        self.bridge.submit(lambda b: self._send(b, session_id, hint, expected_s))  # the bridge keeps it until done

    async def _send(self, backend: SessionBackend, session_id: str, hint: str, expected_s: float | None) -> None:
        for wait in (*self.RETRIES, None):
            try:
                await backend.hint(session_id, hint, expected_s)
                self.sent += 1
                return
            except SessionNotFoundError:
                if wait is None:
                    break
                await asyncio.sleep(wait)
            except Exception as exc:  # noqa: BLE001 - advice: the agent runs on
                log.warning("agentstate %s hint for %s not sent: %s", hint, session_id[:100], str(exc)[:300])
                break
        self.dropped += 1

    def wait(self, timeout: float = 10.0) -> None:
        """Wait for the hints sent so far (tests, and a clean exit)."""
        self.bridge.wait(timeout)
