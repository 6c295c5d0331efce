"""`agentstate.client.Client`, the blocking SDK, against a real server on loopback.

The server runs on its own event loop in a thread (a blocking call made on the server's own loop
would wait for itself); the tests are plain functions, as the code calling a blocking SDK is.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agentstate import StateStore
from agentstate.client import AsyncClient, Client
from agentstate.errors import ConflictError, InvalidArgumentError, SessionNotFoundError
from agentstate.wire import UnauthorizedError
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.test_service import ALICE, BOB, serving


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    """A server for a store of its own, on an event loop in a thread."""
    loop = asyncio.new_event_loop()
    ready: list[str] = []
    started = threading.Event()
    stop = asyncio.Event()

    async def main() -> None:
        try:
            async with (
                StateStore.open(tmp_path / "data", SPEC4, chunk_tokens=64, lmdb_map_size=64 << 20) as store,
                serving(store) as address,
            ):
                ready.append(address)
                started.set()
                await stop.wait()
        finally:
            started.set()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(60) and ready, "the server did not start"
    try:
        yield ready[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
        loop.close()


@pytest.fixture
def alice(url: str) -> Iterator[Client]:
    with Client(url, ALICE, spec=SPEC4) as client:
        yield client


def test_every_async_method_has_a_blocking_twin() -> None:
    methods = {n: f for n, f in inspect.getmembers(AsyncClient, inspect.iscoroutinefunction) if not n.startswith("_")}
    assert set(methods) - {"aclose"} <= {n for n, _ in inspect.getmembers(Client, inspect.isfunction)}
    for name, method in methods.items():
        if name != "aclose":
            twin = getattr(Client, name)
            assert not inspect.iscoroutinefunction(twin), name
            assert inspect.signature(twin) == inspect.signature(method), name


def test_sessions_round_trip_bit_exact(alice: Client) -> None:
    toks, kv = random_tokens(300), random_kv(SPEC4, 300)
    info = alice.snapshot("agent-1", toks, kv, {"turn": 1})
    assert (info.session_id, info.version, info.num_tokens) == ("agent-1", 1, 300)
    r = alice.resume("agent-1")
    assert r.complete and r.tokens == toks and r.state == {"turn": 1} and bits_equal(r.kv, kv)
    with pytest.raises(ConflictError):
        alice.snapshot("agent-1", toks, kv, expected_version=0)
    child = alice.fork("agent-1", "agent-1b")
    assert child.parent == "agent-1"
    assert [s.session_id for s in alice.list()] == ["agent-1", "agent-1b"]
    assert alice.get("agent-1b").tokens == toks
    stats = alice.stats()
    assert (stats.tenant, stats.sessions, stats.session_tokens) == ("alice", 2, 600)
    assert stats.unique_bytes < stats.logical_bytes  # the fork shares its parent's chunks
    alice.delete("agent-1")
    with pytest.raises(SessionNotFoundError):
        alice.resume("agent-1")
    assert bits_equal(alice.resume("agent-1b").kv, kv)
    assert alice.service_spec().fingerprint == alice.spec().fingerprint == SPEC4.fingerprint


def test_prefixes_and_chunks(alice: Client, url: str) -> None:
    toks, kv = random_tokens(256, seed=5), random_kv(SPEC4, 256, seed=5)
    assert alice.put_prefix(toks, kv) == 256
    match = alice.match(toks)
    assert (match.tokens, match.chunks, len(match.handles)) == (256, 4, 4)
    assert bits_equal(alice.load(toks), kv)
    handle = match.handles[1]
    raw = alice.get_chunk(handle)
    assert raw is not None and alice.has_chunk(handle)
    assert bits_equal(alice.decode_chunk(handle, raw), kv[:, :, 64:128])
    assert alice.chunk_key(handle).endswith(handle.partition(".")[0])
    fresh = alice.match(random_tokens(64, seed=6)).handles[0]
    assert not alice.has_chunk(fresh) and alice.get_chunk(fresh) is None
    assert alice.put_chunk(fresh, kv[:, :, :64]) is True
    assert bytes(alice.encode_chunk(fresh, kv[:, :, :64])) == alice.get_chunk(fresh)
    with Client(url, BOB) as bob:  # another tenant: the handle names nothing for it
        assert bob.get_chunk(handle) is None and not bob.has_chunk(handle)
        with pytest.raises(SessionNotFoundError):
            bob.resume("anything")


def test_errors_are_typed_and_close_is_final(url: str) -> None:
    with Client(url, "not-a-token") as stranger, pytest.raises(UnauthorizedError):
        stranger.list()
    client = Client(url, ALICE)
    assert client.list() == []
    client.close()
    client.close()  # idempotent
    with pytest.raises(InvalidArgumentError):
        client.list()
    assert not any(t.name == "agentstate-client" for t in threading.enumerate())  # its thread ended


def test_many_threads_and_a_running_loop(alice: Client) -> None:
    """Calls from several threads at once share one client; it also works where an event loop is
    already running (asyncio.run per call would refuse)."""
    sessions = {f"s{i}": (random_tokens(100 + i, seed=i), random_kv(SPEC4, 100 + i, seed=i)) for i in range(8)}

    def roundtrip(sid: str) -> bool:
        toks, kv = sessions[sid]
        alice.snapshot(sid, toks, kv)
        return bits_equal(alice.resume(sid).kv, kv)

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(roundtrip, sessions))

    async def inside_a_loop() -> int:
        return len(alice.list())

    assert asyncio.run(inside_a_loop()) == len(sessions)
