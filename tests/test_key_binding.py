"""A stored value is bound to its key: valid values swapped or copied under another key are caught.

Every stored chunk and tail is a valid codec frame, so a value moved to another key (two LMDB
values swapped, two chunk files' contents swapped, one value copied over another key) passes every
structural check. The checksum is seeded with the key, so such a value fails under its new key
like a damaged one: a resume never returns the other chunk's KV (it stops before the moved value,
or reads a good copy from another tier, bit-exact), the value is counted as corrupt, and
`agentstate verify` reports it, names the key it belongs to, and exits 1.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch

from agentstate import StateStore, StoreConfig
from agentstate.ops.admin import record_spec
from agentstate.config import TierConfig
from agentstate.server.dataplane import read_chunk
from agentstate.errors import CorruptDataError
from agentstate.manifest import SessionManifest
from agentstate.ops.verify import verify
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens

CHUNK = 64
AGENTSTATE = shutil.which("agentstate")
TIERS = {
    "lmdb": [TierConfig(kind="lmdb", path=Path("chunks"))],
    "file": [TierConfig(kind="file"), TierConfig(kind="lmdb", path=Path("chunks"))],
}
# Equal tail lengths: the tails' shapes agree, so only the key binding tells them apart.
SESSIONS = {
    "a": (random_tokens(3 * CHUNK + 20, seed=1), random_kv(SPEC4, 3 * CHUNK + 20, seed=1)),
    "b": (random_tokens(4 * CHUNK + 20, seed=2), random_kv(SPEC4, 4 * CHUNK + 20, seed=2)),
}
Ref = tuple[str, int]  # (session, index into its chunk keys; -1 is the tail)
FAULTS: dict[str, tuple[str, Ref, Ref]] = {
    "swap-between-sessions": ("swap", ("a", 1), ("b", 2)),
    "swap-within-a-session": ("swap", ("a", 0), ("a", 2)),
    "swap-tails-of-two-sessions": ("swap", ("a", -1), ("b", -1)),
    "copy-over-another-key": ("copy", ("a", 1), ("b", 0)),  # b's chunk 0 now holds a's chunk 1
    "copy-tail-over-another-tail": ("copy", ("b", -1), ("a", -1)),
}


def config(data: Path, where: str) -> StoreConfig:
    return StoreConfig(path=data, tiers=TIERS[where], chunk_tokens=CHUNK, lmdb_map_size=64 << 20)


def key_of(manifests: dict[str, SessionManifest], ref: Ref) -> str:
    m = manifests[ref[0]]
    key = m.tail_key if ref[1] == -1 else m.chunk_keys[ref[1]]
    assert key is not None
    return key


def stored(m: SessionManifest) -> list[str]:
    """The keys of a session's values, in token order (the tail last)."""
    return [*m.chunk_keys, *([m.tail_key] if m.tail_key else [])]


def move_lmdb(data: Path, how: str, src: str, dst: str) -> None:
    """Swap two LMDB values in one transaction, or copy `src`'s value over `dst`'s."""
    with lmdb.open(str(data / "chunks")) as env, env.begin(write=True) as txn:
        a, b = bytes(txn.get(src.encode())), bytes(txn.get(dst.encode()))
        assert a != b
        txn.put(dst.encode(), a)
        if how == "swap":
            txn.put(src.encode(), b)


def move_files(paths: dict[str, Path], how: str, src: str, dst: str) -> None:
    """The same on the file tier: two chunk files' contents swapped, or one copied over the other."""
    a, b = paths[src].read_bytes(), paths[dst].read_bytes()
    assert a != b
    paths[dst].write_bytes(a)
    if how == "swap":
        paths[src].write_bytes(b)


def cli_verify(data: Path, where: str) -> subprocess.CompletedProcess[str]:
    tiers = json.dumps([t.model_dump(mode="json", exclude_none=True) for t in TIERS[where]])
    env = {**os.environ, "AGENTSTATE_CHUNK_TOKENS": str(CHUNK), "AGENTSTATE_TIERS": tiers, "COLUMNS": "200"}
    assert AGENTSTATE is not None
    return subprocess.run(
        [AGENTSTATE, "verify", "-p", str(data), "--json"], check=False, capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("where", ["lmdb", "file"])
@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_value_under_the_wrong_key_is_never_served(tmp_path: Path, where: str, fault: str) -> None:
    how, src_ref, dst_ref = FAULTS[fault]
    data = tmp_path / "data"
    async with StateStore.open(config(data, where), SPEC4) as store:
        manifests = {sid: await store.snapshot(sid, toks, kv) for sid, (toks, kv) in SESSIONS.items()}
        assert (await verify(store)).clean
        files: Any = store.chunks.backend(store.chunks.tier_names[0]) if where == "file" else None  # the file tier's backend: where each key lives
        paths = {k: Path(files._locate(k)[1]) for m in manifests.values() for k in stored(m)} if files else {}
    record_spec(data, SPEC4)
    src, dst = key_of(manifests, src_ref), key_of(manifests, dst_ref)
    moved = {dst: src} | ({src: dst} if how == "swap" else {})  # key -> the key whose value it now holds
    if where == "file":
        move_files(paths, how, src, dst)
    else:
        move_lmdb(data, how, src, dst)

    # verify (the installed command): exit 1, each moved value reported in its tier as another key's
    if AGENTSTATE is not None:
        found = cli_verify(data, where)
        assert found.returncode == 1, f"a value under the wrong key must fail verify: {found.stderr}"
        assert found.stdout, f"verify failed without a report: {found.stderr}"
        report = json.loads(found.stdout)
        assert not report["clean"]
        assert {(b["tier"], b["key"]) for b in report["corrupt"]} == {(where, k) for k in moved}
        for bad in report["corrupt"]:
            assert bad["problem"] == f"misplaced: stored under the wrong key, a valid value of {moved[bad['key']]}"
    async with StateStore.open(config(data, where), SPEC4) as store:  # the library call behind it
        report = await verify(store)
        assert not report.clean and {(b.tier, b.key) for b in report.corrupt} == {(where, k) for k in moved}
        # session -> first token of its first moved value: where a resume from LMDB alone stops
        hurt = {sid: CHUNK * min(i for i, k in enumerate(stored(m)) if k in moved)
                for sid, m in manifests.items() if moved.keys() & set(stored(m))}  # fmt: skip
        if where == "file":
            assert report.affected == []  # LMDB holds a good copy of every moved value
        else:
            assert {(a.session_id, a.restorable_tokens) for a in report.affected} == set(hurt.items())

    async with StateStore.open(config(data, where), SPEC4) as store:
        if where == "lmdb":
            for key in moved:  # the data plane's GET serves no moved value either
                assert await read_chunk(store, key) is None
        for sid, (toks, kv) in SESSIONS.items():
            r = await store.resume(sid)
            expected = len(toks) if where == "file" else hurt.get(sid, len(toks))
            assert r.restored_tokens == expected, f"{sid}: {r.restored_tokens} restored, {expected} intact"
            assert r.kv is not None and bits_equal(r.kv, kv[:, :, :expected]), f"{sid}: wrong KV served"
        counters = (await store.stats()).counters
        assert counters["corrupt"] == len(moved), "a value under the wrong key went uncounted"
        for sid, (toks, kv) in SESSIONS.items():  # the engine recomputes; the same content repairs the store
            await store.snapshot(sid, toks, kv)
        await store.flush()
        assert (await verify(store)).clean
        for sid, (toks, kv) in SESSIONS.items():
            r = await store.resume(sid)
            assert r.complete and bits_equal(r.kv, kv)


async def test_a_value_moved_across_tenants_is_refused(tmp_path: Path) -> None:
    """Two tenants with the same tokens get different keys (namespaces): one tenant's valid chunk
    copied under the other's key is not served as that tenant's KV."""
    data = tmp_path / "data"
    toks, kv = SESSIONS["a"]
    other = random_kv(SPEC4, len(toks), seed=9)
    async with StateStore.open(config(data, "lmdb"), SPEC4) as store:
        mine = await store.for_tenant("alice").snapshot("s", toks, kv)
        theirs = await store.for_tenant("bob").snapshot("s", toks, other)
    move_lmdb(data, "copy", mine.chunk_keys[0], theirs.chunk_keys[0])
    async with StateStore.open(config(data, "lmdb"), SPEC4) as store:
        r = await store.for_tenant("bob").resume("s")
        assert r.restored_tokens == 0
        assert (await store.stats()).counters["corrupt"] == 1
        r = await store.for_tenant("alice").resume("s")
        assert r.complete and bits_equal(r.kv, kv)
        assert not torch.equal(kv.view(torch.uint8), other.view(torch.uint8))


async def test_archive_frames_are_bound_to_their_members(tmp_path: Path) -> None:
    """Export binds each frame to its member name: two frames swapped inside an archive (with the
    index's sizes and checksums swapped to match) are refused by import before anything is written."""
    from agentstate.ops.archive import INDEX, export_sessions, import_sessions

    async with StateStore.open(config(tmp_path / "src", "lmdb"), SPEC4) as store:
        for sid, (toks, kv) in SESSIONS.items():
            await store.snapshot(sid, toks, kv)
        await export_sessions(store, tmp_path / "good.tar")
    with tarfile.open(tmp_path / "good.tar") as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    index = json.loads(files[INDEX])
    one, two = "chunks/000001.kv", "chunks/000005.kv"  # a's chunk 1 and b's chunk 1 (equal shapes)
    files[one], files[two] = files[two], files[one]
    index["members"][one], index["members"][two] = index["members"][two], index["members"][one]
    files[INDEX] = json.dumps(index).encode()
    with tarfile.open(tmp_path / "swapped.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for name, raw in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))

    async with StateStore.open(config(tmp_path / "dst", "lmdb"), SPEC4) as store:
        with pytest.raises(CorruptDataError, match="another key"):
            await import_sessions(store, tmp_path / "swapped.tar")
        assert [m async for m in store.sessions()] == []  # nothing was written
        await import_sessions(store, tmp_path / "good.tar")
        for sid, (toks, kv) in SESSIONS.items():
            r = await store.resume(sid)
            assert r.complete and r.tokens == toks and bits_equal(r.kv, kv)
