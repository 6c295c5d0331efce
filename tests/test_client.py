"""The SDK (`agentstate.client.AsyncClient`) against a real server on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from agentstate import codec
from agentstate.client import AsyncClient
from agentstate.errors import (
    AgentStateError,
    ConflictError,
    CorruptDataError,
    InvalidArgumentError,
    InvalidSessionIdError,
    KVShapeError,
    SessionNotFoundError,
    SpecMismatchError,
)
from agentstate.wire import ERRORS, ChunkMatch, UnauthorizedError, error_from, status_of
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.test_service import ALICE, BOB, Served, footprint, served, serving

__all__ = ["served"]  # the fixture, imported from test_service


@pytest.fixture
async def alice(served: Served) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(served.url, ALICE, spec=SPEC4) as client:
        yield client


@pytest.fixture
async def bob(served: Served) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(served.url, BOB) as client:  # no spec: takes the service's
        yield client


async def test_snapshot_resume_bit_exact_with_state(alice: AsyncClient) -> None:
    toks, kv = random_tokens(300), random_kv(SPEC4, 300)  # 4 chunks of 64 and a 44-token tail
    info = await alice.snapshot("agent-42", toks, kv, {"messages": [{"role": "user", "content": "hi"}]})
    assert (info.session_id, info.version, info.num_tokens, info.fingerprint) == ("agent-42", 1, 300, SPEC4.fingerprint)
    r = await alice.resume("agent-42")
    assert r.complete and r.tokens == toks and bits_equal(r.kv, kv)
    assert r.state == {"messages": [{"role": "user", "content": "hi"}]} and r.manifest.tenant == "alice"

    grown_toks, grown = toks + random_tokens(50, seed=1), torch.cat([kv, random_kv(SPEC4, 50, seed=1)], dim=2)
    info = await alice.snapshot("agent-42", grown_toks, grown, {"turn": 2}, expected_version=1)
    assert info.version == 2
    with pytest.raises(ConflictError):  # a writer that last saw version 1 is stale now
        await alice.snapshot("agent-42", toks, kv, expected_version=1)
    assert (await alice.snapshot("agent-42", toks, kv, expected_version=1, force=True)).version == 3
    manifest = await alice.get("agent-42")
    assert manifest.version == 3 and manifest.tokens == toks
    assert bits_equal((await alice.resume("agent-42")).kv, kv)


async def test_fork_list_delete_stats(alice: AsyncClient) -> None:
    toks, kv = random_tokens(200, seed=2), random_kv(SPEC4, 200, seed=2)
    await alice.snapshot("parent", toks, kv, {"who": "parent"}, ttl_seconds=3600)
    child = await alice.fork("parent", "child")
    assert child.parent == "parent" and child.version == 1
    r = await alice.resume("child")
    assert bits_equal(r.kv, kv) and r.state == {"who": "parent"}
    assert [s.session_id for s in await alice.list()] == ["child", "parent"]
    stats = await alice.stats()
    assert (stats.tenant, stats.sessions, stats.session_tokens, stats.chunk_tokens) == ("alice", 2, 400, 64)
    with pytest.raises(ConflictError):
        await alice.fork("parent", "child")
    with pytest.raises(SessionNotFoundError):
        await alice.fork("nobody", "x")
    await alice.delete("parent")
    with pytest.raises(SessionNotFoundError):
        await alice.resume("parent")
    with pytest.raises(SessionNotFoundError):
        await alice.delete("parent")
    assert bits_equal((await alice.resume("child")).kv, kv)  # the fork shares chunks, and keeps them
    assert [s.session_id for s in await alice.list()] == ["child"]


async def test_errors_are_typed_and_nothing_is_stored(served: Served, alice: AsyncClient) -> None:
    toks, kv = random_tokens(100, seed=3), random_kv(SPEC4, 100, seed=3)
    before = await footprint(served.store)
    other = SPEC4.model_copy(update={"model_id": "test/another-model"})
    async with AsyncClient(served.url, ALICE, spec=other) as wrong_model:
        with pytest.raises(SpecMismatchError):
            await wrong_model.snapshot("s", toks, kv)
        with pytest.raises(SpecMismatchError):
            await wrong_model.put_prefix(toks, kv)
    with pytest.raises(KVShapeError):  # checked before anything is sent
        await alice.snapshot("s", toks[:99], kv)
    with pytest.raises(InvalidSessionIdError):
        await alice.snapshot("../escape", toks, kv)
    async with AsyncClient(served.url, "not-a-token") as stranger:
        with pytest.raises(UnauthorizedError):
            await stranger.list()
        with pytest.raises(UnauthorizedError):
            await stranger.snapshot("s", toks, kv)
    assert await footprint(served.store) == before


async def test_tenants_are_isolated_through_the_sdk(alice: AsyncClient, bob: AsyncClient) -> None:
    toks, kv = random_tokens(256, seed=4), random_kv(SPEC4, 256, seed=4)
    await alice.snapshot("shared-name", toks, kv)
    await alice.put_prefix(toks, kv)
    for call in (bob.resume, bob.get, bob.delete, lambda sid: bob.fork(sid, "mine")):
        with pytest.raises(SessionNotFoundError):
            await call("shared-name")
    assert await bob.list() == [] and (await bob.match(toks)).tokens == 0
    assert (await bob.load(toks)).shape[2] == 0
    theirs = (await alice.match(toks)).handles
    assert [await bob.get_chunk(h) for h in theirs] == [None] * 4
    assert not any([await bob.has_chunk(h) for h in theirs])
    assert bits_equal((await alice.resume("shared-name")).kv, kv)


async def test_chunk_data_plane_round_trip(alice: AsyncClient, bob: AsyncClient) -> None:
    toks, kv = random_tokens(256 + 30, seed=5), random_kv(SPEC4, 256 + 30, seed=5)
    assert await alice.put_prefix(toks, kv) == 256  # 4 whole chunks; the 30-token rest is not a chunk
    assert await alice.put_prefix(toks, kv) == 0  # already held
    m = await alice.match(toks)
    assert (m.tokens, m.chunks, len(m.handles), len(m.tiers)) == (256, 4, 4, 4)
    loaded = await alice.load(toks)
    assert bits_equal(loaded, kv[:, :, :256])
    fp, dtype = SPEC4.fingerprint, SPEC4.torch_dtype
    chunks = []
    for i, handle in enumerate(m.handles):
        assert await alice.has_chunk(handle)
        raw = await alice.get_chunk(handle)
        assert raw is not None
        chunks.append(raw)
        assert bits_equal(await alice.decode_chunk(handle, raw), kv[:, :, i * 64 : (i + 1) * 64])
        key = await alice.chunk_key(handle)
        assert key == f"c/{fp}/{handle.split('.')[0]}"
        assert bits_equal(codec.decode(raw, key=key, fingerprint=fp, dtype=dtype), kv[:, :, i * 64 : (i + 1) * 64])
    with pytest.raises(CorruptDataError, match="another key"):  # a chunk is bound to its key
        await alice.decode_chunk(m.handles[1], chunks[0])

    # An engine on another host, as Bob: it matches its own tokens, then PUTs the chunks it computed.
    mine: ChunkMatch = await bob.match(toks)
    assert mine.tokens == 0 and len(mine.handles) == 4
    with pytest.raises(InvalidArgumentError, match="another key"):  # Alice's bytes are bound to Alice's keys
        await bob.put_chunk(mine.handles[0], chunks[0])
    with pytest.raises(InvalidArgumentError, match="another key"):  # and chunk 1's bytes to chunk 1's
        await alice.put_chunk(m.handles[0], chunks[1])
    assert await bob.put_chunk(mine.handles[0], kv[:, :, :64]) is True  # KV: encoded for the handle
    assert await bob.put_chunk(mine.handles[1], await bob.encode_chunk(mine.handles[1], kv[:, :, 64:128])) is True
    assert await bob.put_chunk(mine.handles[0], kv[:, :, :64]) is False  # held already
    assert (await bob.match(toks)).tokens == 128
    assert bits_equal(await bob.load(toks), kv[:, :, :128])
    got = await bob.get_chunk(mine.handles[1])
    assert got is not None and bits_equal(await bob.decode_chunk(mine.handles[1], got), kv[:, :, 64:128])
    with pytest.raises(InvalidArgumentError):
        await bob.chunk_key("not-a-handle")


async def test_sessions_survive_a_server_restart(open_store: Callable[..., Any]) -> None:
    toks, kv = random_tokens(150, seed=6), random_kv(SPEC4, 150, seed=6)
    async with open_store() as store, serving(store) as url, AsyncClient(url, ALICE, spec=SPEC4) as client:
        await client.snapshot("durable", toks, kv, {"n": 1})
    async with open_store() as store, serving(store) as url, AsyncClient(url, ALICE, spec=SPEC4) as client:
        r = await client.resume("durable")
        assert r.complete and bits_equal(r.kv, kv) and r.state == {"n": 1}


@pytest.mark.parametrize("cls", [cls for cls, _, _ in ERRORS])
def test_every_error_code_comes_back_as_its_class(cls: type[AgentStateError]) -> None:
    status, code = status_of(cls("x"))
    back = error_from(status, code, "x")
    assert type(back) is cls
    assert back.retryable == cls.retryable  # a refusal (502) is never retried; an outage (503) is


async def test_records_through_the_service_are_exact_per_tenant_and_typed(alice: AsyncClient, bob: AsyncClient) -> None:
    """A framework's records over HTTP (PUT, GET, names, delete): bytes exact, tenants apart, bad
    names refused before anything is sent and by the service, the session's KV untouched."""
    import os

    data = {f"ckpt/{i:03d}": os.urandom(n) for i, n in enumerate([0, 1, 1000, 30_000])}
    await alice.put_records("thread-9", data)
    assert await alice.records("thread-9") == data
    assert await alice.record_names("thread-9", "ckpt/00") == sorted(data)
    assert await alice.records("thread-9", "ckpt/003") == {"ckpt/003": data["ckpt/003"]}
    assert await alice.records("thread-9", names=["ckpt/002", "x", "ckpt/001"]) == {
        "ckpt/002": data["ckpt/002"], "ckpt/001": data["ckpt/001"]}  # fmt: skip
    assert await bob.records("thread-9") == {}  # another tenant
    toks, kv = random_tokens(100), random_kv(SPEC4, 100)
    await alice.snapshot("thread-9", toks, kv)
    await alice.fork("thread-9", "thread-9b")
    assert await alice.records("thread-9b") == data
    assert await alice.delete_records("thread-9", ["ckpt/000", "nope"]) == 1
    assert bits_equal((await alice.resume("thread-9")).kv, kv)  # records go, the KV stays
    for bad in ({"bad name": b"x"}, {"ok": "str"}, {"": b""}):
        with pytest.raises(InvalidArgumentError):
            await alice.put_records("thread-9", bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidSessionIdError):
        await alice.records("../etc")
    with pytest.raises(InvalidArgumentError):  # the service checks names too (a client not this SDK)
        await alice._call("PUT", "/v1/sessions/thread-9/records", json={"records": {"x y": "AA=="}})  # noqa: SLF001
    assert await alice.delete_records("thread-9") == 3
    assert await alice.records("thread-9") == {}
    await alice.delete("thread-9b")
    assert await alice.records("thread-9b") == {}
