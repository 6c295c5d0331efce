"""The HTTP service over real HTTP on loopback: auth, tenant isolation, limits, metrics, OpenAPI.

Requests here are built by hand (httpx + `agentstate.wire` frames) so malformed ones can be sent;
tests/test_client.py drives the same server through the SDK.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn

from agentstate import StateStore
from agentstate.errors import InvalidArgumentError, NotFoundError
from agentstate.ops.admin import SPEC_FILE
from agentstate.server.gate import Limits, tenant_table
from agentstate.server.service import create_app, load_tokens, resolve_spec
from agentstate.wire import FRAME_TYPE, checksum, kv_payload
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.ports import free_port

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"
TOKENS = {ALICE: "alice", BOB: "bob"}
LIMITS = Limits(max_body_bytes=1 << 20, max_json_bytes=64 << 10, handle_secret="test-handle-secret-0123456789")


@dataclass
class Served:
    url: str
    store: StateStore


@contextlib.asynccontextmanager
async def serving(store: StateStore, limits: Limits = LIMITS) -> AsyncIterator[str]:
    """A real uvicorn server for `store` on a free loopback port, in this event loop."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_app(store, TOKENS, limits), lifespan="off", log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("uvicorn exited before it started")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


@pytest.fixture
async def served(open_store: Callable[..., Any]) -> AsyncIterator[Served]:
    async with open_store() as store, serving(store) as url:
        yield Served(url, store)


@contextlib.asynccontextmanager
async def http(served: Served, token: str | None = ALICE) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=served.url, headers=headers, timeout=30) as client:
        yield client


def frame(header: dict[str, Any], kv: torch.Tensor, *, fix_checksum: bool = True) -> bytes:
    """A frame with this exact JSON header (valid or not) and the bytes of `kv`."""
    payload = kv_payload(kv)
    if fix_checksum:
        header = {**header, "xxh3": checksum(payload)}
    raw = json.dumps(header).encode()
    return b"ASWF\x01\x00\x00\x00" + len(raw).to_bytes(4, "little") + raw + bytes(payload)


def snapshot_header(tokens: list[int], kv: torch.Tensor, **extra: Any) -> dict[str, Any]:
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[kv.dtype]
    return {"fingerprint": SPEC4.fingerprint, "dtype": dtype, "shape": list(kv.shape), "tokens": tokens, **extra}


async def put_session(
    client: httpx.AsyncClient, sid: str, n: int = 300, seed: int = 0
) -> tuple[list[int], torch.Tensor]:
    toks, kv = random_tokens(n, seed), random_kv(SPEC4, n, seed)
    body = frame(snapshot_header(toks, kv, state={"owner": sid}), kv)
    r = await client.post(f"/v1/sessions/{sid}/snapshot", content=body, headers={"content-type": FRAME_TYPE})
    assert r.status_code == 200, r.text
    return toks, kv


def split(body: bytes) -> tuple[dict[str, Any], bytes]:
    size = int.from_bytes(body[8:12], "little")
    return json.loads(body[12 : 12 + size]), body[12 + size :]


async def footprint(store: StateStore) -> tuple[object, ...]:
    """Everything a refused request must leave as it was."""
    sessions = {}
    for tenant in TOKENS.values():
        sessions[tenant] = sorted([(m.session_id, m.version) async for m in store.for_tenant(tenant).sessions()])
    keys = sorted([k async for k in store.chunks.backend(store.chunks.record_tier).keys("")])
    stats = await store.stats()
    return sessions, keys, stats.sessions, stats.indexed_keys, stats.counters.get("bytes_written", 0)


async def test_openapi_lists_every_path(served: Served) -> None:
    async with http(served, token=None) as client:
        spec = (await client.get("/openapi.json")).json()
    paths = set(spec["paths"])
    assert {
        "/v1/sessions", "/v1/sessions/{session_id}", "/v1/sessions/{session_id}/snapshot",
        "/v1/sessions/{session_id}/resume", "/v1/sessions/{session_id}/fork", "/v1/stats", "/v1/spec",
        "/v1/match", "/v1/prefixes", "/v1/prefixes/load", "/v1/chunks/{handle}", "/metrics", "/healthz",
    } <= paths  # fmt: skip
    assert {"get", "head", "put"} <= set(spec["paths"]["/v1/chunks/{handle}"])
    assert "SessionInfo" in spec["components"]["schemas"] and "ErrorBody" in spec["components"]["schemas"]
    snap = spec["paths"]["/v1/sessions/{session_id}/snapshot"]["post"]
    assert FRAME_TYPE in snap["requestBody"]["content"]


_SAMPLE = re.compile(r'[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? \S+')


async def test_metrics_parse_as_prometheus_text(served: Served) -> None:
    async with http(served) as client:
        await put_session(client, "m1")
        assert (await client.post("/v1/sessions/m1/resume")).status_code == 200
        assert (await client.get("/v1/sessions/nope")).status_code == 404
    async with http(served, token=None) as client:
        assert (await client.get("/healthz")).json()["status"] == "ok"
        r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    lines = r.text.rstrip("\n").split("\n")
    for line in lines:
        assert line.startswith(("# HELP ", "# TYPE ")) or _SAMPLE.fullmatch(line), line
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])
    text = r.text
    assert (
        'agentstate_http_requests_total{method="POST",route="/v1/sessions/{session_id}/snapshot",status="200"} 1'
        in text
    )
    assert 'route="/v1/sessions/{session_id}",status="404"} 1' in text
    assert (
        'agentstate_http_request_duration_seconds_count{method="POST",route="/v1/sessions/{session_id}/resume"} 1'
        in text
    )
    assert re.search(r'agentstate_tier_bytes_used\{tier="lmdb"\} [1-9]', text)
    assert "agentstate_sessions 1" in text
    assert "alice" not in text  # no label names a tenant


async def test_metrics_token_when_configured(open_store: Callable[..., Any]) -> None:
    limits = LIMITS.model_copy(update={"metrics_token": "scrape-me"})
    async with open_store() as store, serving(store, limits) as url, httpx.AsyncClient(base_url=url) as client:
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/metrics", headers={"authorization": f"Bearer {ALICE}"})).status_code == 401
        assert (await client.get("/metrics", headers={"authorization": "Bearer scrape-me"})).status_code == 200


@pytest.mark.parametrize("auth", [None, "Bearer nope", "Basic " + ALICE, "Bearer", ALICE])
async def test_missing_or_wrong_token_is_401_and_stores_nothing(served: Served, auth: str | None) -> None:
    before = await footprint(served.store)
    toks, kv = random_tokens(100), random_kv(SPEC4, 100)
    headers = {"authorization": auth} if auth else {}
    async with httpx.AsyncClient(base_url=served.url, headers=headers) as client:
        for method, path, body in [
            ("POST", "/v1/sessions/x/snapshot", frame(snapshot_header(toks, kv), kv)),
            ("GET", "/v1/sessions", None),
            ("DELETE", "/v1/sessions/x", None),
            ("POST", "/v1/match", b'{"tokens": [1, 2]}'),
        ]:
            r = await client.request(method, path, content=body)
            assert r.status_code == 401 and r.json()["error"] == "unauthorized", (method, path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
    assert await footprint(served.store) == before


async def test_tenants_never_see_each_other(served: Served) -> None:
    async with http(served, ALICE) as alice, http(served, BOB) as bob:
        toks, kv = await put_session(alice, "secret-1")
        before = await footprint(served.store)

        async def as_bob(sid: str) -> list[tuple[int, str, str]]:
            out = []
            calls: list[tuple[str, str, dict[str, Any]]] = [
                ("GET", f"/v1/sessions/{sid}", {}),
                ("POST", f"/v1/sessions/{sid}/resume", {}),
                ("POST", f"/v1/sessions/{sid}/fork", {"json": {"new_id": "bobs-copy"}}),
                ("DELETE", f"/v1/sessions/{sid}", {}),
            ]
            for method, path, kw in calls:
                r = await bob.request(method, path, **kw)
                out.append((r.status_code, r.json()["error"], r.json()["detail"].replace(sid, "ID")))
            return out

        seen = await as_bob("secret-1")
        assert all(status == 404 for status, _, _ in seen)
        assert seen == await as_bob("never-existed")  # identical to a session that does not exist
        assert (await bob.get("/v1/sessions")).json() == []
        assert (await bob.get("/v1/stats")).json()["sessions"] == 0
        m = (await bob.post("/v1/match", json={"tokens": toks})).json()
        assert (m["tokens"], m["chunks"]) == (0, 0)
        assert await footprint(served.store) == before

        # Bob may use the same session id: it is his own session, not a conflict with Alice's.
        await put_session(bob, "secret-1", n=100, seed=9)
        r = await alice.post("/v1/sessions/secret-1/resume")
        header, payload = split(r.content)
        assert header["manifest"]["tokens"] == toks and header["manifest"]["state"] == {"owner": "secret-1"}
        assert bits_equal(torch.frombuffer(bytearray(payload), dtype=SPEC4.torch_dtype).view(kv.shape), kv)
        assert [s["num_tokens"] for s in (await bob.get("/v1/sessions")).json()] == [100]
        assert (await bob.delete("/v1/sessions/secret-1")).status_code == 204
        assert (await alice.get("/v1/sessions/secret-1")).json()["tokens"] == toks


async def test_chunk_handles_are_bound_to_their_tenant(served: Served) -> None:
    async with http(served, ALICE) as alice, http(served, BOB) as bob:
        toks, _ = await put_session(alice, "s", n=256)
        handles = (await alice.post("/v1/match", json={"tokens": toks})).json()["handles"]
        assert len(handles) == 4
        got = await alice.get(f"/v1/chunks/{handles[0]}")
        assert got.status_code == 200 and (await alice.head(f"/v1/chunks/{handles[0]}")).status_code == 200
        before = await footprint(served.store)
        digest, zeros = handles[0].split(".")[0], f"{'0' * 64}.{'0' * 32}"
        absent = (await bob.get(f"/v1/chunks/{zeros}")).json()
        for handle in [handles[0], f"{digest}.{'0' * 32}", digest, "x" * 5000]:
            r = await bob.get(f"/v1/chunks/{handle}")
            assert r.status_code == 404, handle
            if handle.startswith(digest):  # word for word what a chunk that is not there gets
                assert {**r.json(), "detail": r.json()["detail"].replace(handle, zeros)} == absent
            assert (await bob.head(f"/v1/chunks/{handle}")).status_code == 404
            put = await bob.put(f"/v1/chunks/{handle}", content=got.content)
            assert put.status_code == 404, put.text
        bob_handles = (await bob.post("/v1/match", json={"tokens": toks})).json()["handles"]
        assert bob_handles[0] != handles[0]
        assert (await bob.get(f"/v1/chunks/{bob_handles[0]}")).status_code == 404  # Bob's namespace holds nothing
        assert await footprint(served.store) == before


def _bad_requests() -> list[tuple[str, str, str, Callable[[], dict[str, Any]], int, str]]:
    toks, kv = random_tokens(100, seed=3), random_kv(SPEC4, 100, seed=3)
    snap = "/v1/sessions/new-1/snapshot"
    ok = snapshot_header(toks, kv)
    other = SPEC4.model_copy(update={"model_id": "test/other"})

    def chunked(total: int) -> Any:
        async def gen() -> AsyncIterator[bytes]:
            for _ in range(total // 65536 + 1):
                yield b"\0" * 65536

        return gen()

    def f(header: dict[str, Any], t: torch.Tensor = kv, **kw: Any) -> Callable[[], dict[str, Any]]:
        return lambda: {"content": frame(header, t, **kw)}

    header_bytes = frame(ok, kv)[12:].split(b"}", 1)[0]  # JSON header cut short
    big_header = b"ASWF\x01\x00\x00\x00" + (1 << 20).to_bytes(4, "little") + b"{}"
    return [
        ("not a frame", "POST", snap, lambda: {"content": b"garbage"}, 400, "malformed"),
        ("header over its limit", "POST", snap, lambda: {"content": big_header}, 400, "malformed"),
        (
            "malformed JSON header",
            "POST",
            snap,
            lambda: {"content": b"ASWF\x01\x00\x00\x00" + len(header_bytes).to_bytes(4, "little") + header_bytes},
            422,
            "validation_error",
        ),
        ("unknown header field", "POST", snap, f({**ok, "colour": "red"}), 422, "validation_error"),
        ("no tokens", "POST", snap, f({**ok, "tokens": []}), 422, "validation_error"),
        ("state not an object", "POST", snap, f({**ok, "state": [1, 2]}), 422, "validation_error"),
        ("negative token", "POST", snap, f({**ok, "tokens": [-1] + toks[1:]}), 422, "invalid_argument"),
        ("wrong fingerprint", "POST", snap, f({**ok, "fingerprint": other.fingerprint}), 409, "spec_mismatch"),
        ("wrong dtype", "POST", snap, f({**ok, "dtype": "float16"}, kv.view(torch.float16)), 422, "kv_shape"),
        (
            "wrong shape",
            "POST",
            snap,
            f({**ok, "shape": [4, 2, 100, 1, 128]}, kv.reshape(4, 2, 100, 1, 128)),
            422,
            "kv_shape",
        ),
        ("shape disagrees with tokens", "POST", snap, f({**ok, "tokens": toks[:99]}), 422, "kv_shape"),
        ("payload truncated", "POST", snap, lambda: {"content": frame(ok, kv)[:-10]}, 400, "malformed"),
        ("payload checksum wrong", "POST", snap, f({**ok, "xxh3": 12345}, fix_checksum=False), 400, "malformed"),
        ("invalid session id", "POST", "/v1/sessions/-bad/snapshot", f(ok), 422, "invalid_id"),
        (
            "body over the limit",
            "POST",
            snap,
            lambda: {"content": b"\0" * (LIMITS.max_body_bytes + 1)},
            413,
            "too_large",
        ),
        (
            "streamed past the limit",
            "POST",
            snap,
            lambda: {"content": chunked(LIMITS.max_body_bytes * 2)},
            413,
            "too_large",
        ),
        (
            "JSON over its limit",
            "POST",
            "/v1/match",
            lambda: {"json": {"tokens": list(range(20000))}},
            413,
            "too_large",
        ),
        (
            "JSON streamed past its limit",
            "POST",
            "/v1/match",
            lambda: {"content": chunked(LIMITS.max_json_bytes * 2), "headers": {"content-type": "application/json"}},
            413,
            "too_large",
        ),
        (
            "malformed JSON body",
            "POST",
            "/v1/sessions/s/fork",
            lambda: {"content": b'{"new_id": ', "headers": {"content-type": "application/json"}},
            422,
            "validation_error",
        ),
        (
            "fork to an invalid id",
            "POST",
            "/v1/sessions/s/fork",
            lambda: {"json": {"new_id": "../x"}},
            422,
            "invalid_id",
        ),
        ("fork onto an existing id", "POST", "/v1/sessions/s/fork", lambda: {"json": {"new_id": "s"}}, 409, "conflict"),
        (
            "stale expected_version",
            "POST",
            "/v1/sessions/s/snapshot",
            f({**ok, "expected_version": 7}),
            409,
            "conflict",
        ),
        (
            "chunk that is no chunk",
            "PUT",
            "/v1/chunks/HANDLE",
            lambda: {"content": b"ASKV" + b"\0" * 100},
            422,
            "invalid_argument",
        ),
        ("unknown route", "GET", "/v1/nothing-here", dict, 404, "not_found"),
    ]


@pytest.mark.parametrize("case", _bad_requests(), ids=lambda c: c[0])
async def test_bad_requests_are_4xx_and_change_nothing(served: Served, case: tuple[Any, ...]) -> None:
    _, method, path, build, status, code = case
    async with http(served) as client:
        await put_session(client, "s", n=100, seed=1)
        handle = (await client.post("/v1/match", json={"tokens": random_tokens(64, seed=5)})).json()["handles"][0]
        before = await footprint(served.store)
        r = await client.request(method, path.replace("HANDLE", handle), **build())
        assert (r.status_code, r.json()["error"]) == (status, code), r.text
        assert await footprint(served.store) == before
        assert (await client.get("/v1/sessions/s")).json()["version"] == 1  # the server still answers


def test_tokens_and_spec_for_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTSTATE_TOKENS", raising=False)
    with pytest.raises(InvalidArgumentError):
        load_tokens(None)  # the service never runs without tokens
    monkeypatch.setenv("AGENTSTATE_TOKENS", json.dumps({"t0": "alice"}))
    assert load_tokens(None) == {"t0": "alice"}
    bad = tmp_path / "tokens.json"
    for raw in ("not json", "[1, 2]", '{"t": 7}'):
        bad.write_text(raw)
        with pytest.raises(InvalidArgumentError):
            load_tokens(bad)
    for tokens in ({}, {"t": "../etc"}, {"has space": "alice"}):
        with pytest.raises(InvalidArgumentError):
            tenant_table(tokens)
    data = tmp_path / "data"
    with pytest.raises(NotFoundError):  # never a guessed spec
        resolve_spec(data, None)
    assert not (data / SPEC_FILE).exists()
    assert resolve_spec(data, SPEC4) == SPEC4 and (data / SPEC_FILE).exists()  # recorded
    assert resolve_spec(data, None) == SPEC4  # and used when none is given


async def wait_healthy(client: httpx.AsyncClient, proc: asyncio.subprocess.Process, seconds: float = 60) -> None:
    """Poll `/healthz` until the service in `proc` answers 200 (it must not exit meanwhile)."""
    for _ in range(int(seconds * 10)):
        assert proc.returncode is None, "the service exited"
        with contextlib.suppress(httpx.TransportError):
            if (await client.get("/healthz")).status_code == 200:
                return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the service did not answer /healthz within {seconds} s")


def _free_port() -> int:
    return free_port()


async def test_run_serves_a_data_dir_until_sigterm(tmp_path: Path) -> None:
    """`agentstate.server.service.run`, what `agentstate serve` calls, in its own process."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({ALICE: "alice"}))
    port = _free_port()
    code = (
        "import sys; from pathlib import Path; from agentstate.server.service import run; from tests.conftest import SPEC4; "
        f"run(Path(sys.argv[1]), host='127.0.0.1', port={port}, tokens_file=Path(sys.argv[2]), spec=SPEC4)"
    )
    root = Path(__file__).resolve().parent.parent
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, str(tmp_path / "data"), str(tokens), cwd=root
    )
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"authorization": f"Bearer {ALICE}"}
        ) as c:
            await wait_healthy(c, proc)
            assert (await c.get("/v1/spec")).json()["fingerprint"] == SPEC4.fingerprint
            await put_session(c, "in-a-process", n=70)
            assert [s["session_id"] for s in (await c.get("/v1/sessions")).json()] == ["in-a-process"]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    async with StateStore.open(tmp_path / "data", SPEC4) as store:  # closed cleanly, reopened here
        assert [m.session_id async for m in store.for_tenant("alice").sessions()] == ["in-a-process"]
