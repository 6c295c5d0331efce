"""The demo's two prefills, with 1 and with all torch threads: why `agentstate demo` picks one
thread per idle CPU (issue 28, item 6).

A returning agent's turn prefills ~97 new tokens over a ~1.6k-token cached context; recomputing
prefills all ~1.7k. Both on the demo's model (8 layers, hidden 512, random weights). Run it quiet,
then beside `python3 -c "while True: pass"`: on a 2-CPU machine with one CPU taken, the small
prefill with 2 threads stalls in every parallel region on the thread that shares its CPU.

    python benchmarks/bench_demo_threads.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import DynamicCache

from agentstate.demo import _prefill, build_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    model = build_model(8)
    context, new = list(range(1600)), list(range(2000, 2097))
    _, cache = _prefill(model, context, DynamicCache(config=model.config))
    most = torch.get_num_threads()
    print(f"{'threads':>7} {'small p50 ms':>12} {'small max':>9} {'full p50 ms':>11} {'full max':>8}")
    for threads in (most, 1, most, 1):  # twice each, alternating: the load may change meanwhile
        torch.set_num_threads(threads)
        small, full = [], []
        for _ in range(args.rounds):
            c = copy.deepcopy(cache)
            t0 = time.perf_counter()
            _prefill(model, new, c)
            small.append(1e3 * (time.perf_counter() - t0))
        for _ in range(max(2, args.rounds // 3)):
            t0 = time.perf_counter()
            _prefill(model, context + new, DynamicCache(config=model.config))
            full.append(1e3 * (time.perf_counter() - t0))
        print(f"{threads:>7} {statistics.median(small):>12.0f} {max(small):>9.0f} "
              f"{statistics.median(full):>11.0f} {max(full):>8.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
