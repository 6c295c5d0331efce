"""Mooncake tier against a real master and storage process on loopback (skipped where it cannot run)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agentstate import StateStore
from agentstate.config import TierConfig
from agentstate.errors import AgentStateError, BackendError, CapacityError, InvalidArgumentError
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.mooncake_server import MooncakeServer


def mooncake_tier(server: MooncakeServer, prefix: str, **kw: object) -> TierConfig:
    return TierConfig(kind="mooncake", master=server.master_addr, metadata_url=server.metadata_url,
                      admin_url=server.admin_url, prefix=prefix, buffer_bytes=16 << 20, **kw)  # type: ignore[arg-type]  # fmt: skip


async def read_all(backend: object, keys: list[str]) -> tuple[list[bool], dict[int, bytes]]:
    got: dict[int, bytes] = {}
    found = await backend.read(keys, lambda i, v: got.__setitem__(i, bytes(v)))  # type: ignore[attr-defined]
    return found, got


async def test_a_prefix_stored_on_one_host_loads_bit_exact_on_another(
    tmp_path: Path, mooncake_store: MooncakeServer
) -> None:
    tiers = [TierConfig(kind="host", capacity_bytes=64 << 20), TierConfig(kind="lmdb"),
             mooncake_tier(mooncake_store, "t-prefix:")]  # fmt: skip
    tokens, kv = random_tokens(300, seed=41), random_kv(SPEC4, 300, seed=41)
    async with StateStore.open(tmp_path / "host-a", SPEC4, tiers=tiers, chunk_tokens=64) as a:
        assert await a.put_prefix(tokens, kv) == 256
    async with StateStore.open(tmp_path / "host-b", SPEC4, tiers=tiers, chunk_tokens=64) as b:
        m = await b.match(tokens)
        assert (m.tokens, m.tiers) == (256, ["mooncake"] * 4)
        into = torch.zeros_like(kv)
        assert await b.load(tokens, into) == 256 and bits_equal(into[:, :, :256], kv[:, :, :256])
        await b.flush()  # promotions re-read what was loaded, into the host tier
        stats = next(s for s in (await b.stats()).tiers if s.name == "mooncake")
        assert stats.reads >= 4 and stats.errors == 0


async def test_a_session_resumes_bit_exact_on_another_host_from_mooncake(
    tmp_path: Path, mooncake_store: MooncakeServer, redis_server: object
) -> None:
    """Manifests in a shared Redis catalog, Redis the durable record tier, Mooncake the fast shared
    cache in front of it: the second host reads every chunk and the tail from Mooncake."""
    url = redis_server.url  # type: ignore[attr-defined]
    tiers = [TierConfig(kind="host", capacity_bytes=64 << 20), TierConfig(kind="lmdb"),
             mooncake_tier(mooncake_store, "t-session:"), TierConfig(kind="redis", url=url, prefix="t-session:")]  # fmt: skip
    opts = {"tiers": tiers, "chunk_tokens": 64, "catalog_url": url, "catalog_prefix": "t-session-cat:"}
    tokens, kv = random_tokens(300, seed=42), random_kv(SPEC4, 300, seed=42)
    async with StateStore.open(tmp_path / "host-a", SPEC4, **opts) as a:
        await a.snapshot("agent-7", tokens, kv, {"turn": 3})
    async with StateStore.open(tmp_path / "host-b", SPEC4, **opts) as b:
        got = await b.resume("agent-7")
        assert bits_equal(got.kv, kv) and got.state == {"turn": 3}
        await b.flush()
        by_name = {s.name: s for s in (await b.stats()).tiers}
        assert by_name["mooncake"].reads >= 5 and by_name["redis"].reads == 0  # 4 chunks and the tail


async def test_mooncake_alone_cannot_back_a_shared_catalog(tmp_path: Path, mooncake_store: MooncakeServer) -> None:
    with pytest.raises(InvalidArgumentError, match="durable remote tier"):
        StateStore.open(tmp_path / "d", SPEC4, tiers=[TierConfig(kind="lmdb"), mooncake_tier(mooncake_store, "x:")],
                        catalog_url="redis://127.0.0.1:1/0")  # fmt: skip
    with pytest.raises(ValueError, match="no expiry"):
        mooncake_tier(mooncake_store, "x:", ttl_seconds=5)


async def test_overwrite_returns_the_new_bytes_and_big_values_take_the_plain_path(
    mooncake_store: MooncakeServer,
) -> None:
    """`put` in Mooncake keeps the old value of an existing key; the tier upserts. A value larger
    than an arena slot (4 MiB here) goes through plain upsert/get; an empty one is refused."""
    b = mooncake_store.backend(prefix="t-overwrite:")
    try:
        first, second, big = os.urandom(1000), os.urandom(3000), os.urandom(6 << 20)
        await b.put(["c/k"], [first])
        assert await read_all(b, ["c/k"]) == ([True], {0: first})
        await b.put(["c/k", "c/big"], [second, big])
        assert await read_all(b, ["c/k", "c/big"]) == ([True, True], {0: second, 1: big})
        assert await b.sizes(["c/k", "c/big", "c/none"]) == [3000, 6 << 20, 0]
        with pytest.raises(AgentStateError):
            await b.put(["c/empty"], [b""])
        assert (await b.stats()).errors == 0 and not b.breaker.open
    finally:
        await b.close()


async def test_killed_storage_gives_clean_misses_and_opens_the_breaker(tmp_path: Path) -> None:
    server = MooncakeServer(tmp_path / "mc").start()
    try:
        tiers = [TierConfig(kind="host", capacity_bytes=64 << 20), TierConfig(kind="lmdb"),
                 mooncake_tier(server, "t-kill:", timeout_s=1.5, breaker_threshold=2, breaker_cooldown_s=30)]  # fmt: skip
        tokens, kv = random_tokens(300, seed=43), random_kv(SPEC4, 300, seed=43)
        async with StateStore.open(tmp_path / "a", SPEC4, tiers=tiers, chunk_tokens=64) as a:
            await a.snapshot("s", tokens, kv)
            remote = a.chunks.backend("mooncake")
            keys = [k async for k in remote.keys()]
            assert len(keys) == 5  # 4 chunks and the tail
            server.kill_storage()
            for _ in range(5):  # each read fails (transfer error) or misses; none raises
                found, got = await read_all(remote, keys)
                assert found == [False] * 5 and got == {}
                if remote.breaker.open:
                    break
            stats = await remote.stats()
            assert remote.breaker.open and stats.errors >= 2 and stats.misses >= 5
            assert bits_equal((await a.resume("s")).kv, kv)  # from the host tier and LMDB
        async with StateStore.open(tmp_path / "a", SPEC4, tiers=tiers, chunk_tokens=64) as again:
            assert bits_equal((await again.resume("s")).kv, kv)  # a restart: LMDB alone
        async with StateStore.open(tmp_path / "b", SPEC4, tiers=tiers[1:], chunk_tokens=64) as b:
            into = torch.zeros_like(kv)
            assert await b.load(tokens, into) == 0 and not into.view(torch.uint8).any()  # misses, no exception
    finally:
        server.stop()


STUCK_S = 4.0
"""Under the ~4.3 s a dead master holds one client call: a duration below it shows the tier did not wait."""


async def test_master_down_calls_are_bounded_by_the_timeout(tmp_path: Path) -> None:
    """A dead master makes each client call block ~4.3 s: the tier gives up after timeout_s, then
    the open breaker answers at once, without touching the client.

    Bounds are what would fail if the tier waited on the client (STUCK_S, not a speed a loaded machine
    may miss); that no call reaches the client with the circuit open is counted, not timed (every client
    call goes through `_work`). The client does not always block: a master that refuses at once fails fast."""
    server = MooncakeServer(tmp_path / "mc").start()
    b = server.backend(prefix="t-master:", timeout_s=0.5, breaker_threshold=2, breaker_cooldown_s=30)
    calls = 0
    work = b._work

    def counted(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return work(*args)

    b._work = counted
    try:
        await b.put(["c/a"], [b"x" * 1000])
        assert await b.exists(["c/a"]) == [True]
        server.kill_master()
        t0 = time.monotonic()
        assert await b.exists(["c/a"]) == [False]
        found, _ = await read_all(b, ["c/a"])
        assert found == [False] and time.monotonic() - t0 < STUCK_S  # two calls, each cut at 0.5 s
        assert b.breaker.open
        before = calls
        with pytest.raises(BackendError) as err:
            await b.put(["c/b"], [b"y"])
        assert err.value.retryable and not isinstance(err.value, CapacityError)
        assert await b.exists(["c/a"]) == [False]
        with pytest.raises(BackendError):
            _ = [k async for k in b.keys()]
        assert calls == before  # circuit open: no call made
        assert (await b.stats()).errors >= 4
    finally:
        t0 = time.monotonic()
        await b.close()
        assert time.monotonic() - t0 < STUCK_S  # calls still stuck in the client close it when they return
        while b.busy and time.monotonic() - t0 < 60:  # let them, so none is left in C++ at exit
            await asyncio.sleep(0.1)
        assert b.busy == 0
        server.stop()


class FakeClient:
    """The slice of MooncakeDistributedStore the slot functions use, over a dict: raw addresses
    in and out as the real client takes them, and its return codes (-704 missing, -600 too small)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.calls: list[str] = []

    def batch_upsert_from(self, names: list[str], addrs: list[int], sizes: list[int]) -> list[int]:
        self.calls.append("batch_upsert_from")
        for name, addr, size in zip(names, addrs, sizes):
            self.data[name] = ctypes.string_at(addr, size)
        return [0] * len(names)

    def upsert(self, name: str, value: bytes) -> int:
        self.calls.append("upsert")
        self.data[name] = bytes(value)
        return 0

    def batch_get_into(self, names: list[str], addrs: list[int], sizes: list[int]) -> list[int]:
        self.calls.append("batch_get_into")
        return [self._into(n, a, s) for n, a, s in zip(names, addrs, sizes)]

    def get_into(self, name: str, addr: int, size: int) -> int:
        self.calls.append("get_into")
        return self._into(name, addr, size)

    def _into(self, name: str, addr: int, size: int) -> int:
        if name not in self.data:
            return -704
        value = self.data[name]
        if len(value) > size:
            return -600
        ctypes.memmove(addr, value, len(value))
        return len(value)

    def get(self, name: str) -> bytes:
        self.calls.append("get")
        return self.data.get(name, b"")

    def is_exist(self, name: str) -> int:
        return int(name in self.data)


def test_slot_writes_pack_batches_and_reads_fall_back_for_values_larger_than_their_share() -> None:
    from agentstate.backends.mooncake_io import Arena, Guard
    from agentstate.backends.mooncake_ops import INVALID, fetch, store

    arena, client = Arena(1 << 20, 4), FakeClient()  # 256 KiB slots
    values = [os.urandom(40 << 10) for _ in range(10)] + [os.urandom(300 << 10), b""]
    names = [f"k{i}" for i in range(len(values))]
    with arena.slot() as slot:
        codes = store(client, slot, Guard(), names, values)
        assert codes == [0] * 11 + [INVALID]  # the empty value is refused, not sent
        assert client.calls == ["batch_upsert_from", "upsert", "batch_upsert_from"]  # 6 fit a slot, then 4
        got: dict[int, bytes] = {}
        found = [False] * 13
        failed = fetch(
            client, slot, Guard(), [*names[:11], "none", names[0]], lambda i, v: got.__setitem__(i, bytes(v)), found
        )
    assert failed == 0 and found == [True] * 11 + [False, True]
    assert got == {**dict(enumerate(values[:11])), 12: values[0]}
    # groups of 4 keys, 64 KiB each (MIN_SHARE); the 300 KiB value again alone, then by plain get
    assert client.calls[3:] == ["batch_get_into"] * 3 + ["get_into", "get", "batch_get_into"]


def test_an_abandoned_call_never_touches_caller_memory() -> None:
    """A call whose caller timed out or was cancelled: no sink runs, no value is copied or sent."""
    from agentstate.backends.mooncake_io import Arena, Guard
    from agentstate.backends.mooncake_ops import fetch, store

    arena, client = Arena(1 << 20, 1), FakeClient()
    client.data["k"] = b"v" * 100
    gone = Guard()
    gone.abandon()
    with arena.slot() as slot:
        store(client, slot, gone, ["a", "big"], [b"x" * 10, b"y" * (2 << 20)])
        seen: list[int] = []
        fetch(client, slot, gone, ["k"], lambda i, v: seen.append(i), [False])
    assert seen == [] and set(client.data) == {"k"} and "upsert" not in client.calls
