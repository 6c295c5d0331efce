"""An OpenAI Agents SDK agent whose session is an agentstate session: its items and its KV.

Start vLLM as for examples/langgraph_agent.py (the connector with `serve_port`, and
`--enable-auto-tool-choice --tool-call-parser PARSER` for tool calls), then
(`pip install 'agentstate-kv[frameworks]'`):

    python examples/openai_agents_agent.py --vllm http://127.0.0.1:8000/v1 \\
        --agentstate http://127.0.0.1:8471 --token my-token --session user-42 "What is on today?"

`AgentStateSession` keeps the conversation items as records of the agentstate session named by
--session; `run(...)` runs the agent with hooks that hold the session while a tool runs, and its
model calls (through the channel's httpx client) name the session, so each turn loads the KV of
the turns before it instead of recomputing it.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import openai
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled

from agentstate.adapters.agents import Bridge
from agentstate.adapters.openai_agents import AgentStateSession, run
from agentstate.adapters.openai_channel import async_http_client


@function_tool
def calendar(day: str) -> str:
    """The user's calendar for a day."""
    time.sleep(1.0)
    return f"{day}: 10:00 design review, 14:00 dentist"


@function_tool
def reminders() -> str:
    """The user's open reminders."""
    time.sleep(0.5)
    return "buy milk; call Ana"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--agentstate", default="http://127.0.0.1:8471")
    ap.add_argument("--token", required=True)
    ap.add_argument("--session", default="user-42")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("questions", nargs="*", default=["What is on today?", "Anything I should not forget?"])
    args = ap.parse_args()

    set_tracing_disabled(True)
    model_id = httpx.get(args.vllm.rstrip("/") + "/models").json()["data"][0]["id"]
    client = openai.AsyncOpenAI(base_url=args.vllm, api_key="unused", http_client=async_http_client())
    agent = Agent(name="assistant", instructions="You are a concise personal assistant.", tools=[calendar, reminders],
                  model=OpenAIChatCompletionsModel(model=model_id, openai_client=client),
                  model_settings=ModelSettings(max_tokens=args.max_tokens, temperature=0))
    bridge = Bridge.connect(args.agentstate, args.token)
    try:
        session = AgentStateSession(args.session, bridge)
        for question in args.questions:
            result = await run(agent, question, session=session, expected_s={"calendar": 1.0})
            usage = result.context_wrapper.usage
            cached = usage.input_tokens_details.cached_tokens if usage.input_tokens_details else 0
            print(f"> {question}\n{result.final_output}\n  [{usage.input_tokens} input tokens, {cached} cached]")
    finally:
        bridge.close()


if __name__ == "__main__":
    asyncio.run(main())
