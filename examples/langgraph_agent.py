"""A LangGraph ReAct agent whose thread is an agentstate session: its checkpoints and its KV.

Start vLLM with the agentstate connector and the connector's session API (`serve_port`):

    echo '{"my-token": "default"}' > tokens.json
    python -m vllm.entrypoints.openai.api_server --model MODEL --enable-prompt-tokens-details \\
        --enable-auto-tool-choice --tool-call-parser PARSER \\
        --kv-transfer-config '{"kv_connector": "AgentStateConnector",
          "kv_connector_module_path": "agentstate.adapters.vllm", "kv_role": "kv_both",
          "kv_connector_extra_config": {"path": "/data/kv", "serve_port": 8471,
                                        "serve_tokens_file": "tokens.json"}}'

then run the agent (`pip install 'agentstate-kv[frameworks]'`):

    python examples/langgraph_agent.py --vllm http://127.0.0.1:8000/v1 \\
        --agentstate http://127.0.0.1:8471 --token my-token --thread trip-1 "Plan a day in Lyon"

What agentstate does here, with no other code: the model calls carry the thread as the engine's
session (the channel's httpx client), so each call loads the context stored by the one before;
the checkpointer keeps the thread's messages in the same session; a tool call holds the session in
host memory while the tool runs and brings it up when it returns (the hints). Run it again with
the same --thread, even after restarting vLLM: the conversation and its KV come back.
"""

from __future__ import annotations

import argparse
import time

import httpx
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from agentstate.adapters.langgraph import AgentStateHints, AgentStateSaver
from agentstate.adapters.openai_channel import async_http_client, http_client


@tool
def weather(city: str) -> str:
    """Today's weather in a city."""
    time.sleep(1.0)  # a real tool takes time: the session waits in host memory meanwhile
    return f"{city}: sunny, 21 C"


@tool
def search_docs(query: str) -> str:
    """Searches the travel guide."""
    time.sleep(2.0)
    return f"guide entries about {query}: old town, river walk, food market"


search_docs.metadata = {"expected_s": 2.0}  # what its paused hint says (others: a running estimate)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm", default="http://127.0.0.1:8000/v1", help="vLLM's OpenAI API")
    ap.add_argument("--agentstate", default="http://127.0.0.1:8471", help="the connector's session API")
    ap.add_argument("--token", required=True, help="a bearer token of the session API (its tenant)")
    ap.add_argument("--thread", default="trip-1", help="the LangGraph thread = the agentstate session")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("questions", nargs="*", default=["Plan a day in Lyon", "And if it rains?"])
    args = ap.parse_args()

    model = httpx.get(args.vllm.rstrip("/") + "/models").json()["data"][0]["id"]
    llm = ChatOpenAI(model=model, base_url=args.vllm, api_key="unused", max_tokens=args.max_tokens, temperature=0,
                     http_client=http_client(), http_async_client=async_http_client())
    saver = AgentStateSaver.connect(args.agentstate, args.token)
    agent = create_react_agent(llm, [weather, search_docs], checkpointer=saver)
    config = {"configurable": {"thread_id": args.thread}, "callbacks": [AgentStateHints(saver.bridge)]}
    try:
        for question in args.questions:
            out = agent.invoke({"messages": [("user", question)]}, config)
            answer = out["messages"][-1]
            usage = answer.response_metadata.get("token_usage", {})
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            print(f"> {question}\n{answer.content}\n  [{usage.get('prompt_tokens')} prompt tokens, {cached} cached]")
    finally:
        saver.close()


if __name__ == "__main__":
    main()
