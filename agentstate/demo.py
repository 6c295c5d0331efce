"""`agentstate demo`: agents sharing a system prompt, snapshotted turn by turn, paused and resumed.

For now the model is synthetic (random KV of a Llama-8B-like shape, 16 layers): what is shown is
the store itself, dedupe of the shared prompt, durability across a reopen, bit-exactness and
speed. A later stage runs a real transformers model here.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from agentstate import ModelSpec, StateStore

DEMO_SPEC = ModelSpec(model_id="demo/synthetic-16l-8kv-128", num_layers=16, num_kv_heads=8, head_dim=128)


@dataclass
class DemoResult:
    agents: int
    turns: int
    tokens: int
    logical_bytes: int
    stored_bytes: int
    snapshot_s: float
    resume_host_s: float
    resume_lmdb_s: float
    bit_exact: bool


def _kv(num_tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(DEMO_SPEC.kv_shape(num_tokens), generator=g).to(DEMO_SPEC.torch_dtype)


async def run_demo(
    data_dir: Path, *, agents: int = 8, turns: int = 4, system_tokens: int = 2000, turn_tokens: int = 300,
    console: Console | None = None,
) -> DemoResult:  # fmt: skip
    console = console or Console()
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, 32000, (system_tokens,), generator=g).tolist()
    system_kv = _kv(system_tokens, seed=1)
    history = {f"agent-{i}": (list(system), system_kv) for i in range(agents)}
    snapshot_s = 0.0
    async with StateStore.open(data_dir, DEMO_SPEC) as store:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("agents working, snapshot after every turn", total=agents * turns)
            for turn in range(turns):
                for i, sid in enumerate(history):
                    tokens, kv = history[sid]
                    new = torch.randint(0, 32000, (turn_tokens,), generator=g).tolist()
                    history[sid] = (tokens + new, torch.cat([kv, _kv(turn_tokens, seed=1000 * turn + i)], dim=2))
                    t0 = time.perf_counter()
                    await store.snapshot(sid, *history[sid], state={"turn": turn + 1, "messages": turn + 1})
                    snapshot_s += time.perf_counter() - t0
                    progress.advance(task)
        t0 = time.perf_counter()
        hot = await asyncio.gather(*(store.resume(sid) for sid in history))
        resume_host_s = time.perf_counter() - t0
        stats = await store.stats()
    stored = next(t.bytes_used for t in stats.tiers if t.name == "lmdb")
    # Pause every agent: the process "restarts"; a fresh store with no host tier serves from LMDB.
    async with StateStore.open(data_dir, DEMO_SPEC, host_capacity_bytes=0) as store:
        t0 = time.perf_counter()
        cold = await asyncio.gather(*(store.resume(sid) for sid in history))
        resume_lmdb_s = time.perf_counter() - t0
    exact = all(
        r.complete
        and r.kv is not None
        and r.kv.view(torch.uint8).equal(history[r.manifest.session_id][1].view(torch.uint8))
        for r in hot + cold
    )
    total = sum(len(t) for t, _ in history.values())
    return DemoResult(
        agents, turns, total, total * DEMO_SPEC.token_bytes, stored, snapshot_s, resume_host_s, resume_lmdb_s, exact
    )


def print_result(r: DemoResult, console: Console) -> None:
    gb = r.logical_bytes / 1e9
    table = Table(title=f"agentstate demo: {r.agents} agents x {r.turns} turns, one shared system prompt")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("tokens in all sessions", f"{r.tokens:,}")
    table.add_row("KV bytes, logical", f"{gb:.2f} GB")
    table.add_row(
        "KV bytes, stored in LMDB", f"{r.stored_bytes / 1e9:.2f} GB ({r.logical_bytes / r.stored_bytes:.1f}x dedupe)"
    )
    table.add_row("snapshot (durable, all turns)", f"{r.snapshot_s:.2f} s")
    table.add_row("resume all agents, host tier", f"{r.resume_host_s:.3f} s ({gb / r.resume_host_s:.1f} GB/s)")
    table.add_row("resume all agents after restart, LMDB", f"{r.resume_lmdb_s:.3f} s ({gb / r.resume_lmdb_s:.1f} GB/s)")
    table.add_row("restored KV bit-exact", "[green]yes[/green]" if r.bit_exact else "[red]NO[/red]")
    console.print(table)


def main(data_dir: Path | None, agents: int, turns: int, keep: bool) -> bool:
    console = Console()
    path = data_dir or Path(tempfile.mkdtemp(prefix="agentstate-demo-"))
    try:
        result = asyncio.run(run_demo(path, agents=agents, turns=turns, console=console))
        print_result(result, console)
        console.print(f"data directory: {path}" + ("" if keep or data_dir else " (removed)"))
        return result.bit_exact
    finally:
        if data_dir is None and not keep:
            shutil.rmtree(path, ignore_errors=True)
