"""Damaged LMDB files, chunks and catalog alike, are typed errors: never a signal, never an empty store.

LMDB maps its data file: a page past the end of a truncated file is a SIGBUS when touched, and a
garbage page sends LMDB (and py-lmdb, which prefaults a value's pages) to read wherever its sizes
and offsets point. So every fault here is met in a subprocess, whose return code tells a typed
error (1) from a signal (negative). The data directories are real ones, written by a StateStore.

Fault classes: truncation to several lengths, a page overwritten with garbage, the catalog
removed, and another process growing the map (MDB_MAP_RESIZED).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from agentstate.backends.lmdb import LMDBBackend

from agentstate import StateStore
from agentstate.catalog import LMDBCatalog
from agentstate.keys import ChunkKey
from agentstate.manifest import SessionManifest
from agentstate.ops.admin import record_spec
from agentstate.ops.verify import verify
from tests.conftest import SPEC4, random_kv, random_tokens
from tests.cli_process import run_cli

AGENTSTATE = shutil.which("agentstate")
CHUNK = 64
PAGE = 4096
SESSIONS = {f"s{i}": CHUNK * 5 + 17 * i for i in range(4)}  # five chunks and a tail each

OPENER = r"""
import asyncio, sys
from pathlib import Path
from agentstate import ModelSpec, StateStore
from agentstate.errors import AgentStateError

spec = ModelSpec.model_validate_json(sys.argv[1])

async def use(data):
    async with StateStore.open(Path(data), spec, chunk_tokens=64, lmdb_map_size=64 << 20) as store:
        tokens = 0
        async for m in store.sessions():
            tokens += (await store.resume(m.session_id)).restored_tokens
        return tokens

for data in sys.argv[2:]:
    print("open", data, flush=True)
    try:
        print("ok", data, asyncio.run(use(data)), flush=True)
    except AgentStateError as exc:
        print("typed", data, type(exc).__name__, str(exc).replace(chr(10), " "), flush=True)
    except BaseException as exc:
        print("untyped", data, type(exc).__name__, exc, flush=True)
"""


def open_each(dirs: list[Path]) -> dict[str, list[str]]:
    """Open, list and resume every directory in one subprocess: {dir: ["ok"|"typed"|..., details]}."""
    done = subprocess.run(
        [sys.executable, "-c", OPENER, SPEC4.model_dump_json(), *map(str, dirs)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    assert done.returncode == 0, f"signal or crash (rc {done.returncode}) at {lines[-1:]}: {done.stderr[-2000:]}"
    results = {}
    for line in lines:
        kind, data, *rest = line.split(" ", 3)
        if kind != "open":
            results[data] = [kind, *rest]
    assert set(results) == set(map(str, dirs))
    return results


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    assert AGENTSTATE is not None
    env = {**os.environ, "AGENTSTATE_CHUNK_TOKENS": str(CHUNK), "COLUMNS": "200"}
    return run_cli(*args, env=env)  # its own process (tests/cli_process.py)


needs_cli = pytest.mark.skipif(AGENTSTATE is None, reason="the agentstate command is not installed")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory (chunks and catalog in LMDB) with four sessions and a shared prefix."""
    import asyncio

    data = tmp_path_factory.mktemp("written") / "data"

    async def write() -> None:
        async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK, lmdb_map_size=64 << 20) as store:
            for i, (sid, n) in enumerate(SESSIONS.items()):
                await store.snapshot(sid, random_tokens(n, seed=i), random_kv(SPEC4, n, seed=i))

    asyncio.run(write())
    record_spec(data, SPEC4)
    return data


def copy(written: Path, to: Path) -> Path:
    shutil.copytree(written, to)
    (to / "LOCK").unlink(missing_ok=True)
    return to


def btree_pages(file: Path) -> list[int]:
    """Page numbers whose header says branch or leaf page of that number (some may be free)."""
    raw = file.read_bytes()
    pages = []
    for n in range(2, len(raw) // PAGE):
        pgno, _, flags = struct.unpack_from("<QHH", raw, n * PAGE)
        if pgno == n and flags in (1, 2):
            pages.append(n)
    return pages


# -- truncation -------------------------------------------------------------------------------------


def last_page_in_use(file: Path) -> int:
    """The highest page the file's newest snapshot references (its last pages may be free: LMDB
    commits with pages it allocated and freed again, and cutting those loses nothing)."""
    from agentstate.backends.lmdb_env import _HDR, _U64, _Walk

    with open(file, "rb") as f:
        metas = [os.pread(f.fileno(), _HDR + 136, n * PAGE) for n in (0, 1)]
        txnid = max(_U64.unpack_from(m, _HDR + 128)[0] for m in metas)
        walk = _Walk(f.fileno(), os.fstat(f.fileno()).st_size, PAGE)
        assert walk.run(txnid) is None
    return max(walk.seen)


def cuts(file: Path) -> dict[str, int]:
    size, last = file.stat().st_size, last_page_in_use(file)
    return {"empty": 0, "1 byte": 1, "one page": PAGE, "half": size // 2,
            "last page cut": last * PAGE, "last byte cut": (last + 1) * PAGE - 1}  # fmt: skip


@pytest.mark.parametrize("which", ["chunks", "catalog"])
def test_truncated_file_is_corrupt_data_at_open_never_a_signal_nor_an_empty_store(
    written: Path, tmp_path: Path, which: str
) -> None:
    dirs = {}
    for name, length in cuts(written / which / "data.mdb").items():
        data = copy(written, tmp_path / name.replace(" ", "-"))
        os.truncate(data / which / "data.mdb", length)
        dirs[name] = data
    results = open_each(list(dirs.values()))
    for name, data in dirs.items():
        kind, *detail = results[str(data)]
        assert kind == "typed" and detail[0] == "CorruptDataError", f"{which} {name}: {kind} {detail}"
        assert f"{which}/data.mdb" in detail[1], detail  # the message names the file
    assert (dirs["empty"] / which / "data.mdb").stat().st_size == 0  # not re-initialised as a fresh store


@needs_cli
@pytest.mark.parametrize(("which", "cut"), [("chunks", "half"), ("catalog", "empty"), ("catalog", "last page cut")])
def test_cli_reports_a_truncated_directory_and_exits_1(written: Path, tmp_path: Path, which: str, cut: str) -> None:
    data = copy(written, tmp_path / "data")
    os.truncate(data / which / "data.mdb", cuts(data / which / "data.mdb")[cut])
    commands = [("verify",), ("verify", "--json"), ("ls",), ("stats",)] if cut != "last page cut" else [("verify",)]
    for command in commands:
        done = cli(*command, "-p", data)
        assert done.returncode == 1, (command, done.returncode, done.stderr)
        assert "CorruptDataError" in done.stderr and f"{which}/data.mdb" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


# -- garbage pages ----------------------------------------------------------------------------------


def garble(file: Path, page: int, how: str, rng: random.Random) -> None:
    with open(file, "r+b") as f:
        f.seek(page * PAGE)
        buf = bytearray(f.read(PAGE))
        if how == "random page":
            buf[:] = rng.randbytes(PAGE)
        elif how == "random body":  # the header still says which page it is
            buf[16:] = rng.randbytes(PAGE - 16)
        else:  # a few flipped bits
            for _ in range(8):
                buf[rng.randrange(PAGE)] ^= 1 << rng.randrange(8)
        f.seek(page * PAGE)
        f.write(buf)


@pytest.mark.parametrize("which", ["chunks", "catalog"])
def test_garbage_pages_are_typed_errors_or_misses_never_a_signal(written: Path, tmp_path: Path, which: str) -> None:
    rng = random.Random(f"garbage-{which}")
    file = written / which / "data.mdb"
    pages = sorted({*btree_pages(file), file.stat().st_size // PAGE // 2})  # every B-tree page, and the middle one
    dirs = []
    for page in pages:
        for how in ("random page", "random body", "flipped bits"):
            data = copy(written, tmp_path / f"p{page}-{how.replace(' ', '-')}")
            garble(data / which / "data.mdb", page, how, rng)
            dirs.append(data)
    results = open_each(dirs)
    kinds = [r[0] for r in results.values()]
    assert set(kinds) <= {"ok", "typed"}, [r for r in results.values() if r[0] not in ("ok", "typed")]
    assert "typed" in kinds  # damage to the tree's pages is seen
    for kind, *detail in results.values():
        if kind == "typed":
            assert detail[0] == "CorruptDataError", detail


async def test_a_garbage_overflow_page_is_a_miss_and_the_rest_resumes(written: Path, tmp_path: Path) -> None:
    """A chunk's own pages damaged: the codec's checksum catches it; the session resumes up to it."""
    data = copy(written, tmp_path / "data")
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK, lmdb_map_size=64 << 20) as store:
        victim = (await store.session("s2")).chunk_keys[3]
    import lmdb

    with lmdb.open(str(data / "chunks"), readonly=True, lock=False) as env, env.begin() as txn:
        value = txn.get(victim.encode())
    assert value is not None
    offset = (data / "chunks" / "data.mdb").read_bytes().index(value[:PAGE])  # the value's first bytes
    garble(data / "chunks" / "data.mdb", offset // PAGE + 1, "random page", random.Random(5))  # a page inside it
    results = open_each([data])
    assert results[str(data)][0] == "ok"
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK, lmdb_map_size=64 << 20) as store:
        r = await store.resume("s2")
        assert r.restored_tokens == 3 * CHUNK


# -- the catalog lost ---------------------------------------------------------------------------------


async def test_without_its_catalog_the_store_opens_and_verify_reports_every_chunk_as_an_orphan(
    written: Path, tmp_path: Path
) -> None:
    data = copy(written, tmp_path / "data")
    shutil.rmtree(data / "catalog")
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK, lmdb_map_size=64 << 20) as store:
        held = [k for p in store.key_prefixes for k in await store.chunks.scan(store.chunks.record_tier, p)]
        report = await verify(store)
    assert held and sorted(report.orphans) == sorted(held)
    assert report.catalog_lost and report.catalog_created and not report.clean
    if AGENTSTATE is None:
        return
    again = cli("verify", "-p", data, "--json")  # the catalog is there now, and empty: still lost
    assert again.returncode == 1, again.stderr
    found: dict[str, Any] = json.loads(again.stdout)
    assert found["catalog_lost"] and not found["catalog_created"] and len(found["orphans"]) == len(held)
    shutil.rmtree(data / "catalog")
    table = cli("verify", "-p", data)
    assert table.returncode == 1 and "catalog lost" in table.stdout and "no catalog was found" in table.stdout


async def test_a_few_orphans_beside_a_catalog_are_reported_but_clean(written: Path, tmp_path: Path) -> None:
    data = copy(written, tmp_path / "data")
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK, lmdb_map_size=64 << 20) as store:
        m = await store.session("s1")
        removed = await store.catalog.remove(m.tenant, m.session_id)  # as if a crash came before the deletes
        assert removed[0] is not None
        report = await verify(store)
    assert set(report.orphans) == {*m.chunk_keys, m.tail_key}  # sessions share no chunks here
    assert report.clean and not report.catalog_lost


# -- another process grows the map -----------------------------------------------------------------

GROW = r"""
import os, sys, lmdb
path, map_size, until, named = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
env = lmdb.open(path, map_size=map_size, max_dbs=8)
db = env.open_db(b"filler") if named else None
i = 0
while os.path.getsize(os.path.join(path, "data.mdb")) < until:
    with env.begin(write=True, db=db) as txn:
        for _ in range(16):
            txn.put(b"filler/%08d" % i, os.urandom(64 << 10))
            i += 1
env.close()
"""


def grow(path: Path, map_size: int, until: int, named: bool = False) -> None:
    """Another process opens the environment with a bigger map and writes until the file is `until` long."""
    done = subprocess.run(
        [sys.executable, "-c", GROW, str(path), str(map_size), str(until), "1" if named else "0"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


async def test_a_map_grown_by_another_process_is_adopted_by_the_backend(tmp_path: Path) -> None:
    backend = LMDBBackend(tmp_path / "lmdb", map_size=1 << 20)
    try:
        await backend.put(["c/a"], [b"x" * 1000])
        grow(tmp_path / "lmdb", 4 << 20, 3 << 20)  # past this process's 1 MiB map: MDB_MAP_RESIZED
        await backend.put(["c/b"], [b"y" * 1000])
        grow(tmp_path / "lmdb", 8 << 20, 6 << 20)
        assert [k async for k in backend.keys("c/")] == ["c/a", "c/b"]
        grow(tmp_path / "lmdb", 16 << 20, 12 << 20)
        got: list[bytes] = []
        assert await backend.read(["c/a", "c/b", "c/none"], lambda i, v: got.append(bytes(v))) == [True, True, False]
        assert got == [b"x" * 1000, b"y" * 1000]
        grow(tmp_path / "lmdb", 32 << 20, 24 << 20)
        assert (await backend.stats()).items > 2 and await backend.exists(["c/a"]) == [True]
    finally:
        await backend.close()


def manifest(sid: str, keys: list[str]) -> SessionManifest:
    return SessionManifest(
        session_id=sid, tenant="t", fingerprint="f" * 32, chunk_tokens=4, tokens=list(range(10)),
        chunk_keys=[ChunkKey(k) for k in keys], version=1, created_at=0.0, updated_at=0.0,
    )  # fmt: skip


async def test_a_map_grown_by_another_process_is_adopted_by_the_catalog(tmp_path: Path) -> None:
    cat = LMDBCatalog(tmp_path / "cat", map_size=1 << 20)
    try:
        await cat.commit(manifest("a", ["k1"]), None)
        grow(tmp_path / "cat", 4 << 20, 3 << 20, named=True)
        await cat.commit(manifest("b", ["k1", "k2"]), None)  # a write transaction first
        grow(tmp_path / "cat", 8 << 20, 6 << 20, named=True)
        assert [m.session_id for m in await cat.manifests("t")] == ["a", "b"]  # then a read
        assert await cat.refcounts(["k1", "k2"]) == [2, 1]
    finally:
        await cat.close()
    reopened = LMDBCatalog(tmp_path / "cat")  # the file other process grew passes the checks at open
    assert await reopened.session_count() == 2
    await reopened.close()


# -- the checks at open never refuse a healthy file -------------------------------------------------


def test_healthy_files_shorter_than_their_last_page_number_pass(tmp_path: Path) -> None:
    """LMDB may commit with its highest page numbers free and never written: such a file is
    shorter than (last_pgno + 1) pages and healthy. Only pages in use must be in the file."""
    import lmdb
    from agentstate.backends.lmdb_env import _check_extent

    file = tmp_path / "env" / "data.mdb"
    rng = random.Random(7)
    short = 0
    env = lmdb.open(str(tmp_path / "env"), map_size=256 << 20, max_dbs=3)
    dbs = [env.open_db(b"a"), env.open_db(b"b"), None]
    keys: list[tuple[bytes, Any]] = []
    for _ in range(300):
        with env.begin(write=True) as txn:
            for _ in range(rng.randrange(1, 60)):
                if rng.random() < 0.55 or not keys:
                    key, db = rng.randbytes(rng.randrange(4, 300)), rng.choice(dbs)
                    keys.append((key, db))
                    txn.put(key, rng.randbytes(rng.choice([0, 10, 300, 1500, 3000, 20000, 200000])), db=db)
                else:
                    key, db = keys.pop(rng.randrange(len(keys)))
                    txn.delete(key, db=db)
        if file.stat().st_size < (env.info()["last_pgno"] + 1) * PAGE:
            short += 1
            _check_extent(env, file, "test")  # the check open_env makes
    env.close()
    assert short, "the workload never left a short file: this test checks nothing"
