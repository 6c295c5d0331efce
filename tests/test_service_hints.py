"""Agent hints, retention and accounting through the HTTP service: a real uvicorn server on loopback
(tests/test_service.py's `serving`) over a real store (a host tier too small for the working set,
over LMDB), driven by the real SDK, and by hand-built requests where the SDK would refuse to send
what is being tested."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentstate import StateStore, codec
from agentstate.client import AsyncClient, Client
from agentstate.config import TierConfig
from agentstate.errors import InvalidArgumentError, InvalidSessionIdError, SessionNotFoundError
from agentstate.server.gate import Limits
from agentstate.usage import Usage
from agentstate.wire import FRAME_TYPE, UnauthorizedError, checksum, error_from, kv_payload
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.test_client_sync import url
from tests.test_service import ALICE, BOB, LIMITS, footprint, serving, snapshot_header

__all__ = ["url"]  # the blocking SDK's server fixture, imported from test_client_sync

TOKENS = 300  # 4 chunks of 64 tokens and a 44-token tail (SPEC4: 2 KiB of KV per token)
CHUNK = codec.encoded_size(64 * SPEC4.token_bytes)
TAIL = codec.encoded_size(44 * SPEC4.token_bytes)
SESSION_BYTES = 4 * CHUNK + TAIL
HOST = int(CHUNK * 4 * 3.5)  # the host tier holds 13 chunks: three sessions and a bit
METRICS_TOKEN = "metrics-scraper-token-0123456789"
SECURED = LIMITS.model_copy(update={"metrics_token": METRICS_TOKEN})


@dataclass
class Served:
    url: str
    store: StateStore
    alice: AsyncClient
    bob: AsyncClient
    raw: httpx.AsyncClient
    """Alice's token, no SDK checks: for requests the SDK would never send"""


@contextlib.asynccontextmanager
async def service(open_store: Callable[..., Any], limits: Limits = SECURED, **overrides: Any) -> AsyncIterator[Served]:
    async with (
        open_store(**overrides) as store,
        serving(store, limits) as address,
        AsyncClient(address, ALICE, spec=SPEC4) as alice,
        AsyncClient(address, BOB) as bob,
        httpx.AsyncClient(base_url=address, headers={"authorization": f"Bearer {ALICE}"}, timeout=30) as raw,
    ):
        yield Served(address, store, alice, bob, raw)


@pytest.fixture
async def served(open_store: Callable[..., Any]) -> AsyncIterator[Served]:
    """Host memory for 13 chunks over LMDB: a few sessions of pressure evict one from memory."""
    tiers = [TierConfig(kind="host", capacity_bytes=HOST), TierConfig(kind="lmdb")]
    async with service(open_store, tiers=tiers, lmdb_map_size=256 << 20) as s:
        yield s


async def put(client: AsyncClient, sid: str, seed: int, tokens: int = TOKENS, **kw: Any) -> None:
    await client.snapshot(sid, random_tokens(tokens, seed=seed), random_kv(SPEC4, tokens, seed=seed), **kw)


async def resumes_exact(client: AsyncClient, sid: str, seed: int, tokens: int = TOKENS) -> None:
    r = await client.resume(sid)
    assert r.complete and r.tokens == random_tokens(tokens, seed=seed)
    assert bits_equal(r.kv, random_kv(SPEC4, tokens, seed=seed))


def in_host(usage: Usage) -> int:
    """Stored bytes of a session the host memory tier holds now."""
    return usage.bytes_stored.get("host", 0)


# -- hints -----------------------------------------------------------------------------------------


async def test_paused_resuming_done_round_trip(served: Served) -> None:
    alice = served.alice
    await put(alice, "agent", 1)
    assert in_host(await alice.usage("agent")) == SESSION_BYTES  # write-through: in memory and in LMDB

    paused = await alice.paused("agent", 30)
    assert (paused.session_id, paused.hint, paused.chunks, paused.in_memory) == ("agent", "paused", 5, 5)
    assert paused.expected_back_at is not None and paused.held_until is not None
    assert paused.held_until > paused.expected_back_at > time.time()
    assert paused.tenant_share_bytes is not None and 0 < paused.tenant_held_bytes <= paused.tenant_share_bytes
    await put(alice, "filler0", 10)
    await put(alice, "filler1", 11)
    await put(alice, "filler2", 12)  # 20 chunks through a 13-chunk tier: the paused one stays
    assert in_host(await alice.usage("agent")) == SESSION_BYTES
    assert in_host(await alice.usage("filler0")) < SESSION_BYTES

    done = await alice.done("agent")
    assert (done.hint, done.held_until, done.expected_back_at, done.chunks) == ("done", None, None, 5)
    assert done.tenant_held_bytes == 0
    for i in range(3, 6):  # released: plain LRU, and it is the oldest
        await put(alice, f"filler{i}", 10 + i)
    assert in_host(await alice.usage("agent")) == 0  # evicted from memory by pressure, still in LMDB
    assert (await alice.usage("agent")).bytes_stored["lmdb"] == SESSION_BYTES

    resuming = await alice.resuming("agent")
    assert resuming.hint == "resuming" and resuming.moved_chunks == 5 and resuming.in_memory == 5
    assert resuming.moved_bytes >= 300 * SPEC4.token_bytes and resuming.held_until is not None
    before = await alice.usage("agent")
    assert in_host(before) == SESSION_BYTES
    await resumes_exact(alice, "agent", 1)
    after = await alice.usage("agent")
    assert after.bytes_read.get("lmdb", 0) == before.bytes_read.get("lmdb", 0)  # memory only
    assert after.bytes_read["host"] - before.bytes_read.get("host", 0) == SESSION_BYTES
    assert (after.hints, after.resumes) == (3, 1)
    for sid, seed in [("filler0", 10), ("filler5", 15)]:  # pressure moved, never lost
        await resumes_exact(alice, sid, seed)


async def test_resuming_with_nothing_to_move_and_hints_by_the_generic_call(served: Served) -> None:
    await put(served.alice, "warm", 2)
    r = await served.alice.hint("warm", "resuming")
    assert r.moved_chunks == 0 and r.moved_bytes == 0 and r.in_memory == 5  # in memory already
    raw = await served.raw.post("/v1/sessions/warm/hints", json={"hint": "paused", "expected_s": 12})  # an int: seconds
    assert raw.status_code == 200, raw.text
    assert raw.json()["hint"] == "paused" and raw.json()["expected_back_at"] > time.time()
    assert (await served.alice.usage("warm")).hints == 2
    await resumes_exact(served.alice, "warm", 2)


BAD_BODIES: list[tuple[str, bytes]] = [
    ("unknown kind", b'{"hint": "sleeping"}'),
    ("kind in capitals", b'{"hint": "PAUSED", "expected_s": 5}'),
    ("kind not a string", b'{"hint": 1}'),
    ("no kind", b'{"expected_s": 5}'),
    ("paused without expected_s", b'{"hint": "paused"}'),
    ("paused with null expected_s", b'{"hint": "paused", "expected_s": null}'),
    ("negative expected_s", b'{"hint": "paused", "expected_s": -5}'),
    ("zero expected_s", b'{"hint": "paused", "expected_s": 0}'),
    ("NaN expected_s", b'{"hint": "paused", "expected_s": NaN}'),
    ("infinite expected_s", b'{"hint": "paused", "expected_s": Infinity}'),
    ("overflowing expected_s", b'{"hint": "paused", "expected_s": 1e999}'),
    ("expected_s over 7 days", b'{"hint": "paused", "expected_s": 604801}'),
    ("string expected_s", b'{"hint": "paused", "expected_s": "30"}'),
    ("boolean expected_s", b'{"hint": "paused", "expected_s": true}'),
    ("extra field", b'{"hint": "done", "priority": 9}'),
    ("not an object", b'["paused", 30]'),
    ("not JSON", b"paused for 30 seconds"),
    ("truncated JSON", b'{"hint": "paused", "expected_s": 3'),
    ("empty body", b""),
]


async def hint_state(served: Served, sid: str) -> tuple[object, ...]:
    """What a refused hint must leave as it was: the stored footprint, the session (version, hit
    time), its counters, the holds on its chunks and where they are."""
    store = served.store.for_tenant("alice")
    manifest = await store.session(sid)
    usage = await served.alice.usage(sid)
    held = store.chunks.held(f"hint:alice/{sid}")
    return await footprint(served.store), manifest.version, manifest.last_hit_at, usage, held


async def test_bad_hints_are_refused_and_change_nothing(served: Served) -> None:
    await put(served.alice, "s", 3)
    before = await hint_state(served, "s")
    for what, body in BAD_BODIES:
        r = await served.raw.post("/v1/sessions/s/hints", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422, (what, r.status_code, r.text)
        assert r.json()["error"] == "validation_error", what
        assert isinstance(error_from(r.status_code, r.json()["error"], r.json()["detail"]), InvalidArgumentError)
    r = await served.raw.post("/v1/sessions/s/hints", content=b'{"hint": "done"}', headers={"content-type": "text/plain"})
    assert r.status_code == 422, r.text  # a hint is JSON
    for bad_id in ["bad%20id", "-dash-first", "x" * 300]:  # refused by the id rules, never looked up
        r = await served.raw.post(f"/v1/sessions/{bad_id}/hints", json={"hint": "done"})
        assert (r.status_code, r.json()["error"]) == (422, "invalid_id"), (bad_id, r.text)
    r = await served.raw.post("/v1/sessions/nobody/hints", json={"hint": "resuming"})
    assert (r.status_code, r.json()["error"]) == (404, "session_not_found")
    async with httpx.AsyncClient(base_url=served.url) as anonymous:
        r = await anonymous.post("/v1/sessions/s/hints", json={"hint": "done"})
        assert (r.status_code, r.json()["error"]) == (401, "unauthorized")

    # The SDK refuses the same hints before sending them, typed; the service types the rest.
    alice = served.alice
    refused: list[tuple[Any, Any]] = [
        ("sleeping", None), ("paused", None), ("paused", -1.0), ("paused", 0), ("paused", math.nan),
        ("paused", math.inf), ("paused", "30"), ("paused", True), ("paused", 8 * 24 * 3600.0), (None, None),
    ]  # fmt: skip
    for kind, expected in refused:
        with pytest.raises(InvalidArgumentError, match="invalid hint"):
            await alice.hint("s", kind, expected)
    with pytest.raises(InvalidArgumentError):
        await alice.paused("s", math.nan)
    with pytest.raises(InvalidSessionIdError):
        await alice.resuming("../escape")
    with pytest.raises(SessionNotFoundError):
        await alice.paused("nobody", 5)
    with pytest.raises(SessionNotFoundError):  # another tenant's session is no session at all
        await served.bob.done("s")
    async with AsyncClient(served.url, "not-a-token") as stranger:
        with pytest.raises(UnauthorizedError):
            await stranger.resuming("s")
    assert await hint_state(served, "s") == before
    assert before[-1] is None and before[2] is None  # no hold and no hit, then as now
    await resumes_exact(alice, "s", 3)


# -- accounting ------------------------------------------------------------------------------------


async def test_usage_is_exact_per_session_and_per_tenant_and_tenants_are_isolated(served: Served) -> None:
    alice, bob = served.alice, served.bob
    toks, kv = random_tokens(TOKENS, seed=5), random_kv(SPEC4, TOKENS, seed=5)
    await alice.snapshot("a", toks, kv)  # 4 chunks and a tail, all new
    await alice.snapshot("b", toks, kv)  # the same chunks: deduped; only its own tail is written
    await alice.resume("a")
    await alice.resume("a")
    await alice.paused("a", 5)
    await alice.resume("b")
    await put(bob, "a", 6)  # the same name in another tenant: its own session and its own bill
    await bob.resume("a")

    a = await alice.usage("a")
    assert (a.tenant, a.session_id, a.snapshots, a.resumes, a.hints, a.loads) == ("alice", "a", 1, 2, 1, 0)
    assert (a.tokens_written, a.tokens_deduped, a.tokens_read, a.tokens_recomputed) == (300, 0, 600, 0)
    assert a.bytes_written == SESSION_BYTES and a.bytes_read == {"host": 2 * SESSION_BYTES}
    assert a.bytes_stored == {"host": SESSION_BYTES, "lmdb": SESSION_BYTES}
    info = await alice.info("a")
    assert a.last_hit_at is not None and a.last_hit_at == info.last_hit_at  # the hint was its last hit

    b = await alice.usage("b")
    assert (b.snapshots, b.resumes, b.hints, b.tokens_written, b.tokens_deduped, b.tokens_read) == (1, 1, 0, 44, 256, 300)
    assert b.bytes_written == TAIL and b.bytes_read == {"host": SESSION_BYTES}

    total = await alice.usage()
    assert (total.tenant, total.session_id, total.last_hit_at, total.bytes_stored) == ("alice", None, None, {})
    assert (total.snapshots, total.resumes, total.hints, total.loads) == (2, 3, 1, 0)
    assert (total.tokens_written, total.tokens_deduped, total.tokens_read, total.tokens_recomputed) == (344, 256, 900, 0)
    assert total.bytes_written == SESSION_BYTES + TAIL and total.bytes_read == {"host": 3 * SESSION_BYTES}

    theirs = await bob.usage("a")
    mine = await bob.usage()
    for u in (theirs, mine):
        assert (u.tenant, u.snapshots, u.resumes, u.hints, u.tokens_written, u.tokens_read) == ("bob", 1, 1, 0, 300, 300)
        assert u.bytes_written == SESSION_BYTES and u.bytes_read == {"host": SESSION_BYTES}
    with pytest.raises(SessionNotFoundError):
        await bob.usage("b")  # Alice's session: not found, like one that never existed
    r = await served.raw.get("/v1/sessions/bad%20id/usage")
    assert (r.status_code, r.json()["error"]) == (422, "invalid_id")

    # The service answers what the store counts (the same figures the library reads).
    store = served.store.for_tenant("alice")
    assert await store.usage("a") == a and await store.usage() == total
    # A prefix load counts too; a deleted session's bill stays in the tenant's.
    m = await alice.match(toks)
    assert m.tokens == 256 and bits_equal(await alice.load(toks), kv[:, :, :256])
    await alice.delete("a")
    with pytest.raises(SessionNotFoundError):
        await alice.usage("a")
    after = await alice.usage()
    assert (after.resumes, after.loads, after.tokens_read, after.tokens_recomputed) == (3, 1, 1156, 44)
    assert (await bob.usage()).loads == 0


async def test_usage_persists_across_a_server_restart(open_store: Callable[..., Any]) -> None:
    async with service(open_store) as s:
        await put(s.alice, "kept", 7)
        await s.alice.resume("kept")
        await s.alice.done("kept")
        first = await s.alice.usage("kept")
    async with service(open_store) as s:  # flushed at close, read back from the catalog
        again = await s.alice.usage("kept")
        assert again.model_dump(exclude={"bytes_stored"}) == first.model_dump(exclude={"bytes_stored"})
        assert (again.snapshots, again.resumes, again.hints, again.tokens_read) == (1, 1, 1, 300)
        assert (await s.alice.usage()).resumes == 1


# -- retention -------------------------------------------------------------------------------------


async def test_guaranteed_until_and_sliding_ttl_are_visible_in_session_info(served: Served) -> None:
    alice = served.alice
    guarantee = time.time() + 3600
    info = await put_info(alice, "kept", 8, ttl_seconds=60, guaranteed_until=guarantee)
    assert (info.guaranteed_until, info.ttl_seconds, info.last_hit_at) == (guarantee, 60, None)
    assert info.expires_at == guarantee  # the TTL would end sooner; the guarantee holds it
    assert (await alice.info("kept")) == info
    assert [s for s in await alice.list() if s.session_id == "kept"] == [info]
    assert (await alice.get("kept")).guaranteed_until == guarantee

    plain = await put_info(alice, "ttl", 9, ttl_seconds=60)
    assert plain.guaranteed_until is None and plain.expires_at == pytest.approx(plain.updated_at + 60)
    await resumes_exact(alice, "ttl", 9)
    hit = await alice.info("ttl")
    assert hit.last_hit_at is not None and hit.last_hit_at >= plain.updated_at
    assert hit.expires_at == pytest.approx(hit.last_hit_at + 60)  # sliding: counted from the hit
    await alice.paused("ttl", 5)
    hinted = await alice.info("ttl")
    assert hinted.last_hit_at is not None and hinted.last_hit_at >= hit.last_hit_at
    assert hinted.expires_at == pytest.approx(hinted.last_hit_at + 60)

    forever = await put_info(alice, "pinned", 10, pinned=True, guaranteed_until=guarantee)
    assert forever.expires_at is None and forever.guaranteed_until == guarantee
    with pytest.raises(SessionNotFoundError):
        await served.bob.info("kept")


async def put_info(client: AsyncClient, sid: str, seed: int, **kw: Any) -> Any:
    return await client.snapshot(sid, random_tokens(TOKENS, seed=seed), random_kv(SPEC4, TOKENS, seed=seed), **kw)


async def test_bad_guaranteed_until_is_refused_and_nothing_is_stored(served: Served) -> None:
    alice = served.alice
    await put(alice, "s", 11, guaranteed_until=time.time() + 60)
    toks, kv = random_tokens(100, seed=12), random_kv(SPEC4, 100, seed=12)
    before = await footprint(served.store), await alice.info("s"), await alice.usage()
    bad_values: list[Any] = [-1.0, 0, math.nan, math.inf, -math.inf, "tomorrow"]
    for bad in bad_values:
        with pytest.raises(InvalidArgumentError, match="guaranteed_until"):  # checked before sending
            await alice.snapshot("s", toks, kv, guaranteed_until=bad)
        with pytest.raises(InvalidArgumentError, match="guaranteed_until"):
            await alice.snapshot("new", toks, kv, guaranteed_until=bad)
    for raw in ["-1", "0", "NaN", "Infinity", "-Infinity", "1e999", '"tomorrow"', "[1]", "{}"]:
        for sid in ["s", "new"]:
            body = frame_with(snapshot_header(toks, kv), kv, f'"guaranteed_until": {raw}')
            r = await served.raw.post(f"/v1/sessions/{sid}/snapshot", content=body, headers={"content-type": FRAME_TYPE})
            assert r.status_code == 422, (raw, sid, r.status_code, r.text)
            assert r.json()["error"] == "validation_error"
    good = frame_with(snapshot_header(toks, kv), kv, f'"guaranteed_until": {time.time() + 600!r}')  # the same, valid (and still ahead when the reply comes, however loaded the machine)
    assert before == (await footprint(served.store), await alice.info("s"), await alice.usage())
    r = await served.raw.post("/v1/sessions/new/snapshot", content=good, headers={"content-type": FRAME_TYPE})
    assert r.status_code == 200 and r.json()["guaranteed_until"] > time.time()


def frame_with(header: dict[str, Any], kv: Any, member: str) -> bytes:
    """A frame whose JSON header is `header` plus `member` spelled as given (JSON or not)."""
    payload = kv_payload(kv)
    raw = (json.dumps({**header, "xxh3": checksum(payload)})[:-1] + f", {member}}}").encode()
    return b"ASWF\x01\x00\x00\x00" + len(raw).to_bytes(4, "little") + raw + bytes(payload)


def test_blocking_client_hints_usage_and_retention(url: str) -> None:
    """The blocking SDK: the same methods, the same results, the same typed errors."""
    guarantee = time.time() + 600
    with Client(url, ALICE, spec=SPEC4) as alice:
        info = alice.snapshot(
            "sync", random_tokens(TOKENS, 13), random_kv(SPEC4, TOKENS, 13), ttl_seconds=30, guaranteed_until=guarantee
        )
        assert info.guaranteed_until == guarantee and alice.info("sync").expires_at == guarantee
        assert alice.paused("sync", 20).hint == "paused"
        assert alice.resuming("sync").in_memory == 5
        assert alice.hint("sync", "done").held_until is None
        with pytest.raises(InvalidArgumentError):
            alice.paused("sync", -3)
        with pytest.raises(InvalidArgumentError):
            alice.snapshot("sync", [1], random_kv(SPEC4, 1), guaranteed_until=math.nan)
        with pytest.raises(SessionNotFoundError):
            alice.done("nobody")
        r = alice.resume("sync")
        assert r.complete and bits_equal(r.kv, random_kv(SPEC4, TOKENS, 13))
        u = alice.usage("sync")
        assert (u.snapshots, u.resumes, u.hints, u.tokens_read, u.bytes_written) == (1, 1, 3, 300, SESSION_BYTES)
        assert alice.usage().hints == 3 and alice.info("sync").last_hit_at == u.last_hit_at


# -- metrics and the API document ------------------------------------------------------------------


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }  # fmt: skip


async def scrape(served: Served, token: str | None = METRICS_TOKEN) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=served.url, headers=headers) as c:
        return await c.get("/metrics")


async def test_metrics_count_each_tenants_usage(served: Served) -> None:
    alice, bob = served.alice, served.bob
    toks, kv = random_tokens(TOKENS, seed=14), random_kv(SPEC4, TOKENS, seed=14)
    await alice.snapshot("a", toks, kv)
    await alice.snapshot("b", toks, kv)
    await alice.resume("a")
    await alice.paused("a", 10)
    await alice.load(toks + [7])
    await put(bob, "x", 15)
    await bob.done("x")
    assert (await scrape(served, token=None)).status_code == 401  # a metrics token is set: it is asked for

    r = await scrape(served)
    assert r.status_code == 200
    got = samples(r.text)

    def tenant(name: str, who: str, **labels: str) -> float:
        return got[(f"agentstate_tenant_{name}_total", tuple(sorted({"tenant": who, **labels}.items())))]

    expected = {
        "alice": {"tokens_read": 300 + 256, "tokens_written": 344, "tokens_deduped": 256, "tokens_recomputed": 45,
                  "bytes_written": SESSION_BYTES + TAIL, "resumes": 1, "snapshots": 2, "loads": 1, "hints": 1},
        "bob": {"tokens_read": 0, "tokens_written": 300, "tokens_deduped": 0, "tokens_recomputed": 0,
                "bytes_written": SESSION_BYTES, "resumes": 0, "snapshots": 1, "loads": 0, "hints": 1},
    }  # fmt: skip
    for who, counts in expected.items():
        for name, n in counts.items():
            assert tenant(name, who) == n, (who, name)
    assert tenant("bytes_read", "alice", tier="host") == SESSION_BYTES + 4 * CHUNK
    assert not [k for k in got if k[0] == "agentstate_tenant_bytes_read_total" and ("tenant", "bob") in k[1]]
    # the scrape and the tenant's own account agree
    usage = await alice.usage()
    assert tenant("tokens_read", "alice") == usage.tokens_read and tenant("hints", "alice") == usage.hints
    assert tenant("bytes_read", "alice", tier="host") == usage.bytes_read["host"]

    await alice.resume("b")
    again = samples((await scrape(served)).text)
    key = ("agentstate_tenant_resumes_total", (("tenant", "alice"),))
    assert again[key] == 2 and again[("agentstate_tenant_resumes_total", (("tenant", "bob"),))] == 0
    assert again[("agentstate_tenant_bytes_read_total", (("tenant", "alice"), ("tier", "host")))] == (
        2 * SESSION_BYTES + 4 * CHUNK
    )


async def test_an_open_metrics_endpoint_names_no_tenant(open_store: Callable[..., Any]) -> None:
    async with service(open_store, limits=LIMITS) as s:
        await put(s.alice, "a", 16)
        await s.alice.paused("a", 3)
        r = await scrape(s, token=None)
        assert r.status_code == 200 and "agentstate_tenant_" not in r.text and "alice" not in r.text


async def test_openapi_lists_the_new_routes(served: Served) -> None:
    doc = (await served.raw.get("/openapi.json")).json()
    for path, method in [
        ("/v1/sessions/{session_id}/hints", "post"), ("/v1/sessions/{session_id}/usage", "get"),
        ("/v1/usage", "get"), ("/v1/sessions/{session_id}/info", "get"),
    ]:  # fmt: skip
        assert method in doc["paths"][path], path
    schemas = doc["components"]["schemas"]
    assert {"Hint", "HintResult", "Usage"} <= set(schemas)
    assert {"guaranteed_until", "expires_at", "last_hit_at"} <= set(schemas["SessionInfo"]["properties"])

