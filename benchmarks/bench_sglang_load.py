"""SGLang HiCache under CPU contention: agentstate as L3 against SGLang's HiCacheFile, beside a CPU hog (not a test).

`python benchmarks/bench_sglang_load.py [--hogs 2] [--reps 2] [--output 256] [--quick]` (the venv of
tests/test_sglang_server.py). Appends its section to docs/benchmarks.md, replacing an earlier one.

The workload of SGLang's own multi-turn benchmark (benchmark/hicache/bench_multiturn.py), written here
as a small client: `--clients` agents at once, each `--rounds` rounds; a round sends the agent's whole
history plus `--request` new tokens and streams `--output` generated tokens (TTFT = first streamed
chunk). Every client is in flight at once, so prefills, decodes, prefetches from L3 and write-backs to
L3 overlap in one server. The device pool holds 4096 tokens and the host pool twice that; the working
set (clients x rounds x (request + output)) outgrows both after the first round, so returning rounds
read from L3 or recompute.

`--hogs N` starts N busy-loop processes (`while True: pass`) before each server and stops them after:
on a 2-core machine two hogs take about half of each core from the server. Runs alternate between
the two L3s (agentstate, file, agentstate, file, ...) so that drift in the machine hits both alike.
Reported per L3: TTFT p50/p90 of all rounds and of returning rounds (2+), requests/s, storage hit
tokens, and each round's p50 over the first round's (storage hits should make returning rounds
cheaper, not dearer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_sglang import pct, toks  # noqa: E402  (the same tokens and percentiles as the sequential benchmark)
from doc_section import write_section  # noqa: E402

from tests.sglang_server import SGLangServer, _group_members, build_native_hash, make_model  # noqa: E402

PAGE = 16
START, END = "<!-- bench_sglang_load:start -->", "<!-- bench_sglang_load:end -->"
NAMES = {"agentstate": "agentstate", "agentstate-lmdb": "agentstate (LMDB only)",
         "agentstate-wb": "agentstate (write_back: LMDB on eviction)", "file": "HiCacheFile"}
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {  # name: (SGLangServer storage, extra config)
    "agentstate": ("agentstate", {"lmdb_map_size": 8 << 30, "host_capacity_bytes": 2 << 30}),
    "agentstate-lmdb": ("agentstate", {"lmdb_map_size": 8 << 30, "tiers": [{"kind": "lmdb"}]}),
    "agentstate-wb": ("agentstate", {"lmdb_map_size": 8 << 30, "host_capacity_bytes": 2 << 30,
                                     "write_policy": "write_back"}),
    "file": ("file", {}),
}
MODELS = {  # tiny: compute is cheap, so what L3 calls cost shows; bench: the 8-layer model of bench_sglang.py
    "tiny": {"layers": 2, "hidden": 128, "heads": 2, "kv_heads": 2},
    "bench": {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4},
}


def stream(url: str, input_ids: list[int], output: int, timeout: float = 900) -> dict[str, Any]:
    """One streamed greedy /generate: TTFT, end-to-end time, the generated ids, cached token details."""
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": output, "ignore_eos": True}}  # fmt: skip
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    t0 = time.perf_counter()
    ttft, last = None, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(line[5:])
    if ttft is None or last is None:
        raise RuntimeError("the stream ended without a chunk")
    ids = list(last["output_ids"])
    details = last["meta_info"].get("cached_tokens_details") or {}
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "ids": ids, "storage": details.get("storage", 0),
            "cached": last["meta_info"].get("cached_tokens", 0), "prompt": len(input_ids)}  # fmt: skip


def client(url: str, c: int, args: argparse.Namespace, out: list[dict[str, Any]], errors: list[str]) -> None:
    history: list[int] = []
    for r in range(args.rounds):
        prompt = history + toks(args.request, 10_000 * c + r)
        try:
            res = stream(url, prompt, args.output)
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            errors.append(f"client {c} round {r}: {exc!r}")
            return
        res["round"] = r
        out.append(res)
        history = prompt + res["ids"][: args.output]


def cpu_seconds(pids: list[str]) -> float:
    """user + system CPU seconds of these processes (children reaped: none here, they live until stop)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def run(name: str, model: str, ext: Path, work: Path, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    storage, extra = SETTINGS[name]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        server = SGLangServer(model, work / f"server-{name}-{rep}", data_dir=work / f"data-{name}-{rep}",
                              extensions_dir=ext, page_size=PAGE, storage=storage, extra=extra,
                              prefetch_threshold=PAGE, prefetch_policy=None,  # SGLang's default: timeout
                              args=["--max-total-tokens", str(args.device_tokens)])  # fmt: skip
        results: list[dict[str, Any]] = []
        errors: list[str] = []
        with server:
            assert server.proc is not None
            group = _group_members(server.proc.pid)
            cpu0 = cpu_seconds(group)
            t0 = time.perf_counter()
            threads = [threading.Thread(target=client, args=(server.url, c, args, results, errors))
                       for c in range(args.clients)]  # fmt: skip
            for t in threads:
                t.start()
                time.sleep(args.stagger)
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            cpu = cpu_seconds(group) - cpu0
            metrics = server.metrics()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    return {"results": results, "errors": errors, "wall": wall, "cpu": cpu,
            "metrics": {k: v for k, v in metrics.items() if any(w in k for w in ("prefetch", "backup", "storage"))}}


def summary(runs: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    res = [x for r in runs for x in r["results"]]
    later = [x["ttft"] for x in res if x["round"] > 0]
    per_round = [statistics.median([x["ttft"] for x in res if x["round"] == k]) for k in range(rounds)]
    returning = [x for x in res if x["round"] > 0]
    return {
        "p50": pct([x["ttft"] for x in res], 0.5), "p90": pct([x["ttft"] for x in res], 0.9),
        "ret_p50": pct(later, 0.5), "ret_p90": pct(later, 0.9),
        "rps": sum(len(r["results"]) for r in runs) / sum(r["wall"] for r in runs),
        "storage": sum(x["storage"] for x in returning) / max(1, sum(x["prompt"] for x in returning)),
        "cached": sum(x["cached"] for x in returning) / max(1, sum(x["prompt"] for x in returning)),
        "rounds": [p / per_round[0] for p in per_round],
        "cpu_per_req": sum(r["cpu"] for r in runs) / max(1, sum(len(r["results"]) for r in runs)),
        "errors": sum(len(r["errors"]) for r in runs), "cut": sum(r["metrics"].get("storage_prefetch_unfulfilled_tokens_total", 0) for r in runs),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--request", type=int, default=256)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--device-tokens", type=int, default=2048, help="device pool tokens (the host pool: twice)")
    ap.add_argument("--model", choices=sorted(MODELS), default="bench")
    ap.add_argument("--stagger", type=float, default=0.5, help="seconds between client starts")
    ap.add_argument("--only", choices=sorted(NAMES), action="append", help="run only this L3 (repeatable)")
    ap.add_argument("--quick", action="store_true", help="6 clients x 3 rounds, 1 rep")
    ap.add_argument("--no-doc", action="store_true", help="print, do not write docs/benchmarks.md")
    args = ap.parse_args()
    if args.quick:
        args.clients, args.rounds, args.reps = 6, 3, 1
    names = args.only or ["agentstate", "file"]
    t_start = time.time()
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        model = make_model(work / "model", **MODELS[args.model])
        ext = build_native_hash(work / "torch-extensions")
        for rep in range(args.reps):
            for name in names:
                r = run(name, model, ext, work, args, rep)
                runs[name].append(r)
                s = summary([r], args.rounds)
                print(f"rep {rep} {name}: p50 {s['p50']:.2f} s p90 {s['p90']:.2f} s returning p50 {s['ret_p50']:.2f}"
                      f" p90 {s['ret_p90']:.2f} rps {s['rps']:.2f} storage {100 * s['storage']:.0f}% cached {100 * s['cached']:.0f}% rounds "
                      + " ".join(f"{x:.2f}" for x in s["rounds"]) + f" cpu/req {s['cpu_per_req']:.2f} s errors {s['errors']} prefetch cut {s['cut']:.0f}",
                      flush=True)  # fmt: skip
                print("   ", {k: round(v, 3) for k, v in r["metrics"].items()}, flush=True)
    sums = {n: summary(rs, args.rounds) for n, rs in runs.items()}
    m = MODELS[args.model]
    rows = ["| L3 | TTFT p50 | TTFT p90 | returning p50 | returning p90 | requests/s | server CPU s / request |"
            " storage hits (returning) | prefetched tokens cut short | rounds' p50 / round 1 | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]  # fmt: skip
    for n, s in sums.items():
        rows.append(f"| {NAMES[n]} | {s['p50']:.2f} s | {s['p90']:.2f} s | {s['ret_p50']:.2f} s | {s['ret_p90']:.2f} s"
                    f" | {s['rps']:.2f} | {s['cpu_per_req']:.2f} | {100 * s['storage']:.0f}% | {s['cut']:.0f} | "
                    + " / ".join(f"{x:.2f}" for x in s["rounds"]) + f" | {s['errors']} |")  # fmt: skip
    lines = [START, "", "## SGLang HiCache under CPU contention (benchmarks/bench_sglang_load.py)", "",
             f"A real SGLang server on CPU (random-weight Qwen2, {m['layers']} layers, hidden {m['hidden']},"
             f" {m['kv_heads']} KV heads, float32, page {PAGE}, device pool {args.device_tokens} tokens, host pool"
             f" {2 * args.device_tokens}) beside {args.hogs} busy-loop processes; {args.clients} clients x {args.rounds}"
             f" rounds in flight at once, {args.request} new tokens and {args.output} generated per round (working set"
             f" {args.clients * args.rounds * (args.request + args.output)} tokens); {args.reps} run(s) per L3,"
             " alternating; SGLang's default prefetch policy (timeout). TTFT of every request; returning: rounds 2+.",
             "", *rows, ""]  # fmt: skip
    if "agentstate" in sums and "file" in sums:
        a, f = sums["agentstate"], sums["file"]
        pairs = [(summary([x], args.rounds), summary([y], args.rounds)) for x, y in zip(runs["agentstate"], runs["file"])]
        lines.append(f"agentstate / HiCacheFile, all runs pooled: TTFT p50 {a['p50'] / f['p50']:.2f}x, p90"
                     f" {a['p90'] / f['p90']:.2f}x; returning p50 {a['ret_p50'] / f['ret_p50']:.2f}x, p90"
                     f" {a['ret_p90'] / f['ret_p90']:.2f}x; throughput {a['rps'] / f['rps']:.2f}x (goal: p50 and p90"
                     " within 1.1x). Run by run (p50, p90): "
                     + "; ".join(f"{x['p50'] / y['p50']:.2f}x, {x['p90'] / y['p90']:.2f}x" for x, y in pairs) + ".")  # fmt: skip
        lines.append("")
    cmd = " ".join(["python benchmarks/bench_sglang_load.py", *sys.argv[1:]])
    lines += [f"Command: `{cmd}` ({time.strftime('%Y-%m-%d', time.gmtime())}, {os.cpu_count()} cores,"
              f" {time.time() - t_start:.0f} s).", "", END]  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if args.no_doc:
        return
    write_section(ROOT / "docs" / "benchmarks.md", START, END, text)


if __name__ == "__main__":
    main()
