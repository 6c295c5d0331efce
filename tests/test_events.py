"""KV events: what a store's tiers hold, published as vLLM publishes its own, over real ZMQ sockets.

The property that matters to a router: the view it builds from the events (applied in order, or
replayed late) equals what the tiers hold, for every chunk whose tokens the store knows, through
stores, evictions, deletes and a restart; never a block that is not held. Hashes are checked against
a computation of vLLM's scheme written here from its definition (and against vLLM itself in
tests/test_adapter_vllm_events.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import pickle
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import zmq

from agentstate import StateStore
from agentstate.config import StoreConfig
from agentstate.errors import AgentStateError, InvalidArgumentError
from agentstate.events import END_SEQ, KVEvents, KVEventsConfig, decoder
from agentstate.settings import store_config
from tests.conftest import SPEC4, random_kv, random_tokens

CHUNK = 64
CHUNK_BYTES = 64 * SPEC4.token_bytes  # 128 KiB
EVENTS = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", "block_size": 16}


def vllm_hashes(tokens: list[int], block_size: int = 16, salt: str | None = None, seed: str = "vllm-none-hash") -> list[int]:
    """vLLM's block hashes by its definition: SHA-256 of pickle((parent or NONE_HASH, block tokens, extra keys)),
    NONE_HASH = SHA-256 of pickle(seed), published as the low 64 bits."""

    def h(obj: object) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    parent, out = h(seed), []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        extra = (("cache_salt", salt),) if i == 0 and salt else None
        parent = h((parent, tuple(tokens[i : i + block_size]), extra))
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


class Subscriber:
    """A router's view from the events: (block hash, medium, tier) held."""

    def __init__(self, endpoint: str, replay: str | None) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint.replace("0.0.0.0", "127.0.0.1"))
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.replay = replay.replace("0.0.0.0", "127.0.0.1") if replay else None
        self.held: set[tuple[int, str, str]] = set()
        self.seqs: list[int] = []
        self.next = 0
        self.clears = 0
        self.dec = decoder()

    def apply(self, payload: bytes) -> None:
        for event in self.dec.decode(payload).events:
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                self.held.clear()
                self.clears += 1
            elif kind == "BlockStored":
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                self.held |= {(h, event.medium, event.ownership) for h in event.block_hashes}
            else:
                self.held -= {(h, event.medium, event.ownership) for h in event.block_hashes}

    def take(self, seq: int, payload: bytes) -> None:
        """One batch, in sequence: a repeat is skipped, a gap is asked of the replay socket first."""
        if seq < self.next:
            return
        if seq > self.next and self.replay is not None:
            self.replay_from(self.next)
            if seq < self.next:
                return
        self.seqs.append(seq)
        self.apply(payload)
        self.next = seq + 1

    def drain(self, until: Callable[[], bool] | None = None, wait: float = 30.0) -> None:
        """Apply batches as they come until `until()` holds (or, without one, for a moment of quiet);
        the wait only bounds a hang: a loaded machine may take its time."""
        end = time.monotonic() + (wait if until else 0.3)
        while time.monotonic() < end:
            if until is not None and until():
                return
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                self.take(int.from_bytes(seq, "big"), payload)
        assert until is None or until(), "the events never showed what the tiers hold"

    def replay_from(self, start: int) -> list[int]:
        assert self.replay is not None
        req = self.ctx.socket(zmq.DEALER)
        req.connect(self.replay)
        req.send_multipart((b"", start.to_bytes(8, "big")))
        seqs = []
        while req.poll(10_000):
            _, topic, seq, payload = req.recv_multipart()
            if seq == END_SEQ:
                break
            n = int.from_bytes(seq, "big")
            seqs.append(n)
            if n >= self.next:
                self.seqs.append(n)
                self.apply(payload)
                self.next = n + 1
        req.close(linger=0)
        return seqs

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def truth(store: StateStore, tokens_of: dict[str, list[int]]) -> set[tuple[int, str, str]]:
    """What the tiers hold, for the sessions' chunks, as (vLLM hash, medium, tier)."""
    mediums = store.chunks.events.mediums  # type: ignore[union-attr]
    out = set()
    for tokens in tokens_of.values():
        keys = store.chunk_keys(tokens)
        hashes = vllm_hashes(tokens[: len(keys) * CHUNK])
        for i, key in enumerate(keys):
            for tier in store.chunks._index.tiers_of(key):
                out |= {(h, mediums[tier][0], tier) for h in hashes[i * 4 : (i + 1) * 4]}
    return out


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[StateStore]:
    cfg = StoreConfig(path=tmp_path / "s", chunk_tokens=CHUNK, host_capacity_bytes=6 * CHUNK_BYTES, kv_events=EVENTS)
    async with StateStore.open(cfg, SPEC4) as s:
        yield s


async def test_the_view_from_the_events_is_what_the_tiers_hold(store: StateStore) -> None:
    endpoints = store.chunks.publisher_endpoints
    assert endpoints is not None
    sub = Subscriber(*endpoints)
    try:
        tokens_of = {f"s{i}": random_tokens(3 * CHUNK + 10 * i, seed=i) for i in range(4)}
        for sid, tokens in tokens_of.items():  # 12 chunks into a host tier of 6: evictions on the way
            await store.snapshot(sid, tokens, random_kv(SPEC4, len(tokens), seed=len(tokens)))
        sub.replay_from(0)  # a PUB subscriber joins late (ZMQ): what it missed comes from the replay socket
        sub.drain(lambda: sub.held == truth(store, tokens_of))
        assert any(m == "CPU" for _, m, _ in sub.held)
        assert {m for _, m, _ in sub.held} == {"CPU", "STORAGE"}
        assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))  # no gap

        await store.delete("s0")  # its chunks leave every tier
        gone = set(vllm_hashes(tokens_of.pop("s0")))
        sub.drain(lambda: sub.held == truth(store, tokens_of))
        assert not {h for h, _, _ in sub.held} & gone

        late = Subscriber(*endpoints)  # a router started now: the replay gives it the same view
        try:
            seqs = late.replay_from(0)
            assert seqs[0] == 0 and seqs == list(range(len(seqs)))
            assert late.held == sub.held and late.clears == 1  # the store's open said: start over
        finally:
            late.close()
    finally:
        sub.close()


async def test_block_hashes_are_vllms_and_the_salt_marks_the_first_block(store: StateStore) -> None:
    ev = store.chunks.events
    assert ev is not None
    tokens = random_tokens(2 * CHUNK)
    assert [ev._external(h) for h in ev.hasher.chain(None, tokens, 16, None)] == vllm_hashes(tokens)
    salted = [ev._external(h) for h in ev.hasher.chain(None, tokens, 16, "tenant-a")]
    assert salted == vllm_hashes(tokens, salt="tenant-a") and salted[0] != vllm_hashes(tokens)[0]
    other = KVEvents(KVEventsConfig(**{**EVENTS, "hash_seed": "1234"}), {}, CHUNK)  # PYTHONHASHSEED=1234 fleets
    assert [other._external(h) for h in other.hasher.chain(None, tokens, 16, None)] == vllm_hashes(tokens, seed="1234")


async def test_a_restart_clears_then_announces_sessions_again_as_they_are_touched(tmp_path: Path) -> None:
    cfg = StoreConfig(path=tmp_path / "s", chunk_tokens=CHUNK, host_capacity_bytes=0, kv_events=EVENTS)
    tokens = random_tokens(3 * CHUNK + 5)
    async with StateStore.open(cfg, SPEC4) as s:
        await s.snapshot("a", tokens, random_kv(SPEC4, len(tokens)))
    async with StateStore.open(cfg, SPEC4) as s:
        sub = Subscriber(*s.chunks.publisher_endpoints)  # type: ignore[misc]
        try:
            deadline = time.monotonic() + 30
            while sub.clears == 0 and time.monotonic() < deadline:  # the open's clear, once it is published
                sub.replay_from(sub.next)
                time.sleep(0.01)
            assert sub.clears == 1 and sub.held == set()  # nothing is claimed before its tokens are known
            assert (await s.resume("a")).restored_tokens == len(tokens)
            sub.drain(lambda: sub.held == {(h, "STORAGE", "lmdb") for h in vllm_hashes(tokens[: 3 * CHUNK])})
        finally:
            sub.close()


async def test_a_bad_replay_request_is_ignored_and_the_publisher_keeps_going(store: StateStore) -> None:
    endpoints = store.chunks.publisher_endpoints
    assert endpoints is not None
    ctx = zmq.Context()
    try:
        bad = ctx.socket(zmq.DEALER)
        bad.connect(endpoints[1].replace("0.0.0.0", "127.0.0.1"))
        bad.send_multipart((b"", b"not eight bytes", b"extra"))
        bad.send_multipart((b"", b"short"))
        sub = Subscriber(*endpoints)
        try:
            tokens = random_tokens(CHUNK)
            await store.snapshot("x", tokens, random_kv(SPEC4, CHUNK))
            assert sub.replay_from(0)  # still serving
            sub.drain(lambda: {h for h, _, _ in sub.held} == set(vllm_hashes(tokens)))
        finally:
            sub.close()
    finally:
        ctx.destroy(linger=0)


def test_a_full_queue_becomes_one_clear_never_a_wrong_claim() -> None:
    ev = KVEvents(KVEventsConfig(**{**EVENTS, "max_queue_size": 3}), {"host": ("CPU", "LOCAL")}, CHUNK)
    held: set[str] = set()
    for i in range(5):
        key = f"c/{i}"
        held.add(key)
        ev.learn([key], random_tokens(CHUNK, seed=i), lambda k: ["host"] if k in held else [])
    events = ev.take()
    assert type(events[0]).__name__ == "AllBlocksCleared" and ev.dropped == 3
    after = [set(e.block_hashes) for e in events[1:]]  # only what came after the clear: c/3 and c/4
    assert after == [set(vllm_hashes(random_tokens(CHUNK, seed=i))) for i in (3, 4)]
    ev.learn(["c/0"], random_tokens(CHUNK, seed=0), lambda k: ["host"])  # announced again once touched
    assert [set(e.block_hashes) for e in ev.take()] == [set(vllm_hashes(random_tokens(CHUNK, seed=0)))]


@pytest.mark.parametrize(
    "bad",
    [{"block_size": 48}, {"block_size": 0}, {"hash_algo": "md5"}, {"nonsense": 1}, {"buffer_steps": -1},
     {"publisher": "kafka"}],  # fmt: skip
)
async def test_bad_event_settings_are_typed_errors_before_anything_opens(tmp_path: Path, bad: dict) -> None:
    with pytest.raises(AgentStateError) as err:
        cfg = store_config(None, path=tmp_path / "s", chunk_tokens=CHUNK, kv_events={**EVENTS, **bad})
        async with StateStore.open(cfg, SPEC4):
            pass
    assert isinstance(err.value, InvalidArgumentError)
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


async def test_a_port_taken_is_a_typed_error_and_the_directory_is_left_as_it_was(tmp_path: Path) -> None:
    ctx = zmq.Context()
    try:
        taken = ctx.socket(zmq.PUB)
        port = taken.bind_to_random_port("tcp://*")
        cfg = StoreConfig(path=tmp_path / "s", chunk_tokens=CHUNK, kv_events={**EVENTS, "endpoint": f"tcp://*:{port}"})
        with pytest.raises(InvalidArgumentError):
            async with StateStore.open(cfg, SPEC4):
                pass
        cfg = cfg.model_copy(update={"kv_events": KVEventsConfig(**EVENTS)})
        async with StateStore.open(cfg, SPEC4) as s:  # the lock was given back
            await s.snapshot("a", random_tokens(CHUNK), random_kv(SPEC4, CHUNK))
    finally:
        ctx.destroy(linger=0)


def test_memory_is_bounded_and_a_forgotten_chunk_is_announced_removed() -> None:
    ev = KVEvents(KVEventsConfig(**{**EVENTS, "max_tracked_chunks": 2}), {"host": ("CPU", "LOCAL")}, CHUNK)
    view: set[int] = set()
    for i in range(5):
        ev.learn([f"c/{i}"], random_tokens(CHUNK, seed=i), lambda k: ["host"])
        for e in ev.take():
            (view.update if type(e).__name__ == "BlockStored" else view.difference_update)(e.block_hashes)
    assert ev.stats()["chunks_announced"] == 2 and ev.forgotten == 3
    assert view == set(vllm_hashes(random_tokens(CHUNK, seed=3))) | set(vllm_hashes(random_tokens(CHUNK, seed=4)))
    ev.learn(["c/3"], random_tokens(CHUNK, seed=3), lambda k: ["host"])  # touched: now the most recent
    ev.learn(["c/5"], random_tokens(CHUNK, seed=5), lambda k: ["host"])
    removed = [set(e.block_hashes) for e in ev.take() if type(e).__name__ == "BlockRemoved"]
    assert removed == [set(vllm_hashes(random_tokens(CHUNK, seed=4)))]  # the least recently touched went


async def test_one_medium_per_tier_and_the_operator_may_rename_them(tmp_path: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    from agentstate.config import TierConfig

    tiers = [TierConfig(kind="host", capacity_bytes=1 << 20), TierConfig(kind="lmdb"),
             TierConfig(kind="redis", url=redis_server.url, prefix="events-media:")]  # fmt: skip
    cfg = StoreConfig(path=tmp_path / "a", chunk_tokens=CHUNK, tiers=tiers, kv_events=EVENTS)
    async with StateStore.open(cfg, SPEC4) as s:
        assert s.chunks.events.mediums == {  # type: ignore[union-attr]
            "host": ("CPU", "LOCAL"), "lmdb": ("STORAGE", "LOCAL"), "redis": ("REMOTE", "REMOTE")}
    quiet = cfg.model_copy(update={"kv_events": KVEventsConfig(**{**EVENTS, "publisher": "null"})})
    async with StateStore.open(quiet, SPEC4) as s:  # vLLM's "null" publisher: nothing tracked, nothing sent
        assert s.chunks.events is None and s.chunks.publisher_endpoints is None
    named = {**EVENTS, "mediums": {"lmdb": "NVME"}}
    async with StateStore.open(cfg.model_copy(update={"kv_events": KVEventsConfig(**named)}), SPEC4) as s:
        assert s.chunks.events.mediums["lmdb"] == ("NVME", "LOCAL")  # type: ignore[union-attr]


async def test_the_service_exports_the_event_counters(store: StateStore) -> None:
    tokens = random_tokens(2 * CHUNK)
    await store.snapshot("m", tokens, random_kv(SPEC4, 2 * CHUNK))
    deadline = time.monotonic() + 30
    while store.chunks.counters()["kv_events_published"] < 3 and time.monotonic() < deadline:  # clear + 2 stored x 2 tiers
        await asyncio.sleep(0.01)
    counters = store.chunks.counters()
    assert counters["kv_events_published"] >= 3 and counters["kv_events_dropped"] == 0
    assert counters["kv_chunks_forgotten"] == 0
