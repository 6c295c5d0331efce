"""`agentstate demo`: agents on a real transformers model, with and without agentstate.

Several agents share one long system prompt; each has its own growing conversation. After every
turn an agent is paused (its KV cache dropped, as an engine does when it needs the memory) and
resumed at its next turn. Halfway through, the store is closed and reopened (a restart), so later
turns are served from LMDB. Every turn of the token script runs twice, back to back:

- without agentstate: the turn prefills the agent's whole context again;
- with agentstate: a new agent loads the shared system prompt's KV (stored once, by the first
  agent), a returning agent resumes its session; only the new tokens are prefilled.

The two runs of a turn are interleaved (rather than one pass after the other) so that both see the
same machine: on a busy one, a returning agent's small prefill is what slows down most (many short
parallel regions, each waiting for a descheduled thread), and passes minutes apart saw different
loads (speedups of 1.1x to 31x on one busy machine). The demo says how busy the machine was.

Time to first token (TTFT) is from the turn's start to its first reply token; the hit rate is the
share of the turn's prompt tokens whose KV came from the store. The model is a small Llama shape
with random weights (no downloads), so replies are gibberish, but they are compared token for
token between the two runs. A PNG of TTFT per turn lands in the data directory.

With a config file (`agentstate --config FILE demo`) the store is configured by it (tiers, sizes,
chunk size; env vars override it) and its `path` is the data directory unless --data-dir names one;
its [spec] is not used (the demo's model has its own).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from agentstate import StateStore
from agentstate.config import StoreConfig
from agentstate.errors import SessionNotFoundError
from agentstate.settings import read_config_file, store_config

REPLY_TOKENS = 8
VOCAB = 32000


@dataclass
class Turn:
    agent: int
    turn: int
    prompt_tokens: int
    restored_tokens: int
    ttft_s: float
    reply: list[int]


@dataclass
class DemoResult:
    baseline: list[Turn] = field(default_factory=list)
    stored: list[Turn] = field(default_factory=list)
    stored_bytes: int = 0
    logical_bytes: int = 0
    png: Path | None = None
    threads: int = 1
    """torch threads both passes ran with (one per CPU idle when the demo started)"""
    others_cpu: float | None = None
    """share of the machine's CPU time other processes used while the demo ran (None: unknown)"""

    @property
    def speedups(self) -> list[float]:
        """TTFT without / with agentstate, per agent turn (the two ran back to back)."""
        return [b.ttft_s / o.ttft_s for b, o in zip(self.baseline, self.stored)]

    @property
    def replies_identical(self) -> bool:
        return [t.reply for t in self.baseline] == [t.reply for t in self.stored]


def build_model(layers: int = 8, hidden: int = 512) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16384,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def _prefill(model: Any, ids: list[int], cache: Any) -> tuple[int, Any]:
    out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return int(out.logits[0, -1].argmax()), out.cache


def _decode(model: Any, first: int, cache: Any) -> tuple[list[int], Any]:
    """Greedy reply: `first` and the tokens after it; the cache covers all but the last one."""
    reply = [first]
    while len(reply) < REPLY_TOKENS:
        nxt, cache = _prefill(model, [reply[-1]], cache)
        reply.append(nxt)
    return reply, cache


def _script(agents: int, turns: int, system_tokens: int, user_tokens: int) -> tuple[list[int], list[list[list[int]]]]:
    g = torch.Generator().manual_seed(1)
    system = torch.randint(0, VOCAB, (system_tokens,), generator=g).tolist()
    users = [
        [torch.randint(0, VOCAB, (user_tokens,), generator=g).tolist() for _ in range(turns)] for _ in range(agents)
    ]
    return system, users


class Recompute:
    """The pass without agentstate: every turn prefills the agent's whole context again."""

    def __init__(self, model: Any, system: list[int], agents: int) -> None:
        self.model = model
        self.history = [list(system) for _ in range(agents)]

    def turn(self, agent: int, turn: int, message: list[int]) -> Turn:
        from transformers import DynamicCache

        prompt = self.history[agent] + message
        t0 = time.perf_counter()
        first, cache = _prefill(self.model, prompt, DynamicCache(config=self.model.config))
        ttft = time.perf_counter() - t0
        reply, _ = _decode(self.model, first, cache)
        self.history[agent] = prompt + reply
        return Turn(agent, turn, len(prompt), 0, ttft, reply)


async def run_both(
    model: Any, config: StoreConfig, system: list[int], users: list[list[list[int]]], progress: Progress
) -> tuple[list[Turn], list[Turn], int]:
    """Both passes, interleaved turn by turn (which goes first alternates): each pair of turns sees
    the same machine, so a busy spell slows both instead of skewing their ratio. Returns the turns
    without and with agentstate, and the bytes LMDB holds at the end."""
    from agentstate.adapters import transformers as tf

    spec = tf.spec_for(model, model_id="demo/llama-random-8l")
    task = progress.add_task("each turn without agentstate, then with it", total=2 * sum(map(len, users)))
    baseline = Recompute(model, system, len(users))
    plain: list[Turn] = []
    ours: list[Turn] = []
    turns = len(users[0])
    pending: dict[int, int] = {}  # each agent's last reply token: sampled, not yet fed to the model

    async def stored(store: StateStore, agent: int, turn: int, message: list[int]) -> Turn:
        sid = f"agent-{agent}"
        t0 = time.perf_counter()
        try:
            resumed = await tf.resume(store, sid, model)
            cache, restored = resumed.cache, resumed.restored_tokens
            cached = resumed.tokens[:restored]
            new = resumed.tokens[restored:] + [pending[agent]] + message
        except SessionNotFoundError:
            prompt = system + message
            prefix = await tf.load_prefix(store, prompt, model)
            cache, restored = prefix.cache, prefix.tokens
            if restored == 0:  # the first agent computes the system prompt, and stores it once
                _, cache = _prefill(model, system, cache)
                await tf.put_prefix(store, system, cache)
            cached = prompt[:restored] if restored else system
            new = prompt[len(cached) :]
        first, cache = _prefill(model, new, cache)
        ttft = time.perf_counter() - t0
        reply, cache = _decode(model, first, cache)
        fed = cached + new + reply[:-1]
        pending[agent] = reply[-1]
        await tf.snapshot(store, sid, fed, cache, state={"turn": turn})
        return Turn(agent, turn, len(cached) + len(new), restored, ttft, reply)  # paused: its KV is in the store

    store = await StateStore.open(config, spec, writer="agentstate demo")  # records spec and config, so
    try:  # `agentstate ls -p DIR` and the other admin commands open it under the same tiers
        for turn in range(turns):
            if turn == turns // 2 and turn:
                await store.close()  # a restart: the host tier is gone, LMDB serves what follows
                store = await StateStore.open(config, spec, writer="agentstate demo")
            for agent, msgs in enumerate(users):
                if (turn + agent) % 2:  # which of the two goes first alternates
                    ours.append(await stored(store, agent, turn, msgs[turn]))
                    plain.append(baseline.turn(agent, turn, msgs[turn]))
                else:
                    plain.append(baseline.turn(agent, turn, msgs[turn]))
                    ours.append(await stored(store, agent, turn, msgs[turn]))
                progress.advance(task, 2)
        stats = await store.stats()
    finally:
        await store.close()
    return plain, ours, sum(t.bytes_used for t in stats.tiers if t.name == "lmdb")


def _proc_stat() -> list[int] | None:
    """The machine's CPU time so far, in clock ticks: user, nice, system, idle, iowait, irq, softirq,
    steal (/proc/stat's first line); None where it cannot be read."""
    try:
        return [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine has been busy, this process's and its children's), or None
    where /proc/stat is not there. Steal counts as busy: the hypervisor gave the time to others."""
    fields = _proc_stat()
    if fields is None:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    t = os.times()
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return busy, t.user + t.system + t.children_user + t.children_system


def _idle_cpus(seconds: float = 0.5) -> float | None:
    """CPUs idle (or waiting on IO) over the next `seconds`, None where /proc/stat cannot be read."""
    before = _proc_stat()
    time.sleep(seconds)
    after = _proc_stat()
    if before is None or after is None:
        return None
    total = sum(after) - sum(before)
    idle = after[3] + after[4] - before[3] - before[4]
    return (os.cpu_count() or 1) * idle / max(1, total)


def _threads() -> int:
    """torch's intra-op threads for the demo: one per idle CPU. A thread that shares its CPU with
    another process stalls every parallel region of the forward pass; a returning agent's small
    prefill is many short regions, and ran 2.5-3x slower at the median (6x at worst) with 2 threads
    on a 2-CPU machine where another process kept one CPU busy (docs/benchmarks.md)."""
    idle = _idle_cpus()
    return torch.get_num_threads() if idle is None else max(1, min(torch.get_num_threads(), int(idle + 0.5)))


def _others_share(before: tuple[float, float] | None, wall_s: float) -> float | None:
    after = _cpu_seconds()
    if before is None or after is None or wall_s <= 0:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others / (wall_s * (os.cpu_count() or 1)))


def plot(result: DemoResult, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    turns = sorted({t.turn for t in result.baseline})
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in (("without agentstate (recompute)", result.baseline), ("with agentstate", result.stored)):
        ax.plot([t + 1 for t in turns], [1e3 * statistics.median(r.ttft_s for r in rows if r.turn == t) for t in turns],
                marker="o", label=name)  # fmt: skip
    ax.set_xlabel("turn (median over agents)")
    ax.set_ylabel("time to first token, ms")
    ax.set_ylim(bottom=0)
    ax.set_xticks([t + 1 for t in turns])
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("agentstate demo: TTFT per turn")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_demo(
    data_dir: Path, *, agents: int = 4, turns: int = 4, system_tokens: int = 1536, user_tokens: int = 96,
    layers: int = 8, console: Console | None = None, config: StoreConfig | None = None,
) -> DemoResult:  # fmt: skip
    """Run both passes; the store is `config` (its path is `data_dir`), default: env vars only."""
    config = store_config(None, path=data_dir) if config is None else config.model_copy(update={"path": data_dir})
    console = console or Console()
    model = build_model(layers)
    system, users = _script(agents, turns, system_tokens, user_tokens)
    result = DemoResult()
    threads = torch.get_num_threads()
    result.threads = _threads()
    torch.set_num_threads(result.threads)
    before, t0 = _cpu_seconds(), time.perf_counter()
    try:
        with Progress(console=console, transient=True) as progress:
            result.baseline, result.stored, result.stored_bytes = asyncio.run(
                run_both(model, config, system, users, progress)
            )
    finally:
        torch.set_num_threads(threads)
    result.others_cpu = _others_share(before, time.perf_counter() - t0)
    token_bytes = 2 * model.config.num_hidden_layers * 2 * 64 * 4
    result.logical_bytes = (
        sum(t.prompt_tokens + REPLY_TOKENS - 1 for t in result.stored if t.turn == turns - 1) * token_bytes
    )
    result.png = plot(result, data_dir / "demo_ttft.png")
    return result


def print_result(r: DemoResult, console: Console) -> None:
    base, ours = r.baseline, r.stored

    def ms(rows: list[Turn]) -> str:
        return f"{statistics.median(t.ttft_s for t in rows) * 1e3:.0f} ms"

    def hit(rows: list[Turn]) -> str:
        return f"{sum(t.restored_tokens for t in rows) / sum(t.prompt_tokens for t in rows):.0%}"

    table = Table(title="agentstate demo: agents sharing a system prompt, paused and resumed every turn")
    for name, right in (("turn", False), ("without agentstate", True), ("with agentstate", True),
                        ("speedup", True), ("served from the store", True)):  # fmt: skip
        table.add_column(name, justify="right" if right else "left")
    for turn in sorted({t.turn for t in base}):
        b_rows, o_rows = [b for b in base if b.turn == turn], [o for o in ours if o.turn == turn]
        ratio = statistics.median(x for x, b in zip(r.speedups, base) if b.turn == turn)
        label = f"{turn + 1}" + (" (new agents)" if turn == 0 else "")
        table.add_row(label, ms(b_rows), ms(o_rows), f"{ratio:.1f}x", hit(o_rows))
    table.add_row("[bold]all[/bold]", ms(base), ms(ours), f"[bold]{statistics.median(r.speedups):.1f}x[/bold]", hit(ours))
    console.print(table)
    console.print(
        "TTFT per turn: the median over agents; speedup: the median of each agent turn's ratio (its two runs"
        " ran back to back, so both saw the same machine)."
    )
    console.print(f"KV stored in LMDB: {r.stored_bytes / 1e6:.1f} MB (the contexts: {r.logical_bytes / 1e6:.1f} MB)")
    same = "[green]yes[/green]" if r.replies_identical else "[red]NO[/red]"
    console.print(f"replies token-identical with and without agentstate: {same}")
    cpus = os.cpu_count() or 1
    console.print(f"torch threads: {r.threads} (one per CPU idle at the start; {cpus} CPUs)")
    if r.others_cpu is not None and r.others_cpu >= 0.2:
        console.print(
            f"[yellow]the machine was busy[/yellow]: other processes used {r.others_cpu:.0%} of its {cpus} CPUs"
            " meanwhile; both runs of each turn saw the same load, but every time above is slower than on a quiet"
            " machine, and a load that changed during the run moves the per-turn figures."
        )
    elif r.others_cpu is not None:
        console.print(f"the machine was quiet: other processes used {r.others_cpu:.0%} of its {cpus} CPUs meanwhile")
    if r.png:
        console.print(f"plot: {r.png}")


def main(data_dir: Path | None, agents: int, turns: int, config_file: Path | None = None) -> bool:
    """Run the demo in `data_dir`, else the config file's `path`, else ./agentstate-demo (emptied
    first); the directory is kept, the plot inside."""
    console = Console()
    file = read_config_file(config_file) if config_file else None
    named = data_dir or (Path(file.store["path"]) if file and "path" in file.store else None)
    path = named or Path("agentstate-demo")
    config = store_config(file, path=path)  # flags > env > file > defaults
    if named is None and path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = run_demo(path, agents=agents, turns=turns, console=console, config=config)
    print_result(result, console)
    console.print(f"data directory: {path} ({time.perf_counter() - t0:.0f} s in all)")
    return result.replies_identical
