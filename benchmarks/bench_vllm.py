"""vLLM connector benchmark (not a test): `.venv-vllm/bin/python benchmarks/bench_vllm.py [--quick] [--blocks-only]`.

Part 1, the engine (tiny random-weight Llama, float32, CPU): agents return with 1k-8k tokens of
context. Round 0 computes and stores each context; round 1 (after `reset_prefix_cache()`) sends it
again plus 64 new tokens. Returning-turn TTFT (one output token, so end-to-end = TTFT) with
agentstate, with vLLM's in-tree `ExampleConnector`, recomputing (no connector), and a local
prefix-cache hit (round 2, no reset).

Part 2, per block, in this process (Llama-8B KV shape per rank, bf16, 128-token blocks in the CPU
layout): agentstate's store (copy out of the blocks + put) and load (read into the blocks), the
same bytes through safetensors files per layer (what ExampleConnector does), and a plain memcpy of
the same bytes measured in the same run.

Appends a section to docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def engine(tmp: Path, name: str, job: dict) -> dict:
    work = tmp / name
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    (work / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "TMPDIR": str(work / "tmp"), "VLLM_CACHE_ROOT": str(tmp / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp / "ind"), "VLLM_CPU_KVCACHE_SPACE": "2"}  # fmt: skip
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_engine.py"), str(work / "job.json"),
                           str(work / "out.json")], cwd=ROOT, env=env, capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"engine {name} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads((work / "out.json").read_text())


def part1(tmp: Path, sizes: list[int], agents: int) -> list[str]:
    from vllm_engine import make_model

    model = make_model(str(tmp / "model"))
    ctx = {(n, a): toks(n, 100 * n + a) for n in sizes for a in range(agents)}
    new = toks(64, 7)
    warm = {"tokens": toks(300, 99), "max_tokens": 1}  # first request of a round pays one-time costs: not counted
    first = [warm] + [{"tokens": ctx[k], "max_tokens": 1} for k in ctx]
    back = [warm] + [{"tokens": ctx[k] + new, "max_tokens": 1} for k in ctx]
    jobs = {
        "recompute": {"model": model, "connector": None, "rounds": [first, back]},
        "agentstate": {"model": model, "connector": {"path": str(tmp / "as")}, "rounds": [first, back, back],
                       "reset": [False, True, False]},
        "agentstate-sync": {"model": model, "connector": {"path": str(tmp / "as2"), "load_mode": "sync"},
                            "rounds": [first, back]},
        "ExampleConnector": {"model": model, "connector": {"shared_storage_path": str(tmp / "ex")},
                             "connector_class": "ExampleConnector", "rounds": [first, back]},
    }  # fmt: skip
    for job in jobs.values():
        job["max_model_len"] = max(sizes) + 1024
    res = {name: engine(tmp, name, job) for name, job in jobs.items()}
    keys = list(ctx)
    header = ("| context | recompute | agentstate (async load) | agentstate (sync load) | ExampleConnector "
              "| local prefix hit | best agentstate / local |")  # fmt: skip
    rows = [header, "|---|---|---|---|---|---|---|"]
    for n in sizes:
        idx = [i + 1 for i, k in enumerate(keys) if k[0] == n]

        def ms(name: str, rnd: int, idx: list[int] = idx) -> float:
            return 1000 * statistics.median(res[name]["rounds"][rnd][i]["e2e"] for i in idx)

        rec, ag, ex, local = ms("recompute", 1), ms("agentstate", 1), ms("ExampleConnector", 1), ms("agentstate", 2)
        sync = ms("agentstate-sync", 1)
        rows.append(f"| {n} | {rec:.1f} ms | {ag:.1f} ms | {sync:.1f} ms | {ex:.1f} ms | {local:.1f} ms "
                    f"| {min(ag, sync) / local:.2f}x |")
    hits = [r["cached"] for r in res["agentstate"]["rounds"][1][1:]]
    rows.append("")
    rows.append(f"agentstate returning-turn hits (tokens): {hits}")
    return rows


def part2(tmp: Path, blocks: int) -> list[str]:
    from agentstate.adapters.runtime import LoopThread
    from agentstate.adapters.vllm.blocks import EngineBlocks, layout_for
    from safetensors.torch import load_file, save_file

    from agentstate import ModelSpec, StateStore
    from agentstate.layouts import NativeKV

    layers, heads, dim, bs = 32, 8, 128, 128
    spec = ModelSpec(model_id="bench/llama-8b-shape", num_layers=layers, num_kv_heads=heads, head_dim=dim,
                     dtype="bfloat16")  # fmt: skip
    lay = layout_for("CPU_ATTN", "vec", block_size=bs, heads=heads, dim=dim)
    caches = [torch.randn(blocks * 2, heads, bs, 2 * dim).to(torch.bfloat16) for _ in range(layers)]
    engine = EngineBlocks(lay, [lay.planes(c) for c in caches], caches)
    block_bytes = spec.token_bytes * bs
    tokens = toks(blocks * bs, 3)
    ids = list(range(blocks))

    async def run(native: bool) -> dict[str, float]:
        """Store and load the blocks, as canonical chunks or in the blocks' own layout (`native`)."""
        out: dict[str, float] = {}
        path = tmp / ("p2-native" if native else "p2")
        code = engine.native_code
        assert code is not None
        async with StateStore.open(path, spec, chunk_tokens=bs, lmdb_map_size=4 << 30) as store:
            copy, write, handoff = [], [], []
            loop = LoopThread("bench-handoff")
            try:
                for j in range(blocks):  # per block, median: other processes share these cores
                    t = time.perf_counter()  # on the step: the connector only hands the job to its loop
                    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop.loop)
                    handoff.append(time.perf_counter() - t)
                    t = time.perf_counter()  # behind: out of the blocks (into canonical KV, or as they are)
                    if native:
                        kv: Any = NativeKV(code, engine.gather_native([ids[j]]), spec.kv_shape(bs))
                    else:
                        kv = engine.gather([ids[j]], bs, spec.empty_kv(bs))
                    copy.append(time.perf_counter() - t)
                    t = time.perf_counter()  # behind: encode, host + LMDB (synced)
                    await store.put_chunks(tokens[: (j + 1) * bs], {j: kv})
                    write.append(time.perf_counter() - t)
            finally:
                loop.stop()
            out["handoff"] = statistics.median(handoff)
            out["copy_out"], out["write"] = statistics.median(copy), statistics.median(write)
        async with StateStore.open(path, spec, chunk_tokens=bs, lmdb_map_size=4 << 30) as store:
            for name in ("load_lmdb", "load_host"):  # a new process reads LMDB; then the host tier holds them
                target = engine.target([blocks + j for j in range(blocks)], 0, blocks * bs, blocks * bs)
                t = time.perf_counter()
                n = await store.load(tokens, target)
                out[name] = (time.perf_counter() - t) / blocks
                assert n == blocks * bs
                await store.flush()
            out["conversions"] = store.chunks.counters().get("layout_conversions", 0)
        return out

    canon, got = asyncio.run(run(False)), asyncio.run(run(True))
    assert got["conversions"] == 0, "native chunks into their own layout are not converted"
    # ExampleConnector's path: one safetensors file per layer per request, read back per layer
    saves, loads = [], []
    for j in range(blocks):
        t = time.perf_counter()
        for layer in range(layers):
            save_file({"kv": caches[layer][j].contiguous()}, str(tmp / f"ex-{j}-{layer}.safetensors"))
        saves.append(time.perf_counter() - t)
    for j in range(blocks):
        t = time.perf_counter()
        for layer in range(layers):
            caches[layer][blocks + j].copy_(load_file(str(tmp / f"ex-{j}-{layer}.safetensors"))["kv"])
        loads.append(time.perf_counter() - t)
    ex_store, ex_load = statistics.median(saves), statistics.median(loads)
    src = torch.empty(block_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = []
    for _ in range(9):
        t = time.perf_counter()
        dst.copy_(src)
        best.append(time.perf_counter() - t)
    memcpy = statistics.median(best)

    def cell(sec: float) -> str:
        return f"{1000 * sec:.1f} ms ({block_bytes / sec / 1e9:.2f} GB/s)"

    return [
        (
            f"Block: {bs} tokens x 32 layers x 8 KV heads x 128 dim, bf16 = {block_bytes / 2**20:.0f} MiB;"
            f" {blocks} blocks; memcpy of one block in this run: {cell(memcpy)}."
        ),
        "",
        "| per block | agentstate, native layout (default) | agentstate, canonical chunks |"
        " ExampleConnector (safetensors file per layer) |",
        "|---|---|---|---|",
        f"| store: on the step (agentstate: the job handed to its loop, no copy) | {1e6 * got['handoff']:.0f} us"
        f" | {1e6 * canon['handoff']:.0f} us | {cell(ex_store)} (all on the step) |",
        f"| store: behind, out of the blocks | {cell(got['copy_out'])} | {cell(canon['copy_out'])} | |",
        f"| store: behind, encode + host + LMDB (synced) | {cell(got['write'])} | {cell(canon['write'])} | |",
        f"| load into the blocks, from LMDB | {cell(got['load_lmdb'])} | {cell(canon['load_lmdb'])} | {cell(ex_load)} |",
        f"| load into the blocks, from the host tier | {cell(got['load_host'])} | {cell(canon['load_host'])} | |",
        "",
        f"Loads, ExampleConnector / agentstate native: {ex_load / got['load_lmdb']:.2f}x from LMDB,"
        f" {ex_load / got['load_host']:.2f}x from the host tier (goal: 3x); native / memcpy of a block:"
        f" {got['load_host'] / memcpy:.2f}x.",
    ]


def main() -> None:
    quick = "--quick" in sys.argv
    if "--blocks-only" in sys.argv:  # part 2 alone (no engine): printed, for the per-block table in place
        with tempfile.TemporaryDirectory() as d:
            print("\n".join(part2(Path(d), 4 if quick else 16)))
        return
    sizes = [1024, 2048] if quick else [1024, 2048, 4096, 8192]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows1 = part1(tmp, sizes, 2 if quick else 3)
        rows2 = part2(tmp, 4 if quick else 16)
    intro = (
        f"CPU engine, vllm-cpu 0.32.0, tiny random-weight Llama (2 layers), float32, {os.cpu_count()} cores. "
        "Returning turn: the stored context plus 64 new tokens, one output token (median end-to-end = TTFT)."
    )
    text = "\n".join(["", "## vLLM connector (benchmarks/bench_vllm.py)", "", intro, "", *rows1, "", *rows2, ""])
    print(text)
    with open(ROOT / "docs" / "benchmarks.md", "a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
