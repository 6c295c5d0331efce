"""Session lifecycle: versions, fork, delete, garbage collection, TTL."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest

from agentstate import StateStore, manifest
from agentstate.errors import ConflictError, SessionNotFoundError
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens


async def chunk_count(store: StateStore) -> int:
    return len([k async for k in store.chunks.backend(store.chunks.record_tier).keys("c/")])


async def tail_count(store: StateStore) -> int:
    return len([k async for k in store.chunks.backend(store.chunks.record_tier).keys("t/")])


async def test_versions_increase_and_old_tail_is_dropped(store: StateStore) -> None:
    toks, kv = random_tokens(300), random_kv(SPEC4, 300)
    m1 = await store.snapshot("s", toks[:100], kv[:, :, :100], state={"turn": 1})
    m2 = await store.snapshot("s", toks, kv, state={"turn": 2})
    assert (m1.version, m2.version) == (1, 2) and m2.created_at == m1.created_at
    assert m1.chunk_keys[0] == m2.chunk_keys[0]  # the first chunk is shared by both versions
    r = await store.resume("s")
    assert r.state == {"turn": 2} and bits_equal(r.kv, kv)
    assert await tail_count(store) == 1


async def test_fork_shares_chunks_and_diverges(store: StateStore) -> None:
    toks, kv = random_tokens(200), random_kv(SPEC4, 200)
    await store.snapshot("parent", toks, kv, state={"who": "parent"})
    before = await chunk_count(store)
    child = await store.fork("parent", "child")
    assert child.parent == "parent" and child.version == 1 and child.state == {"who": "parent"}
    assert await chunk_count(store) == before  # no chunk copied
    more, more_kv = random_tokens(100, seed=5), random_kv(SPEC4, 100, seed=5)
    import torch

    grown = torch.cat([kv, more_kv], dim=2)
    await store.snapshot("child", toks + more, grown, state={"who": "child"})
    assert bits_equal((await store.resume("parent")).kv, kv)
    r = await store.resume("child")
    assert bits_equal(r.kv, grown) and r.manifest.parent == "parent" and r.state == {"who": "child"}
    with pytest.raises(ConflictError):
        await store.fork("parent", "child")
    with pytest.raises(SessionNotFoundError):
        await store.fork("nobody", "x")


async def test_delete_frees_only_unreferenced_chunks(store: StateStore) -> None:
    shared, kv = random_tokens(256, seed=1), random_kv(SPEC4, 256, seed=1)
    own_a, own_b = random_tokens(128, seed=2), random_tokens(128, seed=3)
    import torch

    kv_a = torch.cat([kv, random_kv(SPEC4, 128, seed=4)], dim=2)
    kv_b = torch.cat([kv, random_kv(SPEC4, 128, seed=5)], dim=2)
    await store.put_prefix(shared[:128], kv[:, :, :128])  # a registered shared prefix: 2 chunks
    await store.snapshot("a", shared + own_a, kv_a)
    await store.snapshot("b", shared + own_b, kv_b)
    assert await chunk_count(store) == 4 + 2 + 2
    await store.delete("a")
    assert await chunk_count(store) == 6
    await store.delete("b")
    assert await chunk_count(store) == 2  # the prefix stays
    assert (await store.match(shared)).tokens == 128
    with pytest.raises(SessionNotFoundError):
        await store.delete("a")
    assert [m async for m in store.sessions()] == []


async def test_gc_sweeps_leftovers_of_a_crash(tmp_path: Path, open_store) -> None:  # type: ignore[no-untyped-def]
    toks, kv = random_tokens(200), random_kv(SPEC4, 200)
    async with open_store() as store:
        await store.snapshot("kept", toks, kv)
        fp = store.fingerprint
    # What a crash between "data durable" and "manifest committed" leaves: chunks and a tail no manifest references.
    with lmdb.open(str(tmp_path / "data" / "chunks")) as env, env.begin(write=True) as txn:
        txn.put(f"c/{fp}/{'ab' * 32}".encode(), b"orphan chunk")
        txn.put(f"t/{fp}/default/ghost/1".encode(), b"orphan tail")
    async with open_store() as store:
        assert await store.gc() == 2
        assert await chunk_count(store) == 3 and await tail_count(store) == 1
        assert bits_equal((await store.resume("kept")).kv, kv)


async def test_ttl_expiry_and_pinning(store: StateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    toks, kv = random_tokens(100), random_kv(SPEC4, 100)
    clock = [1_000_000.0]
    monkeypatch.setattr(manifest, "now", lambda: clock[0])
    monkeypatch.setattr("agentstate.sessions.now", lambda: clock[0])
    await store.snapshot("short", toks, kv, ttl_seconds=60)
    await store.snapshot("pinned", toks, kv, ttl_seconds=60, pinned=True)
    clock[0] += 59
    assert (await store.resume("short")).complete  # a hit: the TTL slides, counted from here
    clock[0] += 59
    assert (await store.resume("pinned")).complete
    assert sorted([m.session_id async for m in store.sessions()]) == ["pinned", "short"]
    clock[0] += 2
    with pytest.raises(SessionNotFoundError):
        await store.resume("short")
    assert [m.session_id async for m in store.sessions()] == ["pinned"]
    assert await store.gc() == 1
    assert bits_equal((await store.resume("pinned")).kv, kv)


async def test_tenants_are_isolated(open_store) -> None:  # type: ignore[no-untyped-def]
    toks, kv = random_tokens(128), random_kv(SPEC4, 128)
    async with open_store(tenant="alice") as alice:
        await alice.snapshot("s", toks, kv)
        await alice.put_prefix(toks, kv)
    async with open_store(tenant="bob") as bob:
        with pytest.raises(SessionNotFoundError):
            await bob.resume("s")
        assert (await bob.match(toks)).tokens == 0  # another tenant's namespace: no match
        assert [m async for m in bob.sessions()] == []


async def test_tenant_views_share_tiers_but_never_sessions_or_chunks(store: StateStore) -> None:
    a, b = store.for_tenant("acme"), store.for_tenant("globex")
    tokens = random_tokens(200, seed=7)
    kv = random_kv(SPEC4, 200, seed=7)
    await a.snapshot("s1", tokens, kv)
    await a.put_prefix(tokens[:128], kv[:, :, :128])
    assert (await b.match(tokens)).tokens == 0  # another namespace: a's chunks are not b's
    with pytest.raises(SessionNotFoundError):
        await b.resume("s1")
    with pytest.raises(SessionNotFoundError):
        await b.delete("s1")
    assert [m.session_id async for m in b.sessions()] == []
    await b.close()  # a view closes nothing
    assert bits_equal((await a.resume("s1")).kv, kv)
    assert (await a.match(tokens)).tokens == 192


async def test_a_directory_reopened_with_another_chunk_size_resumes_what_it_holds(tmp_path: Path) -> None:
    """Chunk size is store configuration, not recorded in the directory: the manifest's own chunk
    size decides the spans (a store reopened with the default raised IndexError before)."""
    toks, kv = random_tokens(300), random_kv(SPEC4, 300)
    async with StateStore.open(tmp_path, SPEC4, chunk_tokens=32) as store:
        await store.snapshot("s", toks, kv)
    async with StateStore.open(tmp_path, SPEC4, chunk_tokens=128) as store:
        r = await store.resume("s")
        assert r.complete and bits_equal(r.kv, kv)
        await store.snapshot("s", toks, kv)  # rewritten in this store's chunks
        assert (await store.session("s")).chunk_tokens == 128 and bits_equal((await store.resume("s")).kv, kv)


async def test_concurrent_snapshots_of_one_session_serialize(store: StateStore) -> None:
    """8 writers of the same sessions, no expected_version: every snapshot commits, versions are
    consecutive, and each session ends holding one writer's whole state (the lock map is empty after).
    A lock dropped from its map right after a release that woke a waiter let a third writer make a
    second lock for the same session: ConflictError ("at version 3, expected 2")."""
    import asyncio

    ids = ["u", "v"]
    kvs = [random_kv(SPEC4, 80, seed=s) for s in range(8)]
    toks = [random_tokens(80, seed=s) for s in range(8)]  # a writer's KV is a function of its tokens
    views = [store, store.for_tenant(store.tenant)]  # a tenant view shares the locks
    versions: dict[str, list[int]] = {i: [] for i in ids}

    async def writer(w: int) -> None:
        for round_ in range(12):
            sid = ids[(w + round_) % len(ids)]
            m = await views[w % 2].snapshot(sid, toks[w], kvs[w], state={"w": w})
            versions[sid].append(m.version)

    await asyncio.gather(*(writer(w) for w in range(8)))
    for sid in ids:
        assert sorted(versions[sid]) == list(range(1, len(versions[sid]) + 1))
        r = await store.resume(sid)
        assert r.manifest.version == len(versions[sid])
        assert r.manifest.tokens == toks[r.state["w"]] and bits_equal(r.kv, kvs[r.state["w"]])
    assert len(store._scope.locks) == 0


async def test_keyed_lock_survives_a_woken_waiter() -> None:
    """The exact interleaving: A holds, B waits, A releases (B woken, not yet run), C arrives.
    C must wait for B, never run beside it."""
    import asyncio

    from agentstate.keyed_locks import KeyedLocks

    locks = KeyedLocks()
    inside: list[str] = []
    overlap: list[tuple[str, ...]] = []

    async def user(name: str, release: asyncio.Event | None = None) -> None:
        async with locks.hold("s"):
            inside.append(name)
            if len(inside) > 1:
                overlap.append(tuple(inside))
            if release is not None:
                await release.wait()
            await asyncio.sleep(0)
            inside.remove(name)

    go = asyncio.Event()
    a = asyncio.create_task(user("a", go))
    await asyncio.sleep(0)
    b = asyncio.create_task(user("b"))
    await asyncio.sleep(0)
    go.set()
    await asyncio.sleep(0)  # a releases: b is woken but has not run yet
    c = asyncio.create_task(user("c"))
    await asyncio.gather(a, b, c)
    assert overlap == [] and len(locks) == 0
