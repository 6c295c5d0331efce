from __future__ import annotations

from pathlib import Path

import pytest

from agentstate.catalog import LMDBCatalog
from agentstate.errors import ConflictError, CorruptDataError
from agentstate.manifest import SessionManifest


def manifest(sid: str, version: int, keys: list[str], tokens: int = 10) -> SessionManifest:
    return SessionManifest(
        session_id=sid, tenant="t", fingerprint="f" * 32, chunk_tokens=4, tokens=list(range(tokens)),
        chunk_keys=keys, version=version, created_at=0.0, updated_at=0.0,
    )  # fmt: skip


async def test_commit_counts_references_and_checks_versions(tmp_path: Path) -> None:
    cat = LMDBCatalog(tmp_path / "cat")
    assert await cat.commit(manifest("a", 1, ["k1", "k2"]), None) == ([], None)
    assert await cat.commit(manifest("b", 1, ["k1"]), None) == ([], None)
    assert await cat.refcounts(["k1", "k2", "k3"]) == [2, 1, 0]
    with pytest.raises(ConflictError):
        await cat.commit(manifest("a", 2, ["k1"]), None)  # a exists: expected version must match
    with pytest.raises(ConflictError):
        await cat.commit(manifest("a", 3, ["k1"]), 2)
    assert await cat.commit(manifest("a", 2, ["k1", "k3"]), 1) == (["k2"], None)  # k2 lost its last reference
    assert (await cat.get("t", "a")).version == 2  # type: ignore[union-attr]
    old, zeroed = await cat.remove("t", "a")
    assert old is not None and zeroed == ["k3"]
    assert await cat.add_prefix(["k1", "k9"]) and not await cat.add_prefix(["k1", "k9"])
    assert await cat.refcounts(["k1", "k9"]) == [2, 1]
    assert sorted(await cat.remove_prefix("k9")) == ["k9"]
    await cat.close()


async def test_map_grows_for_many_large_manifests(tmp_path: Path) -> None:
    cat = LMDBCatalog(tmp_path / "cat", map_size=256 << 10)
    for i in range(40):
        await cat.commit(manifest(f"s{i}", 1, [f"k{i}"], tokens=20_000), None)
    assert await cat.session_count() == 40
    assert len(await cat.manifests("t")) == 40 and await cat.manifests("other") == []
    await cat.close()


async def test_damaged_manifests_are_typed_errors_and_others_stay_readable(tmp_path: Path) -> None:
    """A flipped digit still parses as JSON: only the stored checksum tells it from the truth."""
    import lmdb

    cat = LMDBCatalog(tmp_path / "cat")
    await cat.commit(manifest("a", 1, [], tokens=12), None)
    await cat.commit(manifest("b", 1, []), None)
    await cat.close()
    with lmdb.open(str(tmp_path / "cat"), max_dbs=3) as env:
        db = env.open_db(b"sessions")
        with env.begin(db=db) as txn:
            good = bytes(txn.get(b"t/a"))
    at = good.index(b"11]")  # the last token id: 11 -> 10 is valid JSON and a valid manifest
    damaged = {
        "digit": good[:at] + b"10]" + good[at + 3 :],
        "truncated": good[: len(good) - 7],
        "bare json": good[12:],
        "not json": good[:12] + b'{"session_id": 5}',
        "empty": b"",
    }
    for what, raw in damaged.items():
        with lmdb.open(str(tmp_path / "cat"), max_dbs=3) as env:
            db = env.open_db(b"sessions")
            with env.begin(write=True, db=db) as txn:
                txn.put(b"t/a", raw)
        cat = LMDBCatalog(tmp_path / "cat")
        with pytest.raises(CorruptDataError):
            await cat.get("t", "a")
        assert (await cat.get("t", "b")).tokens == list(range(10)), what
        await cat.close()
    with lmdb.open(str(tmp_path / "cat"), max_dbs=3) as env:
        db = env.open_db(b"sessions")
        with env.begin(write=True, db=db) as txn:
            txn.put(b"t/a", b'{"session_id": 5}')
    cat = LMDBCatalog(tmp_path / "cat")
    with pytest.raises(CorruptDataError):
        await cat.get("t", "a")
    await cat.close()
