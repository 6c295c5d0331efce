"""The request channel (agentstate.adapters.openai_channel): the real `openai` client, through the
clients made here, against a real HTTP server on loopback that records what arrives."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from agentstate.adapters.openai_channel import async_http_client, http_client, mark_resuming, session_for, turn
from agentstate.errors import InvalidArgumentError, InvalidSessionIdError
from tests.loopback_http import json_server

REPLY = {
    "id": "c1", "object": "chat.completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}  # fmt: skip
COMPLETION = {
    "id": "c2", "object": "text_completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}  # fmt: skip


SEEN: list[tuple[str, str, bytes]] = []


def record(method: str, path: str, body: bytes) -> dict[str, Any]:
    SEEN.append((method, path, body))
    return COMPLETION if path.endswith("/v1/completions") else REPLY


@pytest.fixture
def server() -> Iterator[str]:
    SEEN.clear()
    with json_server(record) as url:
        yield url + "/v1"


def bodies() -> list[Any]:
    return [json.loads(b) if b else None for _, _, b in SEEN]


def test_model_calls_in_a_turn_carry_the_session_and_nothing_else_changes(server: str) -> None:
    client = openai.OpenAI(base_url=server, api_key="x", http_client=http_client())
    msgs = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="m", messages=msgs)  # outside any turn: untouched
    with turn("agent-1", tenant="acme", hints=["resuming", "paused"], expected_s=12.5):
        client.chat.completions.create(model="m", messages=msgs)
        client.completions.create(model="m", prompt="hi")
        client.chat.completions.create(model="m", messages=msgs, extra_body={"cache_salt": "mine"})
        client.chat.completions.create(
            model="m", messages=msgs, extra_body={"kv_transfer_params": {"agentstate": {"session_id": "own"}, "x": 1}}
        )
        client.chat.completions.create(model="m", messages=msgs, extra_body={"kv_transfer_params": {"other": 2}})
        httpx.Client(transport=http_client()._transport).get(server + "/models")  # noqa: SLF001
    with turn("x" * 200):  # not a session id: named by its hash, the same as the checkpointer's
        client.chat.completions.create(model="m", messages=msgs)
    b = bodies()
    assert "kv_transfer_params" not in b[0] and "cache_salt" not in b[0]
    want = {"session_id": "agent-1", "hint": ["resuming", "paused"], "expected_s": 12.5}
    assert b[1]["kv_transfer_params"] == {"agentstate": want} and b[1]["cache_salt"] == "acme"
    assert b[1]["messages"] == msgs and b[1]["model"] == "m"
    assert b[2]["kv_transfer_params"] == {"agentstate": want} and b[2]["prompt"] == "hi"
    assert b[3]["cache_salt"] == "mine"  # the caller's stands
    assert b[4]["kv_transfer_params"] == {"agentstate": {"session_id": "own"}, "x": 1}
    assert b[5]["kv_transfer_params"] == {"other": 2, "agentstate": want}
    assert SEEN[6][:2] == ("GET", "/v1/models") and SEEN[6][2] == b""
    assert b[7]["kv_transfer_params"]["agentstate"]["session_id"] == session_for("x" * 200)
    assert session_for("x" * 200).startswith("t-") and session_for("agent-1") == "agent-1"


def test_bodies_that_are_not_model_calls_pass_through_byte_for_byte(server: str) -> None:
    client = http_client()
    with turn("agent-1"):
        for raw in (b"[1, 2]", b"not json", b'"text"', b""):
            client.post(server + "/chat/completions", content=raw)
        client.post(server + "/embeddings", json={"input": "x"})
    assert [b for _, _, b in SEEN[:4]] == [b"[1, 2]", b"not json", b'"text"', b""]
    assert json.loads(SEEN[4][2]) == {"input": "x"}


def test_bad_turns_are_refused_before_any_call() -> None:
    with pytest.raises(InvalidArgumentError):
        with turn("a", hints=["paused"]):  # paused needs its expected seconds
            pass
    with pytest.raises(InvalidArgumentError):
        with turn("a", hints=["sleep"]):
            pass
    with pytest.raises(InvalidSessionIdError):
        with turn("a", tenant="../t"):
            pass


async def test_the_async_client_and_concurrent_turns_keep_their_own_sessions(server: str) -> None:
    client = openai.AsyncOpenAI(base_url=server, api_key="x", http_client=async_http_client())

    async def agent(i: int) -> None:
        with turn(f"agent-{i}"):
            for _ in range(3):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": str(i)}])
                await asyncio.sleep(0)

    await asyncio.gather(*(agent(i) for i in range(8)))
    got = [(b["messages"][0]["content"], b["kv_transfer_params"]["agentstate"]["session_id"]) for b in bodies()]
    assert len(got) == 24 and all(sid == f"agent-{c}" for c, sid in got)


def test_a_session_marked_resuming_carries_its_priority_once(server: str) -> None:
    """Opt-in scheduling priority (an engine run with `--scheduling-policy priority`): only the
    marked session's next model call carries it, never replacing the caller's own, and a bad
    priority is refused before any call."""
    client = openai.OpenAI(base_url=server, api_key="x", http_client=http_client())
    msgs = [{"role": "user", "content": "hi"}]
    mark_resuming("agent-p", -1)
    with turn("agent-q"):
        client.chat.completions.create(model="m", messages=msgs)  # another session: no priority
    with turn("agent-p"):
        client.chat.completions.create(model="m", messages=msgs)  # the marked one: once
        client.chat.completions.create(model="m", messages=msgs)
    mark_resuming("agent-p", 3)
    with turn("agent-p"):
        client.chat.completions.create(model="m", messages=msgs, extra_body={"priority": 7})  # the caller's stands
    b = bodies()
    assert "priority" not in b[0] and b[1]["priority"] == -1 and "priority" not in b[2]
    assert b[3]["priority"] == 7 and b[1]["kv_transfer_params"]["agentstate"] == {"session_id": "agent-p"}
    for bad in (1.5, "1", True, 2**31, None):
        with pytest.raises(InvalidArgumentError):
            mark_resuming("agent-p", bad)  # type: ignore[arg-type]
