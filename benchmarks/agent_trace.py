"""Seeded, deterministic traces of coding agents, for replay benchmarks.

    from agent_trace import make_trace
    trace = make_trace(agents=16, seed=0, time_scale=1 / 15, token_scale=0.25)
    for ev in trace.events():          # sorted by ev.t (replay seconds, zero service time)
        ...
    ids = trace.tokens(ev.agent)[:ev.context]   # the request's prompt, as token ids

The shape follows published coding-agent traces: a median of 33 turns per agent, about 131 input
tokens per output token (every request's prompt counted whole), about 94% of a request's prompt a
prefix the previous request already had (the context only grows: tool results, user text, the
model's own output), tool calls that pause a session for seconds to minutes (lognormal, heavy
tailed), and sub-agents: a tool call of some agents forks the agent's session into a child that
runs turns of its own while the parent waits for it (that tool call lasts as long as the child).

What an agent is, turn by turn: a request (the context so far plus `new_input` tokens: the
system prompt and task on the first turn, a tool result or user text after), `gen_s` of model
time producing `output` tokens, then a tool call of `pause_s` (the framework expected
`expected_s`: the actual duration with lognormal noise, or a child's expected run for a fork)
before the next request. The last turn has no tool call: the agent is done.

Every `*_s` is in replay seconds: trace seconds times `time_scale` (replays run in minutes;
`TraceStats` reports trace seconds). Token counts are multiplied by `token_scale` (at least one
token each), so a model with more KV per token fits in a benchmark's memory. Token ids are drawn
in [0, vocab): the system prompt is the same for every root agent, a child's ids start with its
parent's ids up to the fork, every other run of ids is the agent's own (random, seeded), so
content-addressed stores dedupe exactly what real agents share.

Only numpy and the standard library: the vLLM replay imports this too.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import numpy as np

EventKind = Literal["request", "pause", "fork", "done"]


@dataclass(frozen=True)
class Tool:
    """The tool call after a turn: the session waits `pause_s`; the framework expected `expected_s`."""

    pause_s: float
    expected_s: float
    fork: str | None = None
    """a sub-agent: this call forks the session into that agent and lasts until it is done"""


@dataclass(frozen=True)
class Turn:
    new_input: int
    """tokens appended before the request (system prompt + task on turn 0; a tool result, user text)"""
    output: int
    """tokens the model generates (they join the context)"""
    gen_s: float
    """model time of the request (prefill of the new tokens, then decode)"""
    tool: Tool | None
    """the tool call that follows (None: the agent is done)"""


@dataclass(frozen=True)
class Agent:
    agent_id: str
    start_s: float
    turns: tuple[Turn, ...]
    parent: str | None = None
    """a sub-agent: forked from this agent's session when it started"""
    fork_context: int = 0
    """a sub-agent: tokens of the parent's context it started with"""

    @property
    def final_context(self) -> int:
        return self.fork_context + sum(t.new_input + t.output for t in self.turns)


@dataclass(frozen=True)
class Event:
    """One thing that happens, at `t` replay seconds, assuming requests take no time.

    request: turn `turn` of `agent` is sent; its prompt is the first `context` tokens of
      `Trace.tokens(agent)`, of which `cached` were in the previous request's context (or are the
      shared system prompt / the parent's context), `new_tokens` new; it generates `output` tokens.
    pause: a tool call starts (the context is now `context` tokens): the session is back in
      `duration_s` (the framework expected `expected_s`); `child` is set when it is a fork.
    fork: `agent` (a sub-agent) starts as a copy of `parent`'s session of `context` tokens.
    done: the agent's last turn ended; its session holds `context` tokens.
    """

    t: float
    agent: str
    kind: EventKind
    turn: int = 0
    context: int = 0
    new_tokens: int = 0
    cached: int = 0
    output: int = 0
    duration_s: float = 0.0
    expected_s: float = 0.0
    parent: str | None = None
    child: str | None = None


@dataclass(frozen=True)
class TraceStats:
    root_agents: int
    sub_agents: int
    agents_that_fork: int
    turns_median: float
    turns_max: int
    requests: int
    input_output_ratio: float
    prefix_hit_rate: float
    pause_p50_s: float
    pause_p90_s: float
    pause_p99_s: float
    pause_max_s: float
    final_context_median: int
    final_context_max: int
    duration_s: float
    """trace seconds from the first start to the last done (zero service time)"""


@dataclass(frozen=True)
class WorkingSet:
    """KV bytes of the sessions live at once (started, not done), at the trace's peak."""

    peak_unique_bytes: int
    """distinct stored chunks (shared system prompt and forked prefixes counted once) plus tails"""
    peak_logical_bytes: int
    """every live session's whole context, shared parts counted per session"""
    peak_t: float
    mean_unique_bytes: int
    """time-weighted mean of the unique bytes over the trace"""


@dataclass(frozen=True)
class Trace:
    seed: int
    agents: tuple[Agent, ...]
    system_tokens: int
    time_scale: float
    token_scale: float
    vocab: int
    _streams: dict[str, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    def agent(self, agent_id: str) -> Agent:
        return self._by_id[agent_id]

    @cached_property
    def _by_id(self) -> dict[str, Agent]:
        return {a.agent_id: a for a in self.agents}

    def tokens(self, agent_id: str) -> np.ndarray:
        """Every token id of the agent's session at its end (int32); each context is a prefix of it."""
        if agent_id not in self._streams:
            a = self._by_id[agent_id]
            if a.parent is None:
                head = _ids(self.seed, "system", self.system_tokens, self.vocab)
            else:
                head = self.tokens(a.parent)[: a.fork_context]
            own = _ids(self.seed, agent_id, a.final_context - len(head), self.vocab)
            self._streams[agent_id] = np.concatenate([head, own])
        return self._streams[agent_id]

    def events(self) -> list[Event]:
        """Every event of every agent, sorted by time (ties: agent order of the trace)."""
        out: list[Event] = []
        for a in self.agents:
            t, ctx = a.start_s, a.fork_context
            if a.parent is not None:
                out.append(Event(t, a.agent_id, "fork", context=ctx, parent=a.parent))
            for i, turn in enumerate(a.turns):
                cached = ctx
                if i == 0 and a.parent is None and a is not self.agents[0]:
                    cached = self.system_tokens  # another agent's request had the shared system prompt
                out.append(Event(t, a.agent_id, "request", turn=i, context=ctx + turn.new_input,
                                 new_tokens=ctx + turn.new_input - cached, cached=cached, output=turn.output))  # fmt: skip
                ctx += turn.new_input + turn.output
                t += turn.gen_s
                if turn.tool is None:
                    out.append(Event(t, a.agent_id, "done", turn=i, context=ctx))
                else:
                    out.append(Event(t, a.agent_id, "pause", turn=i, context=ctx, duration_s=turn.tool.pause_s,
                                     expected_s=turn.tool.expected_s, child=turn.tool.fork))  # fmt: skip
                    t += turn.tool.pause_s
        order = {a.agent_id: n for n, a in enumerate(self.agents)}
        return sorted(out, key=lambda e: (e.t, order[e.agent]))

    def stats(self) -> TraceStats:
        evs = self.events()
        reqs = [e for e in evs if e.kind == "request"]
        pauses = np.array([e.duration_s for e in evs if e.kind == "pause"]) / self.time_scale
        roots = [a for a in self.agents if a.parent is None]
        finals = [a.final_context for a in self.agents]
        q = (lambda p: float(np.percentile(pauses, p))) if len(pauses) else (lambda p: 0.0)
        return TraceStats(
            root_agents=len(roots), sub_agents=len(self.agents) - len(roots),
            agents_that_fork=len({a.parent for a in self.agents if a.parent}),
            turns_median=float(np.median([len(a.turns) for a in roots])), turns_max=max(len(a.turns) for a in roots),
            requests=len(reqs),
            input_output_ratio=sum(e.context for e in reqs) / max(1, sum(e.output for e in reqs)),
            prefix_hit_rate=sum(e.cached for e in reqs) / max(1, sum(e.context for e in reqs)),
            pause_p50_s=q(50), pause_p90_s=q(90), pause_p99_s=q(99), pause_max_s=float(pauses.max(initial=0.0)),
            final_context_median=int(np.median(finals)), final_context_max=max(finals),
            duration_s=(max(e.t for e in evs) - min(e.t for e in evs)) / self.time_scale,
        )  # fmt: skip

    def working_set(self, token_bytes: int, chunk_tokens: int) -> WorkingSet:
        """The KV bytes live at once, assuming requests take no time: a session is live from its
        first request (or fork) to its last turn's end; its bytes are its context at the time.
        Unique bytes count each stored chunk once (chunk j of a session is the chunk of the
        session whose tokens it copies, when all its tokens are shared), plus each session's tail."""
        chunk_bytes = token_bytes * chunk_tokens
        sys_chunks = self.system_tokens // chunk_tokens

        def owner(agent_id: str, j: int) -> tuple[str, int]:
            a = self._by_id[agent_id]
            while True:
                if a.parent is None:
                    return ("system", j) if j < sys_chunks else (a.agent_id, j)
                if (j + 1) * chunk_tokens > a.fork_context:
                    return a.agent_id, j
                a = self._by_id[a.parent]

        live: dict[str, int] = {}
        best = (0, 0, 0.0)
        area, last_t, last_unique = 0.0, None, 0
        evs = self.events()
        for e in evs:
            if e.kind in ("request", "pause", "fork"):
                live[e.agent] = max(live.get(e.agent, 0), e.context)
            elif e.kind == "done":
                live.pop(e.agent, None)
            chunks = {owner(a, j) for a, n in live.items() for j in range(n // chunk_tokens)}
            tails = sum(n % chunk_tokens for n in live.values())
            unique = len(chunks) * chunk_bytes + tails * token_bytes
            logical = sum(live.values()) * token_bytes
            if last_t is not None:
                area += last_unique * (e.t - last_t)
            last_t, last_unique = e.t, unique
            if unique > best[0]:
                best = (unique, logical, e.t)
        span = evs[-1].t - evs[0].t if evs else 0.0
        return WorkingSet(best[0], best[1], best[2], int(area / span) if span > 0 else best[0])


def _ids(seed: int, name: str, n: int, vocab: int) -> np.ndarray:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    return rng.integers(0, vocab, size=max(0, n), dtype=np.int32)


def make_trace(
    agents: int,
    seed: int = 0,
    *,
    time_scale: float = 1.0,
    token_scale: float = 1.0,
    turns_median: float = 33,
    turns_sigma: float = 0.6,
    max_turns: int = 60,
    system_tokens: int = 6144,
    task_median: int = 400,
    tool_result_median: int = 700,
    tool_result_sigma: float = 1.0,
    tool_result_max: int = 12000,
    input_output_ratio: float = 131.0,
    pause_median_s: float = 6.0,
    pause_sigma: float = 1.3,
    pause_max_s: float = 600.0,
    expected_sigma: float = 0.5,
    fork_fraction: float = 0.5,
    sub_agents_max: int = 3,
    sub_turns_median: float = 8,
    start_window_s: float = 120.0,
    prefill_tok_s: float = 4000.0,
    decode_tok_s: float = 50.0,
    vocab: int = 32000,
) -> Trace:
    """A trace of `agents` root agents (plus the sub-agents some of them fork), the same for the
    same arguments.

    Root agents start uniformly in the first `start_window_s` trace seconds. Turns per agent:
    lognormal (median `turns_median`, capped at `max_turns`, at least 2). New input per turn:
    the system prompt (shared by all root agents) plus a task on turn 0, then tool results
    (lognormal, median `tool_result_median`). Output per turn: the request's whole prompt divided
    by `input_output_ratio`, times lognormal noise of mean 1 (at least 1 token). Tool pauses:
    lognormal (median `pause_median_s`, capped at `pause_max_s`); the framework's expectation is
    the actual duration times lognormal noise (`expected_sigma`). A `fork_fraction` of the root
    agents fork 1..`sub_agents_max` sub-agents, each at a tool call of a random turn, each
    running a lognormal number of turns (median `sub_turns_median`); the parent waits for it.
    Model time per request: its new tokens at `prefill_tok_s`, its output at `decode_tok_s`.
    Token counts (system prompt, tasks, tool results, outputs) are multiplied by `token_scale`,
    durations (pauses, model time, start window) by `time_scale`.
    """
    if agents < 1:
        raise ValueError("agents must be >= 1")
    rng = np.random.default_rng(seed)

    def sc(n: float) -> int:
        return max(1, round(float(n) * token_scale))

    system = sc(system_tokens)
    out_sigma = 0.5
    out_mu = -(out_sigma**2) / 2  # noise of mean 1

    def n_turns(median: float) -> int:
        return int(min(max_turns, max(2, round(rng.lognormal(math.log(median), turns_sigma)))))

    def pause() -> tuple[float, float]:
        actual = float(min(pause_max_s, rng.lognormal(math.log(pause_median_s), pause_sigma)))
        return actual, float(actual * rng.lognormal(0.0, expected_sigma))

    def gen_s(new: int, output: int) -> float:
        return new / prefill_tok_s + output / decode_tok_s

    def tool_result() -> int:
        return sc(min(tool_result_max, rng.lognormal(math.log(tool_result_median), tool_result_sigma)))

    built: list[Agent] = []

    def build(agent_id: str, start: float, context: int, turns: int, first_input: int, parent: str | None,
              forks: list[int]) -> Agent:  # fmt: skip
        """One agent's turns; its sub-agents (forks at the tool calls of turns `forks`) are built,
        and added to `built`, as its tool calls reach them."""
        out: list[Turn] = []
        t, ctx = start, context
        for i in range(turns):
            new = first_input if i == 0 else tool_result()
            prompt = ctx + new
            output = max(1, round(prompt / input_output_ratio * float(rng.lognormal(out_mu, out_sigma))))
            g = gen_s(new, output)
            ctx, t = prompt + output, t + g
            tool = None
            if i < turns - 1:
                if i in forks:
                    cid = f"{agent_id}.s{forks.index(i)}"
                    child = build(cid, t, ctx, n_turns(sub_turns_median), sc(rng.lognormal(math.log(task_median), 0.5)),
                                  agent_id, [])  # fmt: skip
                    built.append(child)
                    run = sum(c.gen_s + (c.tool.pause_s if c.tool else 0.0) for c in child.turns)
                    expected = sum(c.gen_s + (c.tool.expected_s if c.tool else 0.0) for c in child.turns)
                    tool = Tool(pause_s=run, expected_s=expected, fork=cid)
                else:
                    actual, expected = pause()
                    tool = Tool(pause_s=actual, expected_s=expected)
                t += tool.pause_s
            out.append(Turn(new_input=new, output=output, gen_s=g, tool=tool))
        return Agent(agent_id, start, tuple(out), parent, context)

    roots: list[tuple[Agent, list[Agent]]] = []
    for n in range(agents):
        aid = f"a{n:03d}"
        start = float(rng.uniform(0.0, start_window_s))
        turns = n_turns(turns_median)
        forks: list[int] = []
        if rng.random() < fork_fraction and turns > 2:
            k = int(rng.integers(1, sub_agents_max + 1))
            forks = sorted(int(x) for x in rng.choice(np.arange(1, turns - 1), size=min(k, turns - 2), replace=False))
        built.clear()
        root = build(aid, start, 0, turns, system + sc(rng.lognormal(math.log(task_median), 0.5)), None, forks)
        roots.append((root, list(built)))
    everyone = [a for root, subs in sorted(roots, key=lambda r: r[0].start_s) for a in (root, *subs)]
    scaled = tuple(_scale(a, time_scale) for a in everyone)
    return Trace(seed=seed, agents=scaled, system_tokens=system, time_scale=time_scale, token_scale=token_scale,
                 vocab=vocab)  # fmt: skip


def _scale(a: Agent, k: float) -> Agent:
    turns = tuple(
        Turn(t.new_input, t.output, t.gen_s * k,
             None if t.tool is None else Tool(t.tool.pause_s * k, t.tool.expected_s * k, t.tool.fork))
        for t in a.turns
    )  # fmt: skip
    return Agent(a.agent_id, a.start_s * k, turns, a.parent, a.fork_context)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="print a trace's shape")
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-scale", type=float, default=1.0)
    p.add_argument("--token-bytes", type=int, default=12 * 1024, help="KV bytes per token (working set)")
    p.add_argument("--chunk-tokens", type=int, default=256)
    args = p.parse_args()
    tr = make_trace(args.agents, args.seed, token_scale=args.token_scale)
    print(tr.stats())
    print(tr.working_set(args.token_bytes, args.chunk_tokens))
