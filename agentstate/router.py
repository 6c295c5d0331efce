"""A prefix-aware router over KV events: each request goes to the host holding its longest prefix.

The consumer side of `agentstate.events`, small on purpose: it subscribes to each host's event
stream (an agentstate store's, or a vLLM engine's own, which share the format), keeps per host the
block hashes it holds and in which medium, and for a request's tokens counts the leading blocks
each host holds, and scores each host: the share of the prompt it holds, less `load_weight` times
its share of the last `window` routes relative to a fair share (share x N - 1: an idle host gets
`load_weight` as a bonus, one at twice its share as much as a penalty). A
session's own host keeps it (the rest of the fleet holds only the shared part of its prompt) unless
that host is far busier than the others; a request whose prefix every host holds equally (a new
agent after a shared system prompt) goes to the least busy. Without the load term (`load_weight`
None) every request that shares a system prompt follows it to the first host that held it. Ties go
round-robin among the tied hosts.

Streams are trusted for what they are (a host's word about itself) but checked for what they
carry: a batch that does not decode is dropped with its host's view reset (it can no longer be
known), and a gap in sequence numbers asks the host's replay socket for what was missed, resetting
the view when the replay cannot cover it. A stale view costs a hit, never correctness: the engine
routed to checks every key it loads.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentstate.errors import InvalidArgumentError
from agentstate.events import END_SEQ, BlockHasher, decoder, external_hash

log = logging.getLogger("agentstate.router")
MAX_REPLAY_BATCHES = 1_000_000
"""Batches one replay may bring (vLLM keeps 10,000 by default); past it the replay counts as failed."""


@dataclass
class HostView:
    """What one host said it holds: block hash -> the (medium, tier) places it is in.

    A place is a set member, not a count: an engine may announce a block again while it holds it (vLLM
    reports prefix-cache reuse as BlockStored), and one removal must still take the claim away: a view
    may hold less than the host, never more. `max_blocks` bounds what one host can make the router keep:
    a stream claiming more is reset."""

    name: str
    endpoint: str
    replay: str | None
    max_blocks: int = 1 << 22
    blocks: dict[int | bytes, set[tuple[str | None, str | None]]] = field(default_factory=dict)
    next_seq: int | None = None
    resets: int = 0
    sub: Any = None

    def apply(self, events: Sequence[Any]) -> None:
        for event in events:
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                self.blocks.clear()
            elif kind == "BlockStored":
                where = (event.medium, getattr(event, "ownership", None))
                for h in event.block_hashes:
                    self.blocks.setdefault(h, set()).add(where)
                if len(self.blocks) > self.max_blocks:
                    log.warning("router: %s claims more than %d blocks; its view starts over", self.name, self.max_blocks)
                    self.reset()
            elif kind == "BlockRemoved":
                where = (event.medium, getattr(event, "ownership", None))
                for h in event.block_hashes:
                    held = self.blocks.get(h)
                    if held is not None:
                        held.discard(where)
                        if not held:
                            del self.blocks[h]

    def reset(self) -> None:
        self.blocks.clear()
        self.resets += 1


class PrefixRouter:
    """Routes token sequences to hosts by the longest prefix their KV events say they hold."""

    def __init__(
        self, hosts: dict[str, tuple[str, str | None]], *, block_size: int = 16, hash_algo: str = "sha256",
        hash_seed: str | None = None, int_block_hashes: bool = True, topic: str = "", load_weight: float | None = 0.5,
        window: int = 64,
    ) -> None:  # fmt: skip
        """`hosts`: name -> (PUB endpoint, replay endpoint or None). `load_weight`: None routes by prefix alone."""
        import zmq

        if not hosts:
            raise InvalidArgumentError("a router needs at least one host")
        self._zmq = zmq
        self.block_size, self.int_block_hashes = block_size, int_block_hashes
        self.hasher = BlockHasher(hash_algo, hash_seed)
        self._ctx = zmq.Context()
        self._decode = decoder()
        self.hosts: dict[str, HostView] = {}
        self._topic = topic.encode()
        for name, (endpoint, replay) in hosts.items():
            view = HostView(name, endpoint, replay)
            view.sub = self._ctx.socket(zmq.SUB)
            view.sub.connect(endpoint)
            view.sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            self.hosts[name] = view
        self._turn = 0
        self.routed: Counter[str] = Counter()
        self.load_weight = load_weight
        self._recent: deque[str] = deque(maxlen=max(1, window))

    def catch_up(self, start: int = 0) -> None:
        """Ask every host's replay socket for its buffered batches from `start` (a router starting late)."""
        for view in self.hosts.values():
            if view.replay is not None:
                self._replay(view, start)

    def _replay(self, view: HostView, start: int) -> bool:
        """Batches from `start` on; True when they reached back that far."""
        zmq = self._zmq
        req = self._ctx.socket(zmq.DEALER)
        req.connect(view.replay)
        req.send_multipart((b"", start.to_bytes(8, "big")))
        first: int | None = None
        taken = 0
        try:
            while req.poll(2000) and taken <= MAX_REPLAY_BATCHES:  # a replay that never ends is cut off
                taken += 1
                frames = req.recv_multipart()
                if len(frames) != 4:
                    return False
                _, _, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    return first is not None and first <= start
                seq = int.from_bytes(seq_bytes, "big")
                first = seq if first is None else first
                self._take(view, seq, payload, replaying=True)
            return False
        finally:
            req.close(linger=0)

    def _take(self, view: HostView, seq: int, payload: bytes, *, replaying: bool = False) -> None:
        if view.next_seq is not None and seq < view.next_seq:
            return  # seen already (a replay overlapping the live stream)
        if view.next_seq is not None and seq > view.next_seq and not replaying:
            missed = view.next_seq
            if view.replay is None or not self._replay(view, missed):
                log.warning("router: %s's events %d..%d are lost; its view starts over", view.name, missed, seq - 1)
                view.reset()
            if view.next_seq is not None and seq < view.next_seq:
                return
        try:
            batch = self._decode.decode(payload)
        except Exception as exc:  # noqa: BLE001  # a host's garbage must not stop the router
            log.warning("router: a batch from %s does not decode (%s); its view starts over", view.name, exc)
            view.reset()
            view.next_seq = seq + 1
            return
        view.apply(batch.events)
        view.next_seq = seq + 1

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply the events waiting on every stream; returns how many batches."""
        zmq = self._zmq
        poller = zmq.Poller()
        for view in self.hosts.values():
            poller.register(view.sub, zmq.POLLIN)
        n = 0
        ready = dict(poller.poll(timeout_ms))
        while ready:
            for view in self.hosts.values():
                while view.sub in ready and view.sub.poll(0):
                    frames = view.sub.recv_multipart()
                    if len(frames) != 3 or len(frames[1]) != 8:
                        log.warning("router: a malformed message from %s dropped", view.name)
                        continue
                    self._take(view, int.from_bytes(frames[1], "big"), frames[2])
                    n += 1
            ready = dict(poller.poll(0))
        return n

    def hashes(self, tokens: Sequence[int], salt: str | None = None) -> list[int | bytes]:
        raw = self.hasher.chain(None, list(tokens), self.block_size, salt)
        return [external_hash(h, self.int_block_hashes) for h in raw]

    def matches(self, tokens: Sequence[int], salt: str | None = None) -> dict[str, int]:
        """Per host, how many leading tokens of `tokens` it holds (whole blocks, any medium)."""
        hashes = self.hashes(tokens, salt)
        out = {}
        for name, view in self.hosts.items():
            n = 0
            while n < len(hashes) and hashes[n] in view.blocks:
                n += 1
            out[name] = n * self.block_size
        return out

    def route(self, tokens: Sequence[int], salt: str | None = None) -> tuple[str, int]:
        """The host for `tokens` and how many leading tokens it holds (events applied first)."""
        self.poll()
        found = self.matches(tokens, salt)
        score: dict[str, float] = {name: n / max(len(tokens), 1) for name, n in found.items()}
        if self.load_weight is not None and self._recent:
            recent, n = Counter(self._recent), len(self.hosts)
            for name in score:
                score[name] -= self.load_weight * (recent[name] * n / len(self._recent) - 1)
        best = max(score.values())
        tied = [name for name, v in score.items() if v >= best - 1e-9]
        choice = tied[self._turn % len(tied)]
        self._turn += 1
        self.routed[choice] += 1
        self._recent.append(choice)
        return choice, found[choice]

    def close(self) -> None:
        self._ctx.destroy(linger=0)
