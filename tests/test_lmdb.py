from __future__ import annotations

import os
from pathlib import Path

import lmdb
import pytest
from agentstate.backends.lmdb import LMDBBackend

from agentstate.errors import CapacityError


async def test_map_grows_instead_of_failing(tmp_path: Path) -> None:
    b = LMDBBackend(tmp_path / "db", map_size=1 << 20, value_log_min_bytes=None)  # every value in the map
    vals = [os.urandom(1 << 20) for _ in range(12)]
    for i, v in enumerate(vals):
        await b.put([f"c/{i}"], [v])
    assert (await b.stats()).capacity_bytes >= 12 << 20
    bufs = [memoryview(bytearray(1 << 20)) for _ in vals]
    assert await b.get_into([f"c/{i}" for i in range(12)], bufs) == [1 << 20] * 12
    assert all(bytes(x) == v for x, v in zip(bufs, vals))
    await b.close()


async def test_full_map_at_its_limit_raises_capacity_and_keeps_committed_data(tmp_path: Path) -> None:
    b = LMDBBackend(tmp_path / "db", map_size=2 << 20, max_map_size=4 << 20)
    kept = os.urandom(1 << 20)
    await b.put(["c/kept"], [kept])
    with pytest.raises(CapacityError):
        await b.put([f"c/{i}" for i in range(8)], [os.urandom(1 << 20) for _ in range(8)])
    buf = memoryview(bytearray(1 << 20))
    assert await b.get_into(["c/kept"], [buf]) == [1 << 20] and bytes(buf) == kept
    assert await b.exists(["c/0"]) == [False]  # the failed batch left nothing behind
    await b.put(["c/small"], [b"still usable"])
    await b.close()


async def test_data_is_on_disk_after_close_and_reopen(tmp_path: Path) -> None:
    b = LMDBBackend(tmp_path / "db")
    await b.put(["c/a", "t/b"], [b"alpha", b"beta"])
    await b.close()
    with lmdb.open(str(tmp_path / "db"), readonly=True) as env, env.begin() as txn:
        assert txn.get(b"c/a") == b"alpha" and txn.get(b"t/b") == b"beta"
    b2 = LMDBBackend(tmp_path / "db")
    assert sorted([k async for k in b2.keys()]) == ["c/a", "t/b"]
    await b2.close()


async def test_keys_pages_through_many_entries(tmp_path: Path) -> None:
    b = LMDBBackend(tmp_path / "db")
    names = [f"c/{i:05d}" for i in range(2500)]
    await b.put(names, [b"v"] * len(names))
    assert [k async for k in b.keys("c/")] == names
    await b.close()
