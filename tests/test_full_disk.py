"""A real full disk: the data directory on an 8 MiB tmpfs, filled by snapshots until it refuses.

The refusal is a typed CapacityError (LMDB reports a full disk as EIO: `disk_full` tells the two
apart), nothing committed before it is lost, the failed snapshot left no session, and once
sessions are deleted and gc runs the same store takes new snapshots again; after a reopen every
surviving session is still bit-exact. Needs root to mount a tmpfs (skipped otherwise).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentstate import StateStore, StoreConfig
from agentstate.config import TierConfig
from agentstate.errors import CapacityError, SessionNotFoundError
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens

TOKENS = 512  # 1 MiB of KV per session in SPEC4


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def config(data: Path, file_tier: bool, value_log: bool = False) -> StoreConfig:
    tiers = [TierConfig(kind="host", capacity_bytes=64 << 20)]
    tiers += [TierConfig(kind="file", capacity_bytes=64 << 20)] if file_tier else []  # more than the disk
    return StoreConfig(path=data, tiers=[*tiers, TierConfig(kind="lmdb", path=Path("chunks"))], chunk_tokens=64,
                       lmdb_map_size=64 << 20, lmdb_segment_bytes=1 << 20,
                       lmdb_value_log_min_bytes=64 << 10 if value_log else None)  # fmt: skip


def session(i: int) -> tuple[list[int], object]:
    return random_tokens(TOKENS, seed=i), random_kv(SPEC4, TOKENS, seed=i)


@pytest.mark.parametrize(("file_tier", "value_log"), [(False, False), (True, False), (False, True)],
                         ids=["lmdb", "file+lmdb", "lmdb+value-log"])  # fmt: skip
async def test_full_disk_is_a_capacity_error_and_loses_nothing(small_disk: Path, file_tier: bool, value_log: bool) -> None:
    cfg = config(small_disk / "data", file_tier, value_log)
    committed: list[int] = []
    async with StateStore.open(cfg, SPEC4) as store:
        with pytest.raises(CapacityError):
            for i in range(32):  # 32 MiB into 8: the disk refuses long before
                tokens, kv = session(i)
                await store.snapshot(f"s{i}", tokens, kv)
                committed.append(i)
        refused = len(committed)
        assert refused >= 2
        with pytest.raises(SessionNotFoundError):
            await store.session(f"s{refused}")  # the refused snapshot left nothing behind
        for i in committed:
            result = await store.resume(f"s{i}")
            assert result.complete and bits_equal(result.kv, session(i)[1])

        for i in committed[:2]:  # make room: the same store keeps working
            await store.delete(f"s{i}")
        await store.gc()
        tokens, kv = session(100)
        await store.snapshot("after", tokens, kv)
        assert bits_equal((await store.resume("after")).kv, kv)

    async with StateStore.open(cfg, SPEC4) as store:
        for i in committed[2:]:
            result = await store.resume(f"s{i}")
            assert result.complete and bits_equal(result.kv, session(i)[1])
        assert bits_equal((await store.resume("after")).kv, session(100)[1])


OPEN_NEW = """
import asyncio, sys
from agentstate import StateStore
from agentstate.errors import AgentStateError
from tests.conftest import SPEC4
async def main():
    try:
        async with StateStore.open(sys.argv[1], SPEC4):
            pass
    except AgentStateError as exc:
        print(type(exc).__name__, exc)
        sys.exit(1)
asyncio.run(main())
"""


@pytest.mark.parametrize("left", [0, 4096, 64 << 10])
def test_a_new_store_on_a_full_disk_is_refused_not_a_crash(small_disk: Path, left: int) -> None:
    """LMDB maps its new lock file and first pages: on a tmpfs with no room to back them, the first
    touch is a SIGBUS. Opening a new data directory there is a CapacityError instead."""
    import sys

    filler = small_disk / "filler"
    with open(filler, "wb") as f:  # fill the disk, then give back `left` bytes
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    size = filler.stat().st_size
    with open(filler, "r+b") as f:
        f.truncate(max(0, size - left))
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", OPEN_NEW, str(small_disk / "new")], cwd=root, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "CapacityError" in done.stdout


def fill_to_the_last_byte(path: Path) -> None:
    """Write a ballast file until the filesystem refuses a single byte more."""
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 20, 64 << 10, 4096, 512, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass


@pytest.mark.parametrize(("file_tier", "value_log"), [(False, False), (True, False), (False, True)],
                         ids=["lmdb", "file+lmdb", "lmdb+value-log"])  # fmt: skip
async def test_a_full_disk_never_refuses_the_deletes_that_make_room(
    small_disk: Path, file_tier: bool, value_log: bool
) -> None:
    """Snapshots until the disk refuses, then a ballast takes every byte left: deleting sessions and
    gc still work (the store spends the room it held for this), every other session stays bit-exact,
    and once the ballast goes the store takes snapshots again. Without the held room the catalog's
    removal needs pages the disk no longer has, and the operator could not make room at all."""
    cfg = config(small_disk / "data", file_tier, value_log)
    committed: list[int] = []
    async with StateStore.open(cfg, SPEC4) as store:
        with pytest.raises(CapacityError):
            for i in range(32):
                tokens, kv = session(i)
                await store.snapshot(f"s{i}", tokens, kv)
                committed.append(i)
        fill_to_the_last_byte(small_disk / "ballast")
        assert len(committed) >= 3
        for i in committed[:2]:
            await store.delete(f"s{i}")
        await store.gc()
        for i in committed[2:]:
            result = await store.resume(f"s{i}")
            assert result.complete and bits_equal(result.kv, session(i)[1])
        (small_disk / "ballast").unlink()
        tokens, kv = session(100)
        await store.snapshot("after", tokens, kv)
    async with StateStore.open(cfg, SPEC4) as store:
        names = {m.session_id async for m in store.sessions()}
        assert names == {f"s{i}" for i in committed[2:]} | {"after"}
        assert bits_equal((await store.resume("after")).kv, session(100)[1])
