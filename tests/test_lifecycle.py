"""The chunk lifecycle under concurrency: gc beside commits never loses what a manifest names,
and gc leaves exactly what manifests and prefixes name, in every durable tier (issue 13).

Every operation that returns is checked afterwards, bit-exact, before and after a reopen.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from agentstate import StateStore
from agentstate.config import TierConfig
from agentstate.errors import AgentStateError, ConflictError, SessionNotFoundError
from agentstate.keys import CHUNK_PREFIX, TAIL_PREFIX
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens

CHUNK = 16
TIERS = [
    TierConfig(kind="host", capacity_bytes=6 << 20),
    TierConfig(kind="file", capacity_bytes=None),
    TierConfig(kind="lmdb", path=Path("chunks")),
]


def opener(root: Path, tiers: list[TierConfig] | None = TIERS) -> Callable[[], Any]:
    return lambda: StateStore.open(root, SPEC4, chunk_tokens=CHUNK, lmdb_map_size=64 << 20, tiers=tiers)


async def stored(store: StateStore, tier: str) -> set[str]:
    prefixes = (f"{CHUNK_PREFIX}{store.fingerprint}/", f"{TAIL_PREFIX}{store.fingerprint}/")
    return {k for p in prefixes for k in await store.chunks.scan(tier, p)}


async def named(store: StateStore, prefixes: list[list[str]]) -> set[str]:
    keys = {k for keys in prefixes for k in keys}
    async for m in store.sessions():
        keys.update(m.chunk_keys)
        if m.tail_key:
            keys.add(m.tail_key)
    return keys


async def check_exact(store: StateStore, expect: dict[str, tuple[list[int], torch.Tensor]]) -> None:
    for sid, (tokens, kv) in expect.items():
        r = await store.resume(sid)
        assert r.tokens == tokens, sid
        assert r.restored_tokens == len(tokens), f"{sid}: restored {r.restored_tokens}/{len(tokens)}"
        assert bits_equal(r.kv, kv), sid


async def check_gc_exact(store: StateStore, prefixes: list[list[str]]) -> None:
    """After a quiet gc: every durable tier holds nothing unnamed, the record tier all that is named."""
    await store.gc()
    live = await named(store, prefixes)
    for tier in store.chunks.tier_names:
        if store.chunks.backend(tier).durable:
            extra = await stored(store, tier) - live
            assert not extra, f"{tier} keeps {len(extra)} keys nothing names"
    missing = live - await stored(store, store.chunks.record_tier)
    assert not missing, f"record tier lacks {len(missing)} named keys"


async def test_gc_beside_fork_and_snapshot_loses_nothing(tmp_path: Path) -> None:
    """The reported shape: gather(gc, fork, gc, snapshot, gc), many rounds, tails included."""
    tokens, kv = random_tokens(90), random_kv(SPEC4, 90)
    expect: dict[str, tuple[list[int], torch.Tensor]] = {}
    async with opener(tmp_path / "d")() as store:
        await store.snapshot("a", tokens, kv)
        expect["a"] = (tokens, kv)
        for i in range(60):
            got = await asyncio.gather(
                store.gc(), store.fork("a", f"f{i}"), store.gc(), store.snapshot(f"s{i}", tokens, kv), store.gc(),
                return_exceptions=True,
            )  # fmt: skip
            assert not [g for g in got if isinstance(g, BaseException)], got
            expect[f"f{i}"] = expect[f"s{i}"] = (tokens, kv)
        await check_exact(store, expect)
        await check_gc_exact(store, [])
    async with opener(tmp_path / "d")() as store:
        await check_exact(store, expect)
        await check_gc_exact(store, [])


NEEDED = ("gc", "snapshot", "fork", "resume")


@pytest.mark.parametrize("seconds", [6.0])
async def test_mixed_load_with_gc_is_exact_after_and_after_reopen(tmp_path: Path, seconds: float) -> None:
    """Many tasks snapshot, fork, delete, put_prefix, resume and gc over host + file + LMDB for a
    bounded time; everything that returned is then exact, and gc leaves exactly what is named.

    The workers go on past `seconds` until every kind of operation has run (at most 10 times as long):
    on a loaded machine a fixed time may not be enough for a gc, a fork or a resume to happen."""
    rng = random.Random(13)
    docs = [random_tokens(64 + 16 * i, seed=50 + i) for i in range(4)]
    doc_kv = [random_kv(SPEC4, len(d), seed=50 + i) for i, d in enumerate(docs)]
    expect: dict[str, tuple[list[int], torch.Tensor]] = {}
    prefixes: list[list[str]] = []
    deadline, cap = time.monotonic() + seconds, time.monotonic() + 10 * seconds
    counts = {"snapshot": 0, "fork": 0, "delete": 0, "prefix": 0, "resume": 0, "gc": 0}
    async with opener(tmp_path / "d")() as store:

        async def worker(w: int) -> None:
            n = 0
            while time.monotonic() < deadline or (not all(counts[k] for k in NEEDED) and time.monotonic() < cap):
                n += 1
                op = rng.choice(["snapshot", "snapshot", "fork", "delete", "prefix", "resume", "gc"])
                sid = f"w{w}-{rng.randrange(6)}"
                try:
                    if op == "snapshot":
                        d = rng.randrange(len(docs))
                        extra = rng.randrange(1, 40)  # a tail of 1..39 tokens past a shared document
                        tokens = docs[d] + random_tokens(extra, seed=w * 1000 + n)
                        kv = torch.cat([doc_kv[d], random_kv(SPEC4, extra, seed=w * 1000 + n)], dim=2)
                        await store.snapshot(sid, tokens, kv, force=True)
                        expect[sid] = (tokens, kv)
                    elif op == "fork" and expect:
                        src = rng.choice(sorted(expect))
                        new = f"{src}.f{w}.{n}"
                        before = expect.get(src)
                        m = await store.fork(src, new)
                        # the fork is of whatever version of src it read: check against the manifest
                        if before is not None and m.tokens == before[0]:
                            expect[new] = before
                        else:
                            expect[new] = (m.tokens, (await store.resume(new)).kv.clone())
                    elif op == "delete":
                        expect.pop(sid, None)
                        await store.delete(sid)
                    elif op == "prefix":
                        d = rng.randrange(len(docs))
                        await store.put_prefix(docs[d], doc_kv[d])
                        prefixes.append(store.chunk_keys(docs[d]))
                    elif op == "resume" and expect:
                        sid = rng.choice(sorted(expect))
                        want = expect.get(sid)
                        r = await store.resume(sid)
                        if want is not None and r.tokens == want[0] and expect.get(sid) is want:
                            assert r.restored_tokens == len(want[0]) and bits_equal(r.kv, want[1]), sid
                    elif op == "gc":
                        await store.gc()
                    counts[op] += 1
                except (SessionNotFoundError, ConflictError):
                    pass

        await asyncio.gather(*(worker(w) for w in range(6)))
        assert all(counts[k] for k in NEEDED), counts
        await check_exact(store, expect)
        await check_gc_exact(store, prefixes)
    async with opener(tmp_path / "d")() as store:
        await check_exact(store, expect)
        await check_gc_exact(store, prefixes)


async def test_failed_snapshot_leaves_no_copies_in_any_tier(tmp_path: Path) -> None:
    """A record tier that refuses (full) fails the snapshot; the cache-tier copies it wrote go too."""
    tiers = [TierConfig(kind="file"), TierConfig(kind="lmdb", path=Path("chunks"))]
    async with StateStore.open(
        tmp_path / "d", SPEC4, chunk_tokens=CHUNK, lmdb_map_size=1 << 20, lmdb_max_map_size=2 << 20, tiers=tiers
    ) as store:
        small = random_tokens(40)
        await store.snapshot("small", small, random_kv(SPEC4, 40))
        before = {t: await stored(store, t) for t in ("file", "lmdb")}
        for seed in range(3):
            big = random_tokens(2048, seed=seed + 7)
            with pytest.raises(AgentStateError):
                await store.snapshot(f"big{seed}", big, random_kv(SPEC4, 2048, seed=seed))
            assert {t: await stored(store, t) for t in ("file", "lmdb")} == before
        r = await store.resume("small")
        assert r.restored_tokens == 40


async def test_gc_sweeps_leftovers_of_every_durable_tier(tmp_path: Path) -> None:
    """Copies no manifest names (a crash between write and commit) go from the file tier too."""
    tiers = [TierConfig(kind="file"), TierConfig(kind="lmdb", path=Path("chunks"))]
    async with StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=CHUNK, tiers=tiers) as store:
        tokens = random_tokens(70)
        await store.snapshot("keep", tokens, random_kv(SPEC4, 70))
        keep = await named(store, [])
        orphans = random_tokens(64, seed=3)
        leftover = store.chunk_keys(orphans)
        with store.chunks.pinned(leftover):
            await store.chunks.write(leftover, [random_kv(SPEC4, CHUNK, seed=i) for i in range(4)], durable=True)
        assert set(leftover) <= await stored(store, "file") and set(leftover) <= await stored(store, "lmdb")
        await store.gc()
        for tier in ("file", "lmdb"):
            assert await stored(store, tier) == keep
    async with StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=CHUNK, tiers=tiers) as store:
        assert (await store.resume("keep")).restored_tokens == 70


async def test_a_catalog_of_the_old_format_keeps_its_tails(tmp_path: Path) -> None:
    """Format 1 counted chunks only: on first open the tails get their counts, so gc keeps them."""
    import lmdb

    async with opener(tmp_path / "d", None)() as store:
        tokens, kv = random_tokens(50), random_kv(SPEC4, 50)
        m = await store.snapshot("s", tokens, kv)
        assert m.tail_key
    env = lmdb.open(str(tmp_path / "d" / "catalog"), max_dbs=4)
    with env.begin(write=True) as txn:  # make it look like format 1
        txn.delete(b"format", db=env.open_db(b"meta", txn=txn))
        txn.delete(m.tail_key.encode(), db=env.open_db(b"refs", txn=txn))
    env.close()
    async with opener(tmp_path / "d", None)() as store:
        await store.gc()
        r = await store.resume("s")
        assert r.restored_tokens == 50 and bits_equal(r.kv, kv)


KILLED_WRITER = """
import asyncio, sys
from pathlib import Path
from agentstate import StateStore
from agentstate.config import TierConfig
from tests.conftest import SPEC4, random_kv, random_tokens
async def main():
    tiers = [TierConfig(kind="file"), TierConfig(kind="lmdb", path=Path("chunks"))]
    async with StateStore.open(sys.argv[1], SPEC4, chunk_tokens=16, tiers=tiers) as store:
        print("ready", flush=True)
        for i in range(10**6):
            n = 600 + i % 300
            await store.snapshot(f"s{i % 5}", random_tokens(n, seed=i), random_kv(SPEC4, n, seed=i))
asyncio.run(main())
"""


@pytest.mark.parametrize("after_s", [0.5, 1.3, 2.2])
async def test_copies_left_by_a_killed_writer_are_swept(tmp_path: Path, after_s: float) -> None:
    """SIGKILL in the middle of snapshots leaves file-tier and LMDB copies no manifest names; after
    a reopen, gc leaves exactly what the committed manifests name, and those resume whole."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path / "d")], cwd=root, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    await asyncio.sleep(after_s)
    proc.kill()
    proc.wait()
    tiers = [TierConfig(kind="file"), TierConfig(kind="lmdb", path=Path("chunks"))]
    async with StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=CHUNK, tiers=tiers) as store:
        await check_gc_exact(store, [])
        async for m in store.sessions():
            assert (await store.resume(m.session_id)).restored_tokens == m.num_tokens
