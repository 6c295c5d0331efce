"""Connections to Redis nodes for the tier's reads, and the routing of a batch's keys over them.

Why a pool per node: one connection carries one reply at a time, so a few connections keep a
node's single thread busy while the client is still landing the last value; and a cluster's keys
go each to the node owning its slot, so a dead node costs only its own keys. What the wire client
cannot settle (a MOVED or ASK, a refused handshake) goes back to redis-py. A reply that breaks the
protocol or declares a value longer than its key's bound is a counted miss: it never goes to redis-py,
which would take the server's word for the length.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from agentstate.backends.redis_wire import (
    MISS,
    BadReplyError,
    TOO_BIG,
    ReplyError,
    Request,
    RespProtocol,
    Target,
    WireConfig,
    WireError,
    WireProtocolError,
    handshake,
    pack,
)  # fmt: skip

if TYPE_CHECKING:
    from agentstate.backends.redis import RedisBackend

log = logging.getLogger("agentstate.backends.redis")
FOR_REDIS_PY = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "LOADING", "MASTERDOWN", "READONLY", "NOAUTH",
                "WRONGPASS", "NOPERM")  # fmt: skip
"""Error replies about where, when or as whom to ask, not about the key: redis-py's path decides them
(follows a redirect, or counts an outage, as it always did), never a refusal of that key."""


class NodePool:
    """Up to `size` connections to one node, opened on first use and again after a drop; the requests
    of each batch go to the least loaded ones, pipelined behind whatever they already carry."""

    def __init__(self, config: WireConfig, size: int) -> None:
        self.config, self.size = config, max(1, size)
        self.conns: list[RespProtocol] = []
        self._lock: asyncio.Lock | None = None

    async def _open(self) -> RespProtocol:
        cfg = self.config
        _, proto = await asyncio.get_running_loop().create_connection(RespProtocol, cfg.host, cfg.port)
        hello = handshake(cfg)
        if hello:
            loop = asyncio.get_running_loop()
            reqs = [Request(None, loop.create_future(), b"+") for _ in hello]
            proto.send(hello, reqs)
            try:
                await asyncio.gather(*(r.future for r in reqs))
            except BaseException as exc:
                proto.abort(WireError("handshake failed"))
                if isinstance(exc, ReplyError):  # a wrong password, a db out of range: redis-py says why
                    raise WireProtocolError(f"handshake refused: {exc.reply[:100]}") from None
                raise
        return proto

    async def _ready(self) -> list[RespProtocol]:
        self.conns = [c for c in self.conns if c.closed is None]
        if len(self.conns) < self.size:
            self._lock = self._lock or asyncio.Lock()
            async with self._lock:
                self.conns = [c for c in self.conns if c.closed is None]
                got = await asyncio.gather(*(self._open() for _ in range(self.size - len(self.conns))),
                                           return_exceptions=True)  # fmt: skip
                self.conns += [c for c in got if isinstance(c, RespProtocol)]
                if not self.conns:
                    err = next(e for e in got if isinstance(e, BaseException))
                    if isinstance(err, WireError | asyncio.CancelledError):
                        raise err
                    raise WireError(f"cannot connect ({type(err).__name__}: {err})") from err
        return self.conns

    def _submit(
        self,
        conns: list[RespProtocol],
        keys: Sequence[bytes],
        targets: Sequence[Target | None],
        command: bytes,
        limits: Sequence[int | None],
    ) -> list[Request]:
        """Values spread over the least loaded connections; small replies (EXISTS) all on one, since
        each connection used costs a write and a wakeup of its own."""
        loop = asyncio.get_running_loop()
        load = [c.load for c in conns]
        batches: list[tuple[list[bytes], list[Request]]] = [([], []) for _ in conns]
        reqs = []
        spread = command == b"GET"
        j = min(range(len(conns)), key=load.__getitem__)
        for key, target, limit in zip(keys, targets, limits):
            if spread:
                j = min(range(len(conns)), key=load.__getitem__)
                load[j] += 1
            req = Request(target, loop.create_future(), b"$" if command == b"GET" else b":", limit)
            req.conn = conns[j]
            batches[j][0].append(pack(command, key))
            batches[j][1].append(req)
            reqs.append(req)
        for conn, (payload, sent) in zip(conns, batches):
            if sent:
                try:
                    conn.send(payload, sent)
                except WireError as exc:
                    for req in sent:
                        req.future.set_exception(exc)
        return reqs

    async def fetch(
        self,
        keys: Sequence[bytes],
        targets: Sequence[Target | None],
        *,
        timeout: float,
        retries: int = 2,
        command: bytes = b"GET",
        limits: Sequence[int | None] | None = None,
    ) -> list[int | Exception]:
        """GET each key into its target. Per request: bytes written (or handed to the sink), MISS,
        TOO_BIG, or its error: ReplyError (refused), BadReplyError (a reply no GET returns, or a value
        longer than `limits[i]`: never retried), WireProtocolError (a handshake in doubt), WireError
        (the node is down or slower than `timeout`, after `retries` reconnects). Requests that
        completed keep their result; from the moment a request fails or is cancelled, nothing more of
        its reply lands in its target."""
        if not keys:
            return []
        bounds: Sequence[int | None] = [None] * len(keys) if limits is None else limits
        deadline = time.monotonic() + timeout
        out: list[int | Exception] = [WireError("not sent")] * len(keys)
        todo = list(range(len(keys)))
        for attempt in range(retries + 1):
            try:
                conns = await asyncio.wait_for(self._ready(), max(deadline - time.monotonic(), 0))
            except (WireError, TimeoutError) as exc:
                err = exc if isinstance(exc, WireError) else WireError("connect timed out")
                for i in todo:
                    out[i] = err
                return out
            reqs = self._submit(conns, [keys[i] for i in todo], [targets[i] for i in todo], command,
                                [bounds[i] for i in todo])  # fmt: skip
            try:
                _, late = await asyncio.wait([r.future for r in reqs], timeout=max(deadline - time.monotonic(), 0))
            except BaseException:  # cancelled: from now on its bytes are dropped
                for req in reqs:
                    req.cancel()
                raise
            for req in reqs:
                if req.future in late:  # a node that slow is an outage: drop the connection holding it
                    req.cancel()
                    req.conn.abort(WireError("timed out"))  # type: ignore[union-attr]
            again = []
            for i, req in zip(todo, reqs):
                failed = WireError(f"timed out after {timeout:.1f} s") if req.future in late else req.future.exception()
                if type(failed) is WireError and attempt < retries and not late:
                    again.append(i)  # dropped: GET is idempotent, ask again on a fresh connection
                else:
                    out[i] = req.future.result() if failed is None else failed  # type: ignore[assignment]
            if not (todo := again):
                break
            await asyncio.sleep(min(0.01 * 2**attempt, max(deadline - time.monotonic(), 0)))
        return out

    def close(self) -> None:
        for conn in self.conns:
            conn.abort(WireError("closed"))
        self.conns = []


class WireReader:
    """The tier's reads over the wire client: one pool per node, each node behind its breaker."""

    def __init__(self, backend: RedisBackend, config: WireConfig, connections: int, retries: int) -> None:
        self.backend, self.config, self.connections, self.retries = backend, config, connections, retries
        self.pools: dict[str, NodePool] = {}

    def route(self, keys: Sequence[str]) -> dict[str, tuple[WireConfig, list[int]]]:
        """The keys by the node that owns them (in a cluster, from redis-py's slot map)."""
        b = self.backend
        if not b.cluster:
            return {b.server: (self.config, list(range(len(keys))))}
        groups: dict[str, tuple[WireConfig, list[int]]] = {}
        for i, key in enumerate(keys):
            node = b.node_of(key)
            cfg = WireConfig(node.host, int(node.port), self.config.username, self.config.password)
            groups.setdefault(node.name, (cfg, []))[1].append(i)
        return groups

    async def _ask(
        self,
        keys: Sequence[str],
        targets: Sequence[Target | None],
        command: bytes,
        limits: Sequence[int | None] | None = None,
    ) -> tuple[list[int | None], list[int]]:
        """`command` for each key on the node that owns it. Per key: its integer result (bytes, MISS or
        TOO_BIG for GET; the count for EXISTS), or None where its node is down, refused it or answered
        out of protocol; and the keys the wire client could not settle, for redis-py."""
        b = self.backend
        out: list[int | None] = [None] * len(keys)
        doubt: list[int] = []
        try:
            if b.cluster:
                await b.load_slot_map()
            groups = self.route(keys)
        except b.client_errors:  # any failure of redis-py's, as on its own path
            return out, list(range(len(keys)))  # no slot map: redis-py routes (and fails) it all

        async def run(node: str, cfg: WireConfig, idx: list[int]) -> None:
            breaker = b.breaker_of(node if b.cluster else None)
            if breaker.open:
                b.count(errors=1)
                return
            pool = self.pools.get(node)
            if pool is None or pool.config != cfg:
                pool = self.pools[node] = NodePool(cfg, self.connections)
            async with b.gate():  # calls in flight bounded as on redis-py's path: a wait here is not the node's
                got = await pool.fetch([b.stored_key(keys[i]).encode() for i in idx], [targets[i] for i in idx],
                                       timeout=b.timeout_s, retries=self.retries, command=command,
                                       limits=None if limits is None else [limits[i] for i in idx])  # fmt: skip
            if down := next((g for g in got if type(g) is WireError), None):
                breaker.failure()  # down, or dropped again after every retry: its keys are misses
                b.count(errors=1)
                log.warning("redis %s on %s failed (%s)", command.decode(), node, down)
            else:
                breaker.success()
            refused, bad = [], []
            for i, g in zip(idx, got):
                if isinstance(g, int):
                    out[i] = g
                elif type(g) is WireError:
                    continue
                elif isinstance(g, BadReplyError):
                    bad.append(str(g))  # a miss, its connection already dropped; not an outage of the node
                elif isinstance(g, ReplyError) and not g.reply.startswith(FOR_REDIS_PY):
                    refused.append(g.reply)  # e.g. WRONGTYPE: this key alone is refused, a miss
                elif isinstance(g, ReplyError | WireProtocolError):
                    doubt.append(i)  # moved, resharding, or a stream we doubt: redis-py decides
                else:
                    raise g  # the caller's sink failed
            if refused:
                b.count(refused=len(refused))
                log.warning("redis refused %d %s on %s: %s", len(refused), command.decode(), node, refused[0][:200])
            if bad:
                b.count(errors=len(bad), bad_replies=len(bad))
                log.warning("redis %s on %s: %d replies out of protocol, treated as misses: %s", command.decode(),
                            node, len(bad), bad[0][:200])  # fmt: skip

        if len(groups) == 1:  # one node (always, outside a cluster): no task to schedule
            await run(*next((node, *group) for node, group in groups.items()))
        else:
            await asyncio.gather(*(run(node, cfg, idx) for node, (cfg, idx) in groups.items()))
        return out, doubt

    async def read(
        self, keys: Sequence[str], targets: Sequence[Target], limits: Sequence[int] | None = None
    ) -> list[int]:
        """Each value into its target: bytes, MISS or TOO_BIG. `limits[i]`: the longest value key i may
        have; a longer one is a counted miss, refused before it is received. A down node's keys are
        counted misses (behind its breaker); keys the wire client cannot settle (MOVED, a refused
        handshake) are read again through redis-py, under the same bounds."""
        got, doubt = await self._ask(keys, targets, b"GET", limits)
        out = [MISS if n is None else n for n in got]
        served = sum(n >= 0 for n in out)
        self.backend.count(reads=served, misses=len(keys) - len(doubt) - served)
        if doubt:
            sink = lambda j, view: _deliver(targets, out, doubt[j], view)
            if limits is None:
                await self.backend.read_via_client([keys[i] for i in doubt], sink)
            else:
                await self.backend.read_via_client([keys[i] for i in doubt], sink, [limits[i] for i in doubt])
        return out

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored; a down node holds nothing we can use."""
        got, doubt = await self._ask(keys, [None] * len(keys), b"EXISTS")
        out = [bool(n) for n in got]
        if doubt:
            for i, found in zip(doubt, await self.backend.exists_via_client([keys[i] for i in doubt])):
                out[i] = found
        return out

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


def _deliver(targets: Sequence[Target], out: list[int], i: int, view: memoryview) -> None:
    """A value redis-py read, into its target as the wire client would have put it."""
    target = targets[i]
    if callable(target):
        target(view)
        out[i] = len(view)
    elif len(view) <= len(target):
        target[: len(view)] = view
        out[i] = len(view)
    else:
        out[i] = TOO_BIG
