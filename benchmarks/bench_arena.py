"""Snapshots into the host tier: fresh memory against the arena's touched buffers (not a test).

    python benchmarks/bench_arena.py [--sessions 8] [--tokens 1024] [--rounds 3] [--reps 2] [--no-write]

Each case runs in a fresh process (as a server or an engine starts), on the default store (host tier
over LMDB, value log synced), Llama-8B-shaped bf16 KV (128 KiB a token), `--sessions` sessions of
`--tokens` tokens snapshotted one after another, `--rounds` times (new sessions each round):

- fresh: the host tier is big enough for everything: every value lands in fresh memory;
- prefault: `host_prefault_bytes` covers a round; the timing starts once the arena is filled
  (a server opens its store long before its first snapshot);
- steady: the host tier holds one round: from round 2 on every snapshot evicts the previous
  round's chunks and their buffers are reused (the default arena: `host_arena_bytes` 1 GiB).

Ceilings from the same run: a durable write of the same bytes (write + fsync of one file) and a
copy into fresh vs touched memory. GB = 1e9 bytes of KV payload. Every session's resume is
checked bit-exact after the timed rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
BEGIN, END = "<!-- bench_arena:begin -->", "<!-- bench_arena:end -->"


def case(mode: str, root: str, sessions: int, tokens: int, rounds: int) -> dict[str, object]:
    import torch

    from agentstate import StateStore, codec
    from agentstate.spec import ModelSpec

    spec = ModelSpec(model_id="bench/llama-8b-shape", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    round_bytes = sessions * tokens * spec.token_bytes
    chunk = codec.encoded_size(256 * spec.token_bytes)
    extra: dict[str, object] = {"lmdb_map_size": 4 * rounds * round_bytes}
    if mode == "prefault":
        extra["host_prefault_bytes"] = extra["host_arena_bytes"] = (round_bytes // (chunk - 64) + 1) * chunk
    if mode == "steady":
        extra["host_capacity_bytes"] = round_bytes + sessions * chunk  # one round's chunks (headers included)
    g = torch.Generator().manual_seed(0)
    kvs = [torch.randint(-30000, 30000, spec.kv_shape(tokens), generator=g, dtype=torch.int16).view(torch.bfloat16)
           for _ in range(sessions)]  # fmt: skip

    async def warm() -> dict[str, object]:
        """Sessions only LMDB holds (page cache warm), warmed into a host tier that fits two of them:
        each `resuming` hint copies one up and evicts an older one. warm-fresh: no arena (every copy
        into fresh memory); warm-arena: the default arena (copies into the evicted ones' buffers)."""
        rates = []
        async with StateStore.open(root, spec, **extra) as store:
            for i, kv in enumerate(kvs):
                await store.snapshot(f"w{i}", [i * 10_000 + j for j in range(tokens)], kv)
            await store.chunks.evict("host", budget_bytes=0)
            for _ in range(rounds):
                for i in range(len(kvs)):
                    t = time.perf_counter()
                    got = await store.hint(f"w{i}", "resuming")
                    secs = time.perf_counter() - t
                    if got.moved_bytes:
                        rates.append(got.moved_bytes / 1e9 / secs)
                    await store.hint(f"w{i}", "done")
            stats = (await store.chunks.stats())[0]
            for i, kv in enumerate(kvs):
                assert (await store.resume(f"w{i}")).kv.view(torch.int16).equal(kv.view(torch.int16)), i
        return {"gbps": rates, "reused": stats.arena_reused, "fresh": stats.arena_fresh}

    if mode.startswith("warm"):
        extra["host_capacity_bytes"] = 2 * (tokens // 256 + 1) * chunk
        if mode == "warm-fresh":
            extra["host_arena_bytes"] = 0
        return asyncio.run(warm())

    async def run() -> dict[str, object]:
        times = []
        async with StateStore.open(root, spec, **extra) as store:
            if mode == "prefault":
                host = store.chunks._manager.tiers[0].backend
                deadline = time.monotonic() + 120
                while host.arena.stats().free_bytes < extra["host_prefault_bytes"] and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            for r in range(rounds):
                t = time.perf_counter()
                for i, kv in enumerate(kvs):
                    toks = [r * 1_000_000 + i * 10_000 + j for j in range(tokens)]  # new sessions: nothing dedupes
                    await store.snapshot(f"r{r}-s{i}", toks, kv)
                times.append(time.perf_counter() - t)
            stats = (await store.chunks.stats())[0]
            for r in range(rounds):
                for i, kv in enumerate(kvs):
                    got = await store.resume(f"r{r}-s{i}")
                    assert got.kv.view(torch.int16).equal(kv.view(torch.int16)), (r, i)
        return {"gbps": [round_bytes / 1e9 / t for t in times], "reused": stats.arena_reused,
                "fresh": stats.arena_fresh}  # fmt: skip

    return asyncio.run(run())


def ceilings(root: str, nbytes: int) -> dict[str, float]:
    """In a process of its own, like the cases: a copy into fresh and into touched memory, and the
    best durable sequential write of `nbytes` (4 MiB pwrites then fdatasync, with and without early
    writeback as the value log does)."""
    import numpy as np
    from agentstate.backends.value_log import start_writeback

    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    t = time.perf_counter()
    dest = np.empty(nbytes, dtype=np.uint8)
    np.copyto(dest, src)
    fresh_s = time.perf_counter() - t
    t = time.perf_counter()
    np.copyto(dest, src)
    touched_s = time.perf_counter() - t
    del dest
    write_s = []
    os.makedirs(root, exist_ok=True)
    for early in (False, True):
        path = os.path.join(root, "ceiling.bin")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            t = time.perf_counter()
            for off in range(0, nbytes, 4 << 20):
                n = os.pwrite(fd, src[off : off + (4 << 20)], off)
                if early:
                    start_writeback(fd, off, n)
            os.fdatasync(fd)
            write_s.append(time.perf_counter() - t)
        finally:
            os.close(fd)
            os.unlink(path)
    return {"fresh copy": nbytes / 1e9 / fresh_s, "touched copy": nbytes / 1e9 / touched_s,
            "durable write": nbytes / 1e9 / min(write_s)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2, help="times the sequence of cases runs (figures per rep)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    nbytes = args.sessions * args.tokens * 32 * 2 * 8 * 128 * 2
    if args.case:  # the child: one case in a fresh process
        if args.case == "ceiling":
            print(json.dumps(ceilings(args.root, nbytes)))
        else:
            print(json.dumps(case(args.case, args.root, args.sessions, args.tokens, args.rounds)))
        return
    t0 = time.time()
    results: dict[str, list[dict[str, object]]] = {}
    cases = ("fresh", "prefault", "steady", "warm-fresh", "warm-arena")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        ceils = []
        for mode in ("ceiling", *cases * args.reps, "ceiling"):  # each case and its control close in time
            out = subprocess.run([sys.executable, __file__, "--case", mode, "--root", f"{d}/{mode}",
                                  "--sessions", str(args.sessions), "--tokens", str(args.tokens),
                                  "--rounds", str(args.rounds)], capture_output=True, text=True)  # fmt: skip
            shutil.rmtree(f"{d}/{mode}", ignore_errors=True)  # a case's store is GBs: one on disk at a time
            if out.returncode:
                sys.exit(f"case {mode} failed:\n{out.stderr[-4000:]}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            print(mode, got, flush=True)
            if mode == "ceiling":
                ceils.append(got)
            else:
                results.setdefault(mode, []).append(got)
    ceil = {k: max(c[k] for c in ceils) for k in ceils[0]}  # the better of the runs before and after the cases
    rows = ["| case | round 1, each rep | later rounds (median), each rep | later vs durable write (median) |"
            " buffers reused / fresh, each rep |",
            "|---|---:|---:|---:|---:|"]  # fmt: skip
    warm_rows = ["| case | warm GB/s (median of every hint that moved chunks), each rep | vs copy into touched memory |"
                 " buffers reused / fresh, each rep |", "|---|---:|---:|---:|"]  # fmt: skip
    def each(values: list[float], unit: str = "") -> str:
        return " / ".join(f"{v:.2f}{unit}" for v in values)

    for mode, reps in results.items():
        reused = "; ".join(f"{r['reused']}/{r['fresh']}" for r in reps)
        if mode.startswith("warm"):
            meds = [statistics.median(r["gbps"]) for r in reps]
            warm_rows.append(f"| {mode} | {each(meds)} | {100 * statistics.median(meds) / ceil['touched copy']:.0f}%"
                             f" | {reused} |")  # fmt: skip
            continue
        first = [r["gbps"][0] for r in reps]
        later = [statistics.median(r["gbps"][1:]) if len(r["gbps"]) > 1 else r["gbps"][0] for r in reps]
        rows.append(f"| {mode} | {each(first, ' GB/s')} | {each(later, ' GB/s')} |"
                    f" {100 * statistics.median(later) / ceil['durable write']:.0f}% | {reused} |")  # fmt: skip
    cmd = " ".join(["python benchmarks/bench_arena.py", *sys.argv[1:]])
    text = "\n".join([
        BEGIN,
        "## Snapshots into the host tier: fresh memory vs the arena (benchmarks/bench_arena.py)", "",
        f"Command: `{cmd}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, {time.time() - t0:.0f} s)."
        f" {args.sessions} sessions x {args.tokens} tokens of Llama-8B-shaped bf16 KV ({nbytes / 1e9:.2f} GB a round)"
        f" per round, {args.rounds} rounds, default store (host tier over LMDB, synced), each case in a fresh process;"
        f" the sequence of cases {args.reps} times (fresh memory's speed on this VM moves from minute to minute)."
        f" Ceilings, same run, each in a process of its own before and after the cases (the better kept): durable"
        f" sequential write of {nbytes / 1e9:.2f} GB (pwrite + fdatasync, best of plain and early writeback)"
        f" {ceil['durable write']:.2f} GB/s; copy into fresh memory {ceil['fresh copy']:.2f} GB/s, into touched"
        f" memory {ceil['touched copy']:.2f} GB/s. Per run: " + "; ".join(
            f"{c['durable write']:.2f} / {c['fresh copy']:.2f} / {c['touched copy']:.2f}" for c in ceils) + ".",
        "", *rows, "",
        f"`resuming` hints (warm: LMDB, page cache warm, into the host tier), {args.sessions} sessions in turn,"
        f" {args.rounds} passes, a host tier that holds two sessions: each warm evicts an older session.", "",
        *warm_rows, END,
    ])  # fmt: skip
    print(text)
    if not args.no_write:
        from doc_section import write_section

        write_section(REPO / "docs" / "benchmarks.md", BEGIN, END, text)


if __name__ == "__main__":
    main()
