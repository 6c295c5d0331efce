"""SGLang HiCache with agentstate as L3, against SGLang's own HiCacheFile and against recomputing (not a test).

`python benchmarks/bench_sglang.py [--quick]` (the venv that has requirements-sglang-server.txt, a C++
compiler and OpenSSL headers, as for tests/test_sglang_server.py). Appends its section to
docs/benchmarks.md, replacing an earlier one.

A real SGLang server on CPU (tests/sglang_server.py), a random-weight Qwen2 big enough that prefill
costs (8 layers, hidden 512, 4 KV heads x 64, float32), page size 16, device pool 4096 tokens and a
host pool of twice that. Agents share a 256-token system prompt, each has its own 1024-token
document, and they take turns round robin: each turn sends the whole context so far plus 96 new
tokens (a tool result, the user's next message) and generates one token (so end-to-end = TTFT).
The working set outgrows the host pool after a few agents, so a returning agent's context comes
from L3 or is recomputed. The same workload, in the same run, with three L3 settings:

- agentstate: `AgentStateStorage` (host tier + LMDB, every page checksummed and bound to its key);
- HiCacheFile: SGLang's own file backend (no checksum);
- none: no L3 (what the device and host pools keep, the rest recomputed).

Reported per setting: storage hit rate of returning turns (storage tokens / prompt tokens), TTFT
p50/p99 of returning turns, and the cost of loading a page: each agent's last context is sent twice
after a /flush_cache (first from L3, then from the device pool), and (TTFT from L3 - TTFT from device)
/ pages read from L3.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.sglang_server import SGLangServer, build_native_hash, make_model  # noqa: E402

PAGE = 16
SYSTEM = 256
DOC = 1024
STEP = 96
START, END = "<!-- bench_sglang:start -->", "<!-- bench_sglang:end -->"


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run(storage: str | None, model: str, ext: Path, work: Path, agents: int, turns: int) -> dict[str, Any]:
    extra = {"lmdb_map_size": 8 << 30, "host_capacity_bytes": 2 << 30} if storage == "agentstate" else {}
    server = SGLangServer(model, work / f"server-{storage}", data_dir=work / f"data-{storage}", extensions_dir=ext,
                          page_size=PAGE, storage=storage, extra=extra, prefetch_threshold=PAGE,
                          prefetch_policy=None)  # SGLang's default (timeout), as deployed  # fmt: skip
    system = toks(SYSTEM, 1)
    contexts = [system + toks(DOC, 100 + a) for a in range(agents)]
    returning: list[dict[str, float]] = []
    with server:
        for turn in range(turns):
            for a in range(agents):
                prompt = contexts[a] + toks(STEP, 1000 * turn + a)
                t = time.perf_counter()
                out = server.generate(prompt, 1, return_logprob=False)
                ttft = time.perf_counter() - t
                details = out["meta_info"].get("cached_tokens_details") or {}
                if turn:
                    returning.append({"ttft": ttft, "prompt": len(prompt), "storage": details.get("storage", 0),
                                      "device": details.get("device", 0), "host": details.get("host", 0)})  # fmt: skip
                contexts[a] = prompt + out["output_ids"]
        per_page: list[float] = []
        if storage is not None:
            time.sleep(2)  # let the last write-backs land
            for a in range(agents):
                server.flush_cache()
                prompt = contexts[a] + toks(STEP, 99_999 + a)
                t = time.perf_counter()
                first = server.generate(prompt, 1, return_logprob=False)
                from_l3 = time.perf_counter() - t
                t = time.perf_counter()
                server.generate(prompt, 1, return_logprob=False)
                from_device = time.perf_counter() - t
                pages = (first["meta_info"].get("cached_tokens_details") or {}).get("storage", 0) // PAGE
                if pages:
                    per_page.append((from_l3 - from_device) / pages)
    return {"returning": returning, "per_page": per_page, "startup_s": server.startup_s}


def main() -> None:
    quick = "--quick" in sys.argv
    agents, turns = (4, 3) if quick else (8, 4)
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        model = make_model(work / "model", layers=8, hidden=512, heads=8, kv_heads=4)
        ext = build_native_hash(work / "torch-extensions")
        results = {name: run(name, model, ext, work, agents, turns) for name in ("agentstate", "file", None)}
    names = {"agentstate": "agentstate", "file": "HiCacheFile", None: "none (recompute)"}
    rows = ["| L3 | storage hit rate | TTFT p50 | TTFT p99 | load per page |", "|---|---:|---:|---:|---:|"]
    for key, r in results.items():
        ret = r["returning"]
        rate = sum(x["storage"] for x in ret) / sum(x["prompt"] for x in ret)
        ttfts = [x["ttft"] for x in ret]
        page = f"{1e3 * statistics.median(r['per_page']):.2f} ms" if r["per_page"] else "-"
        rows.append(f"| {names[key]} | {100 * rate:.0f}% | {1e3 * pct(ttfts, 0.5):.0f} ms | {1e3 * pct(ttfts, 0.99):.0f} ms"
                    f" | {page} |")  # fmt: skip
    ours = statistics.median(x["ttft"] for x in results["agentstate"]["returning"])
    peer = statistics.median(x["ttft"] for x in results["file"]["returning"])
    base = statistics.median(x["ttft"] for x in results[None]["returning"])
    text = "\n".join([
        START, "", "## SGLang HiCache L3 (benchmarks/bench_sglang.py)", "",
        f"Real SGLang server on CPU, random-weight Qwen2 (8 layers, hidden 512, 4 KV heads x 64, float32), page {PAGE},"
        f" device pool 4096 tokens, host pool 8192; {agents} agents x {turns} turns round robin, a {SYSTEM}-token shared"
        f" system prompt, {DOC}-token documents, {STEP} new tokens a turn; returning turns: {len(results[None]['returning'])}.",
        "", *rows, "",
        f"Returning-turn TTFT p50: agentstate / HiCacheFile = {ours / peer:.2f}x, agentstate / recompute = {ours / base:.2f}x.",
        "", f"Command: `python benchmarks/bench_sglang.py` on a quiet machine ({time.strftime('%Y-%m-%d', time.gmtime())},"
        " 2 cores, SGLang's default prefetch policy `timeout` for both L3s; agentstate verifies every page's"
        " checksum and key on read, HiCacheFile nothing). Load per page: (TTFT of a context read back from L3"
        " after /flush_cache - the same from the device pool) / pages read.", "", END,
    ])  # fmt: skip
    print(text)
    doc = ROOT / "docs" / "benchmarks.md"
    current = doc.read_text()
    if START in current and END in current:
        current = current[: current.index(START)] + text + current[current.index(END) + len(END) :]
    else:
        current = current.rstrip("\n") + "\n\n" + text + "\n"
    doc.write_text(current)


if __name__ == "__main__":
    main()
