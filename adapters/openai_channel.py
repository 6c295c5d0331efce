"""One request channel for OpenAI-compatible engines: the agent's session rides in every model call.

Agent frameworks reach vLLM through the `openai` client (LangChain's `ChatOpenAI`, the Agents SDK's
`OpenAIChatCompletionsModel`, pydantic-ai's OpenAI provider), and each of those takes an httpx
client. The clients made here (`http_client`, `async_http_client`) add
`kv_transfer_params={"agentstate": {...}}` to the JSON body of `POST .../chat/completions` and
`POST .../completions` from the turn in context, so the engine's connector snapshots the call as
the named session and loads all of it on the next turn, and hints ride along, with no code in
the agent. Every other request, and a call made outside any turn, is sent untouched.

The turn in context is, first, the one set by `turn(...)` (a context manager, and what the
framework integrations set); else, when LangChain is imported, the `thread_id` of the LangGraph
run the call is made from (LangGraph keeps the running config in a context variable). A thread id
that is not a valid session id (`agentstate.keys.validate_id`) names the session
`session_for(thread_id)`, the same everywhere (checkpointer, channel, hints).

What is added, never replacing what the caller set: `kv_transfer_params.agentstate` = session_id
(+ hint, expected_s when the turn carries them), and `cache_salt` = the turn's tenant when one is
given (the engine's tenant, `cache_salt` in vLLM). A body that is not a JSON object, or larger than
`MAX_BODY_BYTES`, is sent as it is.

Opt-in, for an engine run with `--scheduling-policy priority` (vLLM; any other policy refuses a
nonzero priority): `mark_resuming(session, priority)` (what the hints integrations call when a tool
returns, if given a `priority`) makes that session's next model call carry `priority` (lower runs
first), so an agent coming back from a tool, its KV held for it, is not queued behind newcomers'
long prefills. Off unless asked for.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from agentstate.errors import AgentStateError, InvalidArgumentError
from agentstate.hints import Hint
from agentstate.keys import validate_id

log = logging.getLogger("agentstate.adapters.openai_channel")

MAX_BODY_BYTES = 64 << 20
"""Bodies above this are passed through unread (no model call's JSON comes near it)."""
ROUTES = ("/chat/completions", "/completions")


def session_for(thread_id: object) -> str:
    """The agentstate session of a framework's thread/session id: the id itself when it is a valid
    session id, else `t-` and a hash of it (ids with spaces, slashes, over 128 characters)."""
    text = str(thread_id)
    try:
        return validate_id(text)
    except AgentStateError:
        return "t-" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Turn:
    """What the next model calls carry: the session, its tenant (`cache_salt`), and hints."""

    session_id: str
    tenant: str | None = None
    hints: tuple[str, ...] = ()
    expected_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    priority: int | None = None
    """the request's scheduling priority (vLLM: lower first), None: the engine's default"""

    def params(self) -> dict[str, Any]:
        """The `agentstate` entry of `kv_transfer_params`."""
        out: dict[str, Any] = {"session_id": self.session_id, **self.extra}
        if self.hints:
            out["hint"] = list(self.hints) if len(self.hints) > 1 else self.hints[0]
            if self.expected_s is not None:
                out["expected_s"] = self.expected_s
        return out


_turn: contextvars.ContextVar[Turn | None] = contextvars.ContextVar("agentstate_turn", default=None)


@contextlib.contextmanager
def turn(
    session_id: str, *, tenant: str | None = None, hints: Sequence[str] = (), expected_s: float | None = None
) -> Iterator[Turn]:
    """Model calls made inside carry `session_id` (and `hints`); checked here, before any call."""
    sid = session_for(session_id)
    if tenant is not None:
        validate_id(tenant, "tenant")
    for h in hints:
        if h == "paused":
            Hint.parse(h, expected_s)  # a paused hint needs its expected seconds: refused here, not in the engine
        else:
            Hint.parse(h)
    token = _turn.set(Turn(sid, tenant, tuple(hints), expected_s))
    try:
        yield _turn.get()  # type: ignore[misc]
    finally:
        _turn.reset(token)


_resuming: dict[str, int] = {}
"""session -> the priority its next model call carries (`mark_resuming`)"""
_MAX_MARKED = 1 << 16


def mark_resuming(session_id: str, priority: int) -> None:
    """The next model call of `session_id` (through these clients) carries `priority`: its tool
    just returned. For an engine run with priority scheduling only (see the module doc)."""
    if type(priority) is not int or not -(2**31) <= priority < 2**31:
        raise InvalidArgumentError(f"priority must be a 32-bit int, not {priority!r}")
    if len(_resuming) >= _MAX_MARKED:  # sessions marked and never called again: the oldest go
        _resuming.pop(next(iter(_resuming)), None)
    _resuming[session_for(session_id)] = priority


def current_turn() -> Turn | None:
    """The turn in context: `turn(...)`'s, else the running LangGraph thread's (see the module doc);
    a session marked resuming carries its priority, once."""
    found = _turn.get()
    if found is None:
        thread = _langgraph_thread()
        if thread is None:
            return None
        found = Turn(session_for(thread))
    if found.priority is None and (priority := _resuming.pop(found.session_id, None)) is not None:
        found = replace(found, priority=priority)
    return found


def _langgraph_thread() -> object | None:
    import sys

    config_mod = sys.modules.get("langchain_core.runnables.config")
    if config_mod is None:  # LangChain not imported: no LangGraph run can be in progress
        return None
    config = config_mod.var_child_runnable_config.get()
    if not config:
        return None
    return (config.get("configurable") or {}).get("thread_id")


def with_session(request: httpx.Request, body: bytes, found: Turn) -> httpx.Request | None:
    """The request with the turn's params added to its JSON body; None to send it as it is."""
    if len(body) > MAX_BODY_BYTES:
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    params = doc.get("kv_transfer_params")
    if params is None:
        params = {}
    if not isinstance(params, dict) or "agentstate" in params:
        return None  # the caller set its own: theirs stands
    doc["kv_transfer_params"] = {**params, "agentstate": found.params()}
    if found.tenant is not None and "cache_salt" not in doc:
        doc["cache_salt"] = found.tenant
    if found.priority is not None and "priority" not in doc:
        doc["priority"] = found.priority
    content = json.dumps(doc, separators=(",", ":")).encode()
    headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in ("content-length",)]
    return httpx.Request(request.method, request.url, headers=headers, content=content, extensions=request.extensions)


def _applies(request: httpx.Request) -> bool:
    return request.method == "POST" and request.url.path.rstrip("/").endswith(ROUTES)


class AgentStateTransport(httpx.BaseTransport):
    """A transport that adds the turn's session to model calls, then sends with `inner`."""

    def __init__(self, inner: httpx.BaseTransport | None = None) -> None:
        self.inner = inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        found = current_turn() if _applies(request) else None
        if found is not None:
            request = with_session(request, request.read(), found) or request
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


class AsyncAgentStateTransport(httpx.AsyncBaseTransport):
    """`AgentStateTransport` for httpx.AsyncClient (the `openai.AsyncOpenAI` client's)."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.inner = inner or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        found = current_turn() if _applies(request) else None
        if found is not None:
            request = with_session(request, await request.aread(), found) or request
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def http_client(**kwargs: Any) -> httpx.Client:
    """An httpx.Client for `openai.OpenAI(http_client=...)` / `ChatOpenAI(http_client=...)`."""
    if "transport" in kwargs:
        kwargs["transport"] = AgentStateTransport(kwargs["transport"])
    else:
        kwargs["transport"] = AgentStateTransport()
    kwargs.setdefault("timeout", httpx.Timeout(600.0, connect=10.0))
    return httpx.Client(**kwargs)


def async_http_client(**kwargs: Any) -> httpx.AsyncClient:
    """An httpx.AsyncClient for `openai.AsyncOpenAI(http_client=...)` / `ChatOpenAI(http_async_client=...)`."""
    if "transport" in kwargs:
        kwargs["transport"] = AsyncAgentStateTransport(kwargs["transport"])
    else:
        kwargs["transport"] = AsyncAgentStateTransport()
    kwargs.setdefault("timeout", httpx.Timeout(600.0, connect=10.0))
    return httpx.AsyncClient(**kwargs)

