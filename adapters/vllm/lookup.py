"""The lookup channel between vLLM's scheduler process and the worker that owns the store (no vLLM import).

vLLM runs its scheduler (EngineCore) and its workers in different processes on CPU, and a data
directory has one writer. The worker owns the store; the scheduler sends it the chunk keys of a
prompt over a Unix socket (abstract namespace, named after the data directory, the rank and the
engine: see `socket_name`) and gets back how many leading chunks are stored. A scheduler that
cannot reach its own worker treats the prompt as a miss.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from typing import Any

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 64 << 20


def socket_name(path: str, rank: int, engine: str = "") -> str:
    """The abstract Unix socket of the worker of engine `engine` that owns data directory `path` (no
    file, gone with the process). Only a worker that opened the store (and so holds the directory's
    lock) binds it, and the engine's token is in the name: another engine's scheduler, even one on the
    same directory, never reaches it, and a scheduler whose own worker could not open the store finds
    no socket at all (a miss) rather than the worker of an older engine still holding the directory."""
    digest = hashlib.blake2b(f"{path}\0{rank}\0{engine}".encode(), digest_size=12).hexdigest()
    return f"\0agentstate-vllm-{digest}"


def _pack(obj: Any) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return _HEADER.pack(len(body)) + body


class LookupServer:
    """Answers the scheduler's questions on the worker's event loop: `handler(request) -> reply`."""

    def __init__(
        self,
        name: str,
        handler: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
        stamp: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.handler = handler
        self.stamp = dict(stamp or {})  # added to every reply: who answers (the client checks it)
        self.server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._serve, path=self.name)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns.add(task)
        try:
            while True:
                (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                if size > MAX_MESSAGE:
                    break
                request = json.loads(await reader.readexactly(size))
                try:
                    reply = await self.handler(request)
                except Exception as exc:  # noqa: BLE001 - a failed lookup is a miss, the channel stays up
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                writer.write(_pack({**reply, **self.stamp}))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            writer.close()
            self._conns.discard(task)  # type: ignore[arg-type]

    async def stop(self) -> None:
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None


class LookupClient:
    """The scheduler's side: one blocking request at a time, reconnecting after any failure."""

    def __init__(self, name: str, timeout_s: float) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """The worker's reply; raises OSError (or TimeoutError) when it cannot be reached."""
        with self._lock:
            try:
                if self._sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.settimeout(self.timeout_s)
                    sock.connect(self.name)
                    self._sock = sock
                self._sock.sendall(_pack(request))
                (size,) = _HEADER.unpack(self._recv(_HEADER.size))
                if size > MAX_MESSAGE:
                    raise OSError(f"lookup reply of {size} bytes")
                return json.loads(self._recv(size))
            except BaseException:
                self.close()
                raise

    def _recv(self, n: int) -> bytes:
        assert self._sock is not None
        chunks, got = [], 0
        while got < n:
            part = self._sock.recv(n - got)
            if not part:
                raise ConnectionError("the agentstate worker closed the lookup channel")
            chunks.append(part)
            got += len(part)
        return b"".join(chunks)

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
