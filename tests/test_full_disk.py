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


def config(data: Path, file_tier: bool) -> StoreConfig:
    tiers = [TierConfig(kind="host", capacity_bytes=64 << 20)]
    tiers += [TierConfig(kind="file", capacity_bytes=64 << 20)] if file_tier else []  # more than the disk
    return StoreConfig(path=data, tiers=[*tiers, TierConfig(kind="lmdb", path=Path("chunks"))], chunk_tokens=64,
                       lmdb_map_size=64 << 20)  # fmt: skip


def session(i: int) -> tuple[list[int], object]:
    return random_tokens(TOKENS, seed=i), random_kv(SPEC4, TOKENS, seed=i)


@pytest.mark.parametrize("file_tier", [False, True], ids=["lmdb", "file+lmdb"])
async def test_full_disk_is_a_capacity_error_and_loses_nothing(small_disk: Path, file_tier: bool) -> None:
    cfg = config(small_disk / "data", file_tier)
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
