"""Records: a framework's state kept beside a session's KV under the same id (agentstate.records).

Real LMDB catalogs and a real Redis catalog; every value is random bytes compared byte for byte."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentstate import StateStore, manifest
from agentstate.errors import (
    AgentStateError,
    ConflictError,
    CorruptDataError,
    InvalidArgumentError,
    InvalidSessionIdError,
    SessionNotFoundError,
)
from agentstate.ops.archive import export_sessions, import_sessions
from tests.conftest import SPEC4, random_kv, random_tokens
from tests.redis_server import RedisServer


def blobs(n: int, seed: int) -> dict[str, bytes]:
    rng = __import__("random").Random(seed)
    return {f"ckpt/{i:04d}|ns:a%2F": rng.randbytes(rng.choice([0, 1, 100, 70_000])) for i in range(n)}


async def kv_session(store: StateStore, name: str, seed: int = 1, **kw: Any) -> None:
    await store.snapshot(name, random_tokens(100, seed=seed), random_kv(SPEC4, 100, seed=seed), **kw)


@pytest.fixture(params=["lmdb", "redis"])
def opened(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., Any]:
    """Open a store whose catalog is local (LMDB) or shared (Redis, with a Redis record tier)."""
    prefix = f"r{uuid.uuid4().hex[:8]}:"

    def factory(**kw: Any) -> Any:
        if request.param == "redis":
            server: RedisServer = request.getfixturevalue("redis_server")
            kw.setdefault("catalog_url", server.url)
            kw.setdefault("catalog_prefix", prefix)
            kw.setdefault("tiers", [{"kind": "host", "capacity_bytes": 64 << 20},
                                    {"kind": "redis", "url": server.url, "prefix": prefix}])  # fmt: skip
        return StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=64, **kw)

    return factory


async def test_records_round_trip_by_prefix_and_survive_a_restart(opened: Callable[..., Any]) -> None:
    data = blobs(12, seed=1)
    async with opened() as store:
        await store.put_records("thread-1", data)
        await store.put_records("thread-1", {"writes/x": b"w"})
        assert await store.records("thread-1") == {**data, "writes/x": b"w"}
        assert list(await store.records("thread-1", "ckpt/")) == sorted(data)  # name order
        assert await store.record_names("thread-1", "ckpt/") == sorted(data)
        assert await store.record_names("thread-1") == [*sorted(data), "writes/x"]
        assert await store.record_names("thread-1", "ckpt/0003") == ["ckpt/0003|ns:a%2F"]
        some = ["writes/x", "nope", "ckpt/0001|ns:a%2F"]
        assert await store.records("thread-1", names=some) == {"writes/x": b"w", "ckpt/0001|ns:a%2F": data[some[2]]}
        assert list(await store.records("thread-1", names=some)) == ["writes/x", "ckpt/0001|ns:a%2F"]
        with pytest.raises(InvalidArgumentError):
            await store.records("thread-1", names="writes/x")
        assert await store.records("thread-1", "writes/") == {"writes/x": b"w"}
        assert await store.records("nobody") == {}
        other = store.for_tenant("other")
        assert await other.records("thread-1") == {}  # tenants share nothing
    async with opened() as store:
        assert await store.records("thread-1") == {**data, "writes/x": b"w"}
        assert await store.delete_records("thread-1", ["writes/x", "missing"]) == 1
        assert await store.records("thread-1") == data


async def test_a_sessions_records_live_and_die_with_it(opened: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1_000_000.0]
    monkeypatch.setattr(manifest, "now", lambda: clock[0])
    monkeypatch.setattr("agentstate.sessions.now", lambda: clock[0])
    data = blobs(3, seed=2)
    async with opened() as store:
        for name in ("kept", "deleted", "expires"):
            await store.put_records(name, data)
            await kv_session(store, name, ttl_seconds=60 if name == "expires" else None)
        await store.fork("kept", "forked")
        assert await store.records("forked") == data
        await store.delete("deleted")
        assert await store.records("deleted") == {}
        await kv_session(store, "deleted")  # a new session under the old id finds nothing of the old one
        assert await store.records("deleted") == {}
        clock[0] += 61
        assert await store.gc() >= 1
        assert await store.records("expires") == {}
        assert await store.records("kept") == data
        await store.put_records("only-records", data)  # a thread checkpointed before any KV
        await store.delete("only-records")
        assert await store.records("only-records") == {}
        with pytest.raises(SessionNotFoundError):
            await store.delete("only-records")
        with pytest.raises(ConflictError):
            await store.fork("kept", "forked")


@pytest.mark.parametrize(
    ("session", "items", "error"),
    [
        ("../x", {"a": b"1"}, InvalidSessionIdError),
        ("t", {"": b"1"}, InvalidArgumentError),
        ("t", {"has space": b"1"}, InvalidArgumentError),
        ("t", {"é": b"1"}, InvalidArgumentError),
        ("t", {"x" * 241: b"1"}, InvalidArgumentError),
        ("t", {"nul\0": b"1"}, InvalidArgumentError),
        ("t", {"a": "text"}, InvalidArgumentError),
        ("t", {"a": None}, InvalidArgumentError),
        ("t", {"ok": b"1", "big": b"x" * 4097}, InvalidArgumentError),  # all or none: "ok" is not written
        ("t", [("a", b"1")], InvalidArgumentError),
        ("t", {3: b"1"}, InvalidArgumentError),
    ],
)
async def test_bad_records_are_refused_and_change_nothing(
    opened: Callable[..., Any], session: Any, items: Any, error: type[AgentStateError]
) -> None:
    async with opened(max_record_bytes=4096) as store:
        await store.put_records("t", {"before": b"b"})
        with pytest.raises(error):
            await store.put_records(session, items)
        assert await store.records("t") == {"before": b"b"}
        with pytest.raises(InvalidArgumentError):
            await store.delete_records("t", "before")  # one string, not a list of names
        with pytest.raises(InvalidArgumentError):
            await store.records("t", "bad prefix")
        assert await store.records("t") == {"before": b"b"}


async def test_a_damaged_record_is_refused_never_served(opened: Callable[..., Any]) -> None:
    async with opened() as store:
        await kv_session(store, "t")
        await store.put_records("t", {"a": b"payload", "b": b"fine"})
        stored = dict(await store.catalog.records(store.tenant, "t"))
        flipped = bytearray(stored["a"])
        flipped[-1] ^= 1
        for bad in (bytes(flipped), b"", b"short", stored["b"]):  # a flipped bit, empty, truncated, swapped
            await store.catalog.put_records(store.tenant, "t", {"a": bad})
            with pytest.raises(CorruptDataError, match="'a'"):
                await store.records("t")
            assert await store.records("t", "b") == {"b": b"fine"}
        with pytest.raises(CorruptDataError):
            await store.fork("t", "copy")  # damage is not copied on as if it were whole
        assert await store.records("copy") == {}
        with pytest.raises(SessionNotFoundError):
            await store.session("copy")


async def test_export_and_import_carry_records(tmp_path: Path, open_store: Callable[..., Any]) -> None:
    data = blobs(5, seed=3)
    async with open_store() as store:
        await kv_session(store, "s1")
        await store.put_records("s1", data)
        await kv_session(store, "s2", seed=2)  # no records
        await export_sessions(store, tmp_path / "a.tar")
    async with StateStore.open(tmp_path / "target", SPEC4, chunk_tokens=64) as target:
        await target.put_records("s1", {"stale": b"old"})
        with pytest.raises(ConflictError):
            await import_sessions(target, tmp_path / "a.tar")
        assert await target.records("s1") == {"stale": b"old"}
        await import_sessions(target, tmp_path / "a.tar", force=True)
        assert await target.records("s1") == data  # replaced, not merged
        assert await target.records("s2") == {}
        await import_sessions(target, tmp_path / "a.tar", tenant="t2")
        assert await target.for_tenant("t2").records("s1") == data


async def test_an_import_that_fails_puts_the_records_back(tmp_path: Path, open_store: Callable[..., Any]) -> None:
    async with open_store() as store:
        await kv_session(store, "s1")
        await store.put_records("s1", {"new": os.urandom(100)})
        await export_sessions(store, tmp_path / "a.tar")
    async with StateStore.open(tmp_path / "target", SPEC4, chunk_tokens=64) as target:
        await kv_session(target, "s1", seed=9)
        await target.put_records("s1", {"old": b"kept"})
        version = (await target.session("s1")).version

        async def refuse(*_: Any) -> Any:
            raise ConflictError("another writer committed meanwhile")

        target.catalog.commit_all = refuse  # type: ignore[method-assign]
        with pytest.raises(ConflictError):
            await import_sessions(target, tmp_path / "a.tar", force=True)
        assert await target.records("s1") == {"old": b"kept"}
        assert (await target.session("s1")).version == version


async def test_sessions_with_records_are_listed_per_tenant(opened: Callable[..., Any]) -> None:
    async with opened() as store:
        await store.put_records("a", {"x": b"1"})
        await store.put_records("b", {"x": b"1", "y": b"2"})
        await store.for_tenant("other").put_records("a", {"x": b"1"})
        await kv_session(store, "kv-only")
        mine = await store.catalog.record_sessions(store.tenant)
        assert sorted(mine) == [(store.tenant, "a"), (store.tenant, "b")]
        assert len([k for k in await store.catalog.record_sessions() if k[1] == "a"]) == 2
        await store.delete("b")
        assert await store.catalog.record_sessions(store.tenant) == [(store.tenant, "a")]


async def test_a_thread_with_records_and_no_kv_is_exported_and_imported(tmp_path: Path, open_store: Callable[..., Any]) -> None:
    """A framework's thread whose KV was never stored (an in-process graph, a first turn not yet
    answered) is a session too: export carries it, import brings it back, and it conflicts as one."""
    data = blobs(4, seed=5)
    async with open_store() as store:
        await store.put_records("thread-no-kv", data)
        await kv_session(store, "with-kv")
        report = await export_sessions(store, tmp_path / "all.tar")
        assert report.sessions == 2
        named = await export_sessions(store, tmp_path / "one.tar", session_ids=["thread-no-kv"])
        assert named.sessions == 1 and named.tokens == 0
    async with StateStore.open(tmp_path / "target", SPEC4, chunk_tokens=64) as target:
        await import_sessions(target, tmp_path / "all.tar")
        assert await target.records("thread-no-kv") == data
        with pytest.raises(SessionNotFoundError):
            await target.session("thread-no-kv")  # still no KV: records only
        with pytest.raises(ConflictError):
            await import_sessions(target, tmp_path / "one.tar")
        await target.put_records("thread-no-kv", {"newer": b"n"})
        await import_sessions(target, tmp_path / "one.tar", force=True)
        assert await target.records("thread-no-kv") == data  # replaced by the archive's
