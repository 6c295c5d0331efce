"""LangGraph on agentstate (agentstate.adapters.langgraph): LangGraph's own checkpointer conformance
suite over a real store and over the real HTTP service, and real graphs (sync and async) whose
threads are agentstate sessions: checkpoints survive a restart, tool calls place holds, typed errors."""

from __future__ import annotations

import asyncio
import operator
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.tools import tool
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.graph import END, START, StateGraph

from agentstate import StateStore
from agentstate.adapters.agents import Bridge
from agentstate.adapters.langgraph import AgentStateHints, AgentStateSaver, session_for
from agentstate.adapters.runtime import LoopThread
from agentstate.client import AsyncClient
from agentstate.errors import CorruptDataError, InvalidArgumentError
from tests.conftest import SPEC4, random_kv, random_tokens
from tests.test_service import ALICE, serving


async def conformance(make: Any) -> Any:
    report = await validate(make)
    report.print_report()
    return report


async def test_the_saver_passes_langgraphs_conformance_suite_on_a_store() -> None:
    @checkpointer_test(name="agentstate-store")
    async def saver() -> AsyncIterator[AgentStateSaver]:
        with tempfile.TemporaryDirectory() as d:
            async with StateStore.open(d, SPEC4, chunk_tokens=64) as store:
                yield AgentStateSaver(store)

    report = await conformance(saver)
    assert report.passed_all_base() and report.conformance_level() == "FULL"
    results = report.to_dict()["results"]
    assert all(r["tests_failed"] == 0 for r in results.values())
    assert {k for k, r in results.items() if r["passed"] and r["tests_passed"]} >= {
        "put", "put_writes", "get_tuple", "list", "delete_thread", "copy_thread", "prune"}  # fmt: skip


async def test_the_saver_passes_langgraphs_conformance_suite_through_the_service() -> None:
    @checkpointer_test(name="agentstate-service")
    async def saver() -> AsyncIterator[AgentStateSaver]:
        with tempfile.TemporaryDirectory() as d:
            async with StateStore.open(d, SPEC4, chunk_tokens=64) as store, serving(store) as url:
                async with AsyncClient(url, ALICE) as client:
                    yield AgentStateSaver(client)

    report = await conformance(saver)
    assert report.passed_all_base() and report.conformance_level() == "FULL"


class State(TypedDict):
    log: Annotated[list[str], operator.add]
    turns: int


HELD: list[tuple[str, float] | None] = []


def graph(saver: AgentStateSaver, store: StateStore | None = None) -> Any:
    """model -> tool -> model -> END: the edges run the tool between two model calls."""

    @tool
    def lookup(query: str) -> str:
        """A tool that takes time."""
        time.sleep(0.4)
        if store is not None:  # what the store holds for the thread while the tool runs
            held = store.chunks.held(f"hint:{store.tenant}/{session_for('thread A/1')}")
            HELD.append(None if held is None else (held.kind, held.back_at - time.monotonic()))
        return f"result for {query}"

    lookup.metadata = {"expected_s": 42}  # what a paused hint says for this tool

    def model(state: State) -> dict[str, Any]:
        return {"log": [f"model {state.get('turns', 0)}"], "turns": state.get("turns", 0) + 1}

    def run_tool(state: State) -> dict[str, Any]:
        return {"log": [lookup.invoke({"query": f"q{state['turns']}"})]}

    g = StateGraph(State)
    g.add_node("model", model)
    g.add_node("tool", run_tool)
    g.add_edge(START, "model")
    g.add_conditional_edges("model", lambda s: "tool" if s["turns"] < 2 else END, ["tool", END])
    g.add_edge("tool", "model")
    return g.compile(checkpointer=saver)


async def opened(path: Path) -> StateStore:
    return await StateStore.open(path, SPEC4, chunk_tokens=64)


def test_a_sync_graph_keeps_its_thread_in_the_session_across_a_restart(tmp_path: Path) -> None:
    """`invoke` (sync) on a store whose loop runs in another thread; the thread id is not a valid
    session id, so it names the session by its hash; a tool call holds the session, its end
    releases it."""
    loop = LoopThread("test-store")
    thread = "thread A/1"
    session = session_for(thread)
    try:
        store = loop.run(opened(tmp_path / "d"), 60)
        toks = random_tokens(100)
        loop.run(store.snapshot(session, toks, random_kv(SPEC4, 100)), 60)  # the engine's KV of the thread
        saver = AgentStateSaver(store, loop=loop.loop)
        hints = AgentStateHints(saver.bridge)
        HELD.clear()
        config: Any = {"configurable": {"thread_id": thread}, "callbacks": [hints]}
        out = graph(saver, store).invoke({"log": [], "turns": 0}, config)
        hints.hinter.wait()
        assert out["log"] == ["model 0", "result for q1", "model 1"] and out["turns"] == 2
        (during,) = HELD  # held during the tool call, expected back when the tool's metadata says
        assert during is not None and during[0] == "paused" and 40 < during[1] <= 42
        assert store.chunks.held(f"hint:{store.tenant}/{session}") is None  # the run's end: done
        assert hints.hinter.sent == 3 and hints.hinter.dropped == 0  # paused, resuming, done
        history = list(saver.list({"configurable": {"thread_id": thread}}))
        assert len(history) >= 5 and history[0].checkpoint["channel_values"]["turns"] == 2
        assert all(n.startswith("lg/") for n in loop.run(store.record_names(session), 30))
        loop.run(store.close(), 60)

        store = loop.run(opened(tmp_path / "d"), 60)
        saver = AgentStateSaver(store, loop=loop.loop)
        state = graph(saver).get_state({"configurable": {"thread_id": thread}})
        assert state.values["log"] == ["model 0", "result for q1", "model 1"]
        assert [h.checkpoint["id"] for h in saver.list({"configurable": {"thread_id": thread}})] == [
            h.checkpoint["id"] for h in history
        ]
        assert loop.run(store.session(session), 30).tokens == toks  # the KV session is the same session
        saver.delete_thread(thread)  # delete_thread deletes the session, KV included
        assert loop.run(store.record_names(session), 30) == []
        assert loop.run(store.catalog.get(store.tenant, session), 30) is None
        loop.run(store.close(), 60)
    finally:
        loop.stop()


async def test_an_async_graph_through_the_service_and_a_copied_thread() -> None:
    with tempfile.TemporaryDirectory() as d:
        async with StateStore.open(d, SPEC4, chunk_tokens=64) as store, serving(store) as url:
            async with AsyncClient(url, ALICE) as client:
                saver = AgentStateSaver(client)
                g = graph(saver)
                cfg: Any = {"configurable": {"thread_id": "t1"}}
                out = await g.ainvoke({"log": [], "turns": 0}, cfg)
                assert out["turns"] == 2
                await saver.acopy_thread("t1", "t2")  # no KV yet: the records are copied
                copied = await g.aget_state({"configurable": {"thread_id": "t2"}})
                assert copied.values == out
                alice = store.for_tenant("alice")
                assert await alice.records("t2") == await alice.records("t1")


async def test_bad_configs_and_damaged_records_are_typed_errors(tmp_path: Path) -> None:
    async with StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=64) as store:
        saver = AgentStateSaver(store)
        for bad in ({}, {"configurable": {}}, {"configurable": {"thread_id": ""}}):
            with pytest.raises(InvalidArgumentError):
                await saver.aget_tuple(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            [t async for t in saver.alist(None)]
        with pytest.raises(InvalidArgumentError):
            saver.get_tuple({"configurable": {"thread_id": "t"}})  # sync, on the store's own loop
        g = graph(saver)
        await g.ainvoke({"log": [], "turns": 0}, {"configurable": {"thread_id": "t"}})
        names = await store.record_names("t", "lg/c/")
        stored = dict(await store.catalog.records_named(store.tenant, "t", [names[-1]]))
        damaged = bytearray(stored[names[-1]])
        damaged[20] ^= 0x40
        await store.catalog.put_records(store.tenant, "t", {names[-1]: bytes(damaged)})
        with pytest.raises(CorruptDataError):
            await saver.aget_tuple({"configurable": {"thread_id": "t"}})
        with pytest.raises(InvalidArgumentError):
            Bridge(store)._thread  # noqa: B018 - made here, in the store's loop: fine
            await asyncio.to_thread(AgentStateSaver, store)  # no running loop in that thread: refused
