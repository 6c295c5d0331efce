"""Fuzzing the HTTP API (issue 6, bad input and isolation) over real HTTP on loopback.

Every route the served OpenAPI document lists gets hypothesis-made requests: odd path
parameters, random, JSON, frame-shaped and oversized bodies, random content types, good, bad and
missing tokens. The server never answers 5xx; a refused request (4xx) changes nothing stored
(`footprint`). Chunk handles, mutated or taken from another tenant, never return bytes.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agentstate import StateStore
from agentstate.server.service import create_app
from agentstate.wire import CHUNK_TYPE, FRAME_TYPE
from tests.conftest import SPEC4, random_kv, random_tokens
from tests.test_fuzz_formats import JSON, LoopThread
from tests.test_service import ALICE, BOB, LIMITS, TOKENS, footprint, frame, serving, snapshot_header

FUZZ = settings(
    derandomize=True, deadline=None, max_examples=250,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
SEEDED = {"alice": "seeded-session-alice-0001", "bob": "seeded-session-bob-0001"}


@dataclass
class Live:
    loop: LoopThread
    store: StateStore
    url: str
    routes: list[tuple[str, str]]
    handles: list[str]
    """alice's chunk handles (from /v1/match on her seeded session)"""
    chunks: set[bytes]
    """the bytes those handles return to her"""

    def __repr__(self) -> str:  # hypothesis prints its arguments: not the chunk bytes
        return f"Live({self.url})"

    def footprint(self) -> tuple[object, ...]:
        return self.loop.run(footprint(self.store))

    def reseed(self) -> None:
        """After a request that was allowed to change things: back to just the seeded sessions."""
        self.loop.run(_reseed(self.store))


async def _reseed(store: StateStore) -> None:
    for tenant, sid in SEEDED.items():
        view = store.for_tenant(tenant)
        for m in [m async for m in view.sessions()]:
            if m.session_id != sid:
                await view.delete(m.session_id)
        with contextlib.suppress(Exception):
            await view.session(sid)
            continue
        await view.snapshot(sid, random_tokens(200, seed=1), random_kv(SPEC4, 200, seed=1), {"owner": tenant})
    await store.gc()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    loop = LoopThread()
    stack = contextlib.AsyncExitStack()

    async def start() -> tuple[StateStore, str]:
        path = tmp_path_factory.mktemp("fuzz-service")
        store = await stack.enter_async_context(StateStore.open(path, SPEC4, chunk_tokens=64, lmdb_map_size=64 << 20))
        url = await stack.enter_async_context(serving(store))
        await _reseed(store)
        return store, url

    store, url = loop.run(start())
    with httpx.Client(base_url=url, timeout=60) as c:
        doc = c.get("/openapi.json").json()
        auth = {"authorization": f"Bearer {ALICE}"}
        handles = c.post("/v1/match", json={"tokens": random_tokens(200, seed=1)}, headers=auth).json()["handles"]
        chunks = {c.get(f"/v1/chunks/{h}", headers=auth).content for h in handles}
    routes = [(m.upper(), p) for p, ops in doc["paths"].items() for m in ops]
    assert len(handles) == 3 and len(routes) >= 15
    yield Live(loop, store, url, routes, handles, chunks)
    loop.run(stack.aclose())
    loop.close()


TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=60)
PARAM = st.sampled_from([*SEEDED.values(), "s", "-bad", "..", "%2e%2e"]) | TEXT | st.text(min_size=200, max_size=3000)
TOKEN = st.sampled_from([ALICE, BOB, None, "", "Bearer", ALICE + "x"]) | st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=40
)
KV = random_kv(SPEC4, 70, seed=4)
FRAMES = st.fixed_dictionaries(
    {}, optional={"fingerprint": JSON, "dtype": JSON, "shape": JSON, "tokens": JSON, "state": JSON, "xxh3": JSON}
).map(lambda h: frame({**snapshot_header(random_tokens(70), KV), **h}, KV, fix_checksum="xxh3" not in h))
BODY = st.one_of(
    st.none(),
    st.binary(max_size=2048),
    JSON.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({}, optional={"tokens": JSON, "new_id": JSON, "expected_version": JSON, "state": JSON}).map(
        lambda v: json.dumps(v).encode()
    ),
    FRAMES,
    FRAMES.map(lambda f: f[: len(f) // 2]),
    st.just(b"\0" * (LIMITS.max_body_bytes + 1)),
    st.just(json.dumps({"tokens": list(range(LIMITS.max_json_bytes // 4))}).encode()),
)
CONTENT_TYPE = st.sampled_from([None, "application/json", FRAME_TYPE, "text/plain", "application/json; charset=utf-8"])


@FUZZ
@given(data=st.data())
def test_every_route_refuses_bad_requests_without_changing_anything(live: Live, data: st.DataObject) -> None:
    method, template = data.draw(st.sampled_from(live.routes), label="route")
    path = template
    for name in [part[1:-1] for part in template.split("/") if part.startswith("{")]:
        value = data.draw(PARAM, label=name)
        path = path.replace("{" + name + "}", quote(value, safe="") if value else "%20")
    headers: dict[str, str] = {}
    token = data.draw(TOKEN, label="token")
    if token is not None:
        headers["authorization"] = f"Bearer {token}".strip()  # h11 refuses trailing spaces itself
    body = data.draw(BODY, label="body") if method in ("POST", "PUT", "PATCH") else None
    content_type = data.draw(CONTENT_TYPE, label="content-type")
    if content_type:
        headers["content-type"] = content_type

    before = live.footprint()
    with httpx.Client(base_url=live.url, timeout=60) as c:
        r = c.request(method, path, content=body, headers=headers)
        assert r.status_code < 500, f"{method} {path}: {r.status_code} {r.text[:500]}"
        if r.status_code >= 400:
            if method != "HEAD":
                assert "error" in r.json(), r.text[:200]
            assert live.footprint() == before, f"{method} {path} was refused ({r.status_code}) but changed state"
        elif method not in ("GET", "HEAD"):
            live.reseed()  # a request that happened to be valid: allowed to write, then undone
        assert c.get("/healthz").status_code == 200


HANDLE_EDIT = st.tuples(st.integers(0, 96), st.sampled_from("0123456789abcdef.xZ-_"))  # odd paths: the test above


@FUZZ
@given(data=st.data())
def test_forged_or_foreign_chunk_handles_never_return_bytes(live: Live, data: st.DataObject) -> None:
    """Bob with Alice's handles, anyone with edited or random handles: 404, no bytes, nothing written."""
    handle = data.draw(st.sampled_from(live.handles))
    forged = data.draw(
        st.sampled_from(["as-is", "edit", "random"]).flatmap(
            lambda how: (
                st.just(handle)
                if how == "as-is"
                else HANDLE_EDIT.map(lambda e: handle[: e[0]] + e[1] + handle[e[0] + 1 :])
                if how == "edit"
                else st.text(alphabet="0123456789abcdef.", max_size=120)
            )
        )
    )
    token = BOB if forged == handle else data.draw(st.sampled_from([ALICE, BOB]))
    if forged == handle and token == ALICE:
        return
    before = live.footprint()
    with httpx.Client(base_url=live.url, timeout=60, headers={"authorization": f"Bearer {token}"}) as c:
        segment = quote(forged, safe="") if forged.strip(".") else forged.replace(".", "%2E")  # not a dot segment
        path = f"/v1/chunks/{segment or '%20'}"
        for method in ("GET", "HEAD", "PUT"):
            body = data.draw(st.sampled_from(sorted(live.chunks))) if method == "PUT" else None
            r = c.request(method, path, content=body, headers={"content-type": CHUNK_TYPE} if body else {})
            assert r.status_code == 404, f"{method} {forged!r} as {token[:5]}: {r.status_code}"
            assert r.content not in live.chunks
    assert live.footprint() == before


# -- headers and framing the client libraries would never send ------------------------------------

HEADER_VALUE = st.binary(max_size=24) | st.sampled_from(
    [b"0", b"10", b"\xb2", "\u0663".encode(), b"+5", b"-1", b" 5", b"5,5", b"1_0", b"0x10", b"9" * 30, b"chunked"]
)
HEADER_NAME = st.sampled_from([b"content-length", b"content-type", b"transfer-encoding", b"authorization", b"expect"])


@pytest.fixture(scope="module")
def asgi(live: Live) -> object:
    """The same app as served, called as plain ASGI: header bytes exactly as drawn (a server in
    front may pass what uvicorn's parser would refuse)."""
    return create_app(live.store, TOKENS, LIMITS)


@FUZZ
@given(data=st.data())
def test_any_header_bytes_are_answered_4xx_in_place(live: Live, asgi: Any, data: st.DataObject) -> None:
    method, template = data.draw(st.sampled_from(live.routes), label="route")
    path = template.replace("{session_id}", SEEDED["alice"]).replace("{handle}", live.handles[0])
    length = data.draw(st.none() | HEADER_VALUE, label="content-length")
    headers = [(b"authorization", f"Bearer {ALICE}".encode())] + ([(b"content-length", length)] if length else [])
    headers += data.draw(st.lists(st.tuples(HEADER_NAME, HEADER_VALUE), max_size=3), label="headers")
    chunks = data.draw(st.lists(st.binary(max_size=64) | FRAMES, min_size=1, max_size=3), label="body")
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
    }  # fmt: skip
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    before = live.footprint()
    live.loop.run(asgi(scope, receive, send))
    status = [m["status"] for m in sent if m["type"] == "http.response.start"]
    assert len(status) == 1 and status[0] < 500, (method, path, headers, status)
    if status[0] >= 400:
        assert live.footprint() == before
    elif method not in ("GET", "HEAD"):
        live.reseed()


NOT_HEX = bytes.maketrans(b"0123456789abcdefABCDEF\r\n", b"g" * 24)  # a garbled chunk-size line, never a partial one
CONTENT_LENGTH = st.sampled_from(["exact", "short", "absent", "twice"]) | st.text(
    st.characters(min_codepoint=32, max_codepoint=255, exclude_characters="0123456789\r\n"), max_size=8
)


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_lying_or_garbled_framing_over_http_is_4xx(live: Live, data: st.DataObject) -> None:
    """Raw HTTP/1.1 on the socket: Content-Length shorter than the body, doubled, not a number;
    chunked bodies with garbled chunks. Answered 4xx (or the connection closed), nothing stored."""
    method, path = data.draw(st.sampled_from([("POST", "/v1/match"), ("POST", f"/v1/sessions/{SEEDED['alice']}/snapshot"),
                                              ("PUT", f"/v1/chunks/{live.handles[0]}"), ("POST", "/v1/prefixes")]))  # fmt: skip
    body = data.draw(st.binary(min_size=1, max_size=256) | FRAMES, label="body")
    how = data.draw(CONTENT_LENGTH, label="content-length")
    chunked = how == "absent" and data.draw(st.booleans(), label="chunked")
    lines = [f"{method} {path} HTTP/1.1", "host: fuzz", f"authorization: Bearer {ALICE}", "connection: close"]
    if how == "exact" or how == "twice":
        lines += [f"content-length: {len(body)}"] * (2 if how == "twice" else 1)
        if how == "twice":
            lines[-1] = f"content-length: {len(body) + 1}"
    elif how == "short":
        lines.append(f"content-length: {len(body) // 2}")
    elif chunked:
        lines.append("transfer-encoding: chunked")
        garble = data.draw(st.binary(max_size=12).map(lambda b: b.translate(NOT_HEX)), label="garble")
        body = f"{len(body):x}\r\n".encode() + body + b"\r\n" + garble + b"0\r\n\r\n"
    elif how != "absent":
        lines.append(f"content-length: {how}")
    before = live.footprint()
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    with socket.create_connection(urlsplit(live.url).netloc.split(":"), timeout=20) as sock:  # type: ignore[arg-type]
        sock.sendall(head + body)  # no half-close: uvicorn takes it for a disconnect and drops the answer
        answer = b""
        with contextlib.suppress(ConnectionResetError):  # closed on unread garbage: no answer to read
            while part := sock.recv(65536):
                answer += part
    status = int(answer.split(b" ", 2)[1]) if answer else None
    event("answered" if status else "closed")
    assert status is None or status < 500, answer[:300]
    with httpx.Client(base_url=live.url, timeout=60) as c:  # not even a 5xx that reached nobody
        assert 'status="5' not in c.get("/metrics").text
    if status is not None and status < 400:
        live.reseed()
        return
    assert live.footprint() == before


@pytest.mark.parametrize("route", ["/v1/sessions/gone/snapshot", "/v1/prefixes", "/v1/match"])
def test_a_client_that_leaves_mid_body_is_a_400_not_a_500(live: Live, route: str) -> None:
    """Half a declared body, then the socket closes: nothing stored, no 5xx counted (or logged)."""
    label = f'agentstate_http_requests_total{{method="POST",route="{route.replace("gone", "{session_id}")}"'

    def counted(c: httpx.Client) -> dict[str, int]:
        lines = [line.rsplit(" ", 1) for line in c.get("/metrics").text.splitlines() if line.startswith(label)]
        return {key[len(label) :]: int(float(n)) for key, n in lines}

    before = live.footprint()
    body = frame(snapshot_header(random_tokens(70), KV), KV)
    if route == "/v1/match":  # under the JSON limit, so the route itself reads it
        body = json.dumps({"tokens": random_tokens(1000)}).encode()
    head = (
        f"POST {route} HTTP/1.1\r\nhost: fuzz\r\nauthorization: Bearer {ALICE}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    with httpx.Client(base_url=live.url, timeout=60) as c:
        seen = counted(c)
        with socket.create_connection(urlsplit(live.url).netloc.split(":"), timeout=20) as sock:  # type: ignore[arg-type]
            sock.sendall(head.encode() + body[: len(body) // 2])
        for _ in range(1200):  # the server notices the close on its own time (up to a minute on a loaded machine)
            if (now := counted(c)) != seen:
                break
            time.sleep(0.05)
        assert {k: n - seen.get(k, 0) for k, n in now.items() if n != seen.get(k, 0)} == {',status="400"}': 1}, now
    assert live.footprint() == before
