"""The prefix router over real stores' KV events, and over a scripted publisher that loses batches,
sends garbage or malformed frames: the view stays a subset of the truth, a gap is replayed."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import zmq

from agentstate import StateStore
from agentstate.config import StoreConfig
from agentstate.event_wire import AllBlocksCleared, BlockStored, KVEventBatch, encoder
from agentstate.events import END_SEQ
from agentstate.router import PrefixRouter
from tests.conftest import SPEC4, random_kv, random_tokens
from tests.test_events import vllm_hashes

CHUNK = 64
EVENTS = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}


def settle(router: PrefixRouter, done: Callable[[], bool], wait: float = 30.0) -> None:
    """Apply events until `done()`: the wait only bounds a hang (a loaded machine publishes late)."""
    end = time.monotonic() + wait
    while not done() and time.monotonic() < end:
        router.poll(50)
    assert done(), "the router never heard what the stores hold"


def local(endpoint: str | None) -> str | None:
    return endpoint.replace("0.0.0.0", "127.0.0.1") if endpoint else None


async def test_requests_go_where_their_prefix_is_and_cold_ones_spread(tmp_path: Path) -> None:
    stores = []
    try:
        for name in ("a", "b"):
            cfg = StoreConfig(path=tmp_path / name, chunk_tokens=CHUNK, kv_events=EVENTS)
            stores.append(await StateStore.open(cfg, SPEC4))
        hosts = {n: tuple(map(local, s.chunks.publisher_endpoints)) for n, s in zip("ab", stores)}  # type: ignore[arg-type]
        router = PrefixRouter(hosts)  # type: ignore[arg-type]
        try:
            a_tokens, b_tokens = random_tokens(5 * CHUNK, seed=1), random_tokens(3 * CHUNK + 9, seed=2)
            await stores[0].snapshot("sa", a_tokens, random_kv(SPEC4, len(a_tokens)))
            await stores[1].snapshot("sb", b_tokens, random_kv(SPEC4, len(b_tokens)))
            turn = a_tokens + random_tokens(40, seed=3)  # the next request of session sa
            router.catch_up()  # it joined after the stores opened: the replay fills its view
            settle(router, lambda: router.matches(turn)["a"] == 5 * CHUNK and router.matches(b_tokens)["b"] == 3 * CHUNK)
            assert router.route(turn) == ("a", 5 * CHUNK)
            assert router.route(b_tokens + [7] * 30) == ("b", 3 * CHUNK)
            assert router.matches(turn) == {"a": 5 * CHUNK, "b": 0}
            cold = [router.route(random_tokens(100, seed=10 + i))[0] for i in range(4)]
            assert sorted(cold) == ["a", "a", "b", "b"]  # ties spread
            await stores[0].delete("sa")
            settle(router, lambda: router.matches(turn)["a"] == 0)
            assert router.route(turn)[1] == 0  # gone: never routed to for a prefix it lost
        finally:
            router.close()
    finally:
        for s in stores:
            await s.close()


def test_a_gap_is_replayed_and_garbage_resets_only_its_host() -> None:
    ctx = zmq.Context()
    pub, rep = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    port, rport = pub.bind_to_random_port("tcp://127.0.0.1"), rep.bind_to_random_port("tcp://127.0.0.1")
    enc = encoder()
    tokens = random_tokens(4 * 16)
    hashes = vllm_hashes(tokens)

    def stored(i: int) -> bytes:
        event = BlockStored(block_hashes=[hashes[i]], parent_block_hash=hashes[i - 1] if i else None,
                            token_ids=tokens[16 * i : 16 * (i + 1)], block_size=16, lora_id=None, medium="CPU",
                            lora_name=None)  # fmt: skip
        return enc.encode(KVEventBatch(ts=time.time(), events=[event]))

    batches = {0: enc.encode(KVEventBatch(ts=0.0, events=[AllBlocksCleared()])), **{i + 1: stored(i) for i in range(4)}}
    router = PrefixRouter({"h": (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")})
    try:

        def send(seq: int, payload: bytes) -> None:
            pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

        def serve_replay() -> None:
            if rep.poll(30_000):
                client, _, start = rep.recv_multipart()
                for seq in range(int.from_bytes(start, "big"), 5):
                    rep.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), batches[seq]))
                rep.send_multipart((client, b"", b"", END_SEQ, b""))

        deadline = time.monotonic() + 30
        while router.matches(tokens)["h"] != 16 and time.monotonic() < deadline:
            send(0, batches[0])  # again until the subscription is up (ZMQ drops what a PUB sends before)
            send(1, batches[1])
            router.poll(100)
        assert router.matches(tokens)["h"] == 16
        import threading

        server = threading.Thread(target=serve_replay)
        server.start()
        send(4, batches[4])  # 2 and 3 never arrive live
        settle(router, lambda: router.matches(tokens)["h"] == 64)
        server.join()
        assert router.hosts["h"].resets == 0  # replayed, not reset

        pub.send_multipart((b"", b"short", b"x"))  # malformed: dropped
        send(5, b"\xc1not msgpack")  # garbage: the view can no longer be known
        settle(router, lambda: router.hosts["h"].resets == 1)
        assert router.matches(tokens)["h"] == 0
        send(6, stored(0))
        settle(router, lambda: router.matches(tokens)["h"] == 16)  # and it goes on
    finally:
        router.close()
        ctx.destroy(linger=0)


def test_a_block_announced_twice_is_gone_after_one_removal_and_a_flood_resets_only_its_host() -> None:
    from agentstate.event_wire import BlockRemoved
    from agentstate.router import HostView

    view = HostView("h", "tcp://x", None, max_blocks=100)

    def stored(hashes: list[int]) -> BlockStored:
        return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[0] * 16 * len(hashes),
                           block_size=16, lora_id=None, medium="GPU", lora_name=None)  # fmt: skip

    view.apply([stored([1, 2]), stored([1])])  # vLLM reports a reused block as stored again
    view.apply([BlockRemoved(block_hashes=[1], medium="GPU")])
    assert set(view.blocks) == {2}  # never more than the host holds
    view.apply([stored(list(range(1000, 1200)))])  # a stream claiming more than the bound
    assert view.blocks == {} and view.resets == 1
