"""Sessions shared across hosts: a shared catalog and chunks in a real 3-node Redis Cluster.

"Hosts" are separate processes (tests/shared_worker.py) or separate stores, each with its own
host tier and LMDB data directory; only the cluster is shared.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from agentstate import StateStore
from agentstate.errors import ConflictError, InvalidArgumentError
from agentstate.config import StoreConfig
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.redis_server import RedisCluster
from tests.shared_worker import PREFIX_TOKENS, SESSION_TOKENS, race_payload, shared_config

ROOT = Path(__file__).resolve().parent.parent


def worker(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.shared_worker", *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return dict(json.loads(out.strip().splitlines()[-1]))


@pytest.fixture
def fleet(tmp_path: Path, redis_cluster: RedisCluster) -> tuple[Path, str, str]:
    """(data root, cluster URL, a key prefix no other test uses)."""
    return tmp_path, redis_cluster.url, f"t{uuid.uuid4().hex[:8]}:"


def host(fleet: tuple[Path, str, str], name: str, **overrides: Any) -> StoreConfig:
    root, url, prefix = fleet
    return shared_config(root / name, url, prefix, **overrides)


async def test_a_session_one_process_snapshots_resumes_bit_exact_in_another(fleet: tuple[Path, str, str]) -> None:
    root, url, prefix = fleet
    assert result(worker("write", root / "host-a", url, prefix)) == {"version": 1, "prefix_stored": PREFIX_TOKENS}
    async with StateStore.open(host(fleet, "host-b"), SPEC4) as b:
        got = await b.resume("s1")
        assert got.complete and got.state == {"from": "host-a"} and got.tokens == random_tokens(SESSION_TOKENS, seed=1)
        assert bits_equal(got.kv, random_kv(SPEC4, SESSION_TOKENS, seed=1))
        prefix = random_tokens(PREFIX_TOKENS, seed=2)
        assert (await b.match(prefix)).tokens == PREFIX_TOKENS  # known without recomputing it
        into = torch.zeros_like(random_kv(SPEC4, PREFIX_TOKENS))
        assert await b.load(prefix, into) == PREFIX_TOKENS and bits_equal(into, random_kv(SPEC4, PREFIX_TOKENS, seed=2))
        assert [m.session_id async for m in b.sessions()] == ["s1"]


async def test_concurrent_snapshots_from_two_processes_are_never_a_mix(fleet: tuple[Path, str, str]) -> None:
    root, url, prefix = fleet
    rounds = 12
    procs = [worker("race", root / f"writer-{w}", url, prefix, w, rounds) for w in (1, 2)]
    seen: set[tuple[int, int]] = set()
    async with StateStore.open(host(fleet, "reader"), SPEC4) as reader:
        while any(p.poll() is None for p in procs):
            try:
                got = await reader.resume("race")
            except Exception as exc:  # noqa: BLE001 - only "not there yet" is allowed, checked below
                assert type(exc).__name__ == "SessionNotFoundError"
                await asyncio.sleep(0.01)
                continue
            w, i = got.state["writer"], got.state["i"]
            tokens, seed = race_payload(w, i)
            assert got.tokens == tokens  # the manifest is one writer's, whole
            n = got.restored_tokens  # a tail replaced mid-read is a clean miss, never other bytes
            assert bits_equal(got.kv, random_kv(SPEC4, len(tokens), seed=seed)[:, :, :n])
            seen.add((w, i))
        results = [result(p) for p in procs]
        final = await reader.resume("race")
    assert sum(r["won"] + r["lost"] for r in results) == 2 * rounds
    assert final.manifest.version == sum(r["won"] for r in results)  # every commit on top of the last: no lost update
    tokens, seed = race_payload(final.state["writer"], final.state["i"])
    assert final.complete and bits_equal(final.kv, random_kv(SPEC4, len(tokens), seed=seed))
    assert seen


async def test_last_writer_loses_with_a_conflict_or_wins_with_force(fleet: tuple[Path, str, str]) -> None:
    t_x, kv_x = random_tokens(150, seed=10), random_kv(SPEC4, 150, seed=10)
    t_y, kv_y = random_tokens(170, seed=11), random_kv(SPEC4, 170, seed=11)
    async with StateStore.open(host(fleet, "x"), SPEC4) as x, StateStore.open(host(fleet, "y"), SPEC4) as y:
        v1 = await x.snapshot("s", t_x, kv_x)
        assert (await y.resume("s")).complete
        await y.snapshot("s", t_y, kv_y, expected_version=v1.version)  # y continued the session first
        with pytest.raises(ConflictError):
            await x.snapshot("s", t_x, kv_x, expected_version=v1.version)
        got = await x.resume("s")
        assert got.manifest.version == 2 and bits_equal(got.kv, kv_y)  # the winner's session, intact
        forced = await x.snapshot("s", t_x, kv_x, expected_version=v1.version, force=True)
        assert forced.version == 3
        got = await y.resume("s")
        assert got.complete and bits_equal(got.kv, kv_x)
        remote = x.chunks.backend("redis")
        tails = [k async for k in remote.keys(f"t/{x.fingerprint}/")]
        assert tails == [forced.tail_key]  # replaced and losing tails are gone


async def test_shared_gc_sweeps_only_what_nothing_names_and_nobody_used_lately(fleet: tuple[Path, str, str]) -> None:
    shared_prefix = random_tokens(128, seed=20)
    t1 = shared_prefix + random_tokens(200, seed=21)
    t2 = shared_prefix + random_tokens(100, seed=22)
    kv1, kv2 = random_kv(SPEC4, len(t1), seed=21), random_kv(SPEC4, len(t2), seed=22)
    kv2[:, :, :128] = kv1[:, :, :128]
    async with StateStore.open(host(fleet, "x"), SPEC4) as x:
        await x.snapshot("s1", t1, kv1)
        await x.snapshot("s2", t2, kv2)
        await x.put_prefix(shared_prefix, kv1[:, :, :128])
        remote = x.chunks.backend("redis")
        before = {k async for k in remote.keys(f"c/{x.fingerprint}/")}
        await x.delete("s1")
        assert await x.gc() >= 0
        assert {k async for k in remote.keys(f"c/{x.fingerprint}/")} == before  # just used: kept
    async with StateStore.open(host(fleet, "y", gc_grace_seconds=0), SPEC4) as y:
        await y.gc()
        left = {k async for k in remote_of(y).keys(f"c/{y.fingerprint}/")}
        assert left == set((await y.session("s2")).chunk_keys)  # s1's own chunks went; shared ones stay
        assert not [k async for k in remote_of(y).keys(f"t/{y.fingerprint}/") if "/s1/" in k]
        got = await y.resume("s2")
        assert got.complete and bits_equal(got.kv, kv2)


def remote_of(store: StateStore) -> Any:
    return store.chunks.backend("redis")


async def test_a_shared_catalog_needs_a_remote_tier(tmp_path: Path, redis_cluster: RedisCluster) -> None:
    with pytest.raises(InvalidArgumentError):
        StateStore.open(tmp_path / "d", SPEC4, catalog_url=redis_cluster.url, catalog_cluster=True)
