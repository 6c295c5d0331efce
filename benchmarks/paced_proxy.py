"""A TCP proxy that paces each direction to a link's bandwidth and one-way latency: a store on
loopback made to answer like one across a network (benchmarks/bench_frameworks.py --lower remote).

Each direction is its own link (full duplex): bytes read from one side are delivered to the other
no sooner than `latency` after they arrived and no faster than `rate` bytes per second, in order.

    python benchmarks/paced_proxy.py LISTEN_PORT TARGET_PORT --mbps 200 --latency-ms 0.25
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rate: float, latency: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

    async def deliver() -> None:
        free = 0.0  # when the link is next free
        while (item := await queue.get()) is not None:
            arrived, data = item
            free = max(free, arrived + latency) + len(data) / rate
            delay = free - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(deliver())
    try:
        while data := await reader.read(1 << 16):
            queue.put_nowait((time.monotonic(), data))
    finally:
        queue.put_nowait(None)
        with contextlib.suppress(ConnectionError):
            await sender
        writer.close()


async def serve(listen: int, target: int, rate: float, latency: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(
            _pipe(client_r, server_w, rate, latency), _pipe(server_r, client_w, rate, latency), return_exceptions=True
        )

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("listen", type=int)
    ap.add_argument("target", type=int)
    ap.add_argument("--mbps", type=float, required=True, help="each direction's bandwidth, megabits per second")
    ap.add_argument("--latency-ms", type=float, default=0.25, help="one-way latency")
    args = ap.parse_args()
    asyncio.run(serve(args.listen, args.target, args.mbps * 1e6 / 8, args.latency_ms / 1e3))


if __name__ == "__main__":
    main()
