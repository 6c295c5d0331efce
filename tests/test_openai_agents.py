"""OpenAI Agents SDK on agentstate (agentstate.adapters.openai_agents): the Session protocol over a
real store and the real HTTP service, and a real Runner whose model calls go through the channel
to an OpenAI-compatible server on loopback (a tool call, then an answer)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from agents import Agent, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled
from agents.memory import Session

from agentstate import StateStore
from agentstate.adapters.openai_agents import AgentStateRunHooks, AgentStateSession, run
from agentstate.adapters.openai_channel import async_http_client
from agentstate.client import AsyncClient
from agentstate.errors import InvalidArgumentError
from tests.conftest import SPEC4, random_kv, random_tokens
from tests.loopback_http import json_server
from tests.test_service import ALICE, serving

set_tracing_disabled(True)


async def check_protocol(make: Any) -> None:
    s: AgentStateSession = make("conv 1")  # not a valid session id: named by its hash
    assert isinstance(s, Session)
    assert await s.get_items() == [] and await s.pop_item() is None
    items = [{"role": "user", "content": f"m{i}", "n": [i, 1.5, None]} for i in range(13)]
    await s.add_items(items[:10])
    await s.add_items(items[10:])
    assert await s.get_items() == items
    assert await s.get_items(limit=3) == items[-3:] and await s.get_items(limit=0) == []
    assert await s.pop_item() == items[-1]
    assert await s.get_items() == items[:-1]
    await s.add_items([{"role": "assistant", "content": "after pop"}])
    assert (await s.get_items())[-1] == {"role": "assistant", "content": "after pop"}
    for bad in ([{"x": float("nan")}], [{"x": object()}], {"role": "user"}):
        with pytest.raises(InvalidArgumentError):
            await s.add_items(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        await s.get_items(limit=-1)
    assert len(await s.get_items()) == 13  # the refused writes changed nothing
    other = make("conv 2")
    await other.add_items([{"role": "user", "content": "other"}])
    await s.clear_session()
    assert await s.get_items() == [] and await other.get_items() == [{"role": "user", "content": "other"}]


async def test_the_session_protocol_on_a_store_survives_a_restart(tmp_path: Path) -> None:
    async with StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=64) as store:
        await check_protocol(lambda sid: AgentStateSession(sid, store))
        await AgentStateSession("kept", store).add_items([{"role": "user", "content": "hello"}])
    async with StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=64) as store:
        assert await AgentStateSession("kept", store).get_items() == [{"role": "user", "content": "hello"}]


async def test_the_session_protocol_through_the_service(tmp_path: Path) -> None:
    async with StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=64) as store, serving(store) as url:
        async with AsyncClient(url, ALICE) as client:
            await check_protocol(lambda sid: AgentStateSession(sid, client))


SEEN: list[dict[str, Any]] = []


def scripted(method: str, path: str, raw: bytes) -> dict[str, Any]:
    """Chat completions: a call to `lookup` first, then an answer; every body kept."""
    body = json.loads(raw)
    SEEN.append(body)
    if body["messages"][-1].get("role") == "tool":
        message: dict[str, Any] = {"role": "assistant", "content": "the answer"}
        finish = "stop"
    else:
        call = {"id": f"call_{len(SEEN)}", "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"q": "x"})}}  # fmt: skip
        message, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
    return {
        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": finish, "message": message}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }  # fmt: skip


@pytest.fixture
def model_server() -> Iterator[str]:
    SEEN.clear()
    with json_server(scripted) as url:
        yield url + "/v1"


async def test_a_run_stores_the_conversation_names_the_session_and_holds_it_during_the_tool(
    tmp_path: Path, model_server: str
) -> None:
    async with StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=64) as store:
        session = AgentStateSession("user-7", store)
        await store.snapshot("user-7", random_tokens(100), random_kv(SPEC4, 100))  # the engine's KV of it
        held: list[Any] = []

        @function_tool
        async def lookup(q: str) -> str:
            """Looks something up, slowly."""
            await asyncio.sleep(0.3)
            hold = store.chunks.held("hint:default/user-7")
            held.append(None if hold is None else (hold.kind, hold.back_at - time.monotonic()))
            return f"found {q}"

        client = openai.AsyncOpenAI(base_url=model_server, api_key="x", http_client=async_http_client())
        agent = Agent(name="a", instructions="be brief", tools=[lookup],
                      model=OpenAIChatCompletionsModel(model="m", openai_client=client))  # fmt: skip
        result = await run(agent, "what is x?", session=session, expected_s={"lookup": 20})
        assert result.final_output == "the answer"
        assert [b["kv_transfer_params"]["agentstate"]["session_id"] for b in SEEN] == ["user-7"] * 2
        (during,) = held
        assert during is not None and during[0] == "paused" and 18 < during[1] <= 20
        items = await session.get_items()
        kinds = [i.get("type") or i.get("role") for i in items]
        assert kinds[0] == "user" and "function_call" in kinds and "function_call_output" in kinds
        assert items[-1]["content"][0]["text"] == "the answer"
        hooks = AgentStateRunHooks(session.bridge, "user-7", expected_s={"lookup": 20})
        second = await run(agent, "and y?", session=session, hooks=hooks)
        assert second.final_output == "the answer"
        await asyncio.to_thread(hooks.hinter.wait)
        assert (hooks.hinter.sent, hooks.hinter.dropped) == (3, 0)  # paused, resuming, done
        assert store.chunks.held("hint:default/user-7") is None  # done: released
        sent = [m.get("content") for m in SEEN[-2]["messages"] if m.get("role") == "user"]
        assert sent == ["what is x?", "and y?"]  # the stored conversation went into the next turn
