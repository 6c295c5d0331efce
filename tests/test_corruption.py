"""Random damage to stored chunks (bit flips anywhere, truncation to any length) is always caught.

Each trial damages one stored value of a session, in LMDB or in the file tier, then resumes it
in a fresh store. What comes back is always bit-exact: the verified prefix before the damage
(LMDB is the last tier, so the rest is for the engine to recompute), or all of it (a damaged
file-tier copy is read again from LMDB). The damage is counted, the bad copy is dropped, and the
next snapshot of the same content repairs the store.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import lmdb
import pytest

from agentstate import StateStore, StoreConfig
from agentstate.config import TierConfig
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens

TOKENS = 10 * 64 + 40  # ten chunks and a tail
TRIALS = 24


def damage(raw: bytes, rng: random.Random) -> bytes:
    """A flip of one bit anywhere (header or payload), or a cut to a random shorter length."""
    if rng.random() < 0.5:
        at = rng.randrange(len(raw))
        return raw[:at] + bytes([raw[at] ^ (1 << rng.randrange(8))]) + raw[at + 1 :]
    return raw[: rng.randrange(len(raw))]


def config(data: Path, with_file_tier: bool) -> StoreConfig:
    tiers = [TierConfig(kind="file")] if with_file_tier else []
    return StoreConfig(path=data, tiers=[*tiers, TierConfig(kind="lmdb", path=Path("chunks"))], chunk_tokens=64,
                       lmdb_map_size=64 << 20)  # fmt: skip


def rewrite_lmdb_value(data: Path, key: str, change: Any) -> None:
    with lmdb.open(str(data / "chunks")) as env, env.begin(write=True) as txn:
        txn.put(key.encode(), change(bytes(txn.get(key.encode()))))


def lmdb_value(data: Path, key: str) -> bytes:
    with lmdb.open(str(data / "chunks"), readonly=True) as env, env.begin() as txn:
        return bytes(txn.get(key.encode()))


@pytest.mark.parametrize("where", ["lmdb", "file"])
async def test_random_damage_is_detected_counted_dropped_and_repaired(tmp_path: Path, where: str) -> None:
    rng = random.Random(f"corrupt-{where}")
    data, with_file = tmp_path / "data", where == "file"
    tokens, kv = random_tokens(TOKENS, seed=3), random_kv(SPEC4, TOKENS, seed=3)
    async with StateStore.open(config(data, with_file), SPEC4) as store:
        await store.snapshot("victim", tokens, kv)
        await store.snapshot("bystander", random_tokens(300, seed=4), random_kv(SPEC4, 300, seed=4))
    for trial in range(TRIALS):
        async with StateStore.open(config(data, with_file), SPEC4) as store:
            manifest = await store.session("victim")
            keys = [*manifest.chunk_keys, manifest.tail_key]
            hit = rng.randrange(len(keys))
            if with_file:
                path = Path(store.chunks.backend(store.chunks.tier_names[0])._locate(keys[hit])[1])  # type: ignore[attr-defined]
                raw = path.read_bytes()
        if with_file:
            path.write_bytes(damage(raw, rng))
        else:
            rewrite_lmdb_value(data, keys[hit], lambda raw: damage(raw, rng))

        async with StateStore.open(config(data, with_file), SPEC4) as store:
            result = await store.resume("victim")
            expected = TOKENS if with_file else min(hit * 64, TOKENS)
            assert result.restored_tokens == expected, f"trial {trial}: damaged value {hit}"
            assert bits_equal(result.kv, kv[:, :, :expected]) and result.tokens == tokens
            stats = await store.stats()
            assert stats.counters["corrupt"] == 1, "the damage went uncounted"
            other = await store.resume("bystander")
            assert other.complete and bits_equal(other.kv, random_kv(SPEC4, 300, seed=4))
            if not with_file:
                assert not (await store.chunks.backend(store.chunks.record_tier).exists([keys[hit]]))[0], "the bad copy is still there"
                await store.snapshot("victim", tokens, kv)  # same content: writes back what was dropped
            result = await store.resume("victim")
            assert result.complete and bits_equal(result.kv, kv)
        if with_file:  # the bad copy is gone; promotion from LMDB may have written it again, correctly
            assert not path.exists() or path.read_bytes() == lmdb_value(data, keys[hit])


async def test_verify_finds_damage_in_every_tier_and_repair_drops_only_bad_copies(tmp_path: Path) -> None:
    """`agentstate verify` (the library call behind it) on a file tier over LMDB: a damaged file
    copy and a damaged LMDB copy are both reported by tier; repair drops exactly those, and writes
    the file tier's good copy back into LMDB, so the record tier holds every session whole again."""
    from agentstate.ops.verify import verify

    data, rng = tmp_path / "data", random.Random("verify")
    tokens, kv = random_tokens(TOKENS, seed=5), random_kv(SPEC4, TOKENS, seed=5)
    async with StateStore.open(config(data, True), SPEC4) as store:
        m = await store.snapshot("s", tokens, kv)
        file_path = Path(store.chunks.backend(store.chunks.tier_names[0])._locate(m.chunk_keys[2])[1])  # type: ignore[attr-defined]
        assert (await verify(store)).clean
    file_path.write_bytes(damage(file_path.read_bytes(), rng))
    rewrite_lmdb_value(data, m.chunk_keys[7], lambda raw: damage(raw, rng))
    async with StateStore.open(config(data, True), SPEC4) as store:
        report = await verify(store)
        assert {(b.tier, b.key) for b in report.corrupt} == {("file", m.chunk_keys[2]), ("lmdb", m.chunk_keys[7])}
        assert not report.clean and report.affected == []  # a good copy of each in the other tier
        repaired = await verify(store, repair=True)
        dropped_and_restored = {t.tier: t.repaired for t in repaired.tiers}
        assert repaired.repaired and dropped_and_restored == {"file": 1, "lmdb": 2}  # LMDB: dropped + written back
        assert (await verify(store)).clean  # the record tier has its durable copy again, from the file tier
        r = await store.resume("s")
        assert r.complete and bits_equal(r.kv, kv)
    async with StateStore.open(config(data, False), SPEC4) as store:  # LMDB alone: nothing was lost
        r = await store.resume("s")
        assert r.complete and bits_equal(r.kv, kv)
        assert (await verify(store)).clean
