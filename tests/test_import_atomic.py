"""Import is all-or-nothing: a bad archive, or a failure while writing, leaves the target as it was.

"As it was" is checked whole: the same sessions with the same manifests (versions included), KV
that resumes bit-exact, the same stored keys in every tier, and for a directory that did not hold
a store before, no directory (so no data without a `spec.json`). The bad archives are built so
that the bad session comes last, after sessions that are new to the target and one that replaces
a session there (`force`): an import that checked less than snapshot does would commit those
first. The full-disk case runs on a small tmpfs (root only; skipped elsewhere, failed in CI).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from agentstate import ModelSpec, StateStore, StoreConfig
from agentstate.catalog import Catalog
from agentstate.catalog.lmdb import LMDBCatalog
from agentstate.chunks.store import ChunkStore
from agentstate.errors import AgentStateError, CapacityError, ConflictError, CorruptDataError, SpecMismatchError
from agentstate.keys import chunk_keys
from agentstate.manifest import SessionManifest
from agentstate.ops.admin import record_spec
from agentstate.ops.archive import export_sessions, import_sessions, new_directory_undone
from agentstate.sessions import MAX_STATE_DEPTH
from tests.cli_process import run_cli
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.requires import skip_or_fail

CHUNK = 64
AGENTSTATE = shutil.which("agentstate")


def config(data: Path) -> StoreConfig:
    return StoreConfig(path=data, chunk_tokens=CHUNK, lmdb_map_size=64 << 20)


def kv_of(tokens: int, seed: int) -> torch.Tensor:
    return random_kv(SPEC4, tokens, seed=seed)


SYSTEM = random_tokens(2 * CHUNK, seed=5)


def target_sessions() -> dict[tuple[str, str], tuple[list[int], torch.Tensor, dict[str, Any]]]:
    out = {}
    for i, (tenant, sid) in enumerate([("default", "s0"), ("default", "s1"), ("bob", "b0")]):
        tokens = SYSTEM + random_tokens(50 + 40 * i, seed=10 + i)
        kv = kv_of(len(tokens), 20 + i)
        kv[:, :, : len(SYSTEM)] = kv_of(len(SYSTEM), 1)  # a prefix shared with the archive's sessions
        out[(tenant, sid)] = (tokens, kv, {"turn": i})
    return out


async def write_target(data: Path) -> None:
    async with StateStore.open(config(data), SPEC4) as store:
        for (tenant, sid), (tokens, kv, state) in target_sessions().items():
            scoped = store.for_tenant(tenant)
            await scoped.snapshot(sid, tokens, kv, state)
            if sid == "s0":
                await scoped.snapshot(sid, tokens, kv, {"turn": "again"})  # version 2
    record_spec(data, SPEC4)


async def write_archive(path: Path, sessions: int = 3, tokens: int = 150, spec: ModelSpec = SPEC4) -> Path:
    """An archive of new sessions n0.. and a replacement of the target's s0, which comes last."""
    src = path.with_suffix(".src")
    async with StateStore.open(config(src), spec) as store:
        for i in range(sessions):
            toks = SYSTEM + random_tokens(tokens, seed=100 + i)
            kv = kv_of(len(toks), 200 + i) if spec == SPEC4 else spec.empty_kv(len(toks)).normal_()
            await store.snapshot(f"n{i}", toks, kv, {"n": i})
        toks = random_tokens(130, seed=300)
        await store.snapshot("s0", toks, kv_of(130, 301) if spec == SPEC4 else spec.empty_kv(130).normal_())
        await store.snapshot("z", random_tokens(90, seed=400), kv_of(90, 401) if spec == SPEC4 else spec.empty_kv(90))
        await export_sessions(store, path)
    shutil.rmtree(src)
    return path


def rewrite(src: Path, dest: Path, edit: Callable[[dict[str, bytes]], None]) -> Path:
    """Copy the archive `src` to `dest` with its members (name -> bytes) changed by `edit`."""
    with tarfile.open(src) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    edit(members)
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return dest


def edit_last_session(change: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, bytes]], None]:
    """Change the last archived session's index entry (the archive's checksums stay right)."""

    def edit(members: dict[str, bytes]) -> None:
        index = json.loads(members["index.json"])
        change(index["sessions"][-1])
        members["index.json"] = json.dumps(index).encode()

    return edit


def nested(depth: int) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for _ in range(depth - 1):
        state = {"a": state}
    return state


def damage_last_frame(members: dict[str, bytes]) -> None:
    """Flip a payload byte of the last session's last member and fix the index's xxh3 of it, so
    only the codec frame's own checksum can catch it."""
    index = json.loads(members["index.json"])
    last = index["sessions"][-1]
    name = last["tail"] or last["chunks"][-1]
    raw = bytearray(members[name])
    raw[-3] ^= 0x40
    members[name] = bytes(raw)
    index["members"][name] = {"size": len(raw), "xxh3": xxhash.xxh3_64_hexdigest(bytes(raw))}
    members["index.json"] = json.dumps(index).encode()


async def bad_archives(tmp_path: Path) -> list[tuple[str, Path, type[AgentStateError]]]:
    good = await write_archive(tmp_path / "good.tar")
    other = ModelSpec(model_id="test/other", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    cut = tmp_path / "cut.tar"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size * 3 // 4])

    def case(name: str, edit: Callable[[dict[str, bytes]], None]) -> Path:
        return rewrite(good, tmp_path / f"{name}.tar", edit)

    def set_token(value: int) -> Callable[[dict[str, Any]], None]:
        return lambda s: s["tokens"].__setitem__(-1, value)

    return [
        ("negative token id", case("negative", edit_last_session(set_token(-1))), CorruptDataError),
        ("token id 2**63", case("huge", edit_last_session(set_token(2**63))), CorruptDataError),
        ("token id 2**64", case("huger", edit_last_session(set_token(2**64 + 5))), CorruptDataError),
        (
            "state too deep",
            case("deep", edit_last_session(lambda s: s.update(state={"x": nested(MAX_STATE_DEPTH + 1)}))),
            CorruptDataError,
        ),
        (
            "NaN in state",
            case("nan", edit_last_session(lambda s: s.update(state={"x": float("nan")}))),
            CorruptDataError,
        ),
        ("TTL zero", case("ttl", edit_last_session(lambda s: s.update(ttl_seconds=0))), CorruptDataError),
        ("damaged frame in the last session", case("frame", damage_last_frame), CorruptDataError),
        ("truncated", cut, CorruptDataError),
        ("another spec", await write_archive(tmp_path / "other.tar", spec=other), SpecMismatchError),
    ]


async def observe(data: Path) -> dict[str, Any]:
    """Everything a failed import must not change: keys in every tier (read before any resume
    promotes anything), manifests, and the KV every session resumes."""
    async with StateStore.open(config(data), SPEC4) as store:
        keys = {
            (tier, prefix): sorted(await store.chunks.scan(tier, prefix))
            for tier in store.chunks.tier_names
            for prefix in store.key_prefixes
        }
        manifests = {(m.tenant, m.session_id): m.model_dump() for m in await store.catalog.manifests(None)}
        kv = {}
        for tenant, sid in manifests:
            r = await store.for_tenant(tenant).resume(sid)
            assert r.complete and r.kv is not None
            kv[(tenant, sid)] = r.kv.clone()
    return {"keys": keys, "manifests": manifests, "kv": kv}


def assert_same(before: dict[str, Any], after: dict[str, Any], what: str) -> None:
    assert after["manifests"] == before["manifests"], what
    assert after["keys"] == before["keys"], what
    for name, kv in before["kv"].items():
        assert bits_equal(after["kv"][name], kv), f"{what}: {name}"


async def import_into(data: Path, archive: Path, *, force: bool = True) -> None:
    """Import as the CLI does: a new directory is undone on failure, the spec recorded on success."""
    fresh = not (data / "spec.json").exists()
    with new_directory_undone(data):
        async with StateStore.open(config(data), SPEC4) as store:
            await import_sessions(store, archive, force=force)
        if fresh:
            record_spec(data, SPEC4)


async def test_bad_archives_change_nothing(tmp_path: Path) -> None:
    target = tmp_path / "target"
    await write_target(target)
    before = await observe(target)
    assert before["manifests"][("default", "s0")]["version"] == 2
    for what, archive, error in await bad_archives(tmp_path):
        with pytest.raises(error):
            await import_into(target, archive)
        assert_same(before, await observe(target), what)
        fresh = tmp_path / "fresh"
        with pytest.raises(error):
            await import_into(fresh, archive)
        assert not fresh.exists(), what
        empty = tmp_path / "empty"
        empty.mkdir()
        with pytest.raises(error):
            await import_into(empty, archive)
        assert os.listdir(empty) == [], what
        empty.rmdir()

    good = tmp_path / "good.tar"  # and the good one goes in whole
    await import_into(target, good)
    async with StateStore.open(config(target), SPEC4) as store:
        assert {m.session_id for m in await store.catalog.manifests("default")} == {"s0", "s1", "n0", "n1", "n2", "z"}
        assert (await store.session("s0")).version == 3


@pytest.mark.parametrize("when", ["chunks", "commit"])
async def test_a_failure_while_writing_is_undone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """Any error while the import writes (here injected into the last session's chunk write, or
    into the catalog commit of every session) leaves no session and no chunk of it: a replaced
    session keeps its version and its chunks."""
    target = tmp_path / "target"
    await write_target(target)
    before = await observe(target)
    archive = await write_archive(tmp_path / "good.tar")
    calls: list[int] = []

    def failing(real: Callable[..., Any], fail_at: int) -> Callable[..., Any]:
        async def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == fail_at:
                raise CapacityError("injected: the disk is full")
            return await real(self, *args, **kwargs)

        return wrapped

    def inject() -> None:
        calls.clear()
        if when == "chunks":  # n0, n1, n2, s0, z: each writes chunks or a tail
            monkeypatch.setattr(ChunkStore, "write", failing(ChunkStore.write, 5))
        else:
            monkeypatch.setattr(LMDBCatalog, "commit_all", failing(LMDBCatalog.commit_all, 1))

    inject()
    with pytest.raises(CapacityError):
        await import_into(target, archive)
    assert len(calls) == (5 if when == "chunks" else 1)
    monkeypatch.undo()
    assert_same(before, await observe(target), f"failure at {when}")

    fresh = tmp_path / "fresh"
    inject()
    with pytest.raises(CapacityError):
        await import_into(fresh, archive)
    assert not fresh.exists()


async def test_a_cancellation_after_the_commit_landed_leaves_the_whole_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The catalog commits on its own thread: a cancellation that arrives once the transaction
    is under way cannot stop it. Then every session stands, whole and bit-exact, as the same
    import not cancelled leaves them: all of the import, never a part."""
    target = tmp_path / "target"
    await write_target(target)
    archive = await write_archive(tmp_path / "good.tar")
    real = LMDBCatalog.commit_all

    async def landed_then_cancelled(self: LMDBCatalog, *args: Any, **kwargs: Any) -> Any:
        await real(self, *args, **kwargs)
        raise asyncio.CancelledError

    monkeypatch.setattr(LMDBCatalog, "commit_all", landed_then_cancelled)
    with pytest.raises(asyncio.CancelledError):
        await import_into(target, archive)
    monkeypatch.undo()
    whole = tmp_path / "whole"  # the same import, not cancelled
    await write_target(whole)
    await import_into(whole, archive)
    cancelled, imported = await observe(target), await observe(whole)
    assert set(cancelled["manifests"]) == set(imported["manifests"])
    assert {sid for _, sid in cancelled["manifests"]} == {"s0", "s1", "b0", "n0", "n1", "n2", "z"}
    assert cancelled["manifests"][("default", "s0")]["version"] == 3
    for name, kv in imported["kv"].items():
        assert bits_equal(cancelled["kv"][name], kv), name
        assert cancelled["manifests"][name]["tokens"] == imported["manifests"][name]["tokens"]


def manifest(session_id: str, version: int, seed: int) -> SessionManifest:
    tokens = random_tokens(2 * CHUNK, seed=seed)
    keys = chunk_keys(tokens, namespace="default", fingerprint=SPEC4.fingerprint, chunk_tokens=CHUNK)
    return SessionManifest(session_id=session_id, tenant="default", fingerprint=SPEC4.fingerprint, chunk_tokens=CHUNK,
                           tokens=tokens, chunk_keys=keys, version=version, created_at=1.0, updated_at=1.0)  # fmt: skip


@pytest.mark.parametrize("kind", ["lmdb", "redis"])
async def test_commit_all_commits_every_session_or_none(
    tmp_path: Path, request: pytest.FixtureRequest, kind: str
) -> None:
    """The import's commit: one change that conflicts (here the last) and none lands, on the local
    catalog (one transaction) and on a shared one (the landed ones put back); then all land."""
    if kind == "lmdb":
        catalog: Catalog = LMDBCatalog(tmp_path / "catalog")
    else:
        from agentstate.catalog.redis import RedisCatalog

        catalog = RedisCatalog(request.getfixturevalue("redis_server").url, prefix=f"commit-all-{tmp_path.name}:")
    try:
        a1, b1 = manifest("a", 1, seed=1), manifest("b", 1, seed=2)
        await catalog.commit(a1, None)
        await catalog.commit(b1, None)
        a2, c1, b_again = manifest("a", 2, seed=3), manifest("c", 1, seed=4), manifest("b", 1, seed=5)
        with pytest.raises(ConflictError):
            await catalog.commit_all([(a2, a1), (c1, None), (b_again, None)])  # b exists: the last conflicts
        assert await catalog.get("default", "a") == a1
        assert await catalog.get("default", "b") == b1
        assert await catalog.get("default", "c") is None
        if kind == "lmdb":  # counts as before: a1's and b1's keys once, the others none
            assert await catalog.refcounts([*a1.chunk_keys, *b1.chunk_keys]) == [1] * 4
            assert await catalog.refcounts([*a2.chunk_keys, *c1.chunk_keys]) == [0] * 4

        done = await catalog.commit_all([(a2, a1), (c1, None)])
        assert await catalog.get("default", "a") == a2
        assert await catalog.get("default", "c") == c1
        if kind == "lmdb":  # what a2 replaced lost its last reference
            assert [sorted(c.zeroed) for c in done] == [sorted(a1.chunk_keys), []]
    finally:
        await catalog.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True, check=False
    )
    if done.returncode != 0:
        skip_or_fail(f"cannot mount a tmpfs to fill (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    if AGENTSTATE is None:
        skip_or_fail("the agentstate command is not on PATH (pip install -e .)")
    env = {**os.environ, "AGENTSTATE_CHUNK_TOKENS": str(CHUNK), "AGENTSTATE_LMDB_MAP_SIZE": str(64 << 20)}
    return run_cli(*args, env=env)  # its own process (tests/cli_process.py)


async def test_import_onto_a_full_disk_is_a_capacity_error_and_changes_nothing(
    small_disk: Path, tmp_path: Path
) -> None:
    target = small_disk / "target"
    await write_target(target)  # about 1 MiB
    before = await observe(target)
    archive = await write_archive(tmp_path / "big.tar", sessions=12, tokens=512)  # ~13 MiB of KV into 8
    assert archive.stat().st_size > 8 << 20

    fresh = small_disk / "fresh"
    done = cli("import", archive, "-p", fresh)
    assert done.returncode == 1 and "CapacityError" in done.stderr, done.stderr
    assert not fresh.exists()  # so the disk is as free as before, too

    done = cli("import", archive, "-p", target, "--force")
    assert done.returncode == 1 and "CapacityError" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert_same(before, await observe(target), "full disk")

    async with StateStore.open(config(target), SPEC4) as store:  # the target still takes writes
        tokens, kv, _ = target_sessions()[("default", "s1")]
        await store.snapshot("after", tokens, kv)
        resumed = (await store.resume("after")).kv
        assert resumed is not None and bits_equal(resumed, kv)


async def test_cli_import_of_a_bad_archive_into_a_new_directory_leaves_none(tmp_path: Path) -> None:
    archive = rewrite(await write_archive(tmp_path / "good.tar"), tmp_path / "neg.tar",
                      edit_last_session(lambda s: s["tokens"].__setitem__(0, -5)))  # fmt: skip
    fresh = tmp_path / "fresh"
    done = cli("import", archive, "-p", fresh)
    assert done.returncode == 1 and "CorruptDataError" in done.stderr and "non-negative" in done.stderr, done.stderr
    assert not fresh.exists()
