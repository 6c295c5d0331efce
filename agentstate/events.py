"""KV events for routers: what this store's tiers hold, as vLLM publishes its own (`--kv-events-config`).

Why: a router in front of a fleet (llm-d, Dynamo, a small one of our own: `agentstate.router`) sends a
request where its longest prefix already is. Engines publish what their GPU pools hold; the tiers
below (host memory, the local disk, a shared store) hold far more, for longer, and nobody tells the
router. This module does, in the format those routers already decode: a `KVEventBatch(ts, events,
data_parallel_rank)` of `BlockStored` / `BlockRemoved` / `AllBlocksCleared`, msgpack, over ZMQ PUB as
frames (topic, 8-byte big-endian sequence number, payload), and a ROUTER socket that replays the
batches still buffered from a requested sequence number on (ended by sequence -1).

Hashes are in the scheme of the engine routed to: vLLM's block hashes (`hash_block_tokens`, chained
from `NONE_HASH`, SHA-256 over pickle or CBOR, the cache salt in the first block's extra keys), so a
router matches our events and the engines' own with one hash of the prompt. A chunk of `chunk_tokens`
is `chunk_tokens / block_size` blocks. Since chunk keys are one-way hashes, a chunk is announced only
once its tokens are known here: when it is stored or read by a snapshot, a resume or an engine's save
(`KVEvents.learn`); a store reopened announces `AllBlocksCleared` first, then each chunk again as its
session is touched. A router therefore never hears of a block that is not held, and may hear of less
than is (a miss it routes around, never a wrong hit: the engine still checks every key).

Each tier is one medium: the host tier `CPU`, a local disk tier `STORAGE`, a shared store `REMOTE`
(`kv_events.mediums` renames any), with `locality` LOCAL or REMOTE and the tier's name in
`ownership` (vLLM's field for the offloading tier).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentstate.errors import InvalidArgumentError

log = logging.getLogger("agentstate.events")
DEFAULT_SEED = "vllm-none-hash"
"""vLLM's NONE_HASH seed for cryptographic hashes when PYTHONHASHSEED is not set (vLLM >= 0.2x)."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_PENDING_KEPT = 1 << 16
"""Chunks learned but not (yet) held, remembered so that a store that follows is announced."""


class KVEventsConfig(BaseModel):
    """As vLLM's `KVEventsConfig`, plus the hash scheme of the engines routed to."""

    model_config = ConfigDict(extra="forbid")

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = Field(default=None, description="None: zmq when enabled")
    endpoint: str = Field(default="tcp://*:5557", description="PUB: bound when it has * or is ipc/inproc, else connected")
    replay_endpoint: str | None = Field(default=None, description="ROUTER for replays of missed batches")
    buffer_steps: int = Field(default=10_000, gt=0, le=1_000_000, description="batches kept for replay")
    hwm: int = Field(default=100_000, ge=0, description="ZMQ high-water mark of the PUB socket")
    max_queue_size: int = Field(default=100_000, gt=0, description="events waiting to be published, at most")
    topic: str = ""
    data_parallel_rank: int | None = Field(default=None, ge=0)
    block_size: int = Field(default=16, gt=0, le=1 << 16, description="the routed engines' block size (tokens)")
    hash_algo: Literal["sha256", "sha256_cbor"] = Field(default="sha256", description="vLLM's prefix_caching_hash_algo")
    hash_seed: str | None = Field(default=None, description="NONE_HASH seed; None: PYTHONHASHSEED, else vLLM's default")
    int_block_hashes: bool = Field(default=True, description="as VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (vLLM's default)")
    flush_interval_s: float = Field(default=0.01, gt=0, le=10, description="events are batched for this long at most")
    mediums: dict[str, str] = Field(
        default_factory=dict,
        description="tier name -> the medium its events carry; default: GPU, CPU (host), STORAGE (local disk), REMOTE",
    )
    max_tracked_chunks: int = Field(
        default=1 << 16, gt=0, le=1 << 26,
        description="announced chunks remembered (hashes and tokens, about 1.5 KB a 256-token chunk); past it the"
        " least recently touched is announced removed",
    )  # fmt: skip

    @model_validator(mode="after")
    def _publisher(self) -> KVEventsConfig:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        return self


def external_hash(h: bytes, as_int: bool) -> int | bytes:
    """A block hash as events carry it: vLLM's `maybe_convert_block_hash` (the low 64 bits), or the digest."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1) if as_int else h


class BlockHasher:
    """vLLM's block hash chain: `H((parent or NONE_HASH, tuple(block tokens), extra_keys))`."""

    def __init__(self, algo: str, seed: str | None) -> None:
        if algo == "sha256":
            self._dump: Callable[[Any], bytes] = lambda obj: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        elif algo == "sha256_cbor":
            try:
                import cbor2
            except ImportError:
                raise InvalidArgumentError("hash_algo sha256_cbor needs cbor2 (pip install cbor2)") from None
            self._dump = lambda obj: cbor2.dumps(obj, canonical=True)
        else:
            raise InvalidArgumentError(f"unknown hash_algo {algo!r}: sha256 or sha256_cbor")
        seed = seed if seed is not None else os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
        self.none_hash = self.hash(seed)

    def hash(self, obj: Any) -> bytes:
        """SHA-256 of the serialized object (pickle is only ever written here, never read)."""
        return hashlib.sha256(self._dump(obj)).digest()

    def chain(self, parent: bytes | None, tokens: Sequence[int], block_size: int, salt: str | None) -> list[bytes]:
        """Hashes of the full blocks of `tokens`, following `parent` (None: the sequence starts here)."""
        out = []
        for start in range(0, len(tokens) - block_size + 1, block_size):
            extra = (("cache_salt", salt),) if parent is None and salt else None
            parent = self.hash((parent if parent is not None else self.none_hash, tuple(tokens[start : start + block_size]), extra))
            out.append(parent)
        return out


@dataclass
class _Chunk:
    hashes: list[bytes]
    tokens: array
    first: bool  # the sequence's first chunk: its parent is None, its first block carries the salt
    parent: bytes | None
    salt: str | None


class KVEvents:
    """Events for one store: learns chunks' tokens, hears the index's changes, batches what changed.

    Thread-safe (the publisher's thread takes batches; the store's loop adds to them)."""

    def __init__(self, config: KVEventsConfig, mediums: dict[str, tuple[str, str]], chunk_tokens: int) -> None:
        """`mediums`: tier name -> (medium, locality)."""
        if chunk_tokens % config.block_size:
            raise InvalidArgumentError(
                f"kv events: chunk_tokens ({chunk_tokens}) must be a multiple of the engines' block_size ({config.block_size})"
            )
        self.config, self.mediums, self.chunk_tokens = config, mediums, chunk_tokens
        self.hasher = BlockHasher(config.hash_algo, config.hash_seed)
        self._lock = threading.Lock()
        self._info: dict[str, _Chunk] = {}  # every chunk tracked below: its hashes and tokens
        self._held: OrderedDict[str, set[str]] = OrderedDict()  # announced: key -> tiers, least recently touched first
        self._unheld: OrderedDict[str, None] = OrderedDict()  # learned, in no tier yet (or any more)
        self._pending: list[Any] = []
        self.wake = threading.Event()
        self.dropped = 0
        self.forgotten = 0
        self.published_events = 0

    def _external(self, h: bytes) -> int | bytes:
        return external_hash(h, self.config.int_block_hashes)

    def _emit(self, event: Any) -> None:
        if len(self._pending) >= self.config.max_queue_size:  # nobody is taking them: say so, start over
            self.dropped += len(self._pending)
            self._pending = [_wire().AllBlocksCleared()]
            self._unannounce()
            log.warning("kv events: the queue is full; published AllBlocksCleared instead of %d events", self.dropped)
        self._pending.append(event)
        self.wake.set()

    def _unannounce(self) -> None:
        """Everything announced counts as never said (after an AllBlocksCleared): known, not held."""
        for key in self._held:
            self._unheld[key] = None
        self._held.clear()
        self._trim()

    def _trim(self) -> None:
        """Memory is bounded: chunks learned but never stored go first (oldest first); past
        `max_tracked_chunks` announced ones, the least recently touched is forgotten, with a BlockRemoved
        for each of its tiers: a router may hear of less than is held, never of more."""
        while len(self._unheld) > _PENDING_KEPT:
            del self._info[self._unheld.popitem(last=False)[0]]
        while len(self._held) > self.config.max_tracked_chunks:
            key, tiers = self._held.popitem(last=False)
            for tier in tiers:
                self._removed(key, tier)
            del self._info[key]
            self.forgotten += 1

    def cleared(self) -> None:
        """Nothing announced before holds any more (a store opened: routers drop what they heard of it)."""
        with self._lock:
            self._unannounce()
            self._emit(_wire().AllBlocksCleared())

    def learn(
        self, keys: Sequence[str], tokens: Sequence[int] | array, tiers_of: Callable[[str], Iterable[str]],
        salt: str | None = None,
    ) -> None:  # fmt: skip
        """The tokens behind chunk `keys` (the chain from the sequence's start): announce the chunks
        some tier holds and no event said so yet; remember the rest for when they are stored."""
        if not keys:
            return
        with self._lock:
            parent: bytes | None = None
            c = self.chunk_tokens
            for i, key in enumerate(keys):
                chunk = self._info.get(key)
                if chunk is None:
                    part = tokens[i * c : (i + 1) * c]
                    packed = array("i" if max(part, default=0) < 2**31 else "q", part)  # 4 bytes a token when they fit
                    chunk = _Chunk(self.hasher.chain(parent, packed, self.config.block_size, salt), packed, i == 0,
                                   parent, salt)  # fmt: skip
                    self._info[key] = chunk
                    self._unheld[key] = None
                elif key in self._held:
                    self._held.move_to_end(key)
                else:
                    self._unheld.move_to_end(key)
                parent = chunk.hashes[-1]
                for tier in tiers_of(key):
                    self._stored(key, chunk, tier)
            self._trim()

    def _stored(self, key: str, chunk: _Chunk, tier: str) -> None:
        if tier not in self.mediums or tier in self._held.get(key, ()):
            return
        self._unheld.pop(key, None)
        self._held.setdefault(key, set()).add(tier)
        medium, locality = self.mediums[tier]
        extra = [(chunk.salt,) if chunk.first and chunk.salt and j == 0 else None for j in range(len(chunk.hashes))]
        self._emit(_wire().BlockStored(
            block_hashes=[self._external(h) for h in chunk.hashes],
            parent_block_hash=None if chunk.parent is None else self._external(chunk.parent),
            token_ids=chunk.tokens.tolist(), block_size=self.config.block_size, lora_id=None, medium=medium,
            lora_name=None, extra_keys=extra if any(extra) else None, group_idx=0, locality=locality, ownership=tier,
        ))  # fmt: skip

    def _removed(self, key: str, tier: str) -> None:
        medium, locality = self.mediums[tier]
        self._emit(_wire().BlockRemoved(
            block_hashes=[self._external(h) for h in self._info[key].hashes], medium=medium, group_idx=0,
            locality=locality, ownership=tier,
        ))  # fmt: skip

    def added(self, keys: Iterable[str], tier: str) -> None:
        """The index heard `keys` are in `tier` (stored, promoted, found)."""
        with self._lock:
            for key in keys:
                chunk = self._info.get(key)
                if chunk is not None:
                    self._stored(key, chunk, tier)
            self._trim()

    def discarded(self, keys: Iterable[str], tier: str) -> None:
        """`keys` left `tier` (evicted, deleted)."""
        with self._lock:
            for key in keys:
                tiers = self._held.get(key)
                if tiers is None or tier not in tiers:
                    continue
                tiers.discard(tier)
                self._removed(key, tier)
                if not tiers:
                    del self._held[key]
                    self._unheld[key] = None  # its tokens stay known a while: stored again, it is announced
            self._trim()

    def take(self) -> list[Any]:
        """The events since the last take (the publisher's batch)."""
        with self._lock:
            out, self._pending = self._pending, []
            self.wake.clear()
            return out

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"chunks_known": len(self._info), "chunks_announced": len(self._held),
                    "events_pending": len(self._pending), "events_published": self.published_events,
                    "events_dropped": self.dropped, "chunks_forgotten": self.forgotten}  # fmt: skip


class ZmqPublisher:
    """A thread that publishes `KVEvents`' batches on a PUB socket and serves replays on a ROUTER."""

    def __init__(self, events: KVEvents) -> None:
        try:
            import zmq
        except ImportError:
            raise InvalidArgumentError("kv events over zmq need pyzmq and msgspec: pip install 'agentstate-kv[events]'") from None
        cfg = events.config
        self.events, self.config = events, cfg
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay = None
        try:
            if _binds(cfg.endpoint):
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or cfg.endpoint
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint)
            self.replay_endpoint = (
                self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
            )
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise InvalidArgumentError(f"kv events: cannot open {cfg.endpoint} / {cfg.replay_endpoint}: {exc}") from None
        self._topic = cfg.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = 0
        self._running = True
        self._encoder = _wire().encoder()
        self._thread = threading.Thread(target=self._run, name="agentstate-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = self._zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, self._zmq.POLLIN)
        wait_ms = int(self.config.flush_interval_s * 1000) or 1
        while True:
            running = self._running
            try:
                if self._replay is not None and poller.poll(0):
                    self._serve_replay()
                self.events.wake.wait(self.config.flush_interval_s if self._replay is None else wait_ms / 1000)
                self._publish(self.events.take())
            except Exception:  # noqa: BLE001  # a publisher must outlive one bad send; it is logged
                log.exception("kv events: publishing failed")
                time.sleep(0.1)
            if not running:
                return

    def _publish(self, events: list[Any]) -> None:
        if not events:
            return
        batch = _wire().KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.config.data_parallel_rank)
        payload = self._encoder.encode(batch)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.events.published_events += len(events)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:  # a request is (identity, empty, start sequence)
            log.warning("kv events: a malformed replay request (%d frames) ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        """Publish what is pending, then stop."""
        self._running = False
        self.events.wake.set()
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=100)


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _wire() -> Any:
    """The wire structs (`agentstate.event_wire`), imported on first use: this module needs no msgspec."""
    try:
        from agentstate import event_wire
    except ImportError:
        raise InvalidArgumentError("kv events need msgspec and pyzmq: pip install 'agentstate-kv[events]'") from None
    return event_wire


def decoder() -> Any:
    """A msgpack decoder of our batches (the router's; vLLM's own structs decode them as well)."""
    return _wire().decoder()
