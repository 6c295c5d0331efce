"""Fuzzing what agentstate reads back (issue 6, bad input): chunk frames, manifests, ids.

Stored bytes are untrusted: whatever they hold, decoding returns the exact value that was
written or raises a typed AgentStateError (never another exception, never a wrong tensor, never
pickle). Ids are checked before they reach a key or a path. Hypothesis runs derandomized, so a
CI failure reproduces.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentstate import StateStore, codec
from agentstate.errors import AgentStateError, CorruptDataError, InvalidArgumentError
from agentstate.keys import tail_key, validate_id
from agentstate.manifest import MANIFEST_MAGIC, SessionManifest, decode_manifest, encode_manifest
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens

T = TypeVar("T")
FUZZ = settings(derandomize=True, deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
KV = random_kv(SPEC4, 20, seed=11)
FRAME_KEY = f"c/{SPEC4.fingerprint}/{'ab' * 32}"
FRAME = bytes(codec.encode(KV, SPEC4.fingerprint, key=FRAME_KEY))


def decode(buf: bytes) -> torch.Tensor:
    return codec.decode(buf, key=FRAME_KEY, fingerprint=SPEC4.fingerprint, dtype=SPEC4.torch_dtype)


@st.composite
def damaged(draw: st.DrawFn, good: bytes) -> bytes:
    """`good` with bytes flipped, cut, inserted or appended; always different from `good`."""
    raw = bytearray(good)
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "cut", "insert", "append"]))
        at = draw(st.integers(0, max(len(raw) - 1, 0)))
        if how == "flip" and raw:
            raw[at] ^= draw(st.integers(1, 255))
        elif how == "cut":
            del raw[at:]
        elif how == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            raw += draw(st.binary(min_size=1, max_size=16))
    out = bytes(raw)
    return out if out != good else good + b"\0"


@FUZZ
@given(st.binary(max_size=4096) | st.binary(max_size=4096).map(lambda raw: FRAME[: codec.HEADER_SIZE] + raw))
def test_codec_arbitrary_bytes_are_a_typed_error(raw: bytes) -> None:
    """Random bytes, and a valid header over a random payload."""
    with pytest.raises(AgentStateError):
        decode(raw)


@FUZZ
@given(damaged(FRAME))
def test_codec_any_change_to_a_chunk_is_detected(raw: bytes) -> None:
    """Every header field is under the checksum's seed and the payload under the checksum itself."""
    with pytest.raises(AgentStateError):
        decode(raw)


def test_codec_unchanged_frame_decodes_exactly() -> None:
    assert bits_equal(decode(FRAME), KV)


TAIL = tail_key(SPEC4.fingerprint, "t", "fuzz", 1)  # unique per writer: made once


def _manifest() -> SessionManifest:
    return SessionManifest(
        session_id="fuzz", tenant="t", fingerprint=SPEC4.fingerprint, chunk_tokens=64, tokens=random_tokens(70),
        chunk_keys=[f"c/{SPEC4.fingerprint}/{'a' * 64}"], tail_key=TAIL,
        state={"k": [1, "two"]}, version=1, created_at=1.0, updated_at=2.0,
    )  # fmt: skip


MANIFEST = encode_manifest(_manifest())
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30,
)


@FUZZ
@given(st.binary(max_size=2048) | damaged(MANIFEST))
def test_manifest_arbitrary_or_damaged_bytes_are_corrupt(raw: bytes) -> None:
    with pytest.raises(CorruptDataError):
        decode_manifest(raw)


@FUZZ
@given(st.dictionaries(st.sampled_from(list(SessionManifest.model_fields)), JSON, max_size=14) | JSON)
def test_manifest_checksummed_json_of_the_wrong_shape_is_corrupt(value: Any) -> None:
    """Bytes that pass the checksum but do not describe a manifest (a writer's bug, another
    format) are refused as a whole: a manifest is never half parsed."""
    body = json.dumps(value).encode()
    raw = MANIFEST_MAGIC + xxhash.xxh3_64_digest(body) + body
    try:
        m = decode_manifest(raw)
    except CorruptDataError:
        return
    assert decode_manifest(encode_manifest(m)) == m  # then it is a whole, valid manifest


def test_manifest_round_trips() -> None:
    assert decode_manifest(MANIFEST) == _manifest()


ID = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.:@-]{0,127}", fullmatch=True)
FINITE = st.floats(allow_nan=False, allow_infinity=False)
STATE = st.recursive(  # what a snapshot stores: JSON without NaN or infinities (refused before they get here)
    st.none() | st.booleans() | st.integers() | FINITE | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30,
)
VALID = st.builds(
    SessionManifest, session_id=ID, tenant=ID, fingerprint=st.just(SPEC4.fingerprint),
    chunk_tokens=st.integers(1, 4096), tokens=st.lists(st.integers(0, 2**63 - 1), max_size=50),
    chunk_keys=st.lists(st.binary(min_size=32, max_size=32).map(lambda d: f"c/{SPEC4.fingerprint}/{d.hex()}"),
                        max_size=3),
    tail_key=st.none() | st.just(TAIL), state=st.dictionaries(st.text(max_size=10), STATE, max_size=5),
    version=st.integers(1, 2**63), parent=st.none() | ID, created_at=FINITE, updated_at=FINITE,
    ttl_seconds=st.none() | st.floats(min_value=0, exclude_min=True, allow_infinity=False), pinned=st.booleans(),
)  # fmt: skip


@settings(FUZZ, max_examples=150)
@given(VALID)
def test_any_valid_manifest_round_trips_equal(m: SessionManifest) -> None:
    assert decode_manifest(encode_manifest(m)) == m


# -- ids against a real store ------------------------------------------------------------------------


class LoopThread:
    """One event loop on a thread, so sync hypothesis tests can drive one open store."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LoopThread, StateStore]]:
    loop = LoopThread()

    async def opened() -> StateStore:
        return await StateStore.open(tmp_path_factory.mktemp("ids"), SPEC4, chunk_tokens=16, lmdb_map_size=64 << 20)

    store = loop.run(opened())
    yield loop, store
    loop.run(store.close())
    loop.close()


IDS = st.text(max_size=140) | st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.:@/-]{0,130}", fullmatch=True)
SMALL = random_kv(SPEC4, 20, seed=12)
SEEN: dict[str, int] = {}


@settings(FUZZ, max_examples=120, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(IDS)
def test_session_and_tenant_ids_are_accepted_and_usable_or_refused(
    live: tuple[LoopThread, StateStore], sid: str
) -> None:
    """An id is refused with InvalidArgumentError before anything is written, or it works as a
    session id and as a tenant id: a round trip bit-exact, in a namespace of its own."""
    loop, store = live

    async def use() -> None:
        tokens = random_tokens(20, seed=len(SEEN))
        await store.snapshot(sid, tokens, SMALL)
        r = await store.resume(sid)
        assert r.complete and r.tokens == tokens and bits_equal(r.kv, SMALL)
        view = store.for_tenant(sid)
        assert [m.session_id async for m in view.sessions()] == []  # a new tenant sees nothing
        await view.snapshot("mine", tokens, SMALL)
        assert (await view.session("mine")).chunk_keys != (await store.session(sid)).chunk_keys  # own namespace
        await view.delete("mine")
        await store.delete(sid)

    try:
        validate_id(sid)
    except InvalidArgumentError:
        before = loop.run(_listing(store))
        for call in (store.snapshot(sid, [1] * 20, SMALL), store.resume(sid), store.delete(sid)):
            with pytest.raises(InvalidArgumentError):
                loop.run(call)
        with pytest.raises(InvalidArgumentError):
            store.for_tenant(sid)
        assert loop.run(_listing(store)) == before
        return
    assert len(sid) <= 128 and "/" not in sid and not sid.startswith(".")
    SEEN[sid] = len(SEEN)
    loop.run(use())


async def _listing(store: StateStore) -> list[str]:
    return sorted([k async for k in store.chunks.backend(store.chunks.record_tier).keys("")])


def test_ids_never_name_a_path() -> None:
    for bad in ["..", "../x", "a/b", "", ".hidden", "x" * 129, "a\0b", "é"]:
        with pytest.raises(InvalidArgumentError):
            validate_id(bad)
