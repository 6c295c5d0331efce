"""How fast a Python client can SET large values into one redis-server on this machine (not a test).

    python benchmarks/redis_set_ceiling.py [--value-mib 2] [--values 256] [--clients 1 8]

The ceiling for the Redis tier's snapshot writes (docs/benchmarks.md, bench_remote), measured on a
redis-server of its own on loopback, the same values and clients, in one run:

- redis-py: asyncio pipelines of 4 SETs (the tier's write path), values passed as memoryviews;
- sock_sendall: a raw socket per client, each SET's header, the value's own memory and its CRLF
  handed to `loop.sock_sendall` (no copy in Python), replies read after each 4;
- agentstate: the tier's own writer (`backends/redis_writes.py`: batches of 4 SETs per client,
  scatter-gathered with `sendmsg` from the values' memory), one connection per client;
- redis-benchmark: redis's own C client (`-t set -d <value> -c <clients>`).

The values are prepared before timing (no encode, no checksum): what is left is the client's send
path and redis-server taking the bytes in, which on two cores share the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


async def redis_py(url: str, values: list[bytearray], count: int, clients: int) -> float:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, socket_read_size=1 << 20)

    async def run(part: list[int]) -> None:
        for i in range(0, len(part), 4):
            pipe = client.pipeline(transaction=False)
            for k in part[i : i + 4]:
                pipe.set(f"k{k}", memoryview(values[k % len(values)]))
            await pipe.execute()

    t = time.perf_counter()
    await asyncio.gather(*(run(list(range(j, count, clients))) for j in range(clients)))
    took = time.perf_counter() - t
    await client.flushall()
    await client.aclose()
    return count * len(values[0]) / 1e9 / took


async def sock_sendall(port: int, values: list[bytearray], count: int, clients: int) -> float:
    loop = asyncio.get_running_loop()
    socks = []
    for _ in range(clients):
        s = socket.create_connection(("127.0.0.1", port))
        s.setblocking(False)
        socks.append(s)
    size = len(values[0])

    async def run(s: socket.socket, part: list[int]) -> None:
        buf = bytearray(4096)
        for i in range(0, len(part), 4):
            batch = part[i : i + 4]
            for k in batch:
                key = f"k{k}".encode()
                await loop.sock_sendall(s, b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size))
                await loop.sock_sendall(s, memoryview(values[k % len(values)]))
                await loop.sock_sendall(s, b"\r\n")
            got = b""
            while got.count(b"\r\n") < len(batch):
                n = await loop.sock_recv_into(s, buf)
                if not n:
                    raise ConnectionError("redis closed the connection")
                got += bytes(buf[:n])
            if got != b"+OK\r\n" * len(batch):
                raise RuntimeError(f"unexpected replies {got[:80]!r}")

    t = time.perf_counter()
    await asyncio.gather(*(run(socks[j], list(range(j, count, clients))) for j in range(clients)))
    took = time.perf_counter() - t
    for s in socks:
        s.close()
    return count * size / 1e9 / took


async def agentstate_writer(port: int, values: list[bytearray], count: int, clients: int) -> float:
    from agentstate.backends.redis_wire import WireConfig
    from agentstate.backends.redis_writes import Item, NodeWriters

    pool = NodeWriters(WireConfig("127.0.0.1", port), clients)

    async def run(part: list[int]) -> None:
        for i in range(0, len(part), 4):
            items = [Item(f"k{k}".encode(), memoryview(values[k % len(values)])) for k in part[i : i + 4]]
            got = await pool.put(items, None, timeout=60, retries=0)
            if any(g is not None for g in got):
                raise RuntimeError(f"a SET failed: {got}")

    t = time.perf_counter()
    await asyncio.gather(*(run(list(range(j, count, clients))) for j in range(clients)))
    took = time.perf_counter() - t
    pool.close()
    return count * len(values[0]) / 1e9 / took


def redis_benchmark(port: int, size: int, count: int, clients: int) -> float:
    out = subprocess.run(
        ["redis-benchmark", "-p", str(port), "-t", "set", "-d", str(size), "-n", str(count), "-c", str(clients), "--csv"],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout  # fmt: skip
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells[0] == "SET":
            return float(cells[1]) * size / 1e9
    raise RuntimeError(f"no SET line in redis-benchmark's output: {out[:200]!r}")


async def main() -> None:
    from tests.redis_server import RedisServer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--value-mib", type=float, default=2.0)
    ap.add_argument("--values", type=int, default=256, help="SETs per client count and method")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    size = int(args.value_mib * 2**20)
    values = [bytearray(os.urandom(1024) * (size // 1024)) for _ in range(4)]
    server = RedisServer(Path(tempfile.mkdtemp(prefix="redis_set_ceiling_"))).start()
    try:
        print("| clients | redis-py GB/s | sock_sendall GB/s | agentstate writer GB/s | redis-benchmark GB/s "
              "| redis-py / redis-benchmark | agentstate / redis-benchmark |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for clients in args.clients:
            ours = await redis_py(server.url, values, args.values, clients)
            raw = await sock_sendall(server.port, values, args.values, clients)
            mine = await agentstate_writer(server.port, values, args.values, clients)
            import redis.asyncio as aioredis

            admin = aioredis.Redis.from_url(server.url)
            await admin.flushall()
            await admin.aclose()
            peer = redis_benchmark(server.port, size, args.values, clients)
            print(f"| {clients} | {ours:.2f} | {raw:.2f} | {mine:.2f} | {peer:.2f} | {ours / peer:.2f} "
                  f"| {mine / peer:.2f} |", flush=True)  # fmt: skip
    finally:
        server.stop()


if __name__ == "__main__":
    asyncio.run(main())
