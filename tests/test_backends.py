"""One contract suite, run against every backend."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from agentstate.backends.base import Backend
from agentstate.backends.file import FileBackend
from agentstate.backends.host import HostBackend
from agentstate.backends.lmdb import LMDBBackend
from agentstate.backends.redis import RedisBackend


@pytest.fixture(params=["host", "lmdb", "file", "redis", "redis-cluster", "mooncake"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    b: Backend
    if request.param.startswith("redis"):
        cluster = request.param == "redis-cluster"
        server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
        b = RedisBackend(server.url, cluster=cluster, prefix=f"test-{request.node.name}:")
        await b.delete([k async for k in b.keys()])
    elif request.param == "mooncake":
        b = request.getfixturevalue("mooncake_store").backend(prefix=f"test-{request.node.name}:")
        await b.delete([k async for k in b.keys()])
    elif request.param == "host":
        b = HostBackend()
    elif request.param == "lmdb":
        b = LMDBBackend(tmp_path / "lmdb", map_size=8 << 20)
    else:
        b = FileBackend(tmp_path / "files")
    yield b
    await b.close()


def values(n: int, size: int = 4096) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


async def test_put_exists_get_into(backend: Backend) -> None:
    keys = [f"c/k{i}" for i in range(5)]
    vals = values(5)
    await backend.put(keys, vals)
    assert await backend.exists(keys + ["c/nope"]) == [True] * 5 + [False]
    bufs = [memoryview(bytearray(4096)) for _ in range(6)]
    assert await backend.get_into(keys + ["c/nope"], bufs) == [4096] * 5 + [0]
    assert [bytes(b) for b in bufs[:5]] == vals


async def test_get_into_a_too_small_buffer_is_a_miss(backend: Backend) -> None:
    await backend.put(["c/a"], [b"x" * 100])
    assert await backend.get_into(["c/a"], [memoryview(bytearray(99))]) == [0]


async def test_read_hands_out_stored_bytes(backend: Backend) -> None:
    keys, vals = ["c/a", "c/b"], values(2, 10_000)
    await backend.put(keys, vals)
    seen: dict[int, bytes] = {}
    found = await backend.read(["c/b", "c/x", "c/a"], lambda i, v: seen.__setitem__(i, bytes(v)))
    assert found == [True, False, True]
    assert seen == {0: vals[1], 2: vals[0]}


async def test_delete_and_keys_by_prefix(backend: Backend) -> None:
    await backend.put(["c/1", "c/2", "t/1"], values(3, 10))
    await backend.delete(["c/1", "c/missing"])
    assert sorted([k async for k in backend.keys("c/")]) == ["c/2"]
    assert sorted([k async for k in backend.keys()]) == ["c/2", "t/1"]
    stats = await backend.stats()
    assert stats.items == 2 and stats.bytes_used > 0


async def test_concurrent_puts_and_reads(backend: Backend) -> None:
    data = {f"c/{i:04d}": os.urandom(2048) for i in range(200)}
    await asyncio.gather(*(backend.put([k], [v]) for k, v in data.items()))
    bufs = {k: memoryview(bytearray(2048)) for k in data}
    got = await asyncio.gather(*(backend.get_into([k], [bufs[k]]) for k in data))
    assert all(g == [2048] for g in got)
    assert all(bytes(bufs[k]) == v for k, v in data.items())
    assert len([k async for k in backend.keys("c/")]) == 200
