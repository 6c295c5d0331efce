"""Admin operations behind `agentstate ls | inspect | stats | evict | gc` (verify lives in
`agentstate.ops.verify`, export and import in `agentstate.ops.archive`).

Each operation takes an open StateStore and returns a pydantic model, so the CLI only parses
arguments and prints (`--json` is `model_dump_json`). `open_store` opens a data directory under
the ModelSpec and the config its writer recorded (`agentstate.datadir`), and refuses to guess a
spec: opening a directory under the wrong spec would show it as empty.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from agentstate import codec
from agentstate.chunks import EvictResult
from agentstate.chunks import TierInfo as ChunkTierInfo
from agentstate.datadir import SPEC, directory_spec, is_store, read_spec_file, record_spec, recorded_spec  # noqa: F401
from agentstate.errors import InvalidArgumentError
from agentstate.edges import key_spaces
from agentstate.catalog import named_keys
from agentstate.keys import validate_id
from agentstate.manifest import SessionManifest
from agentstate.ops.reports import ChunkInfo, GcReport, SessionDetail, SessionRow, dumps  # noqa: F401  (re-exported)
from agentstate.spec import ModelSpec
from agentstate.store import StateStore, StoreStats

SPEC_FILE = SPEC
"""Where a data directory records its ModelSpec (`agentstate.datadir`)."""


class Progress(Protocol):
    """Where long operations report progress (the CLI draws a rich bar; library callers pass nothing)."""

    def start(self, description: str, total: int) -> None: ...

    def advance(self, n: int = 1) -> None: ...


class _Quiet:
    def start(self, description: str, total: int) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass


QUIET: Progress = _Quiet()


# -- opening a data directory (its layout and records: `agentstate.datadir`) -----------------------


def resolve_spec(path: Path, spec_file: Path | None) -> ModelSpec:
    """The spec to open `path` with: `spec_file`, else the recorded one; a given one must be the
    recorded one (SpecMismatchError naming the fields that differ)."""
    given = read_spec_file(spec_file) if spec_file is not None else None
    return directory_spec(path, given, source=f"the spec of {spec_file}")


@contextlib.asynccontextmanager
async def open_store(
    path: Path, *, tenant: str | None = None, spec_file: Path | None = None, spec: ModelSpec | None = None,
    create: bool = False, read_only: bool = False,
) -> AsyncIterator[StateStore]:  # fmt: skip
    """Open an existing data directory (or create one, for import) under its recorded spec and
    its recorded config (the tiers its writer used; env vars on top), as the admin CLI does.

    `read_only` shares the directory's lock with other readers (ls, inspect, stats, verify,
    export); the write commands take it alone, so they refuse a directory a server holds.
    """
    from agentstate.configured import load, open_configured

    if tenant is not None:
        validate_id(tenant, "tenant")
    loaded = load(path=path, tenant=tenant)
    async with open_configured(
        loaded, spec_file=spec_file, spec=spec, create=create, read_only=read_only, writer="agentstate.ops"
    ) as store:  # fmt: skip
        yield store


# -- ls / inspect ------------------------------------------------------------------------------------


def stored_size(spec: ModelSpec, tokens: int) -> int:
    return codec.encoded_size(tokens * spec.token_bytes)


def state_size(spec: ModelSpec, m: SessionManifest) -> int:
    """Stored bytes of a hybrid session's state (0 for a dense one)."""
    if m.state_key is None or spec.state is None:
        return 0
    return codec.encoded_size(spec.state.nbytes_at(m.num_tokens))


def _row(store: StateStore, m: SessionManifest) -> SessionRow:
    size = len(m.chunk_keys) * stored_size(store.spec, m.chunk_tokens)
    size += stored_size(store.spec, m.tail_tokens) if m.tail_key else 0
    size += state_size(store.spec, m)
    return SessionRow(
        session_id=m.session_id, tenant=m.tenant, version=m.version, tokens=m.num_tokens, chunks=len(m.chunk_keys),
        tail_tokens=m.tail_tokens, bytes=size, parent=m.parent, pinned=m.pinned, ttl_seconds=m.ttl_seconds,
        created_at=m.created_at, updated_at=m.updated_at, guaranteed_until=m.guaranteed_until,
        expires_at=m.expires_at(), last_hit_at=m.last_hit_at, lossy=m.lossy,
    )  # fmt: skip


async def list_sessions(store: StateStore) -> list[SessionRow]:
    """This tenant's live sessions (expired ones are gc's), sorted by id."""
    return sorted([_row(store, m) async for m in store.sessions()], key=lambda r: r.session_id)


async def other_tenants(store: StateStore) -> dict[str, int]:
    """Live sessions per tenant other than the store's own: where a listing that found none should look."""
    counts: dict[str, int] = {}
    for m in await store.catalog.manifests(None):
        if m.tenant != store.tenant and not m.expired():
            counts[m.tenant] = counts.get(m.tenant, 0) + 1
    return dict(sorted(counts.items()))


async def inspect_session(store: StateStore, session_id: str) -> SessionDetail:
    """A session's manifest, and for every chunk: its key, size and which tiers hold it."""
    m = await store.session(session_id)
    keys = named_keys(m)
    await store.chunks.discover(keys)
    chunks = []
    for i, key in enumerate(keys):
        kind = "state" if key == m.state_key else "tail" if i == len(m.chunk_keys) else "chunk"
        holders = store.chunks.where(key)
        size = (await store.chunks.backend(holders[0]).sizes([key]))[0] if holders else 0
        info = ChunkInfo(
            index=i, kind=kind, key=key, first_token=m.num_tokens if kind == "state" else i * m.chunk_tokens,
            tokens={"state": 0, "tail": m.tail_tokens}.get(kind, m.chunk_tokens), bytes=size, tiers=holders,
        )  # fmt: skip
        chunks.append(info)
    hold = store.chunks.held(f"hint:{m.tenant}/{m.session_id}")
    return SessionDetail(
        session_id=m.session_id, tenant=m.tenant, fingerprint=m.fingerprint, version=m.version, parent=m.parent,
        chunk_tokens=m.chunk_tokens, num_tokens=m.num_tokens, tail_tokens=m.tail_tokens, tail_key=m.tail_key,
        state_key=m.state_key, created_at=m.created_at, updated_at=m.updated_at, ttl_seconds=m.ttl_seconds, pinned=m.pinned, state=m.state,
        bytes=sum(c.bytes for c in chunks), missing=sum(not c.tiers for c in chunks), chunks=chunks,
        guaranteed_until=m.guaranteed_until, expires_at=m.expires_at(), last_hit_at=m.last_hit_at,
        hint=None if hold is None else hold.kind,
        hint_held_until=None if hold is None else time.time() + (hold.until - time.monotonic()),
        usage=await store.usage(session_id), lossy=m.lossy,
        lossy_tiers=[t.tier_name for t in store.config.tier_list() if t.lossy],
        records=len(await store.record_names(session_id)),
    )  # fmt: skip


# -- stats / gc / evict ------------------------------------------------------------------------------


class TierInfo(BaseModel):
    name: str
    record: bool
    durable: bool
    remote: bool
    capacity_bytes: int | None
    """the cache budget this store evicts to (None: unbounded, or the backend's own limit)"""
    chunks: int
    """keys this process accounts to the tier (a host tier is empty in a freshly started process)"""


class StatsReport(BaseModel):
    """A store's stats; plus, for each key space an adapter declares (`agentstate.edges`), how many of its
    keys of this spec the record tier holds, under the field the adapter names (an engine's rank
    directory may hold its pages, not sessions)."""

    model_config = ConfigDict(extra="allow")
    path: str
    spec: ModelSpec
    chunk_tokens: int
    store: StoreStats
    tiers: list[TierInfo]
    tenant_sessions: int
    session_tokens: int
    unique_chunks: int
    tails: int
    logical_bytes: int
    """what the tenant's sessions would take stored one by one"""
    unique_bytes: int
    """what they take with shared chunks stored once"""


async def stats(store: StateStore) -> StatsReport:
    found = [m async for m in store.sessions()]
    chunks = {k: m.chunk_tokens for m in found for k in m.chunk_keys}
    tails = [m for m in found if m.tail_key]
    unique = sum(stored_size(store.spec, n) for n in chunks.values())
    unique += sum(stored_size(store.spec, m.tail_tokens) for m in tails)
    unique += sum(state_size(store.spec, m) for m in {m.state_key: m for m in found if m.state_key}.values())
    record = store.chunks.record_tier
    spaces = {s.report: len(await store.chunks.scan(record, f"{s.prefix}{store.fingerprint}/")) for s in key_spaces()}
    figures = await store.stats()
    stored = {t.name: t.items for t in figures.tiers}
    return StatsReport(
        path=str(store.config.path), spec=store.spec, chunk_tokens=store.chunk_tokens, store=figures,
        tiers=[_tier_info(t, stored) for t in store.chunks.tier_info()], tenant_sessions=len(found),
        session_tokens=sum(m.num_tokens for m in found), unique_chunks=len(chunks), tails=len(tails),
        logical_bytes=sum(_row(store, m).bytes for m in found), unique_bytes=unique,
        **spaces,
    )  # fmt: skip


def _tier_info(tier: ChunkTierInfo, stored: dict[str, int]) -> TierInfo:
    """A lazy tier's chunks are what its backend stores (the index knows only what was asked for
    since open); the others', what the index knows."""
    return TierInfo(
        name=tier.name, record=tier.record, durable=tier.durable, remote=tier.remote,
        capacity_bytes=tier.capacity_bytes, chunks=stored.get(tier.name, tier.chunks) if tier.lazy else tier.chunks,
    )  # fmt: skip


async def gc(store: StateStore, progress: Progress = QUIET) -> GcReport:
    """A whole gc pass, in steps (`gc_step_keys` each) shown as they go; a shared catalog's gc is
    one mark and sweep."""
    if not store.catalog.shared:
        local = [t.name for t in store.chunks.tier_info() if t.durable and not t.remote]
        progress.start("gc: sweeping stored keys", sum(t.items for t in await store.chunks.stats() if t.name in local))
    return GcReport(removed=await store.gc(lambda step: progress.advance(step.keys)))


EvictReport = EvictResult


async def evict(
    store: StateStore, tier_name: str, *, budget_bytes: int | None = None, sessions: Sequence[str] = ()
) -> EvictReport:
    """Drop cached copies from a cache tier: oldest first until it uses at most `budget_bytes`
    (0: all), or every chunk and tail of `sessions`. A chunk no lower tier holds is written down
    before it goes (the chunk layer's eviction), so no session loses data; pinned chunks stay.

    Host and device tiers are memory of the process that opened the store: in a separate CLI
    process they are empty, so this matters for persistent cache tiers (a file tier over LMDB) or
    when called inside a serving process.
    """
    if (budget_bytes is None) == (not sessions):
        raise InvalidArgumentError("evict needs either a byte budget or sessions, not both")
    if budget_bytes is not None and budget_bytes < 0:
        raise InvalidArgumentError(f"byte budget must be >= 0, got {budget_bytes}")
    wanted = [k for sid in sessions for k in named_keys(await store.session(sid))]
    return await store.chunks.evict(tier_name, budget_bytes=budget_bytes, keys=wanted if sessions else None)
