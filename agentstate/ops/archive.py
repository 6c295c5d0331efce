"""`agentstate export` / `import`: a portable archive of sessions.

An archive is a plain, uncompressed tar (inspectable with `tar tvf`) holding

- `chunks/NNNNNN.kv`: one codec frame per distinct chunk or tail (magic, fingerprint, dtype, shape,
  xxh3 of the payload), each stored once however many exported sessions name it, and bound to its
  member name as its key (so frames swapped between members fail their checksum);
- `index.json`, written last: format and version, the ModelSpec and its fingerprint, every
  session (tenant, id, tokens, state, TTL, pin, which members hold its KV), and the size and xxh3
  of every member.

Nothing in an archive is ever unpickled or extracted to the filesystem: members are read as bytes
and checked by the codec. Import checks the whole archive (member checksums, every chunk decoded
under the target's spec, token counts, ids, conflicts) before it writes anything, then stores each
session as `snapshot` does, so keys are rebuilt for the target (another tenant, another chunk size)
and shared chunks are deduplicated there as anywhere else.

Import is all-or-nothing, in three steps:

1. Check. Every session is checked exactly as `snapshot` would check it, with snapshot's own
   checks (`agentstate.snapshots.check_snapshot`: ids, token ids >= 0 and < 2**63, state as JSON only
   (no NaN, bounded nesting), options; `snapshot_manifest`), plus what an archive
   adds (member checksums, each chunk decoded under the target's spec and token count, duplicates,
   sessions present in the target unless `force`). A session snapshot would refuse is a
   CorruptDataError here, before anything is written.
2. Stage. Under the sessions' locks, with every key the import names pinned (and every key of
   the versions it replaces), each session's chunks that the record tier lacks and its tail are
   written durably, as `snapshot` writes them. Nothing references them yet. Before each session,
   room for undoing it is held on the disk (`agentstate.reserve`: an unnamed, preallocated
   file per filesystem of the data directory and its local tiers), so a disk that fills refuses
   the write while the undo's room is still there.
3. Commit. Every manifest in one catalog transaction (`Catalog.commit_all`), each a
   compare-and-set on the version the check saw. The local catalog (LMDB) commits all or none,
   whatever fails, a full disk or a crash included; then the room is given back and the replaced
   versions' chunks that nothing names any more are collected.

If anything fails before the commit lands (a full disk's CapacityError, a session changed
meanwhile, an outage, a cancellation), the held room is given back and the chunks this import
wrote are collected from every tier (a chunk something else names by then stays), so the target
is left as it was: the same sessions and versions, the same keys in every tier. A crash (SIGKILL,
power loss) before the commit leaves no session and no held room; the staged chunks are
unreferenced, and `gc` removes them.

What this does not cover: a shared (Redis) catalog has no multi-session transaction, so there
`commit_all` commits one session after another and, if one fails, puts back the ones committed
(best effort, see `Catalog.commit_all`); a crash meanwhile leaves those committed so far, and
staged chunks are left to gc's mark and sweep. The CLI's `import` also undoes a new data
directory: when `--path` held no data directory before (no catalog, no `spec.json`), a failed
import removes it (or, if the directory existed, what the import created in it), so no data
without a `spec.json` is left.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import tarfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentstate import codec, model_state
from agentstate.catalog import named_keys
from agentstate.errors import (
    AgentStateError,
    ConflictError,
    CorruptDataError,
    InvalidArgumentError,
    KVShapeError,
    NotFoundError,
    SessionNotFoundError,
    SpecMismatchError,
)
from agentstate.keys import validate_id
from agentstate.manifest import SessionManifest, now
from agentstate.datadir import is_store, spec_differences
from agentstate.ops.admin import QUIET, Progress
from agentstate.records import frame, validate_name
from agentstate.reserve import Reserve, local_dirs
from agentstate.snapshots import check_snapshot, hold_retained, snapshot_manifest, write_session
from agentstate.spec import ModelSpec
from agentstate.store import StateStore

FORMAT: Literal["agentstate-archive"] = "agentstate-archive"
FORMAT_VERSION = 2  # 2: codec frames of format 2, bound to their member names
INDEX = "index.json"
_MAX_INDEX_BYTES = 1 << 30
log = logging.getLogger("agentstate.archive")


class Member(BaseModel):
    model_config = ConfigDict(extra="forbid")

    size: int = Field(ge=0)
    xxh3: str = Field(pattern=r"^[0-9a-f]{16}$")


class ArchivedSession(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str
    session_id: str
    tokens: list[int]
    state: dict[str, Any]
    ttl_seconds: float | None = Field(default=None, gt=0)
    guaranteed_until: float | None = Field(default=None, gt=0)
    pinned: bool = False
    parent: str | None = None
    chunk_tokens: int = Field(gt=0)
    chunks: list[str]
    """members holding the session's full chunks, in token order"""
    tail: str | None = None
    """member holding the tokens after the last full chunk"""
    records: dict[str, str] = Field(default_factory=dict)
    """the session's records (`agentstate.records`: a framework's state), name -> member"""
    model_state: str | None = None
    """a hybrid model's session: the member holding its state after the last token (a codec frame
    of the spec's `state_spec`, the layout's tensors as raw bytes)"""


class ArchiveIndex(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["agentstate-archive"]
    format_version: int
    created_at: float
    spec: ModelSpec
    fingerprint: str
    sessions: list[ArchivedSession]
    members: dict[str, Member]


class ExportReport(BaseModel):
    archive: str
    sessions: int
    tokens: int
    chunks: int
    """distinct chunk and tail members written (shared chunks once)"""
    bytes: int


class ImportReport(BaseModel):
    archive: str
    sessions: int
    tokens: int
    replaced: int
    """sessions that existed in the target and were overwritten (`force`)"""


# -- export ------------------------------------------------------------------------------------------


async def export_sessions(
    store: StateStore, dest: Path, *, session_ids: Sequence[str] = (), all_tenants: bool = False,
    progress: Progress = QUIET,
) -> ExportReport:  # fmt: skip
    """Write the store's sessions (the ones named, or all of this tenant's, or of every tenant)
    to the archive `dest`, atomically (a temporary file renamed at the end).

    Each session is resumed, so every byte exported has passed its checksum; a session that cannot
    be restored completely (missing or corrupt chunks) stops the export with CorruptDataError
    naming it, since an archive that silently lost KV would be worse than none: run `verify`.
    """
    manifests, records_only = await _selected(store, session_ids, all_tenants)
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".partial")
    members: dict[str, Member] = {}
    by_key: dict[str, str] = {}
    archived: list[ArchivedSession] = []
    progress.start("export", sum(m.num_tokens for m in manifests))
    try:
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
            for m in manifests:
                result = await store.for_tenant(m.tenant).resume(m.session_id)
                if not result.complete or result.kv is None:
                    raise CorruptDataError(
                        f"session {m.tenant}/{m.session_id}: only {result.restored_tokens} of {m.num_tokens} "
                        "tokens restore (missing or corrupt chunks); run `agentstate verify` first"
                    )
                m, kv, ct = result.manifest, result.kv, result.manifest.chunk_tokens
                spans: list[tuple[str, int, int]] = [(k, i * ct, (i + 1) * ct) for i, k in enumerate(m.chunk_keys)]
                if m.tail_key:
                    spans.append((m.tail_key, len(m.chunk_keys) * ct, m.num_tokens))
                names = []
                for key, a, b in spans:
                    if key not in by_key:
                        by_key[key] = _add(tar, members, kv[:, :, a:b], store.fingerprint)
                    names.append(by_key[key])
                held = None
                if m.state_key:  # a hybrid model's: the KV without its state would resume wrong, so both or none
                    if result.model_state is None:
                        raise CorruptDataError(f"session {m.tenant}/{m.session_id}: its model state does not restore")
                    held = _add_state(tar, members, store.spec, result.model_state, m.num_tokens)
                entry = ArchivedSession(
                    tenant=m.tenant, session_id=m.session_id, tokens=m.tokens, state=m.state,
                    ttl_seconds=m.ttl_seconds, guaranteed_until=m.guaranteed_until, pinned=m.pinned, parent=m.parent,
                    chunk_tokens=ct, model_state=held,
                    chunks=names[: len(m.chunk_keys)], tail=names[len(m.chunk_keys)] if m.tail_key else None,
                )  # fmt: skip
                _add_records(tar, members, entry, await store.for_tenant(m.tenant).records(m.session_id))
                archived.append(entry)
                progress.advance(m.num_tokens)
            for owner, sid in records_only:  # a framework's thread with no KV yet: its records alone
                entry = ArchivedSession(tenant=owner, session_id=sid, tokens=[], state={},
                                        chunk_tokens=store.chunk_tokens, chunks=[])  # fmt: skip
                _add_records(tar, members, entry, await store.for_tenant(owner).records(sid))
                archived.append(entry)
            index = ArchiveIndex(
                format=FORMAT, format_version=FORMAT_VERSION, created_at=time.time(), spec=store.spec,
                fingerprint=store.fingerprint, sessions=archived, members=members,
            )  # fmt: skip
            _put(tar, INDEX, index.model_dump_json(indent=1).encode())
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)
    return ExportReport(
        archive=str(dest), sessions=len(archived), tokens=sum(len(s.tokens) for s in archived),
        chunks=len(members), bytes=dest.stat().st_size,
    )  # fmt: skip


async def _selected(
    store: StateStore, session_ids: Sequence[str], all_tenants: bool
) -> tuple[list[SessionManifest], list[tuple[str, str]]]:
    """The sessions to export: manifests, and (tenant, id) of sessions that have records and no
    manifest (a framework's thread whose KV was never stored)."""
    if session_ids and all_tenants:
        raise InvalidArgumentError("name sessions or pass all_tenants, not both")
    if session_ids:
        manifests, records_only = [], []
        for sid in dict.fromkeys(session_ids):
            try:
                manifests.append(await store.session(sid))
            except SessionNotFoundError:
                if not await store.record_names(sid):
                    raise
                records_only.append((store.tenant, sid))
        return manifests, records_only
    every = await store.catalog.manifests(None if all_tenants else store.tenant)
    live = [m for m in every if m.fingerprint == store.fingerprint and not m.expired()]
    named = {(m.tenant, m.session_id) for m in every}
    records_only = [k for k in await store.catalog.record_sessions(None if all_tenants else store.tenant)
                    if k not in named]  # fmt: skip
    return sorted(live, key=lambda m: (m.tenant, m.session_id)), sorted(records_only)


def _add_records(tar: tarfile.TarFile, members: dict[str, Member], entry: ArchivedSession, values: dict[str, bytes]) -> None:
    for rname, value in values.items():
        entry.records[rname] = member = f"records/{len(members):06d}.bin"
        _put(tar, member, value)
        members[member] = Member(size=len(value), xxh3=xxhash.xxh3_64_hexdigest(value))


def _add(tar: tarfile.TarFile, members: dict[str, Member], kv: torch.Tensor, fingerprint: str) -> str:
    """Write `kv` as the next chunk member, its frame bound to the member's name (its key here)."""
    name = f"chunks/{len(members):06d}.kv"
    data = codec.encode(kv, fingerprint, key=name)
    _put(tar, name, data)
    members[name] = Member(size=len(data), xxh3=xxhash.xxh3_64_hexdigest(data))
    return name


def _add_state(
    tar: tarfile.TarFile, members: dict[str, Member], spec: ModelSpec, tensors: dict[str, torch.Tensor], position: int
) -> str:
    """Write a hybrid session's state as the next member: its packed bytes, a frame of the state spec."""
    assert spec.state_spec is not None
    name = f"states/{len(members):06d}.state"
    data = codec.encode(model_state.pack(spec, tensors, position), spec.state_spec.fingerprint, key=name)
    _put(tar, name, data)
    members[name] = Member(size=len(data), xxh3=xxhash.xxh3_64_hexdigest(data))
    return name


def _put(tar: tarfile.TarFile, name: str, data: codec.Buffer) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
    tar.addfile(info, io.BytesIO(data))


# -- import ------------------------------------------------------------------------------------------


async def import_sessions(
    store: StateStore, source: Path, *, tenant: str | None = None, force: bool = False, progress: Progress = QUIET
) -> ImportReport:
    """Store every session of the archive `source` in `store`: in its recorded tenant, or all in
    `tenant` when given. All or nothing (see the module doc): nothing is written until the whole
    archive checks out, every session commits in one catalog transaction, and a failure before
    that commit lands removes every chunk the import wrote.

    - SpecMismatchError: the archive holds KV of another model spec than the store serves, or a
      session to replace was stored for another spec (`force=True` replaces it);
    - CorruptDataError: not an agentstate archive, a member damaged, missing or not a valid chunk
      of the spec, token counts that disagree with the chunks, a session `snapshot` would refuse
      (token ids < 0 or >= 2**63, state that is not JSON or nested too deep, bad ids or options);
    - ConflictError: a session already exists in the target (`force=True` overwrites it), or one
      changed while the import wrote;
    - CapacityError: a disk filled (the undo's room included), after the undo;
    - whatever else stopped the writing (an outage, a cancellation), after the undo.
    """
    source = Path(source)
    with _open(source) as tar:
        index = _read_index(tar, source)
        if index.fingerprint != store.fingerprint:
            raise SpecMismatchError(
                f"{source} holds KV of another spec than this store's (archive != store):"
                f" {', '.join(spec_differences(index.spec, store.spec))}"
            )
        targets = [(tenant or s.tenant, s) for s in index.sessions]
        plans = await _check(store, tar, index, targets, force=force, progress=progress)
        progress.start("import", sum(len(s.tokens) for s in index.sessions))
        async with contextlib.AsyncExitStack() as locks:  # writers of these sessions wait (sorted: no deadlock)
            for p in sorted(plans, key=lambda p: (p.owner, p.session.session_id)):
                await locks.enter_async_context(store.for_tenant(p.owner).session_lock(p.session.session_id))
            await _store_all(store, tar, index, plans, progress)
    return ImportReport(
        archive=str(source), sessions=len(plans), tokens=sum(len(p.session.tokens) for p in plans),
        replaced=sum(p.prev is not None and not p.prev.expired() for p in plans),
    )  # fmt: skip


_UNDO_BASE_BYTES = 1 << 20
"""Room the undo needs whatever it deletes: LMDB's transaction, its free list, slack."""
_UNDO_KEY_BYTES = 8 << 10
"""Room the undo needs per chunk it deletes: LMDB copies the leaf page naming it (4 KiB) and
shares of the branch pages above; the page numbers it frees go into LMDB's free list."""


@dataclass
class _Plan:
    """One archived session to store, and what the target held under its name when checked."""

    owner: str
    session: ArchivedSession
    prev: SessionManifest | None
    """the target's manifest (expired ones too) when checked: what the commit expects to replace"""
    manifest: SessionManifest | None
    """the manifest to commit (its keys and tail for the target's tenant and chunk size); None for
    a session archived with records only (no KV: nothing to commit but its records)"""
    usage: dict[str, int] = field(default_factory=dict)
    """what `snapshot` would count for it"""
    records: dict[str, bytes] = field(default_factory=dict)
    """the session's records, checked"""
    model_state: torch.Tensor | None = None
    """a hybrid model's session: its state, packed, checked"""


async def _store_all(
    store: StateStore, tar: _Archive, index: ArchiveIndex, plans: list[_Plan], progress: Progress
) -> None:
    """Stage every session's chunks (pinned, unreferenced), then commit every manifest in one
    catalog transaction. Until that commit nothing names what was staged; if anything fails before
    it lands, the room held for the undo is given back and the chunks this import wrote are
    collected (a chunk something else names by then stays)."""
    kv = [p for p in plans if p.manifest is not None]
    named = [k for p in kv for k in named_keys(p.manifest)]  # type: ignore[arg-type]
    kept = [k for p in plans if p.prev is not None for k in named_keys(p.prev)]
    written: list[str] = []
    with Reserve(local_dirs(store.config)) as reserve:  # CapacityError here: nothing written yet
        try:
            with store.chunks.pinned([*named, *kept]):  # replaced versions stay stored until the commit stands
                reserve.grow(_UNDO_BASE_BYTES)
                for p in kv:
                    await _stage(store, tar, index, p, reserve, written)
                    progress.advance(len(p.session.tokens))
                stamp = now()
                manifests = [p.manifest.model_copy(update={"updated_at": stamp}) for p in kv]  # type: ignore[union-attr]
                replaced = await _put_records(store, plans)
                committed = await store.catalog.commit_all([(m, p.prev) for m, p in zip(manifests, kv)])
        except BaseException as exc:
            reserve.release()  # the room the undo's deletes need
            await _undo(store, written, exc, locals().get("replaced"))
            raise
    for p, m in zip(kv, manifests):
        store.usage_log.add(p.owner, m.session_id, p.usage)
        hold_retained(store.chunks, m)
    old_tails = [c.old_tail for c, m in zip(committed, manifests) if c.old_tail and c.old_tail != m.tail_key]
    try:  # the import stands: what it replaced goes now, or (a full disk) to the next gc
        await store.chunks.collect([k for c in committed for k in c.zeroed], store.catalog.refcounts)
        if old_tails:
            await store.chunks.delete(old_tails)
    except AgentStateError as exc:
        log.warning("import committed; the chunks of the versions it replaced are left for gc: %s", exc)


async def _stage(
    store: StateStore, tar: _Archive, index: ArchiveIndex, p: _Plan, reserve: Reserve, written: list[str]
) -> None:
    """Write the chunks of one session the record tier lacks, and its tail, as `snapshot` does
    (keys pinned by the caller); `written` gets their keys before they are written."""
    s, m = p.session, p.manifest
    assert m is not None
    kv = torch.empty(store.spec.kv_shape(len(s.tokens)), dtype=store.spec.torch_dtype)
    for i, name in enumerate([*s.chunks, *([s.tail] if s.tail else [])]):
        a = i * s.chunk_tokens
        b = min(a + s.chunk_tokens, len(s.tokens))
        codec.decode_into(_member(tar, name, index), kv[:, :, a:b], key=name, fingerprint=store.fingerprint)

    def before_write(keys: list[str]) -> None:
        reserve.grow(_UNDO_KEY_BYTES * len(keys))
        written.extend(keys)

    p.usage = (await write_session(store.chunks, m, kv, before_write, p.model_state, store.spec)).usage(m)


_Replaced = list[tuple[str, str, dict[str, bytes], int]]
"""(tenant, session id, its records before the import, the version the import commits)"""


async def _put_records(store: StateStore, plans: list[_Plan]) -> _Replaced:
    """Replace each imported session's records with the archive's, right before the commit; what
    each held before, for the undo (records name no chunks: they go first, and come back on failure)."""
    before: _Replaced = []
    for p in plans:
        sid = p.session.session_id
        old = dict(await store.catalog.records(p.owner, sid))
        # records-only sessions commit no manifest: undone whenever the import fails (version -1)
        before.append((p.owner, sid, old, p.manifest.version if p.manifest is not None else -1))
        await store.catalog.remove_records(p.owner, sid)
        where = f"{p.owner}/{sid}"
        await store.catalog.put_records(p.owner, sid, {n: frame(where, n, v) for n, v in p.records.items()})
    return before


async def _undo(
    store: StateStore, written: list[str], exc: BaseException,
    records: _Replaced | None = None,
) -> None:  # fmt: skip
    """Collect the chunks a failed import wrote, from every tier: those nothing references, and put
    back the records it replaced. (A cancellation that arrives while the catalog's thread commits
    can leave the commit landed: then every session stands, whole, and references its chunks,
    which stay.) A failure here is logged and noted on `exc`: what is left is unreferenced, for gc."""
    try:
        for owner, sid, old, version in records or []:
            if await store.catalog.version(owner, sid) != version:  # its commit did not land
                await store.catalog.remove_records(owner, sid)
                await store.catalog.put_records(owner, sid, old)
        await store.chunks.collect(written, store.catalog.refcounts)
    except Exception as undo_exc:  # noqa: BLE001 - the import's own error is the one to raise
        log.error("import undo failed, %d chunks are left for gc: %s", len(written), undo_exc)
        note = getattr(exc, "add_note", None)  # Python >= 3.11
        if note is not None:
            note(f"import could not remove the {len(written)} chunks it wrote ({type(undo_exc).__name__}: {undo_exc})")


async def _check(
    store: StateStore, tar: _Archive, index: ArchiveIndex, targets: list[tuple[str, ArchivedSession]],
    *, force: bool, progress: Progress,
) -> list[_Plan]:  # fmt: skip
    """Every check import makes, before anything is written; each session as `snapshot` checks it."""
    seen: set[tuple[str, str]] = set()
    tokens_of: dict[str, int] = {}
    plans: list[_Plan] = []
    for owner, s in targets:
        try:
            validate_id(owner, "tenant")
            validate_id(s.session_id)
        except InvalidArgumentError as exc:
            raise CorruptDataError(f"archive names an invalid session: {exc}") from None
        if (owner, s.session_id) in seen:
            raise CorruptDataError(f"archive holds session {owner}/{s.session_id} twice")
        seen.add((owner, s.session_id))
        if not s.tokens and not s.chunks and s.tail is None and s.records:  # records, no KV yet
            prev = await store.catalog.get(owner, s.session_id)
            there = (prev is not None and not prev.expired()) or await store.catalog.record_names(owner, s.session_id)
            if there and not force:
                raise ConflictError(f"session {owner}/{s.session_id} exists in the target; pass --force to overwrite it")
            plans.append(_Plan(owner, s, prev, None, records=_checked_records(store, tar, index, owner, s)))
            continue
        if not s.tokens or len(s.chunks) != len(s.tokens) // s.chunk_tokens:
            raise CorruptDataError(f"session {s.session_id}: {len(s.chunks)} chunks for {len(s.tokens)} tokens")
        if (s.tail is not None) != (len(s.tokens) % s.chunk_tokens > 0):
            raise CorruptDataError(f"session {s.session_id}: tail member does not match its token count")
        for name in s.chunks:
            _expect(tokens_of, name, s.chunk_tokens)
        if s.tail:
            _expect(tokens_of, s.tail, len(s.tokens) % s.chunk_tokens)
        prev = await store.catalog.get(owner, s.session_id)
        tensors = _checked_state(store, tar, index, s)
        manifest = _as_snapshot(store.for_tenant(owner), s, prev, force=force, tensors=tensors)
        if prev is not None and not force:
            if prev.fingerprint != store.fingerprint:
                raise SpecMismatchError(
                    f"session {owner}/{s.session_id} in the target holds state of spec {prev.fingerprint}; "
                    "pass --force to replace it"
                )
            if not prev.expired():
                raise ConflictError(
                    f"session {owner}/{s.session_id} exists in the target; pass --force to overwrite it"
                )
        if prev is None and not force and await store.catalog.records(owner, s.session_id):
            raise ConflictError(
                f"session {owner}/{s.session_id} has records in the target; pass --force to overwrite it"
            )
        plans.append(_Plan(owner, s, prev, manifest, records=_checked_records(store, tar, index, owner, s),
                           model_state=None if tensors is None else model_state.pack(store.spec, tensors, len(s.tokens))))
    progress.start("check archive", len(tokens_of))
    for name, tokens in tokens_of.items():
        buf = _member(tar, name, index)
        try:
            codec.decode(buf, key=name, fingerprint=store.fingerprint, dtype=store.spec.torch_dtype,
                         shape=store.spec.kv_shape(tokens))  # fmt: skip
        except AgentStateError as exc:
            raise CorruptDataError(f"archive member {name} is not a valid chunk: {exc}") from None
        progress.advance()
    return plans


def _checked_records(
    store: StateStore, tar: _Archive, index: ArchiveIndex, owner: str, s: ArchivedSession
) -> dict[str, bytes]:
    """An archived session's records, each name and size checked and each member's checksum."""
    out = {}
    for rname, member in s.records.items():
        try:
            validate_name(rname)
        except InvalidArgumentError as exc:
            raise CorruptDataError(f"archive session {owner}/{s.session_id}: {exc}") from None
        if index.members.get(member, Member(size=0, xxh3="0" * 16)).size > store.config.max_record_bytes:
            raise CorruptDataError(f"archive record {rname!r} of {s.session_id} is over max_record_bytes")
        out[rname] = _member(tar, member, index)
    return out


def _checked_state(store: StateStore, tar: _Archive, index: ArchiveIndex, s: ArchivedSession) -> dict[str, torch.Tensor] | None:
    """A hybrid session's state from its member, checked (checksum, bound to its member name, the
    state spec's fingerprint, the layout's size after its tokens); None for a dense model's session.
    CorruptDataError when a hybrid spec's session has none, or a dense one's names one."""
    spec = store.spec
    if (s.model_state is None) != (spec.state_spec is None):
        raise CorruptDataError(
            f"archive session {s.session_id}: " + ("no model state for a hybrid model's session" if s.model_state is None
                                                   else "a model state for a model that has none")
        )  # fmt: skip
    if s.model_state is None or spec.state_spec is None or spec.state is None:
        return None
    size = spec.state.nbytes_at(len(s.tokens))
    try:
        payload = codec.decode(_member(tar, s.model_state, index), key=s.model_state,
                               fingerprint=spec.state_spec.fingerprint, dtype=spec.state_spec.torch_dtype,
                               shape=spec.state_spec.kv_shape(size))  # fmt: skip
        return model_state.unpack(spec, payload.clone(), len(s.tokens))
    except AgentStateError as exc:
        raise CorruptDataError(f"archive member {s.model_state} is not a valid model state: {exc}") from None


def _as_snapshot(
    scoped: StateStore, s: ArchivedSession, prev: SessionManifest | None, *, force: bool,
    tensors: dict[str, torch.Tensor] | None = None,
) -> SessionManifest:  # fmt: skip
    """The manifest `snapshot` would commit for an archived session; CorruptDataError where
    `snapshot` would refuse it, with snapshot's own checks: token ids, state, options, manifest."""
    try:
        request = check_snapshot(
            scoped, s.session_id, s.tokens, s.state, ttl_seconds=s.ttl_seconds,
            guaranteed_until=s.guaranteed_until, pinned=s.pinned, force=force, state_tensors=tensors,
        )  # fmt: skip
        return snapshot_manifest(scoped, request, prev)
    except (InvalidArgumentError, KVShapeError) as exc:
        raise CorruptDataError(f"archive session {scoped.tenant}/{s.session_id} would be refused: {exc}") from None


def _expect(tokens_of: dict[str, int], name: str, tokens: int) -> None:
    if tokens_of.setdefault(name, tokens) != tokens:
        raise CorruptDataError(f"archive member {name} is named for {tokens_of[name]} and {tokens} tokens")


@contextlib.contextmanager
def new_directory_undone(path: Path) -> Iterator[None]:
    """For an import into `path`: when `path` held no data directory (no catalog, no spec.json),
    an exception leaves it as it was: removed if it did not exist, else without what was created
    in it (top-level entries that were not there before). An existing data directory is left
    alone: `import_sessions` undoes its own writes. Use it around the store's whole open-close."""
    path = Path(path)
    existed = path.exists()
    if existed and is_store(path):
        yield
        return
    before = set(os.listdir(path)) if existed and path.is_dir() else set()
    try:
        yield
    except BaseException:
        if not existed:
            shutil.rmtree(path, ignore_errors=True)
        elif path.is_dir():
            for name in set(os.listdir(path)) - before:
                entry = path / name
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        raise


class _Archive:
    """An open tar and its regular-file members by name (duplicates refused)."""

    def __init__(self, tar: tarfile.TarFile, source: Path) -> None:
        self.tar, self.source = tar, source
        self.files: dict[str, tarfile.TarInfo] = {}
        for info in tar.getmembers():
            if not info.isfile():
                raise CorruptDataError(f"{source}: member {info.name!r} is not a regular file")
            if info.name in self.files:
                raise CorruptDataError(f"{source}: member {info.name!r} appears twice")
            self.files[info.name] = info

    def read(self, name: str, limit: int) -> bytes:
        info = self.files.get(name)
        if info is None:
            raise CorruptDataError(f"{self.source}: member {name!r} is missing")
        if info.size > limit:
            raise CorruptDataError(f"{self.source}: member {name!r} is {info.size} bytes, more than {limit}")
        f = self.tar.extractfile(info)
        data = f.read() if f is not None else b""
        if len(data) != info.size:
            raise CorruptDataError(f"{self.source}: member {name!r} is truncated")
        return data


class _Opened:
    def __init__(self, source: Path) -> None:
        self.source = source

    def __enter__(self) -> _Archive:
        try:
            self.tar = tarfile.open(self.source, "r:")
            return _Archive(self.tar, self.source)
        except FileNotFoundError:
            raise NotFoundError(f"no archive {self.source}") from None
        except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
            raise CorruptDataError(f"{self.source} is not a readable agentstate archive: {exc}") from None

    def __exit__(self, *exc: object) -> None:
        if hasattr(self, "tar"):
            self.tar.close()


def _open(source: Path) -> _Opened:
    return _Opened(source)


def _read_index(tar: _Archive, source: Path) -> ArchiveIndex:
    raw = _guarded(lambda: tar.read(INDEX, _MAX_INDEX_BYTES), source)
    try:
        index = ArchiveIndex.model_validate_json(raw)
    except ValidationError as exc:
        raise CorruptDataError(
            f"{source}: {INDEX} is not an agentstate archive index ({exc.error_count()} errors)"
        ) from None
    if index.format_version != FORMAT_VERSION:
        raise CorruptDataError(
            f"{source}: archive format version {index.format_version}; this build reads {FORMAT_VERSION}"
        )
    if index.spec.fingerprint != index.fingerprint:
        raise CorruptDataError(f"{source}: index fingerprint {index.fingerprint} is not its spec's")
    unknown = set(tar.files) - set(index.members) - {INDEX}
    if unknown:
        raise CorruptDataError(f"{source}: members not in the index: {sorted(unknown)[:3]}")
    return index


def _member(tar: _Archive, name: str, index: ArchiveIndex) -> bytes:
    """A member's bytes, checked against the size and xxh3 the index records for it."""
    meta = index.members.get(name)
    if meta is None:
        raise CorruptDataError(f"archive member {name!r} is not in the index")
    data = _guarded(lambda: tar.read(name, meta.size), tar.source)
    if len(data) != meta.size or xxhash.xxh3_64_hexdigest(data) != meta.xxh3:
        raise CorruptDataError(f"archive member {name} fails its checksum")
    return data


def _guarded(read: Any, source: Path) -> bytes:
    try:
        data: bytes = read()
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        raise CorruptDataError(f"{source}: archive is damaged: {exc}") from None
    return data


def read_spec(source: Path) -> ModelSpec:
    """The ModelSpec an archive's KV belongs to (from its index; members are checked by import)."""
    with _open(Path(source)) as tar:
        return _read_index(tar, Path(source)).spec
