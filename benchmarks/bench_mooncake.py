"""Mooncake tier: put/read throughput through the registered arena against plain put/get.

    python benchmarks/bench_mooncake.py [--values 16] [--reps 5] [--in-flight 1 4]

Starts its own master and storage process on loopback (tests/mooncake_server.py), so the values
cross a process boundary over the TCP transport. 4 MiB values, calls of 4 values, 1 and 4 calls in flight:
once with a 256 MiB arena (batch_upsert_from / batch_get_into through slots), once with slots
too small for any value (plain upsert / get, staged through the client's local buffer). Prints
the best of `--reps` rounds; the sink only looks at the bytes, so decode cost is not included.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.mooncake_server import MooncakeServer

VALUE = 4 << 20
PER_CALL = 4


async def measure(backend: object, label: str, count: int, reps: int, in_flight: int) -> None:
    values = [os.urandom(VALUE) for _ in range(count)]
    keys = [f"c/{label}/{i}" for i in range(count)]
    calls = list(range(0, count, PER_CALL))
    gate = asyncio.Semaphore(in_flight)

    async def put(i: int) -> None:
        async with gate:
            await backend.put(keys[i : i + PER_CALL], values[i : i + PER_CALL])  # type: ignore[attr-defined]

    async def read(i: int) -> list[bool]:
        async with gate:
            return await backend.read(keys[i : i + PER_CALL], lambda j, v: None)  # type: ignore[attr-defined,no-any-return]

    best_put = best_read = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        await asyncio.gather(*(put(i) for i in calls))
        best_put = max(best_put, count * VALUE / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        found = await asyncio.gather(*(read(i) for i in calls))
        best_read = max(best_read, count * VALUE / (time.perf_counter() - t) / 1e9)
        assert all(all(f) for f in found), "a value went missing"
    print(f"{label:>6}, {in_flight} in flight: put {best_put:.2f} GB/s, read {best_read:.2f} GB/s")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = MooncakeServer(Path(tmp), segment_bytes=2 * args.values * VALUE + (64 << 20)).start()
        try:
            arena = server.backend(prefix="bench:", buffer_bytes=256 << 20)
            plain = server.backend(prefix="bench:", buffer_bytes=4 << 20, local_buffer_bytes=128 << 20)
            for n in args.in_flight:
                await measure(arena, "arena", args.values, args.reps, n)
                await measure(plain, "plain", args.values, args.reps, n)
            await arena.close()
            await plain.close()
        finally:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
