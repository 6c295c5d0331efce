"""LMDB's value log: large values in segment files, pointers in LMDB (backends/value_log.py).

Round trips are bit-exact across restarts, mixed with values kept inline and with directories
written before the log existed; every class of damage to a segment or a pointer (cut, removed,
overwritten, garbage pointer records) is a miss that the chunk layer recomputes, never a signal
and never wrong bytes; deleted space comes back (empty segments removed, sparse ones compacted)
without moving a byte of what is live; the tier's size limit covers the log.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import lmdb
import pytest

from agentstate import StateStore, StoreConfig
from agentstate.backends.lmdb import LMDBBackend
from agentstate.backends.value_log import Pointer
from agentstate.config import TierConfig
from agentstate.errors import CapacityError, InvalidArgumentError
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens

MIN = 64 << 10
SIZES = (0, 1, 4095, 4096, 4097, MIN - 1, MIN, MIN + 1, 300_000, 1 << 20, (1 << 20) + 17)


def backend(path: Path, **kw: object) -> LMDBBackend:
    kw.setdefault("value_log_min_bytes", MIN)
    kw.setdefault("segment_bytes", 1 << 20)
    return LMDBBackend(path, map_size=8 << 20, **kw)  # type: ignore[arg-type]


async def read_all(b: LMDBBackend, keys: list[str]) -> dict[str, bytes]:
    got: dict[str, bytes] = {}
    found = await b.read(keys, lambda i, view: got.__setitem__(keys[i], bytes(view)))
    assert [k in got for k in keys] == found
    return got


def values(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"c/{seed}-{i}": rng.randbytes(n) for i, n in enumerate(SIZES)}


def segments(path: Path) -> list[Path]:
    return sorted((path / "values").glob("*.seg"))


async def test_round_trips_inline_and_logged_values_across_reopen(tmp_path: Path) -> None:
    want = values(1)
    b = backend(tmp_path / "db")
    await b.put(list(want), list(want.values()))
    assert await read_all(b, list(want)) == want
    await b.close()
    assert segments(tmp_path / "db"), "large values went to the value log"
    b = backend(tmp_path / "db")
    assert await read_all(b, list(want)) == want
    bufs = [memoryview(bytearray(len(v) + 8)) for v in want.values()]
    assert await b.get_into(list(want), bufs) == [len(v) for v in want.values()]
    assert all(bytes(buf[: len(v)]) == v for buf, v in zip(bufs, want.values()))
    assert await b.sizes(list(want)) == [len(v) for v in want.values()]
    assert sorted([k async for k in b.keys()]) == sorted(want)
    assert sorted([k async for k in b.keys("c/1-1")]) == sorted(k for k in want if k.startswith("c/1-1"))
    assert (await b.stats()).items == len(want)
    await b.close()


async def test_a_directory_written_without_the_log_reads_and_moves_on(tmp_path: Path) -> None:
    old = values(2)
    b = backend(tmp_path / "db", value_log_min_bytes=None)
    await b.put(list(old), list(old.values()))
    await b.close()
    assert not segments(tmp_path / "db")
    b = backend(tmp_path / "db")  # the log on: old values stay where they are and read as before
    new = values(3)
    await b.put(list(new), list(new.values()))
    assert await read_all(b, [*old, *new]) == {**old, **new}
    await b.put(list(old), list(old.values()))  # a re-put of an inline value moves it; each key once
    assert sorted([k async for k in b.keys()]) == sorted([*old, *new])
    await b.delete(list(old))
    assert await b.exists(list(old)) == [False] * len(old)
    await b.close()
    b = backend(tmp_path / "db", value_log_min_bytes=None)  # the log off again: what it holds still reads
    assert await read_all(b, list(new)) == new
    await b.close()


async def test_keys_of_the_backend_itself_are_refused(tmp_path: Path) -> None:
    b = backend(tmp_path / "db")
    for key in ("\x01values", "\x01next-segment", ""):
        with pytest.raises(InvalidArgumentError):
            await b.put([key], [b"x" * MIN])
    await b.close()


def damage_segment(path: Path, how: str) -> None:
    seg = segments(path)[0]
    if how == "cut":
        os.truncate(seg, seg.stat().st_size // 3)
    elif how == "removed":
        seg.unlink()
    elif how == "emptied":
        os.truncate(seg, 0)
    elif how == "replaced":  # a file of the same size and other bytes
        seg.write_bytes(os.urandom(seg.stat().st_size))


def damage_pointers(path: Path, how: str, rng: random.Random) -> None:
    with lmdb.open(str(path), max_dbs=1) as env:
        db = env.open_db(b"\x01values", create=False)
        with env.begin(write=True, db=db) as txn:
            for key, raw in list(txn.cursor()):
                if key.startswith(b"\x01"):
                    continue
                p = Pointer.unpack(raw)
                assert p is not None
                bad = {
                    "garbage": rng.randbytes(len(raw)),
                    "short": raw[: rng.randrange(len(raw))],
                    "past-the-end": Pointer(p.segment, p.offset, p.length + (64 << 20)).pack(),
                    "far-offset": Pointer(p.segment, 1 << 40, p.length).pack(),
                    "other-segment": Pointer(p.segment + 1000, p.offset, p.length).pack(),
                    "unaligned": Pointer(p.segment, p.offset + 1, p.length).pack(),
                }[how]
                txn.put(key, bad)


@pytest.mark.parametrize("how", ["cut", "removed", "emptied", "garbage", "short", "past-the-end", "far-offset",
                                 "other-segment", "unaligned"])  # fmt: skip
async def test_damaged_segments_and_pointers_are_misses_never_a_signal(tmp_path: Path, how: str) -> None:
    want = {k: v for k, v in values(4).items() if len(v) >= MIN}
    b = backend(tmp_path / "db", segment_bytes=64 << 20)
    await b.put(list(want), list(want.values()))
    await b.close()
    if how in ("cut", "removed", "emptied"):
        damage_segment(tmp_path / "db", how)
    else:
        damage_pointers(tmp_path / "db", how, random.Random(how))
    b = backend(tmp_path / "db", segment_bytes=64 << 20)
    got = await read_all(b, list(want))
    assert all(got[k] == want[k] for k in got), "a damaged value log served wrong bytes"
    if how not in ("cut",):
        assert not got, f"{how}: every damaged value is a miss"
    await b.put(["c/after"], [b"z" * MIN])  # the tier keeps working
    assert await read_all(b, ["c/after"]) == {"c/after": b"z" * MIN}
    await b.put(list(want), list(want.values()))  # storing the same values again repairs every one
    assert await read_all(b, list(want)) == want
    await b.close()
    b = backend(tmp_path / "db", segment_bytes=64 << 20)
    assert await read_all(b, list(want)) == want
    await b.close()


async def test_deleted_space_comes_back_and_live_bytes_never_move_wrongly(tmp_path: Path) -> None:
    rng = random.Random(6)
    b = backend(tmp_path / "db", segment_bytes=1 << 20)
    stored = {f"c/{i}": rng.randbytes(rng.choice((MIN, 200_000, 300_000))) for i in range(40)}
    await b.put(list(stored), list(stored.values()))
    for round_ in range(6):  # delete a random part, add a little, check every live byte
        gone = rng.sample(sorted(stored), len(stored) // 3)
        await b.delete(gone)
        for k in gone:
            del stored[k]
        fresh = {f"c/r{round_}-{i}": rng.randbytes(MIN * 2) for i in range(3)}
        await b.put(list(fresh), list(fresh.values()))
        stored.update(fresh)
        assert await read_all(b, list(stored)) == stored
        live = sum(len(v) for v in stored.values())
        sealed = sum(p.stat().st_size for p in segments(tmp_path / "db")[:-1])
        assert sealed <= 2 * live + (1 << 20), f"round {round_}: {sealed} bytes of sealed segments for {live} live"
    assert b._counts["compactions"] > 0
    await b.delete(list(stored))
    await b.put(["c/last"], [b"y" * MIN])
    assert len(segments(tmp_path / "db")) == 1, "segments with nothing live are removed"
    await b.close()
    b = backend(tmp_path / "db")
    assert await read_all(b, ["c/last"]) == {"c/last": b"y" * MIN}
    await b.close()


async def test_the_size_limit_covers_the_value_log(tmp_path: Path) -> None:
    b = LMDBBackend(tmp_path / "db", map_size=2 << 20, max_map_size=4 << 20, value_log_min_bytes=MIN)
    kept = os.urandom(1 << 20)
    await b.put(["c/kept"], [kept])
    with pytest.raises(CapacityError):
        await b.put([f"c/{i}" for i in range(8)], [os.urandom(1 << 20) for _ in range(8)])
    assert await b.exists([f"c/{i}" for i in range(8)]) == [False] * 8  # the refused batch left nothing
    assert await read_all(b, ["c/kept"]) == {"c/kept": kept}
    await b.close()
    total = sum(p.stat().st_size for p in segments(tmp_path / "db"))
    assert total <= 4 << 20


async def test_leftovers_of_a_crash_are_removed_by_reclaim_and_live_segments_stay(tmp_path: Path) -> None:
    """A writer killed after appending and before committing leaves a segment nothing names: the
    next writer's reclaim (what gc calls) removes it; a read-only open touches nothing."""
    want = {k: v for k, v in values(7).items() if len(v) >= MIN}
    b = backend(tmp_path / "db")
    await b.put(list(want), list(want.values()))
    await b.close()
    live = segments(tmp_path / "db")
    leftover = tmp_path / "db" / "values" / "000000009999.seg"
    leftover.write_bytes(os.urandom(3 * 4096))
    b = backend(tmp_path / "db")
    assert await read_all(b, list(want)) == want
    assert leftover.exists()  # opening and reading remove nothing
    await b.reclaim()
    assert not leftover.exists() and segments(tmp_path / "db") == live
    await b.put(["c/new"], [b"n" * MIN])  # a new segment takes a number past the leftover's
    assert all(int(p.name[:-4]) > 9999 for p in segments(tmp_path / "db") if p not in live)
    assert await read_all(b, [*want, "c/new"]) == {**want, "c/new": b"n" * MIN}
    await b.close()


@pytest.mark.parametrize("how", ["removed", "cut", "replaced"])
async def test_a_store_over_a_damaged_log_reports_resumes_a_prefix_and_repairs(tmp_path: Path, how: str) -> None:
    """What an operator would see: verify names the damage and the sessions it costs, a resume gets
    the verified prefix bit for bit, and the next snapshot of the same content makes it whole."""
    from agentstate.ops.verify import verify

    data = tmp_path / "data"
    cfg = StoreConfig(path=data, tiers=[TierConfig(kind="lmdb", path=Path("chunks"))], chunk_tokens=64,
                      lmdb_map_size=64 << 20, lmdb_value_log_min_bytes=MIN)  # fmt: skip
    tokens, kv = random_tokens(64 * 8 + 5, seed=8), random_kv(SPEC4, 64 * 8 + 5, seed=8)
    async with StateStore.open(cfg, SPEC4) as store:
        await store.snapshot("s", tokens, kv)
    damage_segment(data / "chunks", how)
    async with StateStore.open(cfg, SPEC4) as store:
        report = await verify(store)
        assert not report.clean and [a.session_id for a in report.affected] == ["s"]
        result = await store.resume("s")
        assert result.restored_tokens < len(tokens)
        assert bits_equal(result.kv[:, :, : result.restored_tokens], kv[:, :, : result.restored_tokens])
        await verify(store, repair=True)
        await store.snapshot("s", tokens, kv)
        assert (await verify(store)).clean
    async with StateStore.open(cfg, SPEC4) as store:
        result = await store.resume("s")
        assert result.complete and bits_equal(result.kv, kv)


async def test_a_put_replaces_and_one_buffer_may_back_several_keys(tmp_path: Path) -> None:
    """Put over a stored key replaces its value (as LMDB's own put does: a damaged copy can be
    overwritten); one buffer under two keys, a key twice in a batch and concurrent puts of one key
    all leave each key with exactly one readable value and the live-byte count exact."""
    import asyncio

    b = backend(tmp_path / "db")
    shared, other = os.urandom(MIN * 2), os.urandom(MIN * 3)
    await b.put(["c/a", "c/b"], [shared, shared])
    await b.put(["c/a"], [other])
    await asyncio.gather(b.put(["c/c"], [shared]), b.put(["c/c"], [other]), b.put(["c/d", "c/d"], [shared, other]))
    got = await read_all(b, ["c/a", "c/b", "c/c", "c/d"])
    assert got["c/a"] == other and got["c/b"] == shared and got["c/c"] in (shared, other) and got["c/d"] == other
    assert b._log.live_bytes == sum(len(v) for v in got.values())
    await b.delete(["c/a", "c/b", "c/c", "c/d"])
    assert b._log.live_bytes == 0
    await b.close()
