"""Our KV events read by vLLM's own decoder, with block hashes equal to vLLM's own functions.

Runs in the vLLM venv (CI's .venv-ci-vllm): `vllm.distributed.kv_events` decodes what a store
publishes over a real ZMQ socket, and `vllm.v1.core.kv_cache_utils.hash_block_tokens` (after
`init_none_hash`, as the engine calls it) gives the hashes the events carry, for both of vLLM's
cryptographic schemes and with a cache salt.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

from agentstate import StateStore
from agentstate.config import StoreConfig
from agentstate.events import END_SEQ, KVEvents, KVEventsConfig
from tests.conftest import SPEC4, random_kv, random_tokens

CHUNK = 64


def vllm_chain(tokens: list[int], algo: str, salt: str | None = None) -> list[int]:
    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    parent, out = None, []
    for i in range(0, len(tokens) - 15, 16):
        extra = (("cache_salt", salt),) if i == 0 and salt else None
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[i : i + 16], extra)
        out.append(kv_cache_utils.maybe_convert_block_hash(parent))
    return out


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_block_hashes_equal_vllms_own(algo: str, salt: str | None) -> None:
    ev = KVEvents(KVEventsConfig(enable_kv_cache_events=True, hash_algo=algo), {}, CHUNK)  # type: ignore[arg-type]
    tokens = random_tokens(3 * CHUNK + 7)
    ours = [ev._external(h) for h in ev.hasher.chain(None, tokens, 16, salt)]
    assert ours == vllm_chain(tokens, algo, salt) and len(ours) == (3 * CHUNK + 7) // 16


async def test_vllms_decoder_reads_what_a_store_publishes(tmp_path: Path) -> None:
    cfg = StoreConfig(path=tmp_path / "s", chunk_tokens=CHUNK, host_capacity_bytes=2 * CHUNK * SPEC4.token_bytes,
                      kv_events={"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0",
                                 "topic": "kv@agentstate"})  # fmt: skip
    decode = msgspec.msgpack.Decoder(type=KVEventBatch)
    tokens = random_tokens(4 * CHUNK)
    hashes = vllm_chain(tokens, "sha256")
    ctx = zmq.Context()

    def replayed(replay: str) -> list[object]:
        """Every batch the store still buffers, through its replay socket, decoded by vLLM's structs."""
        req = ctx.socket(zmq.DEALER)
        req.connect(replay.replace("0.0.0.0", "127.0.0.1"))
        req.send_multipart((b"", (0).to_bytes(8, "big")))
        events: list[object] = []
        try:
            while req.poll(10_000):
                _, topic, seq, payload = req.recv_multipart()
                if seq == END_SEQ:
                    break
                assert topic == b"kv@agentstate" and len(seq) == 8
                batch = decode.decode(payload)
                assert isinstance(batch, KVEventBatch) and batch.ts > 0
                events += batch.events
        finally:
            req.close(linger=0)
        return events

    try:
        async with StateStore.open(cfg, SPEC4) as store:
            _, replay = store.chunks.publisher_endpoints  # type: ignore[misc]
            await store.snapshot("a", tokens, random_kv(SPEC4, 4 * CHUNK))  # 4 chunks, a host tier of 2
            await store.delete("a")
            deadline = time.monotonic() + 30
            while True:  # until the publisher has sent the delete's removals (a loaded machine is slow)
                events = replayed(replay)
                gone = {h for e in events if isinstance(e, BlockRemoved) and e.medium == "STORAGE" for h in e.block_hashes}
                if gone == set(hashes) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert isinstance(events[0], AllBlocksCleared)  # the open said: start over
        assert {h for e in stored for h in e.block_hashes} == set(hashes)
        assert {e.medium for e in stored} == {"CPU", "STORAGE"} and all(e.block_size == 16 for e in stored)
        assert all(e.token_ids == tokens[hashes.index(e.block_hashes[0]) * 16 :][: 16 * len(e.block_hashes)] for e in stored)
        assert gone == set(hashes)  # deleted from the record tier
    finally:
        ctx.destroy(linger=0)


class Collector:
    """SUB sockets on several endpoints, each stream's decoded events kept, on a thread of its own."""

    def __init__(self, endpoints: dict[str, str]) -> None:
        import threading

        self.ctx = zmq.Context()
        self.events: dict[str, list[object]] = {name: [] for name in endpoints}
        self.socks = {}
        for name, endpoint in endpoints.items():
            sub = self.ctx.socket(zmq.SUB)
            sub.connect(endpoint)  # before the engine binds it: ZMQ connects when it appears
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            self.socks[name] = sub
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        decode = msgspec.msgpack.Decoder(type=KVEventBatch)
        poller = zmq.Poller()
        for sub in self.socks.values():
            poller.register(sub, zmq.POLLIN)
        while not self.stop.is_set():
            for sub, _ in poller.poll(100):
                name = next(n for n, s in self.socks.items() if s is sub)
                _, _, payload = sub.recv_multipart()
                self.events[name] += decode.decode(payload).events

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.ctx.destroy(linger=0)


def test_a_real_engine_under_the_sglang_scheme_with_events() -> None:
    """One vLLM engine (CI time), two things shown. (1) KV events: vLLM publishes its GPU blocks, the
    connector what its tiers hold; a router hashing a prompt once finds both, the cache salt included.
    (2) `key_scheme="sglang"`: the connector's saves land under SGLang's page keys (a chunk is one
    128-token page) and the next round, its GPU cache reset, loads them."""
    import shutil
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(prefix="ev"))  # vLLM's IPC paths live below it: they must stay short
    try:
        _real_engine(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _real_engine(tmp_path: Path) -> None:
    from agentstate import ModelSpec
    from agentstate.adapters.sglang_keys import sglang_page_keys
    from tests.ports import free_port
    from tests.test_adapter_vllm import req, run_engine, toks
    from vllm_engine import make_model

    model = make_model(str(tmp_path / "model"))
    ours, theirs = free_port(), free_port()
    plain, salted = toks(700, 11), toks(600, 12)
    job = {
        "model": model, "rounds": [[req(plain), req(salted, salt="tenant-b")], [req(plain)]],
        "connector": {"path": str(tmp_path / "data"), "key_scheme": "sglang", "chunk_tokens": 128, "kv_events": {
            "enable_kv_cache_events": True, "endpoint": f"tcp://*:{ours}", "block_size": 128}},
        "kv_events": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{theirs}"},
    }  # fmt: skip
    collect = Collector({"agentstate": f"tcp://127.0.0.1:{ours}", "vllm": f"tcp://127.0.0.1:{theirs}"})
    try:
        out = run_engine(tmp_path, "events", job)
        time.sleep(0.5)
    finally:
        collect.close()
    stored = {name: [e for e in evs if isinstance(e, BlockStored)] for name, evs in collect.events.items()}
    engine = {h for e in stored["vllm"] for h in e.block_hashes}
    mine = {h for e in stored["agentstate"] for h in e.block_hashes}
    assert {e.block_size for e in stored["vllm"]} == {128} and stored["agentstate"]
    assert mine and mine <= engine  # every block the tiers announce is one the engine names the same way
    # the two prompts' whole chunks (128 tokens: one block each), the salted one hashed with its salt
    want = set(vllm_chain_sized(plain[:640], "sha256", 128)) | set(vllm_chain_sized(salted[:512], "sha256", 128, "tenant-b"))
    assert mine == want
    assert {e.medium for e in stored["agentstate"]} == {"CPU", "STORAGE"}

    first, again = out["rounds"][0][0], out["rounds"][1][0]
    assert first["cached"] == 0 and again["cached"] >= 5 * 128 and again["tokens"] == first["tokens"]
    spec = ModelSpec.model_validate_json((tmp_path / "data" / "spec.json").read_text())
    pages = sglang_page_keys(plain, fingerprint=spec.fingerprint, page_size=128)
    salted_pages = sglang_page_keys(salted, fingerprint=spec.fingerprint, page_size=128, salt="tenant-b")

    async def held() -> list[bool]:
        cfg = StoreConfig(path=tmp_path / "data", chunk_tokens=128, key_scheme="sglang")
        async with StateStore.open(cfg, spec) as store:
            assert store.prefix_keys(plain) == pages
            return await store.chunks.present([*pages, *salted_pages])

    assert asyncio.run(held()) == [True] * 9  # 5 + 4 whole pages, each under SGLang's key for its tenant


def vllm_chain_sized(tokens: list[int], algo: str, block: int, salt: str | None = None) -> list[int]:
    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    parent, out = None, []
    for i in range(0, len(tokens) - block + 1, block):
        extra = (("cache_salt", salt),) if i == 0 and salt else None
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[i : i + block], extra)
        out.append(kv_cache_utils.maybe_convert_block_hash(parent))
    return out


