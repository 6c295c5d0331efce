"""OpenAI Agents SDK: a `Session` stored by agentstate, run hooks that send hints, model calls that
carry the session.

`AgentStateSession` implements the SDK's `Session` protocol (`get_items`, `add_items`, `pop_item`,
`clear_session`): the conversation items are records (`agentstate.records`) of the agentstate
session its `session_id` names (`session_for`), the one the engine stores the conversation's KV
under, so they are durable, per tenant, expire, fork and export with it. `run(agent, input,
session=...)` runs `Runner.run` with the session, with `AgentStateRunHooks` (a tool call that
starts sends `paused` with the tool's expected seconds, from `expected_s` or a running estimate;
its end sends `resuming`; the agent's final output sends `done`), and inside `turn(...)`, so every
model call made through `openai_channel`'s clients names the session.

Items are `oa/i/<sequence>` records (JSON), one per item, written all or none per `add_items`.
One writer per session at a time (as the SDK's SQLiteSession): calls on one session object are
serialized, and two processes adding to one session at once may interleave their items.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from agents import Agent, RunHooks, Runner
from agents.result import RunResult

from agentstate.adapters.agents import Bridge, Hinter, SessionBackend, ToolClock
from agentstate.adapters.openai_channel import session_for, turn
from agentstate.errors import CorruptDataError, InvalidArgumentError

__all__ = ["AgentStateRunHooks", "AgentStateSession", "run"]

PREFIX = "oa/i/"


class AgentStateSession:
    """The Agents SDK `Session` protocol over agentstate records (see the module docstring)."""

    session_settings = None

    def __init__(self, session_id: str, backend: SessionBackend | Bridge, *, loop: Any = None) -> None:
        if not isinstance(session_id, str) or not session_id:
            raise InvalidArgumentError("session_id must be a non-empty string")
        self.session_id = session_id
        self.agentstate_id = session_for(session_id)
        self.bridge = backend if isinstance(backend, Bridge) else Bridge(backend, loop)
        self._lock: asyncio.Lock | None = None  # made on the home loop, where every call runs

    def _serial(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def _names(self, b: SessionBackend) -> list[str]:
        return await b.record_names(self.agentstate_id, PREFIX)

    async def _read(self, b: SessionBackend, names: list[str]) -> list[Any]:
        found = await b.records(self.agentstate_id, names=names)
        items = []
        for name in names:
            if name not in found:
                continue  # popped meanwhile
            try:
                items.append(json.loads(found[name]))
            except ValueError:
                raise CorruptDataError(f"session item {name} is not JSON") from None
        return items

    async def _get_items(self, b: SessionBackend, limit: int | None) -> list[Any]:
        names = await self._names(b)
        if limit is not None:
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise InvalidArgumentError("limit must be a non-negative integer or None")
            names = names[-limit:] if limit else []
        return await self._read(b, names)

    async def _add_items(self, b: SessionBackend, items: list[Any]) -> None:
        if not isinstance(items, list):
            raise InvalidArgumentError("items must be a list")
        if not items:
            return
        encoded = []
        for item in items:
            try:
                encoded.append(json.dumps(item, allow_nan=False, separators=(",", ":")).encode())
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentError(f"a session item must be JSON: {exc}") from None
        async with self._serial():
            names = await self._names(b)
            first = int(names[-1][len(PREFIX) :]) + 1 if names else 0
            await b.put_records(self.agentstate_id, {f"{PREFIX}{first + i:012d}": e for i, e in enumerate(encoded)})

    async def _pop_item(self, b: SessionBackend) -> Any | None:
        async with self._serial():
            names = await self._names(b)
            if not names:
                return None
            (item,) = await self._read(b, names[-1:]) or [None]
            await b.delete_records(self.agentstate_id, names[-1:])
            return item

    async def _clear(self, b: SessionBackend) -> None:
        async with self._serial():
            names = await self._names(b)
            if names:
                await b.delete_records(self.agentstate_id, names)

    async def get_items(self, limit: int | None = None) -> list[Any]:
        """The latest `limit` items (all when None), oldest first."""
        return await self.bridge.call(lambda b: self._get_items(b, limit))

    async def add_items(self, items: list[Any]) -> None:
        await self.bridge.call(lambda b: self._add_items(b, items))

    async def pop_item(self) -> Any | None:
        return await self.bridge.call(self._pop_item)

    async def clear_session(self) -> None:
        await self.bridge.call(self._clear)


class AgentStateRunHooks(RunHooks[Any]):
    """Run hooks that send the session's hints: `paused` when a tool starts (`expected_s[tool]`, else
    a running estimate), `resuming` when it ends, `done` when the agent gives its final output."""

    def __init__(
        self, bridge: Bridge, session_id: str, *, expected_s: Mapping[str, float] | None = None,
        clock: ToolClock | None = None,
    ) -> None:  # fmt: skip
        self.hinter = Hinter(bridge)
        self.session = session_for(session_id)
        self.expected = dict(expected_s or {})
        self.clock = clock or ToolClock()

    @staticmethod
    def _run_id(context: Any, tool: Any) -> str:
        return str(getattr(context, "tool_call_id", None) or f"{id(context)}/{getattr(tool, 'name', '?')}")

    async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
        name = str(getattr(tool, "name", "tool"))
        self.clock.started(self._run_id(context, tool), name)
        self.hinter.send(self.session, "paused", self.clock.expected_s(name, self.expected.get(name)))

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: object) -> None:
        self.clock.ended(self._run_id(context, tool))
        self.hinter.send(self.session, "resuming")

    async def on_agent_end(self, context: Any, agent: Any, output: Any) -> None:
        self.hinter.send(self.session, "done")


async def run(
    agent: Agent[Any], input: Any, *, session: AgentStateSession, tenant: str | None = None,
    expected_s: Mapping[str, float] | None = None, hooks: AgentStateRunHooks | None = None, **kwargs: Any,
) -> RunResult:  # fmt: skip
    """`Runner.run(agent, input, session=session, ...)` with agentstate's hooks, its model calls
    naming the session (and `tenant` as `cache_salt`) through `openai_channel`'s clients."""
    hooks = hooks or AgentStateRunHooks(session.bridge, session.session_id, expected_s=expected_s)
    with turn(session.agentstate_id, tenant=tenant):
        return await Runner.run(agent, input, session=session, hooks=hooks, **kwargs)
