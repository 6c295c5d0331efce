"""Fuzzing application state and tenant isolation on a real store (issue 6, bad input and isolation).

A session's state is whatever JSON the agent framework hands over: it is stored and resumed
exactly, or refused with InvalidArgumentError before anything is written (a state that commits
but cannot be read back would lose the session). Distinct ids never share a key, and tenants
share chunks only when the operator sets `shared_namespace`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agentstate import StateStore
from agentstate.catalog import LMDBCatalog
from agentstate.errors import InvalidArgumentError, SessionNotFoundError
from agentstate.keys import _ID_RE, chain_root, chunk_keys, namespace_for, tail_key
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.test_fuzz_formats import LoopThread

FUZZ = settings(
    derandomize=True, deadline=None, max_examples=100,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
FP = SPEC4.fingerprint
ID = st.from_regex(_ID_RE, fullmatch=True)
KV = random_kv(SPEC4, 48, seed=21)
FRESH = itertools.count(1000)  # token seeds no other example used


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LoopThread, StateStore, StateStore]]:
    """Two stores on the same spec: per-tenant namespaces (the default), and the opt-in global one."""
    loop = LoopThread()

    async def opened(shared: bool) -> StateStore:
        path = tmp_path_factory.mktemp("shared" if shared else "own")
        return await StateStore.open(path, SPEC4, chunk_tokens=16, lmdb_map_size=64 << 20, shared_namespace=shared)

    own, shared = loop.run(opened(False)), loop.run(opened(True))
    yield loop, own, shared
    for store in (own, shared):
        loop.run(store.close())
    loop.close()


@settings(FUZZ, max_examples=300)
@given(st.lists(ID, min_size=2, max_size=2, unique=True), st.lists(st.integers(0, 2**63 - 1), min_size=16, max_size=40))
def test_distinct_ids_never_share_a_key(ids: list[str], tokens: list[int]) -> None:
    """Chunk keys, chain roots, tail keys and catalog keys of two ids (as tenant or session) differ."""
    a, b = ids
    ns_a, ns_b = namespace_for(a), namespace_for(b)
    assert ns_a != ns_b and "global" not in (ns_a, ns_b)
    assert chain_root(ns_a, FP) != chain_root(ns_b, FP)
    keys_a = chunk_keys(tokens, namespace=ns_a, fingerprint=FP, chunk_tokens=16)
    assert set(keys_a).isdisjoint(chunk_keys(tokens, namespace=ns_b, fingerprint=FP, chunk_tokens=16))
    pairs = [(a, a), (a, b), (b, a), (b, b)]  # (tenant, session)
    assert len({tail_key(FP, t, s, 1, "w") for t, s in pairs}) == 4
    assert len({LMDBCatalog._skey(t, s) for t, s in pairs}) == 4
    assert not any(LMDBCatalog._skey(t, s).startswith(f"{u}/".encode()) for t, s in pairs for u in {a, b} - {t})


def _nested(depth: int) -> Any:
    value: Any = "bottom"
    for level in range(depth):
        value = {"k": value} if level % 2 else [value]
    return {"deep": value}


TEXT = st.text(max_size=8)
LEAF = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | TEXT
JSON = st.dictionaries(TEXT, st.recursive(LEAF, lambda x: st.lists(x, max_size=4) | st.dictionaries(TEXT, x, max_size=4),
                                          max_leaves=20), max_size=5)  # fmt: skip
POISON = st.sampled_from([float("nan"), float("inf"), "\ud800", "a\udfff", b"\0", {1}, object()])
STATE = st.one_of(
    JSON,
    JSON,
    JSON,
    st.tuples(JSON, TEXT, POISON).map(lambda t: {**t[0], t[1]: t[2]}),
    st.tuples(JSON, st.sampled_from(["\ud800", "k\udc80"])).map(lambda t: {**t[0], t[1]: 1}),  # not UTF-8
    st.integers(1, 400).map(_nested),
    st.sampled_from([[1, 2], "text", 7]),  # not an object
)


@FUZZ
@given(STATE)
def test_state_resumes_exactly_or_is_refused_before_anything_is_written(
    stores: tuple[LoopThread, StateStore, StateStore], state: Any
) -> None:
    loop, store, _ = stores

    async def attempt() -> bool:
        before = sorted([k async for k in store.chunks.backend(store.chunks.record_tier).keys("")])
        n = next(FRESH)
        sid, tokens = f"state-{n}", random_tokens(48, seed=n)
        try:
            await store.snapshot(sid, tokens, KV, state)
        except InvalidArgumentError:
            assert sorted([k async for k in store.chunks.backend(store.chunks.record_tier).keys("")]) == before
            return False
        r = await store.resume(sid)
        assert r.complete and r.tokens == tokens and bits_equal(r.kv, KV)
        assert r.state == state, "the state that was resumed is not the state that was stored"
        await store.delete(sid)
        return True

    stored = loop.run(attempt())
    event("stored" if stored else "refused")
    assert not stored or isinstance(state, dict)


@FUZZ
@given(st.lists(ID, min_size=2, max_size=2, unique=True), st.integers(1, 3))
def test_tenants_share_chunks_only_in_the_global_namespace(
    stores: tuple[LoopThread, StateStore, StateStore], ids: list[str], chunks: int
) -> None:
    """B matches the prefix A stored only where the operator opted in; sessions stay per tenant."""
    a, b = ids
    loop, own, shared = stores
    tokens = random_tokens(16 * chunks, seed=next(FRESH))

    async def check(store: StateStore, expect_shared: bool) -> None:
        alice, bob = store.for_tenant(a), store.for_tenant(b)
        assert await alice.put_prefix(tokens, KV[:, :, : len(tokens)]) == len(tokens)
        assert (await alice.match(tokens)).tokens == len(tokens)
        assert (await bob.match(tokens)).tokens == (len(tokens) if expect_shared else 0)
        await alice.snapshot("s", tokens, KV[:, :, : len(tokens)], {"owner": a})
        with pytest.raises(SessionNotFoundError):
            await bob.session("s")
        assert "s" not in [m.session_id async for m in bob.sessions()]
        await alice.delete("s")

    loop.run(check(own, False))
    loop.run(check(shared, True))
