"""`agentstate demo`: agents on a real transformers model, with and without agentstate.

Several agents share one long system prompt; each has its own growing conversation. After every
turn an agent is paused (its KV cache dropped, as an engine does when it needs the memory) and
resumed at its next turn. Halfway through, the store is closed and reopened (a restart), so later
turns are served from LMDB. The same token script runs twice:

- without agentstate: every turn prefills the agent's whole context again;
- with agentstate: a new agent loads the shared system prompt's KV (stored once, by the first
  agent), a returning agent resumes its session; only the new tokens are prefilled.

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


def run_baseline(model: Any, system: list[int], users: list[list[list[int]]], progress: Progress) -> list[Turn]:
    from transformers import DynamicCache

    task = progress.add_task("without agentstate: recompute every context", total=sum(map(len, users)))
    history: list[list[int]] = [list(system) for _ in users]
    out = []
    for turn in range(len(users[0])):
        for agent, msgs in enumerate(users):
            prompt = history[agent] + msgs[turn]
            t0 = time.perf_counter()
            first, cache = _prefill(model, prompt, DynamicCache(config=model.config))
            ttft = time.perf_counter() - t0
            reply, _ = _decode(model, first, cache)
            history[agent] = prompt + reply
            out.append(Turn(agent, turn, len(prompt), 0, ttft, reply))
            progress.advance(task)
    return out


async def run_stored(
    model: Any, config: StoreConfig, system: list[int], users: list[list[list[int]]], progress: Progress
) -> tuple[list[Turn], int]:
    from agentstate.adapters import transformers as tf

    spec = tf.spec_for(model, model_id="demo/llama-random-8l")
    task = progress.add_task("with agentstate: resume, prefill only what is new", total=sum(map(len, users)))
    out: list[Turn] = []
    turns = len(users[0])
    pending: dict[int, int] = {}  # each agent's last reply token: sampled, not yet fed to the model
    store = await StateStore.open(config, spec, writer="agentstate demo")  # records spec and config, so
    try:  # `agentstate ls -p DIR` and the other admin commands open it under the same tiers
        for turn in range(turns):
            if turn == turns // 2 and turn:
                await store.close()  # a restart: the host tier is gone, LMDB serves what follows
                store = await StateStore.open(config, spec, writer="agentstate demo")
            for agent, msgs in enumerate(users):
                sid = f"agent-{agent}"
                t0 = time.perf_counter()
                try:
                    resumed = await tf.resume(store, sid, model)
                    cache, restored = resumed.cache, resumed.restored_tokens
                    cached = resumed.tokens[:restored]
                    new = resumed.tokens[restored:] + [pending[agent]] + msgs[turn]
                except SessionNotFoundError:
                    prompt = system + msgs[turn]
                    prefix = await tf.load_prefix(store, prompt, model)
                    cache, restored = prefix.cache, prefix.tokens
                    if restored == 0:  # the first agent computes the system prompt, and stores it once
                        _, cache = _prefill(model, system, cache)
                        await tf.put_prefix(store, system, cache)
                    cached = prompt[:restored] if restored else system
                    new = prompt[len(cached) :]
                prompt_tokens = len(cached) + len(new)
                first, cache = _prefill(model, new, cache)
                ttft = time.perf_counter() - t0
                reply, cache = _decode(model, first, cache)
                fed = cached + new + reply[:-1]
                pending[agent] = reply[-1]
                await tf.snapshot(store, sid, fed, cache, state={"turn": turn})
                del cache  # paused: its KV lives in the store now
                out.append(Turn(agent, turn, prompt_tokens, restored, ttft, reply))
                progress.advance(task)
        stats = await store.stats()
    finally:
        await store.close()
    return out, sum(t.bytes_used for t in stats.tiers if t.name == "lmdb")


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
        ax.plot([t + 1 for t in turns], [1e3 * statistics.mean(r.ttft_s for r in rows if r.turn == t) for t in turns],
                marker="o", label=name)  # fmt: skip
    ax.set_xlabel("turn (mean over agents)")
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
    with Progress(console=console, transient=True) as progress:
        result.baseline = run_baseline(model, system, users, progress)
        result.stored, result.stored_bytes = asyncio.run(run_stored(model, config, system, users, progress))
    token_bytes = 2 * model.config.num_hidden_layers * 2 * 64 * 4
    result.logical_bytes = (
        sum(t.prompt_tokens + REPLY_TOKENS - 1 for t in result.stored if t.turn == turns - 1) * token_bytes
    )
    result.png = plot(result, data_dir / "demo_ttft.png")
    return result


def print_result(r: DemoResult, console: Console) -> None:
    table = Table(title="agentstate demo: agents sharing a system prompt, paused and resumed every turn")
    table.add_column("")
    table.add_column("without agentstate", justify="right")
    table.add_column("with agentstate", justify="right")
    base, ours = r.baseline, r.stored

    def ms(rows: list[Turn], q: str) -> str:
        values = [t.ttft_s * 1e3 for t in rows]
        return f"{statistics.median(values):.0f} ms" if q == "p50" else f"{statistics.mean(values):.0f} ms"

    def hit(rows: list[Turn]) -> str:
        return f"{sum(t.restored_tokens for t in rows) / sum(t.prompt_tokens for t in rows):.0%}"

    table.add_row("turns", str(len(base)), str(len(ours)))
    table.add_row("TTFT, mean", ms(base, "mean"), ms(ours, "mean"))
    table.add_row("TTFT, median", ms(base, "p50"), ms(ours, "p50"))
    later = [t for t in ours if t.turn > 0]
    table.add_row(
        "TTFT, returning agents (mean)",
        ms([t for t in base if t.turn > 0], "mean"),
        ms(later, "mean") if later else "-",
    )
    table.add_row("prompt tokens served from the store", "0%", hit(ours))
    speedup = statistics.mean(t.ttft_s for t in base) / statistics.mean(t.ttft_s for t in ours)
    table.add_row("TTFT speedup", "1.0x", f"[bold]{speedup:.1f}x[/bold]")
    table.add_row("KV stored in LMDB", "-", f"{r.stored_bytes / 1e6:.1f} MB (contexts: {r.logical_bytes / 1e6:.1f} MB)")
    same = "[green]yes[/green]" if r.replies_identical else "[red]NO[/red]"
    table.add_row("replies token-identical", "", same)
    console.print(table)
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
