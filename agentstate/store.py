"""StateStore: the async API engines and agent frameworks call (prefixes, matches, sessions)."""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from array import array
from collections import Counter
from collections.abc import Callable, Generator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from pydantic import BaseModel
from typing_extensions import Self

from agentstate import datadir, slices
from agentstate import model_state as model_state_codec
from agentstate.backends.base import BackendStats
from agentstate.catalog import Catalog
from agentstate.chunks import ChunkStore, PrefetchHandle, PrefetchPolicy, deadline_for
from agentstate.config import StoreConfig
from agentstate.errors import AgentStateError, InvalidArgumentError, KVShapeError
from agentstate.hints import Hint, HintKind, HintResult
from agentstate.keys import ChunkKey, boundary_key, token_array, validate_id
from agentstate.layouts import NativeKV
from agentstate.manifest import MatchResult
from agentstate.sessions import Sessions, leading
from agentstate.spec import ModelSpec
from agentstate.store_base import StoreScope
from agentstate.target import KVTarget
from agentstate.usage import UsageLog

if TYPE_CHECKING:
    import torch

log = logging.getLogger("agentstate.store")
P = ParamSpec("P")
R = TypeVar("R")


def _session_op(op: Callable[Concatenate[Sessions, P], R]) -> Callable[Concatenate[StateStore, P], R]:
    """`Sessions.<op>` offered as a StateStore method: same signature, same docstring."""

    @functools.wraps(op)
    def call(self: StateStore, *args: P.args, **kwargs: P.kwargs) -> R:
        return op(self._sessions, *args, **kwargs)

    call.__qualname__ = f"StateStore.{op.__name__}"
    return call


class StoreStats(BaseModel):
    fingerprint: str
    tenant: str
    sessions: int
    indexed_keys: int
    tiers: list[BackendStats]
    counters: dict[str, int]


class StateStore:
    """Per-session and shared-prefix KV state over a host tier and LMDB.

    Open with `async with StateStore.open(path_or_config, spec) as store:` (or `await` it and
    `await store.close()`). All methods are coroutines and safe to run concurrently.

    A StateStore has a ChunkStore (`chunks`: every chunk's bytes in every tier), a Catalog
    (`catalog`: manifests, prefixes, references) and the session operations (`Sessions`), all
    seen as one tenant (`for_tenant`: another); it adds shared prefixes, matches and loads.
    """

    def __init__(self, config: StoreConfig, spec: ModelSpec, *, read_only: bool = False) -> None:
        self._bind(StoreScope(config, spec, read_only=read_only))

    def _bind(self, scope: StoreScope) -> None:
        self._scope = scope
        self._sessions = Sessions(scope)

    def for_tenant(self, tenant: str) -> Self:
        """This store seen as another tenant: same chunks and catalog; that tenant's sessions and
        key namespace. One process serves many tenants this way (the HTTP service does), since a
        data directory is opened once per process. Closing a view closes nothing.
        """
        view = copy.copy(self)
        view._bind(self._scope.for_tenant(tenant))
        return view

    # -- what it is made of (the same objects in every tenant view) ----------------------------

    @property
    def config(self) -> StoreConfig:
        return self._scope.config

    @property
    def spec(self) -> ModelSpec:
        return self._scope.spec

    @property
    def fingerprint(self) -> str:
        return self._scope.fingerprint

    @property
    def tenant(self) -> str:
        return self._scope.tenant

    @property
    def namespace(self) -> str:
        """The chunk keys' sharing scope: this tenant's, or the global one (`shared_namespace`)."""
        return self._scope.namespace

    @property
    def chunk_tokens(self) -> int:
        return self._scope.chunk_tokens

    @property
    def chunks(self) -> ChunkStore:
        return self._scope.chunks

    @property
    def catalog(self) -> Catalog:
        return self._scope.catalog

    @property
    def usage_log(self) -> UsageLog:
        """Accounting and hit times on their way to the catalog (one for every tenant view)."""
        return self._scope.usage_log

    @property
    def key_prefixes(self) -> list[str]:
        """Where this spec's chunks and tails live in every tier (what open adopts and gc sweeps)."""
        return self._scope.key_prefixes

    def chunk_keys(self, tokens: Sequence[int] | torch.Tensor) -> list[ChunkKey]:
        """The keys of the full chunks of `tokens` in this tenant's namespace."""
        return self._scope.chunk_keys(token_array(tokens))

    def prefix_keys(self, tokens: Sequence[int] | torch.Tensor) -> list[ChunkKey]:
        """The keys of a shared prefix's full chunks (`put_prefix`, `match`, `load`; see `key_scheme`)."""
        return self._scope.prefix_keys(token_array(tokens))

    def prefix_key_base(self) -> str:
        """What every prefix key starts with before its last part (see `key_scheme`)."""
        return self._scope.prefix_key_base()

    def session_lock(self, session_id: str) -> contextlib.AbstractAsyncContextManager[None]:
        """The one writer's place of this tenant's session in this process (see StoreScope)."""
        return self._scope.session_lock(session_id)

    async def flush(self) -> None:
        """Wait until background work (promotions of chunks read from slow tiers) is done."""
        await self._scope.flush()

    async def close(self) -> None:
        await self._scope.close()

    # -- sessions ------------------------------------------------------------------------------

    snapshot = _session_op(Sessions.snapshot)
    session = _session_op(Sessions.session)
    resume = _session_op(Sessions.resume)
    fork = _session_op(Sessions.fork)
    delete = _session_op(Sessions.delete)
    sessions = _session_op(Sessions.sessions)
    hint = _session_op(Sessions.hint)
    paused = _session_op(Sessions.paused)
    resuming = _session_op(Sessions.resuming)
    done = _session_op(Sessions.done)
    usage = _session_op(Sessions.usage)
    gc = _session_op(Sessions.gc)
    gc_step = _session_op(Sessions.gc_step)

    async def put_records(self, session_id: str, items: Mapping[str, bytes]) -> None:
        """Keep framework state beside a session (`agentstate.records`): name -> bytes, all or none."""
        await self._sessions.records.put(session_id, items)

    async def records(
        self, session_id: str, prefix: str = "", *, names: Sequence[str] | None = None
    ) -> dict[str, bytes]:
        """A session's records whose name starts with `prefix`, in name order, or those of `names`
        that exist (in that order); each checked."""
        return await self._sessions.records.get(session_id, prefix, names)

    async def record_names(self, session_id: str, prefix: str = "") -> list[str]:
        """The names of a session's records that start with `prefix`, in name order (no values read)."""
        return await self._sessions.records.names(session_id, prefix)

    async def delete_records(self, session_id: str, names: Sequence[str] | None = None) -> int:
        """Remove named records of a session (None: all of them, the session's KV stays); how many."""
        return await self._sessions.records.delete(session_id, names)

    @classmethod
    def open(
        cls, path_or_config: str | Path | StoreConfig, spec: ModelSpec, *, read_only: bool = False,
        writer: str = "agentstate.StateStore", recorded: StoreConfig | None = None, **overrides: Any,
    ) -> _Opening:  # fmt: skip
        """Open a data directory (taking its lock: one writer at a time, DataDirLockedError otherwise).

        `spec` must be the one the directory records, if it records one (SpecMismatchError naming
        the fields that differ). A writer records its spec where none is, and the config it opened
        with (`recorded`, default the one opened; `writer` names it), so that `agentstate ls -p DIR`
        and the other admin commands open the same spec and tiers (`agentstate.datadir`).
        `read_only=True` shares the lock with other readers instead (the admin CLI's inspecting
        commands) and records nothing; such a store must not be written.
        """
        if isinstance(path_or_config, StoreConfig):
            config = path_or_config.model_copy(update=overrides) if overrides else path_or_config
        else:
            config = StoreConfig(path=Path(path_or_config), **overrides)
        store = cls(config, spec, read_only=read_only)
        return _Opening(store, None if read_only else (recorded or config, writer))

    async def _start(self, record: tuple[StoreConfig, str] | None = None) -> StateStore:
        """Check the spec against the directory's, adopt what the persistent tiers hold (a reopened
        store finds all it had), then record spec and config (`record`: what, and by whom)."""
        try:
            datadir.check_spec(self.config.path, self.spec)
            await self.chunks.open(self.key_prefixes)
            if record is not None:
                datadir.record(record[0], self.spec, record[1])
        except BaseException:
            await self.close()
            raise
        return self

    async def __aenter__(self) -> StateStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- shared prefixes -----------------------------------------------------------------------

    async def put_prefix(
        self, tokens: Sequence[int] | torch.Tensor, kv: torch.Tensor, *,
        model_state: Mapping[str, torch.Tensor] | None = None,
    ) -> int:  # fmt: skip
        """Store the full chunks of a shared prefix once; returns how many tokens were newly stored.

        The prefix is kept (referenced) until removed, whatever happens to sessions that share it.
        A hybrid model's prefix (its spec has a `state` layout) is whole chunks, and `model_state` is
        its state after the last token: the boundary a later `load` may stop at (a prefix is a hit up
        to the last boundary stored; store one every few chunks with several calls).
        """
        packed = token_array(tokens)
        self.spec.check_kv(kv, len(packed))
        keys = self._scope.prefix_keys(packed)
        payload = model_state_codec.checked(self.spec, model_state, len(packed))
        boundary = None if payload is None else self._boundary(packed, keys, payload)
        stored = await self._store_prefix(keys, self._scope.slices(kv, len(keys)), keys, boundary)
        self.chunks.learn(keys, packed)
        return stored

    def _boundary(self, packed: array, keys: list[ChunkKey], payload: torch.Tensor) -> tuple[str, torch.Tensor]:
        """(key, payload) of a hybrid prefix's state after its last token; KVShapeError unless the
        prefix is whole chunks (the state is valid after its last token only)."""
        if not keys or len(packed) != len(keys) * self.chunk_tokens:
            raise KVShapeError(
                f"a hybrid model's prefix is whole chunks of {self.chunk_tokens} tokens (its state is valid after"
                f" the last one only), got {len(packed)} tokens"
            )
        return boundary_key(keys[-1]), payload

    async def prefix_state(self, tokens: Sequence[int] | torch.Tensor, num_tokens: int) -> dict[str, torch.Tensor] | None:
        """A hybrid model's state after the first `num_tokens` of `tokens` (a boundary a `load`
        stopped at: whole chunks), or None when no tier holds it intact."""
        packed = token_array(tokens)
        c = self.chunk_tokens
        if self.spec.state is None:
            raise KVShapeError("this spec has no state layout: a dense model's prefix is its KV alone")
        if num_tokens <= 0 or num_tokens % c or num_tokens > len(packed):
            raise InvalidArgumentError(f"a boundary is a whole number of {c}-token chunks within the tokens, got {num_tokens}")
        key = boundary_key(self._scope.prefix_keys(packed[:num_tokens])[-1])
        with self.chunks.pinned([key]):
            return await model_state_codec.read(self.chunks, self.spec, key, num_tokens)

    async def put_chunks(
        self, tokens: Sequence[int] | torch.Tensor, chunks: Mapping[int, torch.Tensor | NativeKV], *,
        model_state: Mapping[str, torch.Tensor] | None = None,
    ) -> int:  # fmt: skip
        """Store some full chunks of a shared prefix, by chunk index, without the KV of the others:
        what an engine that saves chunk by chunk as it computes them calls (the vLLM connector).

        `tokens` covers the prefix through the last chunk given; `chunks[i]` is the canonical KV of
        tokens `i*chunk_tokens .. (i+1)*chunk_tokens`, or that KV in the engine's own layout
        (`NativeKV`: stored as it is, converted for readers of another layout). Chunks already stored are skipped; the
        prefix through the last given chunk is recorded (kept until removed, as `put_prefix`).
        Returns how many tokens were newly stored.

        A hybrid model's (its spec has a state layout) may come with `model_state`, its state after
        the last token of `tokens` (whole chunks): a boundary a later load may stop at. Its chunks
        stored without one are a hit only up to an earlier boundary (`lookup_keys`).
        """
        packed = token_array(tokens)
        keys = self._scope.prefix_keys(packed)
        if not chunks and model_state is None:
            return 0
        if chunks and (min(chunks) < 0 or max(chunks) >= len(keys)):
            raise InvalidArgumentError(f"chunk indices {sorted(chunks)} outside the {len(keys)} full chunks of tokens")
        for kv in chunks.values():
            if isinstance(kv, NativeKV):
                kv.check(self.spec, self.chunk_tokens)
            else:
                self.spec.check_kv(kv, self.chunk_tokens)
        boundary = None
        if model_state is not None:  # checked (a dense spec refuses it) before anything is written
            payload = model_state_codec.checked(self.spec, model_state, len(packed))
            assert payload is not None
            boundary = self._boundary(packed, keys, payload)
        order = sorted(chunks)
        prefix = keys if boundary is not None else keys[: order[-1] + 1]
        stored = await self._store_prefix([keys[i] for i in order], [chunks[i] for i in order], prefix, boundary)
        self.chunks.learn(prefix, packed)
        return stored

    async def _store_prefix(
        self, keys: list[ChunkKey], kv: Sequence[torch.Tensor | NativeKV], prefix: list[ChunkKey],
        boundary: tuple[str, torch.Tensor] | None = None,
    ) -> int:  # fmt: skip
        """Write the chunks of `keys` not stored yet (`kv[i]` is chunk `keys[i]`) and a hybrid
        model's `boundary` state (key, payload), then record `prefix` (and the boundary) so they are
        kept; what this call wrote goes again if it fails."""
        if not prefix:
            return 0
        new: list[int] = []
        wrote: list[str] = []
        written = 0
        named: list[str] = [*prefix, *([boundary[0]] if boundary else [])]
        try:
            with self.chunks.pinned([*keys, *named]):
                new = await self.chunks.missing(keys, durable=False)
                if new:
                    wrote = [keys[i] for i in new]
                    written = await self.chunks.write(wrote, [kv[i] for i in new], durable=False)
                if boundary is not None and await self.chunks.missing([boundary[0]], durable=False):
                    wrote.append(boundary[0])
                    written += await self.chunks.write([boundary[0]], [boundary[1]], durable=False,
                                                       spec=self.spec.state_spec)  # fmt: skip
                await self.catalog.add_prefix(named)
        except BaseException:
            with contextlib.suppress(AgentStateError):  # nothing names what this call wrote
                await self._scope.collect(wrote)
            raise
        c = self.chunk_tokens
        self.usage_log.add(self.tenant, None, {
            "tokens_written": len(new) * c, "tokens_deduped": (len(keys) - len(new)) * c, "bytes_written": written,
        })  # fmt: skip
        return len(new) * c

    async def lookup_keys(self, keys: Sequence[ChunkKey] | Sequence[str], chunk_tokens: int | None = None) -> int:
        """How many leading chunks of a prefix (`prefix_keys`) are stored in this store's slicing of
        heads, after bringing in those another TP size of the model stored (`agentstate.slices`):
        read, narrowed or assembled to this rank's heads, and kept under this slicing's keys.
        `chunk_tokens`: the tokens each key holds, where not this store's (an engine's own pages)."""
        n = await self.chunks.lookup(keys)
        if self.spec.state is not None:  # a hybrid prefix: up to the last boundary whose state is stored
            present = await self.chunks.present([boundary_key(k) for k in keys[:n]]) if n else []
            return max((i + 1 for i, p in enumerate(present) if p), default=0)
        if n == len(keys) or self.chunks.read_only:
            return n
        try:
            sources = await slices.find(self.chunks, self.spec, keys, n)
            if not sources:
                return n
            kv = await slices.gather(self.chunks, self.spec, sources, chunk_tokens or self.chunk_tokens)
            if kv:
                got = [ChunkKey(keys[s.index]) for s in sources[: len(kv)]]
                await self._store_prefix(got, kv, [ChunkKey(k) for k in keys[: n + len(kv)]])
                self.chunks.count(chunks_resliced=len(kv))
        except AgentStateError as exc:  # a miss, never a failed lookup: the engine computes the rest
            log.warning("chunks stored at another TP size not brought in: %s", exc)
            return n
        return n + len(kv)

    async def match(self, tokens: Sequence[int] | torch.Tensor) -> MatchResult:
        """How many leading tokens are cached (whole chunks), and which tier serves each chunk."""
        packed = token_array(tokens)
        keys = self._scope.prefix_keys(packed)
        n = await self.lookup_keys(keys)
        self.chunks.learn(keys[:n], packed)
        tiers = [self.chunks.fastest(k) or "" for k in keys[:n]]
        return MatchResult(tokens=n * self.chunk_tokens, chunks=n, tiers=tiers)

    async def prefetch(self, tokens: Sequence[int] | torch.Tensor) -> PrefetchHandle:
        """Start bringing the matched prefix of `tokens` into host memory; `load` completes it.

        Returns once the prefix is known (one batched `exists` per remote tier for chunks the index
        lacks); the reads go on in the background.
        """
        keys = self._scope.prefix_keys(token_array(tokens))
        return self.chunks.prefetch(keys[: await self.lookup_keys(keys)], self.chunk_tokens)

    async def load(
        self,
        tokens: Sequence[int] | torch.Tensor,
        into: torch.Tensor | KVTarget,
        *,
        policy: PrefetchPolicy | None = None,
        timeout: float | None = None,
        prefetch: PrefetchHandle | None = None,
    ) -> int:
        """Write the cached prefix of `tokens` into `into`; returns how many tokens landed (whole chunks).

        `into` is a canonical tensor or a KVTarget (e.g. a paged pool). A chunk that turns out
        missing or corrupt ends the prefix there. Under `best_effort`/`timeout` only what is in
        memory by the deadline is copied; the rest keeps arriving in the background.
        """
        target = self._scope.target(into)
        packed = token_array(tokens)
        keys = self._scope.prefix_keys(packed)
        n = min(await self.lookup_keys(keys), target.num_tokens // self.chunk_tokens)
        policy = policy or self.config.prefetch_policy
        deadline = deadline_for(
            policy, n * self.chunk_tokens, timeout=timeout, base=self.config.prefetch_timeout_base_s,
            per_1k=self.config.prefetch_timeout_per_1k_tokens_s,
        )  # fmt: skip
        if deadline is None:
            if prefetch is not None:
                await prefetch.wait()
        else:
            prefetch = prefetch or await self.prefetch(packed)
            await prefetch.wait(deadline)
            n = min(n, prefetch.ready(self.chunks.in_memory))
        usage: Counter[str] = Counter()
        with self.chunks.pinned(keys[:n]):
            staged = prefetch.staged if prefetch else None
            ok = await self.chunks.read(keys[:n], self._scope.spans(n), target, staged=staged, usage=usage)
        target.synchronize()
        landed = leading(ok) * self.chunk_tokens
        self.chunks.learn(keys[: leading(ok)], packed)
        usage.update(loads=1, tokens_read=landed, tokens_recomputed=len(packed) - landed)
        self.usage_log.add(self.tenant, None, usage)
        return landed

    async def hint_tokens(
        self, name: str, tokens: Sequence[int] | torch.Tensor, hint: HintKind | Hint, expected_s: float | None = None
    ) -> HintResult:
        """A hint about the cached prefix of `tokens` rather than a named session: what an engine
        that stores chunks by prefix (the vLLM connector) sends when the request carries one.

        `name` identifies the agent session to the caller (one hold per name and tenant; a later
        hint under the same name replaces it). Same meaning as `hint`: `paused` holds the prefix
        in the fast tiers, `resuming` brings it up into host memory, `done` releases it.
        """
        validate_id(name, "hint name")
        parsed = Hint.parse(hint, expected_s)
        keys = self._scope.prefix_keys(token_array(tokens))
        keys = keys[: await self.lookup_keys(keys)]
        self.usage_log.add(self.tenant, None, {"hints": 1})
        return await self._sessions.apply_hint(
            f"prefix:{self.tenant}/{name}", name, list(keys), [self.chunk_tokens] * len(keys), parsed
        )

    async def stats(self) -> StoreStats:
        return StoreStats(
            fingerprint=self.fingerprint, tenant=self.tenant, sessions=await self.catalog.session_count(),
            indexed_keys=len(self.chunks), tiers=await self.chunks.stats(), counters=self.chunks.counters(),
        )  # fmt: skip


class _Opening:
    """What `StateStore.open` returns: awaitable, or an async context manager that closes the store."""

    def __init__(self, store: StateStore, record: tuple[StoreConfig, str] | None) -> None:
        self._store = store
        self._record = record

    def __await__(self) -> Generator[Any, None, StateStore]:
        return self._store._start(self._record).__await__()

    async def __aenter__(self) -> StateStore:
        return await self._store._start(self._record)

    async def __aexit__(self, *exc: object) -> None:
        await self._store.close()
