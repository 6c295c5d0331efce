"""Agent frameworks end to end on a real vLLM OpenAI server (CPU, tiny random-weight Llama, float32).

A LangGraph agent (ChatOpenAI through `openai_channel`'s clients, `AgentStateSaver`,
`AgentStateHints`) and an OpenAI Agents SDK agent (`AgentStateSession`, `run`) run two turns,
each a model call, a tool call and a model call, against:

- `python -m vllm.entrypoints.openai.api_server` without the connector: the reference replies;
- the same with the connector and its session API (`serve_port`): every model call is answered
  by the server, vLLM's own prefix cache is emptied before each (`/reset_prefix_cache`), so the
  cached tokens the server reports are agentstate's; `agentstate inspect --url` during a tool call
  shows the thread's session, its paused hold, its usage and its records;
- a new server on the same directory: the thread resumes from its checkpoint and its first call
  loads the KV.

A random-weight model chooses no tools: the graph's edges (LangGraph) or a model that adds a tool
call to the server's answer (Agents SDK) run the tool between two model calls.
Runs under the venv that has vLLM (.ci/run makes .venv-ci-vllm); CI fails instead of skipping.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any, TypedDict

import httpx
import pytest

from tests.requires import require_module

vllm = require_module("vllm", "pip install -c constraints.txt -r requirements-vllm.txt (a venv of its own: .ci/run)")
require_module("langgraph", "pip install -e '.[test]' (the frameworks extra)")
require_module("agents", "pip install -e '.[test]' (the frameworks extra)")
require_module("langchain_openai", "pip install -e '.[test]' (the frameworks extra)")

import openai  # noqa: E402
from agents import Agent, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled  # noqa: E402
from agents.items import ModelResponse  # noqa: E402
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.checkpoint.memory import InMemorySaver  # noqa: E402
from langgraph.graph import END, START, StateGraph  # noqa: E402
from langgraph.graph.message import add_messages  # noqa: E402
from langgraph.prebuilt import ToolNode  # noqa: E402
from openai.types.responses import ResponseFunctionToolCall  # noqa: E402

from agentstate.adapters.langgraph import AgentStateHints, AgentStateSaver  # noqa: E402
from agentstate.adapters.openai_agents import AgentStateSession, run  # noqa: E402
from agentstate.adapters.openai_channel import async_http_client, http_client  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from ports import address_in_use, free_port  # noqa: E402
from readme_blocks import NEEDS_SERVER  # noqa: E402
from readme_blocks import PYTHON as README_PYTHON  # noqa: E402
from vllm_engine import make_model, stop_server  # noqa: E402

set_tracing_disabled(True)
TOKEN = "frameworks-token-0123456789"
SYSTEM = " ".join(f"t{10 + i % 400}" for i in range(600))  # 600 tokens: the long context an agent carries
TOOL_RESULT = "t40 t41 t42 t43 t44"


class Server:
    """One vLLM OpenAI server process (its own process group: its engine processes go with it)."""

    def __init__(self, tmp: Path, model: str, name: str, data: Path | None) -> None:
        self.tmp, self.model, self.name, self.data = tmp, model, name, data
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = self.api_port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def start(self) -> Server:
        for _ in range(3):  # a port lost to another process while the server imported: another one
            self.port, self.api_port = free_port(), free_port()
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                   "--served-model-name", "tiny", "--enable-prompt-tokens-details", "--dtype", "float32",
                   "--enforce-eager", "--max-model-len", "4096", "--seed", "0", "--host", "127.0.0.1",
                   "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",  # what an agent deployment runs
                   "--port", str(self.port)]  # fmt: skip
            if self.data is not None:
                (self.tmp / "tokens.json").write_text(json.dumps({TOKEN: "default"}))
                extra = {"path": str(self.data), "serve_port": self.api_port,
                         "serve_tokens_file": str(self.tmp / "tokens.json")}  # fmt: skip
                cmd += ["--kv-transfer-config", json.dumps({
                    "kv_connector": "AgentStateConnector", "kv_connector_module_path": "agentstate.adapters.vllm",
                    "kv_role": "kv_both", "kv_connector_extra_config": extra})]  # fmt: skip
            work = self.tmp / self.name
            (work / "tmp").mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
                   "TMPDIR": str(work / "tmp"), "VLLM_CACHE_ROOT": str(self.tmp / "vllm-cache"),
                   "TORCHINDUCTOR_CACHE_DIR": str(self.tmp / "inductor")}  # fmt: skip
            self.log = work / "server.log"
            with open(self.log, "w") as out:
                self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)  # fmt: skip
            if self._ready(300):
                return self
            text = self.log.read_text()
            self.stop()
            if not address_in_use(text):
                raise AssertionError(f"vLLM server {self.name} did not start:\n{text[-6000:]}")
        raise AssertionError(f"vLLM server {self.name}: no free port in 3 tries")

    def _ready(self, limit_s: float) -> bool:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return False
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    if self.data is None or httpx.get(self.api + "/healthz", timeout=2).status_code == 200:
                        return True
            time.sleep(0.5)
        return False

    def reset(self) -> None:
        """Empty vLLM's own prefix cache: the next call's cached tokens can only be agentstate's."""
        for _ in range(100):  # blocks of a finished session request stay held until its snapshot is written
            if httpx.post(self.url + "/reset_prefix_cache", timeout=30).status_code == 200:
                return
            time.sleep(0.1)
        raise AssertionError("reset_prefix_cache kept failing")

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc)
            self.proc = None


# -- LangGraph -----------------------------------------------------------------------------------


class Chat(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


class LangGraphAgent:
    """model -> tools -> model -> END per turn; the model's first answer of a turn carries a call to
    `lookup` (the edges run the tool), its second ends the turn."""

    def __init__(self, server: Server, checkpointer: Any, on_tool: Any = None) -> None:
        self.server, self.usage = server, []
        self.llm = ChatOpenAI(model="tiny", base_url=server.url + "/v1", api_key="x", max_tokens=8, temperature=0,
                              max_retries=0, http_client=http_client(), http_async_client=async_http_client())  # fmt: skip

        @tool
        def lookup(query: str) -> str:
            """Looks a fact up (takes a second)."""
            if on_tool is not None:
                on_tool()
            time.sleep(1.0)
            return TOOL_RESULT

        lookup.metadata = {"expected_s": 30}

        def model(state: Chat) -> dict[str, Any]:
            self.server.reset()
            reply = self.llm.invoke(state["messages"])
            usage = reply.response_metadata["token_usage"]
            self.usage.append((usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))
            if not isinstance(state["messages"][-1], AIMessage) and state["messages"][-1].type == "human":
                call = {"name": "lookup", "args": {"query": "x"}, "id": f"call-{len(self.usage)}"}
                reply = AIMessage(content=reply.content, tool_calls=[call])
            return {"messages": [AIMessage(content=reply.content, tool_calls=getattr(reply, "tool_calls", []))]}

        g = StateGraph(Chat)
        g.add_node("model", model)
        g.add_node("tools", ToolNode([lookup]))
        g.add_edge(START, "model")
        g.add_conditional_edges("model", lambda s: "tools" if s["messages"][-1].tool_calls else END, ["tools", END])
        g.add_edge("tools", "model")
        self.graph = g.compile(checkpointer=checkpointer)

    def turn(self, config: dict[str, Any], text: str, first: bool = False) -> list[str]:
        """The model's answers of this turn."""
        new: list[AnyMessage] = [SystemMessage(SYSTEM)] if first else []
        had = len(self.graph.get_state(config).values.get("messages", []))
        out = self.graph.invoke({"messages": [*new, HumanMessage(text)]}, config)
        return [m.content for m in out["messages"][had:] if isinstance(m, AIMessage)]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("frameworks")


@pytest.fixture(scope="module")
def model(tmp: Path) -> str:
    return make_model(str(tmp / "model"), chat=True)


@pytest.fixture(scope="module")
def reference(tmp: Path, model: str) -> dict[str, Any]:
    """Both agents on a server without the connector: the replies to compare with."""
    server = Server(tmp, model, "plain", None).start()
    try:
        lg = LangGraphAgent(server, InMemorySaver())
        cfg = {"configurable": {"thread_id": "ref"}}
        replies = lg.turn(cfg, "t7 t8 t9", first=True) + lg.turn(cfg, "t20 t30") + lg.turn(cfg, "t21 t31")
        sdk = _sdk_turns(server, None)
        return {"langgraph": replies, "sdk": sdk}
    finally:
        server.stop()


def _inspect(server: Server, session: str) -> str:
    cmd = [sys.executable, "-m", "agentstate", "inspect", session, "--url", server.api, "--token", TOKEN]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())  # lines wrapped at the terminal's width, joined


def _prompt_leaving_the_session_part_way(server: Server) -> None:
    """A prompt that differs from the stored session 20 tokens before its end (a template that
    re-tokenizes the last reply differently): the session still serves every token before that,
    not only its whole chunks."""
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.post(server.api + "/v1/sessions/thread-7/fork", json={"new_id": "probe"}, headers=auth).is_success
    stored = httpx.get(server.api + "/v1/sessions/probe", headers=auth).json()["tokens"]
    n = len(stored) - 20
    if n % 256 <= 20:  # inside a chunk or the tail, 20+ tokens past its start: whole chunks alone fall short
        n -= n % 256 + 1
    server.reset()
    body = {"model": "tiny", "prompt": stored[:n] + [7] * 30, "max_tokens": 1,
            "kv_transfer_params": {"agentstate": {"session_id": "probe"}}}  # fmt: skip
    usage = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == n, usage


def _example(server: Server, name: str, session_flag: str) -> str:
    cmd = [sys.executable, str(ROOT / "examples" / name), "--vllm", server.url + "/v1", "--agentstate", server.api,
           "--token", TOKEN, session_flag, f"example-{name[:5]}", "--max-tokens", "8", "t7 t8", "t9 t10"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    return done.stdout


def test_a_langgraph_agent_keeps_its_thread_and_kv_in_one_session_across_a_restart(
    tmp: Path, model: str, reference: dict[str, Any]
) -> None:
    server = Server(tmp, model, "lg", tmp / "data-lg").start()
    seen: list[str] = []
    try:
        saver = AgentStateSaver.connect(server.api, TOKEN)
        hints = AgentStateHints(saver.bridge)
        lg = LangGraphAgent(server, saver, on_tool=lambda: seen.append(_inspect(server, "thread-7")) if not seen else None)
        cfg: dict[str, Any] = {"configurable": {"thread_id": "thread-7"}, "callbacks": [hints]}
        replies = lg.turn(cfg, "t7 t8 t9", first=True) + lg.turn(cfg, "t20 t30")
        hints.hinter.wait()
        assert replies == reference["langgraph"][:4]  # the same replies as without agentstate
        prompts = [p for p, _ in lg.usage]
        cached = [c for _, c in lg.usage]
        assert cached[0] == 0  # nothing stored yet
        for i in range(1, len(lg.usage)):  # every later call loads the whole context before it
            assert cached[i] >= prompts[i - 1], lg.usage
        (shown,) = seen  # `agentstate inspect --url` while the first tool ran
        assert "default/thread-7" in shown and "held by a paused hint" in shown, shown
        assert "usage:" in shown and "records:" in shown, shown
        assert hints.hinter.dropped == 0
        before = lg.graph.get_state({"configurable": {"thread_id": "thread-7"}}).values["messages"]
        saver.close()
        _prompt_leaving_the_session_part_way(server)
        for example, session in (("langgraph_agent.py", "--thread"), ("openai_agents_agent.py", "--session")):
            shown = _example(server, example, session)  # the README's examples run as written
            assert shown.count("cached]") == 2, shown
        for code in (b for b in README_PYTHON if NEEDS_SERVER in b):  # and the README's framework blocks
            env = {**os.environ, "VLLM_URL": server.url + "/v1", "AGENTSTATE_URL": server.api,
                   "AGENTSTATE_TOKEN": TOKEN, "MODEL": "tiny"}  # fmt: skip
            done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp, capture_output=True, text=True,
                                  timeout=300, check=False)  # fmt: skip
            assert done.returncode == 0, f"{code}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    finally:
        server.stop()

    server = Server(tmp, model, "lg2", tmp / "data-lg").start()  # a new server on the same directory
    try:
        saver = AgentStateSaver.connect(server.api, TOKEN)
        lg = LangGraphAgent(server, saver)
        cfg = {"configurable": {"thread_id": "thread-7"}, "callbacks": [AgentStateHints(saver.bridge)]}
        state = lg.graph.get_state(cfg).values["messages"]
        assert [m.content for m in state] == [m.content for m in before]  # resumed from its checkpoint
        replies = lg.turn(cfg, "t21 t31")
        assert replies[-2:] == reference["langgraph"][-2:]
        assert lg.usage[0][1] >= prompts[-1]  # its first call loads the KV stored before the restart
        saver.close()
    finally:
        server.stop()


# -- OpenAI Agents SDK -----------------------------------------------------------------------------


class ToolFirst(OpenAIChatCompletionsModel):
    """The server's answer, with a call to `lookup` added to the first answer of a turn."""

    usage: list[tuple[int, int]]
    server: Server

    async def get_response(self, system_instructions: Any, input: Any, *args: Any, **kw: Any) -> ModelResponse:
        self.server.reset()
        response = await super().get_response(system_instructions, input, *args, **kw)
        details = response.usage.input_tokens_details
        self.usage.append((response.usage.input_tokens, getattr(details, "cached_tokens", 0) or 0))
        last = input[-1] if isinstance(input, list) and input else {}
        if isinstance(last, dict) and last.get("role") == "user":
            call = ResponseFunctionToolCall(arguments='{"q": "x"}', call_id=f"call-{len(self.usage)}", name="lookup",
                                            type="function_call", id=f"fc-{len(self.usage)}", status="completed")  # fmt: skip
            response.output = [*response.output, call]
        return response


def _sdk_agent(server: Server) -> tuple[Agent[Any], ToolFirst]:
    @function_tool
    def lookup(q: str) -> str:
        """Looks a fact up (takes a second)."""
        time.sleep(1.0)
        return TOOL_RESULT

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", http_client=async_http_client(), max_retries=0)
    model = ToolFirst(model="tiny", openai_client=client)
    model.usage, model.server = [], server
    from agents import ModelSettings

    agent = Agent(name="a", instructions=SYSTEM, tools=[lookup], model=model, reset_tool_choice=False,
                  model_settings=ModelSettings(max_tokens=8, temperature=0, tool_choice="none"))  # fmt: skip
    return agent, model


def _sdk_turns(server: Server, session: Any) -> list[str]:
    import asyncio

    from agents import Runner
    from agents.memory import SQLiteSession

    agent, _ = _sdk_agent(server)

    async def go() -> list[str]:
        s = session or SQLiteSession("ref")
        out = []
        for text in ("t7 t8 t9", "t20 t30"):
            result = await Runner.run(agent, text, session=s)
            out.append(result.final_output)
        return out

    return asyncio.run(go())


def test_an_openai_agents_sdk_agent_keeps_its_session_and_kv_across_a_restart(
    tmp: Path, model: str, reference: dict[str, Any]
) -> None:
    import asyncio

    server = Server(tmp, model, "sdk", tmp / "data-sdk").start()
    try:
        agent, m = _sdk_agent(server)

        async def turns() -> tuple[list[str], list[Any]]:
            session = AgentStateSession("chat-9", await _client(server))
            out = [(await run(agent, t, session=session, expected_s={"lookup": 30})).final_output
                   for t in ("t7 t8 t9", "t20 t30")]  # fmt: skip
            return out, await session.get_items()

        replies, items = asyncio.run(turns())
        assert replies == reference["sdk"]  # the same answers as without agentstate
        cached = [c for _, c in m.usage]
        prompts = [p for p, _ in m.usage]
        assert cached[0] == 0
        for i in range(1, len(m.usage)):
            assert cached[i] >= prompts[i - 1], m.usage
    finally:
        server.stop()

    server = Server(tmp, model, "sdk2", tmp / "data-sdk").start()
    try:
        agent, m = _sdk_agent(server)

        async def resumed() -> tuple[list[Any], str]:
            session = AgentStateSession("chat-9", await _client(server))
            kept = await session.get_items()
            result = await run(agent, "t21 t31", session=session)
            return kept, result.final_output

        kept, _ = asyncio.run(resumed())
        assert kept == items  # the conversation is the session's, across the restart
        assert m.usage[0][1] >= prompts[-1]  # and so is its KV: the first call loads it
    finally:
        server.stop()


async def _client(server: Server) -> Any:
    from agentstate.client import AsyncClient

    return AsyncClient(server.api, TOKEN)
