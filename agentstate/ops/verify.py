"""`agentstate verify`: every stored chunk and tail, in every tier, checked by the codec.

A store's own reads already treat a corrupt chunk as a miss (and drop it); verify finds damage
before a resume meets it, says which sessions it costs, and with `repair` drops the bad copies
so they read as misses and the next snapshot of each session rewrites them.
"""

from __future__ import annotations

from pydantic import BaseModel

from agentstate import codec
from agentstate.chunks import batches
from agentstate.edges import key_spaces
from agentstate.errors import AgentStateError, CorruptDataError
from agentstate.keys import CHUNK_PREFIX, TAIL_PREFIX, is_state_key
from agentstate.catalog import named_keys
from agentstate.ops.admin import QUIET, Progress, stored_size
from agentstate.spec import ModelSpec
from agentstate.store import StateStore


class BadChunk(BaseModel):
    tier: str
    key: str
    problem: str


class TierCheck(BaseModel):
    tier: str
    checked: int
    ok: int
    corrupt: int
    missing: int
    """record tier: keys a live manifest names that it lacks; other tiers: keys gone while listed"""
    repaired: int
    """bad copies dropped, plus (record tier) lost copies written back from a good copy elsewhere"""
    pages: int = 0
    """of `checked`, keys an adapter stores outside the catalog (`agentstate.edges`: an engine's own pages;
    no manifest names them: never missing, never orphans)"""


class AffectedSession(BaseModel):
    tenant: str
    session_id: str
    tokens: int
    restorable_tokens: int
    """how many leading tokens a resume restores now; the engine recomputes the rest"""
    bad_keys: list[str]


class VerifyReport(BaseModel):
    clean: bool
    repaired: bool
    tiers: list[TierCheck]
    corrupt: list[BadChunk]
    missing: list[str]
    affected: list[AffectedSession]
    orphans: list[str] = []
    """record-tier chunks and tails no manifest and no shared prefix names (a crash between a
    commit and its deletes leaves a few; gc sweeps them)"""
    catalog_lost: bool = False
    """the record tier holds chunks but the catalog names none of them: the catalog is missing,
    empty or another directory's. Not clean: gc would delete every chunk, so restore it first"""
    catalog_created: bool = False
    """this open found no catalog and made an empty one"""


async def verify(store: StateStore, *, repair: bool = False, progress: Progress = QUIET) -> VerifyReport:
    """Check every stored chunk, tail and adapter page of this spec, in every tier, with the codec (magic,
    version, fingerprint, dtype, shape, length, xxh3 of the payload seeded with the key, so a valid
    value stored under another key is reported too; no unpickling: the codec only reads raw bytes).
    `repair=True` deletes corrupt copies, so reads see misses, and writes a good copy found in
    another tier back into the record tier, so no durable copy stays lost; what no tier holds
    intact, the next snapshot of its session rewrites. Sessions of every tenant are checked, since
    tenants share the tiers. What the record tier holds and nothing names is reported as orphans;
    when that is all of it (the catalog is missing or empty), the report is not clean.
    """
    every = [m for m in await store.catalog.manifests(None) if m.fingerprint == store.fingerprint]
    manifests = [m for m in every if not m.expired()]
    expected: dict[str, int] = {}
    for m in manifests:
        expected.update(dict.fromkeys(m.chunk_keys, m.chunk_tokens))
        if m.tail_key:
            expected[m.tail_key] = m.tail_tokens
        if m.state_key and store.spec.state is not None:
            expected[m.state_key] = store.spec.state.nbytes_at(m.num_tokens)
    good: set[str] = set()
    checks: list[TierCheck] = []
    corrupt: list[BadChunk] = []
    missing: list[str] = []
    record_lacks: list[str] = []
    record_held: list[str] = []
    for tier in store.chunks.tier_names:
        prefixes = (f"{CHUNK_PREFIX}{store.fingerprint}/", f"{TAIL_PREFIX}{store.fingerprint}/")
        listed = [k for p in prefixes for k in await store.chunks.scan(tier, p)]
        pages = [k for s in key_spaces() for k in await store.chunks.scan(tier, f"{s.prefix}{store.fingerprint}/")]
        listed += pages
        progress.start(f"verify {tier}", len(listed))
        status = await _check_tier(store, tier, listed, expected, progress)
        bad = [BadChunk(tier=tier, key=k, problem=s) for k, s in status.items() if s not in ("ok", "missing")]
        gone = [k for k, s in status.items() if s == "missing"]
        if tier == store.chunks.record_tier:
            record_held = listed[: len(listed) - len(pages)]  # pages belong to an engine's index, not the catalog
            held = set(listed)
            gone += [k for k in expected if k not in held]
            record_lacks = [k for k in gone if k in expected]
            record_lacks += [b.key for b in bad if b.key in expected] if repair else []
        good.update(k for k, s in status.items() if s == "ok")
        if repair and bad:
            await store.chunks.delete([b.key for b in bad], [tier])
        corrupt += bad
        missing += [k for k in gone if k in expected]
        check = TierCheck(
            tier=tier, checked=len(listed), ok=sum(s == "ok" for s in status.values()), corrupt=len(bad),
            missing=len(gone), repaired=len(bad) if repair else 0, pages=len(pages),
        )  # fmt: skip
        checks.append(check)
    restored = await _restore_record(store, record_lacks, checks) if repair else set()
    orphans = await _orphans(store, record_held, {k for m in every for k in named_keys(m)})
    catalog_lost = bool(record_held) and len(orphans) == len(set(record_held))
    missing = [k for k in missing if k not in restored]
    affected = []
    for m in manifests:
        keys = named_keys(m)
        lost = [k for k in keys if k not in good]
        if lost:
            lead = next(i for i, k in enumerate(keys) if k not in good)
            if m.state_key:  # a hybrid session resumes whole or not at all
                lead = 0
            hit = AffectedSession(
                tenant=m.tenant, session_id=m.session_id, tokens=m.num_tokens,
                restorable_tokens=lead * m.chunk_tokens, bad_keys=lost,
            )  # fmt: skip
            affected.append(hit)
    return VerifyReport(
        clean=not corrupt and not missing and not catalog_lost, repaired=repair and bool(corrupt or restored),
        tiers=checks, corrupt=corrupt, missing=sorted(set(missing)),
        affected=sorted(affected, key=lambda a: (a.tenant, a.session_id)), orphans=orphans,
        catalog_lost=catalog_lost, catalog_created=store.catalog.created,
    )  # fmt: skip


async def _orphans(store: StateStore, held: list[str], named: set[str]) -> list[str]:
    """What the record tier holds that no manifest (expired ones included) names and nothing
    counts (a shared prefix's chunks are counted, not named)."""
    unnamed = sorted(set(held) - named)
    counts = await store.catalog.refcounts(unnamed) if unnamed else []
    return [k for k, n in zip(unnamed, counts) if n == 0]


async def _check_tier(
    store: StateStore, tier: str, keys: list[str], expected: dict[str, int], progress: Progress
) -> dict[str, str]:
    """key -> "ok" | "missing" | the codec's complaint, checked in place in the backend's memory."""
    status = dict.fromkeys(keys, "missing")
    spec = store.spec
    full = stored_size(spec, store.chunk_tokens)
    for run in batches([full] * len(keys), store.config.batch_bytes):
        batch = [keys[i] for i in run]

        def sink(j: int, view: memoryview, batch: list[str] = batch) -> None:
            key = batch[j]
            status[key] = check_chunk(view, _spec_of(spec, key), expected.get(key), key)

        await store.chunks.read_raw(tier, batch, sink)
        progress.advance(len(batch))
    await _name_misplaced(store, tier, status, spec)
    return status


_MISPLACED_TRIES = 1024
"""checksum tries per tier spent naming the key a misplaced value belongs to (report detail only)"""


async def _name_misplaced(store: StateStore, tier: str, status: dict[str, str], spec: ModelSpec) -> None:
    """A value whose checksum fails may be another key's valid value (swapped, or copied over):
    say whose, trying the other failing keys first, then the intact ones, within a bounded budget.
    What no try explains keeps the codec's complaint (damaged, or stored under another key)."""
    bad = [k for k, s in status.items() if "checksum mismatch" in s]
    candidates = bad + [k for k, s in status.items() if s == "ok"]
    budget = _MISPLACED_TRIES
    for key in bad:
        value = await store.chunks.raw_value(tier, key) if budget > 0 else None
        for other in candidates:
            if value is None or budget <= 0:
                break
            if other == key:
                continue
            budget -= 1
            if check_chunk(value, _spec_of(spec, other), None, other) == "ok":
                status[key] = f"misplaced: stored under the wrong key, a valid value of {other}"
                break


def _spec_of(spec: ModelSpec, key: str) -> ModelSpec:
    """The spec whose value `key` holds: a hybrid model's state (`.state` keys) is its `state_spec`'s."""
    if is_state_key(key) and spec.state_spec is not None:
        return spec.state_spec
    return spec


def check_chunk(buf: codec.Buffer, spec: ModelSpec, tokens: int | None, key: str) -> str:
    """Return "ok", or why `buf` is not a valid chunk of `spec` stored under `key` (`tokens` long,
    when a manifest says): a valid value of another key (swapped, copied over) is not ok."""
    try:
        shape = spec.kv_shape(tokens) if tokens is not None else None
        got = codec.check(buf, key=key, fingerprint=spec.fingerprint, dtype=spec.dtype, shape=shape)  # no torch
        layers, planes, _, heads, dim = spec.kv_shape(0)
        if shape is None and (got[:2], got[3:]) != ((layers, planes), (heads, dim)):
            raise CorruptDataError(f"chunk shape {got} is not one of this spec")
    except AgentStateError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


async def _restore_record(store: StateStore, missing: list[str], checks: list[TierCheck]) -> set[str]:
    """Write back into the record tier what it lacks but another tier holds intact (checked again
    by the codec on the way: a copy is only trusted as it is read)."""
    record = store.chunks.record_tier
    others = [t for t in store.chunks.tier_names if t != record]
    back: set[str] = set()
    for key in dict.fromkeys(missing):
        for tier in others:
            value = await store.chunks.raw_value(tier, key)
            if value is not None and check_chunk(value, store.spec, None, key) == "ok":
                with store.chunks.pinned([key]):
                    await store.chunks.put_values([key], [value], tiers=[record])
                back.add(key)
                break
    for c in checks:
        if c.tier == record:
            c.repaired += len(back)
            c.missing -= len(back)
    return back

