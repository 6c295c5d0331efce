"""What one SGLang L3 call costs, quiet and beside a CPU hog: agentstate's adapter against HiCacheFile (not a test).

    python benchmarks/bench_sglang_calls.py [--pages 64] [--calls 200] [--hogs 0 2] [--no-write]

SGLang's cache controller calls its L3 from three threads of the scheduler process (prefetch query,
prefetch IO, backup), one batch at a time, while the scheduler's main thread runs the model. On a
busy machine each call's latency is what a request waits for (a prefetch that runs past SGLang's
timeout is cut short and its tokens recomputed; a slow backup holds host-pool pages). This replays
those calls from one thread against SGLang's real host pool (tests/sglang_launch.py's CPU stand-ins),
with a "scheduler" thread beside them in the same process (torch matmuls and Python work, as a
model's forward does: it competes for the GIL and the cores), and `--hogs` busy-loop processes.

Per call and setting: latency p50/p90 over `--calls` calls of `--pages` pages (tiny model pages:
2 layers x 2 KV heads x 64 dim, float32, 16 tokens: 32 KiB). Calls: `batch_exists` (all present),
`get` (agentstate `batch_get_v1` zero-copy from its host tier; HiCacheFile the controller's generic
path: fresh dummy pages, `batch_get`, copy into the slot), `set` (new pages; agentstate `batch_set_v1`,
HiCacheFile `batch_set` of flat pages).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from doc_section import write_section  # noqa: E402
import tests.sglang_launch  # noqa: F401, I001  (SGLang's CPU stand-ins, before any SGLang import)
from bench_sglang_pages import storage_config  # noqa: I001
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

LAYERS, HEADS, DIM, PAGE = 2, 2, 64, 16
MODEL = "bench/tiny"
BEGIN = "<!-- bench_sglang_calls:begin -->"
END = "<!-- bench_sglang_calls:end -->"


def host_pool(pages: int) -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(size=4 * PAGE, page_size=PAGE, dtype=torch.float32, head_num=HEADS, head_dim=DIM,
                              layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False)  # fmt: skip
    host = MHATokenToKVPoolHost(device._mha_buffer_info(), host_to_device_ratio=1.0, host_size=0, page_size=PAGE,
                                layout="layer_first", pin_memory=False, device="cpu", device_capacity_tokens=4 * PAGE,
                                start_layer=0, end_layer=LAYERS, host_token_capacity=pages * PAGE)  # fmt: skip
    host.kv_buffer.view(torch.uint8).copy_(torch.randint(0, 256, host.kv_buffer.view(torch.uint8).shape,
                                                         dtype=torch.uint8))  # fmt: skip
    return host


class Scheduler:
    """A thread that works like a model's forward: small torch ops and Python between them."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.steps = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        a = torch.randn(256, 256)
        while not self.stop.is_set():
            b = a
            for _ in range(8):
                b = torch.tanh(b @ a) * 0.5
            sum(i * i for i in range(2000))  # Python between kernels: holds the GIL
            self.steps += 1

    def __enter__(self) -> Scheduler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def lat(fn: Callable[[int], object], calls: int) -> list[float]:
    out = []
    for i in range(calls):
        t = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t)
    return out


def pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def measure(root: Path, pages: int, calls: int) -> dict[str, dict[str, list[float]]]:
    host = host_pool(pages * 2)
    slots = torch.arange(pages * PAGE, dtype=torch.int64)
    out: dict[str, dict[str, list[float]]] = {}
    # agentstate: host tier over LMDB, as SGLang runs it
    extra = {"backend_name": "agentstate", "module_path": "agentstate.adapters.sglang",
             "class_name": "AgentStateStorage", "interface_v1": 1, "path": str(root / "agentstate"),
             "lmdb_map_size": 4 << 30, "host_capacity_bytes": 2 << 30}  # fmt: skip
    ours = StorageBackendFactory.create_backend("dynamic", storage_config(extra, model=MODEL, page_first=False), host)
    try:
        ours.register_mem_pool_host(host)
        base = [f"{i:064x}" for i in range(pages)]
        assert all(ours.batch_set_v1(base, slots))
        res: dict[str, list[float]] = {}
        res["exists"] = lat(lambda i: ours.batch_exists(base), calls)
        res["get"] = lat(lambda i: ours.batch_get_v1(base, slots), calls)
        res["set"] = lat(lambda i: ours.batch_set_v1([f"{i + 1:08x}{j:056x}" for j in range(pages)], slots), calls)
        out["agentstate"] = res
    finally:
        ours.close()
    from peer_hicache import make_backend

    peer = make_backend(str(root / "hicache"))
    flat = [host.get_data_page(j * PAGE) for j in range(pages)]
    assert peer.batch_set(base, flat)

    def peer_get(i: int) -> None:
        dummies = [host.get_dummy_flat_data_page() for _ in range(pages)]
        got = peer.batch_get(base, dummies)
        for j, page in enumerate(got):
            host.set_from_flat_data_page(int(slots[j * PAGE]), page)

    res = {}
    res["exists"] = lat(lambda i: peer.batch_exists(base), calls)
    res["get"] = lat(peer_get, calls)
    res["set"] = lat(lambda i: peer.batch_set([f"{i + 1:08x}{j:056x}" for j in range(pages)], flat), calls)
    out["HiCacheFile"] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--hogs", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    rows = ["| hogs | call | agentstate p50 | HiCacheFile p50 | ratio | agentstate p90 | HiCacheFile p90 | ratio |",
            "|---:|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for hogs in args.hogs:
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
        try:
            with tempfile.TemporaryDirectory() as d, Scheduler():
                res = measure(Path(d), args.pages, args.calls)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        for call in ("exists", "get", "set"):
            a, f = res["agentstate"][call], res["HiCacheFile"][call]
            rows.append(f"| {hogs} | {call} | {1e3 * pct(a, .5):.2f} ms | {1e3 * pct(f, .5):.2f} ms | "
                        f"{pct(a, .5) / pct(f, .5):.2f}x | {1e3 * pct(a, .9):.2f} ms | {1e3 * pct(f, .9):.2f} ms | "
                        f"{pct(a, .9) / pct(f, .9):.2f}x |")  # fmt: skip
            print(rows[-1], flush=True)
    cmd = "python benchmarks/bench_sglang_calls.py " + " ".join(sys.argv[1:])
    text = "\n".join([
        BEGIN,
        "## One SGLang L3 call, quiet and beside a CPU hog (benchmarks/bench_sglang_calls.py)", "",
        f"Command: `{cmd.strip()}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, {time.time() - t0:.0f} s)."
        f" {args.calls} calls of {args.pages} pages ({PAGE} tokens, {LAYERS} layers x {HEADS} KV heads x {DIM} dim,"
        " float32: 32 KiB a page) from one thread, as SGLang's controller threads call, beside a thread doing"
        " model-like work (torch matmuls and Python) in the same process and `hogs` busy-loop processes.", "",
        *rows, END,
    ])  # fmt: skip
    print(text)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", BEGIN, END, text)


if __name__ == "__main__":
    main()
