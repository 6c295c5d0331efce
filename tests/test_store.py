"""StateStore on the embedded default (host tier + real LMDB), with real torch tensors."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch

from agentstate import ModelSpec, StateStore
from agentstate.errors import (
    InvalidArgumentError,
    InvalidSessionIdError,
    KVShapeError,
    SessionNotFoundError,
    SpecMismatchError,
)
from tests.conftest import SPEC4, SPEC32, bits_equal, random_kv, random_tokens

DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("base", [SPEC4, SPEC32], ids=["4-layer", "32-layer-8x128"])
async def test_session_round_trip_bit_exact_with_tail(open_store, base: ModelSpec, dtype: str) -> None:  # type: ignore[no-untyped-def]
    spec = base.model_copy(update={"dtype": dtype})
    n = 150 if base is SPEC32 else 1000  # both end mid-chunk (64-token chunks)
    tokens, kv = random_tokens(n), random_kv(spec, n, seed=7)
    async with open_store(spec, host_capacity_bytes=0 if base is SPEC32 else 1 << 30) as store:
        man = await store.snapshot("s1", tokens, kv, state={"messages": [{"role": "user", "content": "hi"}]})
        assert man.tail_tokens == n % 64 and man.tail_key is not None
        r = await store.resume("s1")
    assert r.complete and r.tokens == tokens
    assert bits_equal(r.kv, kv)
    assert r.state == {"messages": [{"role": "user", "content": "hi"}]}


async def test_session_of_exact_chunks_has_no_tail(store: StateStore) -> None:
    tokens, kv = random_tokens(128), random_kv(SPEC4, 128)
    man = await store.snapshot("even", tokens, kv)
    assert man.tail_key is None and len(man.chunk_keys) == 2
    assert bits_equal((await store.resume("even")).kv, kv)
    short = await store.snapshot("short", tokens[:5], kv[:, :, :5])  # shorter than a chunk: all tail
    assert short.chunk_keys == [] and bits_equal((await store.resume("short")).kv, kv[:, :, :5])


async def test_prefix_put_match_load_from_lmdb_and_host(open_store) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = random_tokens(500), random_kv(SPEC4, 500, seed=2)
    async with open_store() as store:
        assert await store.put_prefix(tokens, kv) == 448  # 7 full chunks; the rest is not a chunk
        assert await store.put_prefix(tokens, kv) == 0  # stored once
        m = await store.match(tokens + [1, 2, 3])
        assert (m.tokens, m.chunks, set(m.tiers)) == (448, 7, {"host"})
        assert (await store.match(tokens[:200] + [0] * 300)).tokens == 192
        into = torch.zeros_like(kv)
        assert await store.load(tokens, into) == 448
        assert bits_equal(into[:, :, :448], kv[:, :, :448]) and not into[:, :, 448:].view(torch.uint8).any()
    async with open_store(host_capacity_bytes=0) as store:  # LMDB only, after a reopen
        assert (await store.match(tokens)).tiers == ["lmdb"] * 7
        into = torch.zeros_like(kv)
        assert await store.load(tokens, into[:, :, :200]) == 192  # as many whole chunks as fit
        assert bits_equal(into[:, :, :192], kv[:, :, :192])


async def test_lmdb_reads_are_promoted_to_host(open_store) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = random_tokens(256), random_kv(SPEC4, 256)
    async with open_store() as store:
        await store.put_prefix(tokens, kv)
    async with open_store() as store:
        assert (await store.match(tokens)).tiers == ["lmdb"] * 4
        await store.load(tokens, torch.empty_like(kv))
        await store.flush()
        assert (await store.match(tokens)).tiers == ["host"] * 4


async def _lmdb_bytes(store: StateStore) -> int:
    return next(t for t in (await store.stats()).tiers if t.name == "lmdb").bytes_used


async def test_shared_system_prompt_is_stored_once(open_store) -> None:  # type: ignore[no-untyped-def]
    system = random_tokens(1000, seed=1)
    spec = SPEC4
    a_tok, b_tok = system + random_tokens(200, seed=2), system + random_tokens(200, seed=3)
    kv_sys = random_kv(spec, 1000, seed=4)
    a_kv = torch.cat([kv_sys, random_kv(spec, 200, seed=5)], dim=2)
    b_kv = torch.cat([kv_sys, random_kv(spec, 200, seed=6)], dim=2)
    async with open_store(spec, host_capacity_bytes=0) as store:
        empty = await _lmdb_bytes(store)
        await store.snapshot("agent-a", a_tok, a_kv)
        one = await _lmdb_bytes(store) - empty
        await store.snapshot("agent-b", b_tok, b_kv)
        both = await _lmdb_bytes(store) - empty
        assert one >= 1200 * spec.token_bytes  # sanity: real bytes were measured
        assert both < 1.3 * one, f"two sessions took {both / one:.2f}x one session's bytes"
        assert bits_equal((await store.resume("agent-a")).kv, a_kv)
        assert bits_equal((await store.resume("agent-b")).kv, b_kv)


RESUME_CHILD = """
import asyncio, json, sys
from agentstate import ModelSpec, StateStore
spec = ModelSpec.model_validate_json(sys.argv[2])
async def main():
    async with StateStore.open(sys.argv[1], spec, chunk_tokens=64) as store:
        out = {}
        for sid in ("a", "b"):
            r = await store.resume(sid)
            out[sid] = [r.restored_tokens, r.state]
            r.kv.contiguous().view(-1).view(torch.uint8).numpy().tofile(sys.argv[3] + f"/{sid}.raw")
        print(json.dumps(out))
import torch
asyncio.run(main())
"""


async def test_new_process_resumes_both_sessions_bit_exact(tmp_path: Path, open_store) -> None:  # type: ignore[no-untyped-def]
    tokens = {"a": random_tokens(333, seed=1), "b": random_tokens(130, seed=2)}
    kvs = {sid: random_kv(SPEC4, len(t), seed=len(t)) for sid, t in tokens.items()}
    async with open_store() as store:
        for sid in tokens:
            await store.snapshot(sid, tokens[sid], kvs[sid], state={"sid": sid})
    proc = subprocess.run(
        [sys.executable, "-c", RESUME_CHILD, str(tmp_path / "data"), SPEC4.model_dump_json(), str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for sid, kv in kvs.items():
        assert out[sid] == [kv.shape[2], {"sid": sid}]
        restored = (tmp_path / f"{sid}.raw").read_bytes()  # the raw KV bytes the child restored
        assert restored == kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _flip_byte_in_lmdb_value(data_dir: Path, key: str, offset: int) -> None:
    with lmdb.open(str(data_dir / "chunks")) as env, env.begin(write=True) as txn:
        value = bytearray(txn.get(key.encode()))
        value[offset] ^= 0x01
        txn.put(key.encode(), bytes(value))


async def test_flipped_byte_is_a_miss_and_nothing_wrong_is_returned(tmp_path: Path, open_store) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = random_tokens(400, seed=9), random_kv(SPEC4, 400, seed=9)
    async with open_store() as store:
        man = await store.snapshot("s", tokens, kv)
        await store.put_prefix(tokens, kv)
    _flip_byte_in_lmdb_value(tmp_path / "data", man.chunk_keys[3], offset=5000)
    async with open_store() as store:
        into = torch.zeros_like(kv)
        assert await store.load(tokens, into) == 3 * 64  # stops before the corrupt chunk
        assert bits_equal(into[:, :, :192], kv[:, :, :192])
        assert (await store.match(tokens)).chunks == 3  # and it is a miss from now on
        assert (await store.stats()).counters["corrupt"] == 1
        r = await store.resume("s")  # the session resumes up to the damage; the engine recomputes the rest
        assert r.restored_tokens == 192 and bits_equal(r.kv, kv[:, :, :192]) and r.tokens == tokens
        await store.put_prefix(tokens, kv)  # a later store rewrites the dropped chunk
        r = await store.resume("s")
        assert r.complete and bits_equal(r.kv, kv)


async def test_bad_input_raises_typed_errors_and_keeps_data(open_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tokens, kv = random_tokens(200), random_kv(SPEC4, 200)
    async with open_store() as store:
        await store.snapshot("good", tokens, kv)
        with pytest.raises(SessionNotFoundError):
            await store.resume("unknown")
        for bad in ["../good", "a/b", "", "x" * 200]:
            with pytest.raises(InvalidSessionIdError):
                await store.snapshot(bad, tokens, kv)
            with pytest.raises(InvalidSessionIdError):
                await store.resume(bad)
        with pytest.raises(KVShapeError):
            await store.snapshot("good", tokens, kv[:, :, :199])  # tokens and KV disagree
        with pytest.raises(KVShapeError):
            await store.snapshot("good", tokens, kv.to(torch.float16))
        with pytest.raises(KVShapeError):
            await store.snapshot("good", tokens, kv[:3])
        with pytest.raises(KVShapeError):
            await store.load(tokens, torch.empty(4, 2, 200, 2, 32, dtype=torch.bfloat16))
        with pytest.raises(InvalidArgumentError):
            await store.snapshot("good", tokens, kv, state={"x": object()})  # type: ignore[dict-item]
        with pytest.raises(InvalidArgumentError):
            await store.snapshot("good", [], kv[:, :, :0])
        with pytest.raises(InvalidArgumentError):
            await store.snapshot("good", [-1] * 200, kv)
        r = await store.resume("good")
        assert r.manifest.version == 1 and bits_equal(r.kv, kv)
    other = SPEC4.model_copy(update={"model_id": "test/other-model"})
    with pytest.raises(SpecMismatchError, match="model_id 'test/other-model' != 'test/"):
        await open_store(other)  # the directory records SPEC4: another spec is refused, naming the field
    (tmp_path / "data" / "spec.json").unlink()  # without a record (an older version's directory) it opens,
    async with open_store(other, read_only=True) as store:  # and still never serves SPEC4's state
        with pytest.raises(SpecMismatchError):
            await store.resume("good")
        assert (await store.match(tokens)).tokens == 0  # another spec never matches these chunks
    async with open_store() as store:
        assert bits_equal((await store.resume("good")).kv, kv)


async def test_200_concurrent_snapshots_and_resumes(store: StateStore) -> None:
    system = random_tokens(300, seed=42)
    sys_kv = random_kv(SPEC4, 300, seed=42)
    sessions = {}
    for i in range(100):
        own = 1 + (i * 37) % 150
        sessions[f"agent-{i}"] = (
            system + random_tokens(own, seed=i),
            torch.cat([sys_kv, random_kv(SPEC4, own, seed=1000 + i)], dim=2),
        )
    await asyncio.gather(*(store.snapshot(sid, t, kv, state={"i": sid}) for sid, (t, kv) in sessions.items()))
    results = await asyncio.gather(
        *(store.resume(sid) for sid in sessions),
        *(store.snapshot(sid + "-v2", t, kv) for sid, (t, kv) in sessions.items()),
    )
    for (sid, (_, kv)), r in zip(sessions.items(), results[:100]):
        assert r.complete and bits_equal(r.kv, kv) and r.state == {"i": sid}
    again = await asyncio.gather(*(store.resume(sid + "-v2") for sid in sessions))
    assert all(bits_equal(r.kv, kv) for r, (_, kv) in zip(again, sessions.values()))
