"""Cost independent of the store's size (issue 29, item 5): what open, dedupe, reads and gc do
without an index of every stored key, and the LMDB open check that a clean close lets skip.

- Open lists nothing: the index learns a key of LMDB or a file tier when it is asked for, so after
  a restart resumes are bit-exact, prefixes hit, dedupe writes nothing twice, a fork checks its
  chunks on disk, and a damaged host copy falls back to LMDB.
- The LMDB page walk runs on an open unless a clean close recorded the file exactly as it is now:
  truncation, garbage in place (even with its mtime set back), a crash and a malformed record all
  make the next open walk (and refuse a damaged file).
- gc in steps: each step reads at most `limit` sessions and keys, a pass removes exactly what
  nothing names, and commits between steps lose nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentstate import StateStore
from agentstate.backends import lmdb_env
from agentstate.config import TierConfig
from agentstate.errors import CorruptDataError, InvalidArgumentError
from agentstate.ops import admin
from agentstate.keys import CHUNK_PREFIX, TAIL_PREFIX
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens

CHUNK = 16


def opener(root: Path, **overrides: Any) -> Callable[[], Any]:
    tiers = [TierConfig(kind="host", capacity_bytes=8 << 20), TierConfig(kind="lmdb", path=Path("chunks"))]
    options: dict[str, Any] = {"chunk_tokens": CHUNK, "lmdb_map_size": 64 << 20, "tiers": tiers, **overrides}
    return lambda: StateStore.open(root, SPEC4, **options)


async def stored(store: StateStore, tier: str = "lmdb") -> set[str]:
    prefixes = (f"{CHUNK_PREFIX}{store.fingerprint}/", f"{TAIL_PREFIX}{store.fingerprint}/")
    return {k for p in prefixes for k in await store.chunks.scan(tier, p)}


def walks(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record each LMDB page walk (the real one still runs)."""
    seen: list[Path] = []
    real = lmdb_env._check_pages

    def counted(file: Path, psize: int, txnid: int) -> str | None:
        seen.append(Path(file))
        return real(file, psize, txnid)

    monkeypatch.setattr(lmdb_env, "_check_pages", counted)
    return seen


# -- the index is filled lazily ------------------------------------------------------------------


async def test_a_reopened_store_lists_nothing_and_finds_everything(tmp_path: Path) -> None:
    open_store = opener(tmp_path / "d")
    sessions = {f"s{i}": (random_tokens(5 * CHUNK + 3, seed=i), random_kv(SPEC4, 5 * CHUNK + 3, seed=i)) for i in range(3)}
    prompt = random_tokens(4 * CHUNK, seed=50)
    async with open_store() as store:
        for sid, (tokens, kv) in sessions.items():
            await store.snapshot(sid, tokens, kv)
        await store.put_prefix(prompt, random_kv(SPEC4, 4 * CHUNK, seed=50))
        on_disk = await stored(store)
    async with open_store() as store:
        assert len(store.chunks) == 0, "open listed the LMDB tier"
        report = await admin.stats(store)  # counts come from the backend, not from what the index learnt
        assert next(t.chunks for t in report.tiers if t.name == "lmdb") == len(on_disk)
        match = await store.match(prompt)
        assert match.tokens == 4 * CHUNK  # a prefix stored before the restart hits
        for sid, (tokens, kv) in sessions.items():
            result = await store.resume(sid)
            assert result.complete and result.tokens == tokens and bits_equal(result.kv, kv)
        written = (await store.stats()).tiers
        lmdb_writes = next(t.writes for t in written if t.name == "lmdb")
        tokens, kv = sessions["s0"]
        await store.snapshot("again", tokens, kv)  # every full chunk is on disk already: only the tail is new
        after = next(t.writes for t in (await store.stats()).tiers if t.name == "lmdb")
        assert after - lmdb_writes == 1, "dedupe against chunks stored before the restart failed"
        forked = await store.fork("s1", "s1-copy")  # checks its chunks are durable: asks LMDB
        assert forked.session_id == "s1-copy"
        copy = await store.resume("s1-copy")
        assert copy.complete and bits_equal(copy.kv, sessions["s1"][1])
        assert on_disk <= await stored(store)


async def test_a_damaged_cache_copy_falls_back_to_the_lmdb_copy_the_index_never_listed(tmp_path: Path) -> None:
    tiers = [TierConfig(kind="file", capacity_bytes=64 << 20), TierConfig(kind="lmdb", path=Path("chunks"))]
    open_store = opener(tmp_path / "d", tiers=tiers)  # a file cache (adopted at open: it has a capacity) over LMDB
    tokens, kv = random_tokens(4 * CHUNK, seed=7), random_kv(SPEC4, 4 * CHUNK, seed=7)
    async with open_store() as store:
        await store.snapshot("s", tokens, kv)
        keys = store.chunk_keys(tokens)
        path = Path(store.chunks.backend("file")._locate(keys[1])[1])  # type: ignore[attr-defined]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    async with open_store() as store:
        assert store.chunks.where(keys[1]) == ["file"], "open listed the LMDB tier"
        result = await store.resume("s")
        assert result.complete and bits_equal(result.kv, kv)
        assert (await store.stats()).counters["corrupt"] == 1
        assert "lmdb" in store.chunks.where(keys[1])


async def test_a_key_remembered_absent_is_found_once_written(tmp_path: Path) -> None:
    """Misses of a lazy tier are remembered (an engine asks about pages nobody stored, again and
    again); a key written afterwards is found, and a reopened store asks afresh."""
    open_store = opener(tmp_path / "d")
    tokens, kv = random_tokens(3 * CHUNK, seed=11), random_kv(SPEC4, 3 * CHUNK, seed=11)
    async with open_store() as store:
        keys = store.chunk_keys(tokens)
        assert (await store.match(tokens)).chunks == 0 and await store.chunks.present(keys) == [False] * 3
        await store.put_prefix(tokens, kv)
        assert (await store.match(tokens)).chunks == 3
    async with open_store() as store:
        assert await store.chunks.present(keys) == [True] * 3
        assert (await store.match(tokens)).tiers == ["lmdb"] * 3


# -- the LMDB open check -------------------------------------------------------------------------


async def test_a_clean_close_lets_the_next_open_skip_the_walk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    open_store = opener(tmp_path / "d")
    tokens, kv = random_tokens(3 * CHUNK, seed=1), random_kv(SPEC4, 3 * CHUNK, seed=1)
    async with open_store() as store:
        await store.snapshot("s", tokens, kv)
    assert (tmp_path / "d" / "chunks" / lmdb_env.STAMP_FILE).exists()
    seen = walks(monkeypatch)
    async with open_store() as store:
        assert bits_equal((await store.resume("s")).kv, kv)
    assert seen == [], "an unchanged file was walked"
    async with open_store() as store:  # the resume above wrote (a hit time): closed cleanly again
        pass
    assert seen == []


@pytest.mark.parametrize("change", ["truncate", "garbage", "garbage-with-old-mtime", "bad-record", "no-record"])
async def test_any_change_since_the_record_makes_open_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:  # fmt: skip
    open_store = opener(tmp_path / "d")
    tokens, kv = random_tokens(6 * CHUNK, seed=2), random_kv(SPEC4, 6 * CHUNK, seed=2)
    async with open_store() as store:
        await store.snapshot("s", tokens, kv)
    data = tmp_path / "d" / "chunks" / lmdb_env.DATA_FILE
    stamp = data.parent / lmdb_env.STAMP_FILE
    record = json.loads(stamp.read_text())
    size, psize = data.stat().st_size, 4096
    if change == "truncate":
        os.truncate(data, size - psize)
    elif change.startswith("garbage"):
        with open(data, "r+b") as f:  # the last page: a B-tree page every open reads
            f.seek(size - psize)
            f.write(b"\xa5" * psize)
        if change == "garbage-with-old-mtime":
            os.utime(data, ns=(record["st_mtime_ns"], record["st_mtime_ns"]))
    elif change == "bad-record":
        stamp.write_text(json.dumps({**record, "st_size": str(record["st_size"]), "txnid": 10**40}))
    else:
        stamp.unlink()
    seen = walks(monkeypatch)
    if change in ("bad-record", "no-record"):  # a healthy file, walked and opened
        async with open_store() as store:
            assert bits_equal((await store.resume("s")).kv, kv)
    else:
        try:
            async with open_store() as store:  # a damaged last page need not be reachable: then it opens
                result = await store.resume("s")
                assert bits_equal(result.kv, kv[:, :, : result.restored_tokens])
        except CorruptDataError:
            pass
    assert data in seen, f"{change}: the open did not walk the changed file"


def test_a_crash_leaves_a_stale_record_and_the_next_open_walks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "d"
    script = f"""
import asyncio, os, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from tests.test_scale import opener
from tests.conftest import random_kv, random_tokens, SPEC4
from pathlib import Path

async def main():
    async with opener(Path({str(root)!r}))() as store:
        await store.snapshot("a", random_tokens(48, seed=1), random_kv(SPEC4, 48, seed=1))
    store = await opener(Path({str(root)!r}))()
    await store.snapshot("b", random_tokens(48, seed=2), random_kv(SPEC4, 48, seed=2))
    os._exit(0)  # no close: a crash after a commit

asyncio.run(main())
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    seen = walks(monkeypatch)

    async def check() -> None:
        async with opener(root)() as store:
            for sid, seed in (("a", 1), ("b", 2)):
                result = await store.resume(sid)
                assert result.complete and bits_equal(result.kv, random_kv(SPEC4, 48, seed=seed))

    import asyncio

    asyncio.run(check())
    assert root / "chunks" / lmdb_env.DATA_FILE in seen


# -- gc in steps ---------------------------------------------------------------------------------


async def test_gc_steps_are_bounded_and_a_pass_removes_exactly_the_leftovers(tmp_path: Path) -> None:
    open_store = opener(tmp_path / "d")
    async with open_store() as store:
        kept = {}
        for i in range(6):
            tokens, kv = random_tokens(3 * CHUNK + 5, seed=i), random_kv(SPEC4, 3 * CHUNK + 5, seed=i)
            await store.snapshot(f"s{i:02}", tokens, kv, ttl_seconds=0.01 if i % 3 == 0 else None)
            kept[f"s{i:02}"] = kv
        leftover = store.chunk_keys(random_tokens(4 * CHUNK, seed=99))
        with store.chunks.pinned(leftover):  # chunks of a snapshot that never committed
            await store.chunks.write(leftover, [random_kv(SPEC4, CHUNK, seed=i) for i in range(4)], durable=True)
        before = await stored(store)
        with pytest.raises(InvalidArgumentError):
            await store.gc_step(0)
        import asyncio

        await asyncio.sleep(0.05)  # s00 and s03 expire
        steps, removed, scanned = [], 0, 0
        while True:
            step = await store.gc_step(3)
            assert step.sessions <= 3 and step.keys <= 3
            steps.append(step)
            removed += step.removed
            scanned += step.keys
            if len(steps) == 2:  # a commit between two steps of the pass is kept
                tokens, kv = random_tokens(2 * CHUNK + 1, seed=40), random_kv(SPEC4, 2 * CHUNK + 1, seed=40)
                await store.snapshot("late", tokens, kv)
                kept["late"] = kv
            if step.done:
                break
        assert len(steps) > 3 and scanned >= len(before) - 2 * 4  # every key reached (expired ones may go first)
        after = await stored(store)
        assert not set(leftover) & after
        for sid in ("s00", "s03"):
            kept.pop(sid)
        assert {m.session_id for m in [m async for m in store.sessions()]} == set(kept)
        for sid, kv in kept.items():
            assert bits_equal((await store.resume(sid)).kv, kv)
        named = {k for m in [m async for m in store.sessions()] for k in (*m.chunk_keys, m.tail_key) if k}
        assert after == named, "a pass left something no session names, or took something one names"
        assert removed >= 2 + len(leftover)
        again = await store.gc_step(1000)  # the pass ended: this one starts over and finds nothing
        assert again.done and again.removed == 0 and again.keys == len(after)
    async with open_store() as store:
        for sid, kv in kept.items():
            assert bits_equal((await store.resume(sid)).kv, kv)
