"""Bad snapshot arguments are refused before anything is written, and a session stored for another
ModelSpec is never replaced silently (issue 13)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from agentstate import StateStore
from agentstate.errors import AgentStateError, InvalidArgumentError, KVShapeError, SpecMismatchError
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens

SPEC2 = SPEC4.model_copy(update={"num_layers": 2})


async def everything(store: StateStore) -> tuple[set[str], list[Any]]:
    keys = {k for t in store.chunks.tier_names for p in store.key_prefixes for k in await store.chunks.scan(t, p)}
    return keys, sorted([(m.session_id, m.version, m.tokens) async for m in store.sessions()])


BAD_OPTIONS: list[dict[str, Any]] = [
    {"ttl_seconds": 0},
    {"ttl_seconds": -5},
    {"ttl_seconds": math.nan},
    {"ttl_seconds": math.inf},
    {"ttl_seconds": "60"},
    {"ttl_seconds": True},
    {"pinned": "yes"},
    {"pinned": None},
    {"force": 1},
    {"expected_version": -1},
    {"expected_version": 1.5},
    {"expected_version": "1"},
    {"state": {"x": math.nan}},
    {"state": ["not", "a", "dict"]},
    {"state": {"b": b"bytes"}},
]


@pytest.mark.parametrize("options", BAD_OPTIONS, ids=[repr(o) for o in BAD_OPTIONS])
async def test_bad_options_change_nothing(store: StateStore, options: dict[str, Any]) -> None:
    tokens, kv = random_tokens(150), random_kv(SPEC4, 150)
    await store.snapshot("s", tokens, kv)
    before = await everything(store)
    new_tokens = random_tokens(200, seed=5)
    with pytest.raises(InvalidArgumentError):
        await store.snapshot("s", new_tokens, random_kv(SPEC4, 200, seed=5), **options)
    with pytest.raises(InvalidArgumentError):
        await store.snapshot("other", new_tokens, random_kv(SPEC4, 200, seed=5), **options)
    assert await everything(store) == before
    r = await store.resume("s")
    assert r.restored_tokens == 150 and bits_equal(r.kv, kv)


def bad_kvs() -> list[tuple[str, Any]]:
    kv = random_kv(SPEC4, 130)
    return [
        ("meta", torch.empty(kv.shape, dtype=kv.dtype, device="meta")),
        ("sparse", torch.zeros(2, 2).to_sparse()),
        ("dtype", kv.float()),
        ("short", kv[:, :, :100]),
        ("layers", kv[:2]),
        ("4-dim", kv[0]),
        ("list", kv.tolist()[:1]),
        ("none", None),
    ]


@pytest.mark.parametrize("name,kv", bad_kvs(), ids=[n for n, _ in bad_kvs()])
async def test_bad_kv_changes_nothing(store: StateStore, name: str, kv: Any) -> None:
    await store.snapshot("s", random_tokens(70), random_kv(SPEC4, 70))
    before = await everything(store)
    with pytest.raises(KVShapeError):
        await store.snapshot("s", random_tokens(130, seed=2), kv)
    with pytest.raises(KVShapeError):
        await store.put_prefix(random_tokens(130, seed=2), kv)
    assert await everything(store) == before


async def test_a_session_of_another_spec_is_not_replaced(tmp_path: Path) -> None:
    tokens, kv = random_tokens(150), random_kv(SPEC4, 150)
    async with StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=64) as a:
        await a.snapshot("s", tokens, kv)
    with pytest.raises(SpecMismatchError, match="num_layers 2 != 4"):
        await StateStore.open(tmp_path / "d", SPEC2, chunk_tokens=64)  # the directory records SPEC4
    recorded = tmp_path / "d" / "spec.json"
    recorded.unlink()  # without a record (an older version's directory) it opens; the sessions still refuse
    async with StateStore.open(tmp_path / "d", SPEC2, chunk_tokens=64) as b:
        other = random_kv(SPEC2, 150, seed=1)
        for kwargs in ({}, {"expected_version": 1}, {"expected_version": None}):
            with pytest.raises(SpecMismatchError):
                await b.snapshot("s", tokens, other, **kwargs)
        with pytest.raises(SpecMismatchError):
            await b.resume("s")
    recorded.unlink()
    async with StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=64) as a:
        r = await a.resume("s")
        assert r.restored_tokens == 150 and bits_equal(r.kv, kv) and r.manifest.version == 1
    recorded.unlink()
    async with StateStore.open(tmp_path / "d", SPEC2, chunk_tokens=64) as b:  # on purpose: force
        m = await b.snapshot("s", tokens, other, force=True)
        assert m.version == 2 and bits_equal((await b.resume("s")).kv, other)


def test_errors_are_typed() -> None:
    for exc in (InvalidArgumentError, KVShapeError, SpecMismatchError):
        assert issubclass(exc, AgentStateError)
