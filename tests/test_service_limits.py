"""The service holds under load: against a real `agentstate serve` process (its memory measured
from /proc), a lying Content-Length allocates nothing, stalled heads and bodies are cut at their
deadlines, KV in flight stays within its byte budget (503 + Retry-After beyond it), the SDK
retries such a 503 until capacity frees, and no refused request leaves anything stored.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from agentstate import StateStore
from agentstate.client import AsyncClient
from agentstate.errors import BackendError
from agentstate.ops.admin import record_spec
from agentstate.wire import ResumeHeader, split_frame
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.ports import free_port

TOKEN = "limits-token-0123456789"
HEAD_TIMEOUT = SEND_TIMEOUT = 2.0
BODY_TIMEOUT = 4.0  # a stalled upload holds the budget this long: the window in which the SDK test is refused
GUARD_S = 60.0
"""Longest a test waits for something the server must do: a guard against a hang, not a speed."""
BUDGET = 24 << 20
BIG = 4096  # tokens: 8 MiB of SPEC4 KV, three fit in the budget


@dataclass
class Server:
    url: str
    port: int
    pid: int
    data: Path

    def rss(self) -> int:
        """Resident memory of the server process, bytes."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")


def _free_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("limits")
    data = root / "data"
    record_spec(data, SPEC4)
    (root / "tokens.json").write_text(json.dumps({TOKEN: "alice"}))
    port = _free_port()
    env = {
        **os.environ,
        "AGENTSTATE_CHUNK_TOKENS": "256",
        "AGENTSTATE_SERVICE_BODY_TIMEOUT_S": str(BODY_TIMEOUT),
        "AGENTSTATE_SERVICE_HEADER_TIMEOUT_S": str(HEAD_TIMEOUT),
        "AGENTSTATE_SERVICE_SEND_TIMEOUT_S": str(SEND_TIMEOUT),
        "AGENTSTATE_SERVICE_MAX_INFLIGHT_BYTES": str(BUDGET),
        "AGENTSTATE_SERVICE_RETRY_AFTER_S": "1",
    }
    code = (
        "import sys; from pathlib import Path; from agentstate.server.service import run; "
        "run(Path(sys.argv[1]), port=int(sys.argv[2]), tokens_file=Path(sys.argv[3]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(data), str(port), str(root / "tokens.json")],
        env=env, stdout=subprocess.DEVNULL, stderr=open(root / "server.log", "wb"),  # noqa: SIM115
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(proc, url, root), "the server answering /healthz")
        yield Server(url, port, proc.pid, data)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wait_until(ready: Callable[[], bool], what: str, guard: float = 180.0) -> None:
    """Poll `ready` until true; a loaded machine may take long (the server imports torch), a hang fails."""
    deadline = time.monotonic() + guard
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {guard:.0f} s")
        time.sleep(0.05)


async def until(ready: Callable[[], bool], what: str) -> None:
    """`wait_until` inside a test's event loop: the condition is a real server's state, polled."""
    deadline = time.monotonic() + GUARD_S
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {GUARD_S:.0f} s")
        await asyncio.sleep(0.05)


def _healthy(proc: subprocess.Popen[bytes], url: str, root: Path) -> bool:
    assert proc.poll() is None, (root / "server.log").read_text()
    try:
        return httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def client(server: Server, **kw: object) -> AsyncClient:
    return AsyncClient(server.url, TOKEN, spec=SPEC4, **kw)  # type: ignore[arg-type]


async def raw(server: Server, head: bytes, body: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(head + body)
    await writer.drain()
    return reader, writer


def upload_head(sid: str, length: int) -> bytes:
    return (
        f"POST /v1/sessions/{sid}/snapshot HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/x-agentstate-frame\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


async def answer(reader: asyncio.StreamReader, within: float) -> bytes:
    """Everything the server sends until it closes the connection (or `within` s pass: a failure)."""
    return await asyncio.wait_for(reader.read(), within)


def inflight(server: Server) -> int:
    return int(httpx.get(f"{server.url}/healthz").json()["inflight_bytes"])


async def stored(server: Server) -> list[tuple[str, int]]:
    async with client(server) as c:
        return sorted((s.session_id, s.version) for s in await c.list())


async def test_a_huge_content_length_allocates_nothing(server: Server) -> None:
    before_sessions = await stored(server)
    before = server.rss()
    conns = [await raw(server, upload_head(f"liar-{i}", 1 << 30), b"ASWF\x01\x00\x00\x00") for i in range(2)]
    await asyncio.sleep(0.5)
    grown = server.rss() - before
    print(f"RSS {before >> 20} -> {(before + grown) >> 20} MiB with two 1 GiB bodies declared, 8 bytes sent")
    assert grown < 32 << 20, f"server RSS grew {grown >> 20} MiB for two 1 GiB bodies of 8 bytes"
    replies = [await answer(r, GUARD_S) for r, _ in conns]
    statuses = sorted(int(reply.split(b" ", 2)[1]) for reply in replies)
    # one is admitted and cut at the body deadline (400), the other finds no room (503); or both time out
    assert statuses in ([400, 503], [400, 400]), replies
    for reply in replies:
        if b" 503 " in reply.split(b"\r\n", 1)[0]:
            assert b"retry-after: 1" in reply.lower() and b"overloaded" in reply
        else:
            assert b"malformed" in reply and b"incomplete after" in reply
    for _, w in conns:
        w.close()
    assert await stored(server) == before_sessions


async def test_stalled_heads_and_bodies_are_cut_at_their_deadlines(server: Server) -> None:
    """Each stalled connection is cut (a server without the deadlines would hold them past GUARD_S);
    the body's answer names the deadline that cut it. No stopwatch: a loaded machine answers late."""
    head, _ = await raw(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # no token needed to stall a head
    idle, _ = await raw(server, b"")  # says nothing at all
    body, _ = await raw(server, upload_head("stalled", 1000), b"ASWF\x01\x00\x00\x00")
    assert await answer(head, GUARD_S) == b""  # closed
    assert await answer(idle, GUARD_S) == b""
    reply = await answer(body, GUARD_S)
    assert reply.startswith(b"HTTP/1.1 400") and f"incomplete after {BODY_TIMEOUT:g} s".encode() in reply, reply
    assert "stalled" not in dict(await stored(server))

    async with httpx.AsyncClient(base_url=server.url) as c:  # keep-alive connections still serve
        assert (await c.get("/healthz")).status_code == 200


async def test_resumes_past_the_budget_get_503_and_memory_stays_bounded(server: Server) -> None:
    tokens, kv = random_tokens(BIG, seed=1), random_kv(SPEC4, BIG, seed=1)
    async with client(server) as c:
        await c.snapshot("big", tokens, kv)
        await c.resume("big")  # warm: chunks in the host tier, a restore buffer in the pool
    before_sessions = await stored(server)
    base = server.rss()
    peak = base
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, server.rss())
            await asyncio.sleep(0.005)

    async def resume(http: httpx.AsyncClient) -> httpx.Response:
        return await http.post("/v1/sessions/big/resume")

    sampler = asyncio.create_task(sample())
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(base_url=server.url, headers={"authorization": f"Bearer {TOKEN}"},
                                 timeout=60, limits=limits) as http:  # fmt: skip
        answers = await asyncio.gather(*[resume(http) for _ in range(32)])
    done.set()
    await sampler
    codes = [a.status_code for a in answers]
    assert set(codes) <= {200, 503} and codes.count(200) >= 3 and codes.count(503) >= 1, codes
    for a in answers:
        if a.status_code == 503:
            assert a.headers["retry-after"] == "1" and a.json()["error"] == "overloaded"
        else:
            head, payload = split_frame(a.content, 1 << 20)
            assert ResumeHeader.model_validate_json(head).restored_tokens == BIG
            got = torch.frombuffer(bytearray(payload), dtype=kv.dtype).view(kv.shape)
            assert bits_equal(got, kv)
    grown = peak - base
    print(f"RSS {base >> 20} MiB, peak {peak >> 20} MiB during 32 resumes of 8 MiB: {codes.count(503)} got 503")
    # unbounded, 32 resumes of 8 MiB hold 256 MiB at once; the budget lets three in
    assert grown < 96 << 20, f"server RSS grew {grown >> 20} MiB during 32 concurrent resumes"
    assert await stored(server) == before_sessions


async def test_the_sdk_retries_a_503_until_capacity_frees(server: Server) -> None:
    tokens, kv = random_tokens(BIG, seed=2), random_kv(SPEC4, BIG, seed=2)
    async with client(server) as c:
        await c.snapshot("wanted", tokens, kv)
    before_sessions = await stored(server)
    # an upload declaring the whole budget and stalling holds it until its body deadline
    hog, hog_writer = await raw(server, upload_head("hog", BUDGET), b"ASWF\x01\x00\x00\x00")
    await until(lambda: inflight(server) >= BUDGET, "budget held by the stalled upload")  # admitted, not slept on
    async with client(server, retries=0) as impatient:
        with pytest.raises(BackendError) as refused:
            await impatient.resume("wanted")
        assert "overloaded" in str(refused.value) or "busy" in str(refused.value)
        with pytest.raises(BackendError):  # an upload finds no room either, and stores nothing
            await impatient.snapshot("refused", tokens[:256], kv[:, :, :256])
    async with client(server) as patient:
        result, info = await asyncio.gather(
            patient.resume("wanted"), patient.snapshot("late", tokens[:256], kv[:, :, :256])
        )  # an upload is sent again whole on each try
        assert patient.retried >= 2 and info.version == 1
    assert result.complete and bits_equal(result.kv, kv)
    assert (await answer(hog, GUARD_S)).startswith(b"HTTP/1.1 400")
    hog_writer.close()
    assert await stored(server) == sorted([*before_sessions, ("late", 1)])  # no "hog", no "refused"
    async with client(server) as c:
        back = await c.resume("late")
        assert back.complete and bits_equal(back.kv, kv[:, :, :256])
        await c.delete("late")
    assert inflight(server) == 0


async def test_a_client_that_stops_reading_its_answer_is_dropped(server: Server) -> None:
    """A resume nobody reads holds its share of the budget for at most the send deadline."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.connect(("127.0.0.1", server.port))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    head = f"POST /v1/sessions/big/resume HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
    writer.write(head.encode())
    await writer.drain()
    await until(lambda: inflight(server) >= BIG * SPEC4.token_bytes, "8 MiB held")  # the stuck resume holds its 8 MiB
    await until(lambda: inflight(server) == 0, "drop at the send deadline")  # dropped, its reservation given back
    got = await answer(reader, GUARD_S)  # what was buffered, then the close
    assert got.startswith(b"HTTP/1.1 200") and len(got) < BIG * SPEC4.token_bytes
    writer.close()


def test_refused_requests_left_nothing_behind(server: Server) -> None:
    """Last: with the server stopped, gc of its directory finds nothing unreferenced to remove."""
    os.kill(server.pid, 15)
    wait_until(lambda: not Path(f"/proc/{server.pid}").exists() or "zombie" in _state(server.pid), "exit")

    async def check() -> None:
        async with StateStore.open(server.data, SPEC4, chunk_tokens=256) as store:
            names = sorted(m.session_id for m in await store.catalog.manifests(None))
            assert names == ["big", "wanted"]
            assert await store.gc() == 0

    asyncio.run(check())


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split("\n", 1)[0]
    except (OSError, IndexError):
        return "zombie"
