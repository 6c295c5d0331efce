"""Session operations of StateStore: snapshot, resume, fork, delete, list, gc, hints, usage.

`Sessions` works on a StoreScope (store_base.py: a ChunkStore, the catalog, the tenant);
`StateStore` (store.py: prefixes, matches, loads) holds one and offers its methods as its own.
Everything here goes through the catalog, local (LMDB) or shared by every host (Redis), with the
same rules: data first (one durable write), the manifest last, one atomic compare-and-set on the
session's version. Chunks are touched only through the ChunkStore's public methods.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentstate import model_state, slices
from agentstate.catalog import Committed, kv_keys, named_keys
from agentstate.chunks import SweepCursor
from agentstate.errors import (
    AgentStateError,
    ConflictError,
    CorruptDataError,
    InvalidArgumentError,
    KVShapeError,
    SessionNotFoundError,
    SpecMismatchError,
)
from agentstate.hints import Hint, HintKind, HintResult, paused_hold_s
from agentstate.keys import tail_key, validate_id
from agentstate.manifest import ResumeResult, SessionManifest, now
from agentstate.records import Records
from agentstate.snapshots import MAX_STATE_DEPTH as MAX_STATE_DEPTH
from agentstate.snapshots import check_snapshot, hold_retained, snapshot_manifest, write_session
from agentstate.store_base import StoreScope
from agentstate.target import KVTarget, TensorTarget
from agentstate.usage import Usage

if TYPE_CHECKING:
    import torch

log = logging.getLogger("agentstate.sessions")
_FORCE_RETRIES = 16


class Sessions:
    """The session lifecycle; every write goes data first, then one compare-and-set of the manifest."""

    def __init__(self, scope: StoreScope) -> None:
        self.scope = scope
        # the parts used here, named as on StateStore (a scope's parts never change)
        self.chunks, self.catalog, self.usage_log = scope.chunks, scope.catalog, scope.usage_log
        self.config, self.spec, self.tenant = scope.config, scope.spec, scope.tenant
        self.fingerprint = scope.fingerprint
        self.records = Records(scope)

    async def snapshot(
        self,
        session_id: str,
        tokens: Sequence[int] | torch.Tensor,
        kv: torch.Tensor,
        state: dict[str, Any] | None = None,
        *,
        ttl_seconds: float | None = None,
        guaranteed_until: float | None = None,
        pinned: bool = False,
        expected_version: int | None = None,
        force: bool = False,
        model_state: Mapping[str, torch.Tensor] | None = None,
    ) -> SessionManifest:
        """Durably store a session: chunks and tail reach the record tier first (one durable write),
        then the manifest commits.

        `model_state`: a hybrid model's state after the last token (the tensors of the spec's
        `state` layout: SSM/conv states, sliding windows), stored with the tail; required by a hybrid
        spec, refused by a dense one.

        A crash leaves the previous version or this one, never a mix. `expected_version` is the
        version this writer last saw (e.g. the one it resumed): when another writer, on this host
        or another, committed since, this raises ConflictError and leaves that writer's session
        untouched. A session stored for another ModelSpec is never replaced silently
        (SpecMismatchError). `force=True` makes this write win on top of whatever is there.
        Every argument is checked before anything is written.

        Retention: `ttl_seconds` expires the session that long after its last write or hit (a
        resume or a hint refreshes it); `guaranteed_until` (wall-clock seconds) keeps it at least
        until then, whatever the TTL. While either is in force its chunks are also held in the
        fast tiers (after hinted sessions, within the tenant's share); eviction only moves them down.
        """
        request = check_snapshot(
            self.scope, session_id, tokens, state, kv=kv, ttl_seconds=ttl_seconds, guaranteed_until=guaranteed_until,
            pinned=pinned, expected_version=expected_version, force=force, state_tensors=model_state,
        )  # fmt: skip
        async with self.scope.session_lock(session_id):
            prev = await self.catalog.get(self.tenant, session_id)
            base = prev.version if prev else 0
            if prev is not None and prev.fingerprint != self.fingerprint and not force:
                raise SpecMismatchError(
                    f"session {session_id!r} holds state of spec {prev.fingerprint}, this store serves"
                    f" {self.fingerprint}; snapshot with force=True to replace it"
                )
            if expected_version is not None and expected_version != base and not force:
                raise ConflictError(f"session {session_id!r} is at version {base}, expected {expected_version}")
            manifest = snapshot_manifest(self.scope, request, prev)
            tkey = manifest.tail_key
            try:
                with self.chunks.pinned(named_keys(manifest)):
                    written = await write_session(self.chunks, manifest, kv, state=request.model_state, spec=self.spec)
                    manifest = manifest.model_copy(update={"updated_at": now()})
                    manifest, committed = await self._commit(manifest, base, force=force)
            except BaseException as exc:
                await self._discard_attempt([*request.keys, *([manifest.state_key] if manifest.state_key else [])],
                                            tkey, exc)  # fmt: skip
                raise
            self.usage_log.add(self.tenant, session_id, written.usage(manifest))
            self.chunks.learn(manifest.chunk_keys, request.tokens)
            hold_retained(self.chunks, manifest)
            await self.scope.collect(committed.zeroed)
            if committed.old_tail and committed.old_tail != tkey:
                await self.chunks.delete([committed.old_tail])
        return manifest

    async def _discard_attempt(self, keys: Sequence[str], tkey: str | None, exc: BaseException) -> None:
        """Remove what a failed snapshot or fork wrote, from every tier, unless it committed after all.

        Local catalog: collected by count, so what a commit names (this one, if it landed before
        a cancellation, or another's) stays. Shared catalog: the tail only, and only when the
        commit surely failed (a conflict); anything else is left for gc's mark and sweep.
        """
        with contextlib.suppress(AgentStateError):
            if not self.catalog.shared:
                await self.scope.freeing(lambda: self.scope.collect([*keys, *([tkey] if tkey else [])]))
            elif tkey and isinstance(exc, ConflictError | SpecMismatchError):
                await self.chunks.delete([tkey])

    async def _commit(self, manifest: SessionManifest, base: int, *, force: bool) -> tuple[SessionManifest, Committed]:
        """Compare-and-set on the version; under `force`, retry on top of each newer version seen."""
        for _ in range(_FORCE_RETRIES):
            try:
                return manifest, await self.catalog.commit(manifest, base or None)
            except ConflictError:
                if not force:
                    raise
                base = await self.catalog.version(manifest.tenant, manifest.session_id)
                manifest = manifest.model_copy(update={"version": base + 1})
        raise ConflictError(f"session {manifest.session_id!r} kept changing: {_FORCE_RETRIES} forced commits lost")

    def _hit_known(self, manifest: SessionManifest) -> SessionManifest:
        """The manifest with this process's latest hit, which may not be in the catalog yet."""
        pending = self.usage_log.last_hit(manifest.tenant, manifest.session_id)
        if pending is not None and pending > (manifest.last_hit_at or 0.0):
            manifest.last_hit_at = pending
        return manifest

    async def _manifest(self, session_id: str, *, sliced: bool = False) -> SessionManifest:
        """The session's manifest; SpecMismatchError when another spec stored it, unless `sliced` and
        that spec is a slicing of this model whose heads hold this rank's (`slices.holder`)."""
        validate_id(session_id)
        manifest = await self.catalog.get(self.tenant, session_id)
        if manifest is not None:
            manifest = self._hit_known(manifest)
        if manifest is None or manifest.expired():
            raise SessionNotFoundError(f"no session {session_id!r}")
        if manifest.fingerprint != self.fingerprint and not (sliced and slices.holder(self.spec, manifest.fingerprint)):
            raise SpecMismatchError(
                f"session {session_id!r} was stored for spec {manifest.fingerprint}, this store serves {self.fingerprint}"
            )
        return manifest

    async def session(self, session_id: str) -> SessionManifest:
        """The session's current manifest (its version is what a later `snapshot` may expect)."""
        return await self._manifest(session_id)

    async def resume(self, session_id: str, into: torch.Tensor | KVTarget | None = None) -> ResumeResult:
        """Restore a session's tokens, state and KV, complete to the last token (tail included);
        bit-exact unless a chunk came back through a lossy tier (fp8): `ResumeResult.exact` says.

        KV lands in `into` (a canonical tensor or a KVTarget such as an engine's paged pool, with
        room for the whole session) when given; else in a fresh huge-page host tensor. Chunks
        this host has never seen (another host wrote the session) are found in the remote tiers.
        """
        manifest = await self._manifest(session_id, sliced=True)
        source = slices.holder(self.spec, manifest.fingerprint)  # stored at another TP size: narrowed
        kv = None
        if into is None:
            kv = self.chunks.host_tensor(self.spec.kv_shape(manifest.num_tokens), self.spec.torch_dtype)
        target = self.scope.target(kv if kv is not None else into)
        if target.num_tokens < manifest.num_tokens:
            raise KVShapeError(
                f"into holds {target.num_tokens} tokens, session {session_id!r} has {manifest.num_tokens}"
            )
        keys = kv_keys(manifest)
        usage: Counter[str] = Counter()
        lossy: set[str] = set()
        carried = None
        with self.chunks.pinned(named_keys(manifest)):
            await self.chunks.discover(keys)
            # the manifest's chunk size, not this store's: a directory reopened with another
            # chunk_tokens still resumes what it holds
            spans = self.scope.spans(len(manifest.chunk_keys), manifest.num_tokens, manifest.chunk_tokens)
            if source is None:
                ok = await self.chunks.read(keys, spans, target, usage=usage, lossy=lossy)
            else:
                ok = await slices.read_into(self.chunks, source, self.spec, keys, spans, target, lossy)
            if manifest.state_key and all(ok) and source is None:
                carried = await model_state.read(self.chunks, self.spec, manifest.state_key, manifest.num_tokens)
        target.synchronize()
        lead = leading(ok)
        if manifest.state_key and carried is None:
            lead = 0  # a hybrid model resumes whole or not at all: its state is valid at the end only
        if manifest.chunk_tokens == self.scope.chunk_tokens and source is None:
            self.chunks.learn(manifest.chunk_keys[: min(lead, len(manifest.chunk_keys))], manifest.tokens)
        restored = manifest.num_tokens if lead == len(keys) else lead * manifest.chunk_tokens
        usage.update(resumes=1, tokens_read=restored, tokens_recomputed=manifest.num_tokens - restored)
        self.usage_log.add(self.tenant, session_id, usage)
        self._hit(manifest)
        self.chunks.release(f"hint:{self.tenant}/{session_id}")  # it is back: plain LRU from here
        if restored < manifest.num_tokens:
            log.warning(
                "session %s resumed %d of %d tokens: stored data missing or corrupt",
                session_id,
                restored,
                manifest.num_tokens,
            )
        if kv is not None and restored < manifest.num_tokens:
            kv[:, :, restored:].zero_()  # a pooled buffer holds old bytes: expose none of them
        if kv is None and isinstance(target, TensorTarget):
            kv = target.tensor
        exact = not lossy.intersection(keys[:lead])
        return ResumeResult(
            manifest=manifest, kv=kv[:, :, :restored] if kv is not None else None, restored_tokens=restored,
            exact=exact, model_state=carried,
        )

    async def fork(self, source_id: str, new_id: str) -> SessionManifest:
        """A new session sharing every chunk of `source_id` (no copy); only the small tail and the
        session's records (`agentstate.records`) are copied.

        The fork names chunks it does not write, so it commits only after checking, under its
        pins, that the record tier still holds every one of them (a concurrent delete of the
        source and gc may have taken them); if not, it reads the source again.
        """
        validate_id(source_id)
        validate_id(new_id)
        async with self.scope.session_lock(new_id):
            if await self.catalog.get(self.tenant, new_id) is not None or await self.catalog.records(self.tenant, new_id):
                raise ConflictError(f"session {new_id!r} already exists")
            for _ in range(_FORCE_RETRIES):
                src = await self._manifest(source_id)
                tkey = tail_key(self.fingerprint, self.tenant, new_id, 1) if src.tail_key else None
                # a hybrid model's state is named, not copied: the fork shares it as it shares chunks
                shared = [*src.chunk_keys, *([src.state_key] if src.state_key else [])]
                pins = [*shared, *([src.tail_key, tkey] if src.tail_key and tkey else [])]
                with self.chunks.pinned(pins):
                    if not await self.chunks.durable(shared):
                        continue  # the source changed under us: its chunks went with an older version
                    try:
                        if src.tail_key and tkey and not await self._copy_tail(src, tkey):
                            if await self.catalog.version(self.tenant, source_id) != src.version:
                                continue  # its tail went with the version we read
                            raise CorruptDataError(f"tail of session {source_id!r} is missing or corrupt")
                        stamp = now()
                        fields = {
                            "session_id": new_id, "tail_key": tkey, "version": 1, "parent": source_id,
                            "last_hit_at": None, "lossy": src.lossy or (tkey is not None and self.config.lossy),
                        }  # fmt: skip
                        manifest = src.model_copy(update={**fields, "created_at": stamp, "updated_at": stamp})
                        await self.records.copy(source_id, new_id)
                        await self.catalog.commit(manifest, None)
                    except BaseException as exc:
                        with contextlib.suppress(Exception):
                            await self.catalog.remove_records(self.tenant, new_id)
                        await self._discard_attempt([], tkey, exc)
                        raise
                hold_retained(self.chunks, manifest)
                return manifest
        raise ConflictError(f"session {source_id!r} kept changing while it was forked")

    async def _copy_tail(self, src: SessionManifest, tkey: str) -> bool:
        """Copy the source's tail under the fork's own key; False when it cannot be read intact."""
        assert src.tail_key is not None
        tail = self.spec.empty_kv(src.tail_tokens)
        await self.chunks.discover([src.tail_key])
        span = [(0, src.tail_tokens)]
        if not (await self.chunks.read([src.tail_key], span, TensorTarget(tail, self.spec)))[0]:
            return False
        await self.chunks.write([tkey], [tail], durable=True)
        return True

    async def delete(self, session_id: str) -> None:
        """Remove a session and its records (`agentstate.records`); chunks no other session or
        prefix references are deleted (shared stores: by the next gc, see `gc`)."""
        validate_id(session_id)
        async with self.scope.session_lock(session_id):
            # records first: a delete that fails between the two is retried whole, and a session
            # made later under this id never finds records of this one
            had = await self.scope.freeing(lambda: self.catalog.remove_records(self.tenant, session_id))
            manifest, zeroed = await self.scope.freeing(lambda: self.catalog.remove(self.tenant, session_id))
            if manifest is None:
                if had:
                    return  # a session with records and no KV yet (a framework's thread)
                raise SessionNotFoundError(f"no session {session_id!r}")
            self.usage_log.forget(self.tenant, session_id)
            for kind in ("hint", "retain"):
                self.chunks.release(f"{kind}:{self.tenant}/{session_id}")
            await self.scope.freeing(lambda: self.scope.collect(zeroed))
            if self.catalog.shared and manifest.tail_key:
                await self.scope.freeing(lambda: self.chunks.delete([manifest.tail_key]))

    async def sessions(self) -> AsyncIterator[SessionManifest]:
        """This tenant's live sessions (expired ones left out), each as its current manifest."""
        for manifest in await self.catalog.manifests(self.tenant):
            if not self._hit_known(manifest).expired():
                yield manifest

    # -- hints and accounting ------------------------------------------------------------------

    def _hit(self, manifest: SessionManifest) -> None:
        """A resume or hint: the sliding TTL counts from now, and the retention hold with it."""
        stamp = now()
        manifest.last_hit_at = max(stamp, manifest.last_hit_at or 0.0)
        self.usage_log.hit(self.tenant, manifest.session_id, stamp)
        hold_retained(self.chunks, manifest)

    async def hint(self, session_id: str, hint: HintKind | Hint, expected_s: float | None = None) -> HintResult:
        """Tell the store what comes next for a session (see `agentstate.hints`).

        `paused`: a tool call started, expected back in `expected_s` seconds: its chunks stay in
        the fast tiers (evicted after everything not expected back sooner) for a bounded time.
        `resuming`: its next turn is imminent: chunks only the slow tiers (LMDB, remote) hold are
        brought up into host memory now, and held there until the resume (or
        `hint_resuming_hold_s`). `done`: release it early: its chunks go first under pressure.
        Hints are advice: they never change what is stored, and a bad one changes nothing.
        """
        parsed = Hint.parse(hint, expected_s)
        manifest = await self._manifest(session_id)
        self.usage_log.add(self.tenant, session_id, {"hints": 1})
        if parsed.hint == "done":
            self.chunks.release(f"retain:{self.tenant}/{session_id}")
        else:
            self._hit(manifest)
        return await self.apply_hint(
            f"hint:{self.tenant}/{session_id}", session_id, kv_keys(manifest), _key_tokens(manifest), parsed
        )

    async def apply_hint(
        self, name: str, session_id: str, keys: list[str], tokens: list[int], parsed: Hint
    ) -> HintResult:
        """Place (or release) the hold `name` on `keys` (`tokens[i]` tokens each) that `parsed` asks for."""
        stamp = now()
        held_until = expected_back = None
        moved = moved_bytes = 0
        if parsed.hint == "done":
            self.chunks.release(name, keys)
        else:
            if parsed.hint == "paused":
                assert parsed.expected_s is not None
                hold_s = paused_hold_s(
                    parsed.expected_s, sum(tokens) * self.spec.token_bytes,
                    reload_bytes_per_s=self.config.hint_reload_bytes_per_s, max_hold_s=self.config.hint_max_hold_s,
                )  # fmt: skip
                back_in = parsed.expected_s
            else:
                hold_s, back_in = self.config.hint_resuming_hold_s, 0.0
            # a resuming session is the one certainly back next: it ranks before every paused one
            # (a paused session whose tool overran is "due" too, but may not come at all)
            rank_in = -math.inf if parsed.hint == "resuming" else back_in
            self.chunks.hold(name, self.tenant, keys, for_s=hold_s, back_in_s=rank_in, kind=parsed.hint)
            held_until, expected_back = stamp + hold_s, stamp + back_in
            if parsed.hint == "resuming":
                with self.chunks.pinned(keys):
                    await self.chunks.discover(keys)
                    moved, moved_bytes = await self.chunks.warm(keys, tokens)
        memory = self.chunks.memory_tier
        in_memory = sum(memory in self.chunks.where(k) for k in keys) if memory else 0
        held = self.chunks.held_bytes(self.tenant).get(memory or "", 0)
        capacity = self.chunks.tier_capacity(memory) if memory else None
        return HintResult(
            session_id=session_id, hint=parsed.hint, held_until=held_until, expected_back_at=expected_back,
            chunks=len(keys), in_memory=in_memory, moved_chunks=moved, moved_bytes=moved_bytes,
            tenant_held_bytes=held,
            tenant_share_bytes=None if capacity is None else int(capacity * self.config.hint_tenant_share),
        )  # fmt: skip

    async def paused(self, session_id: str, expected_s: float) -> HintResult:
        """A tool call started; the session is expected back in `expected_s` seconds."""
        return await self.hint(session_id, "paused", expected_s)

    async def resuming(self, session_id: str) -> HintResult:
        """The session's next turn is imminent: bring it up into host memory now."""
        return await self.hint(session_id, "resuming")

    async def done(self, session_id: str) -> HintResult:
        """The session will not be back soon: release its place in the fast tiers."""
        return await self.hint(session_id, "done")

    async def usage(self, session_id: str | None = None) -> Usage:
        """Accounting of one session, or of this tenant (all its sessions, loads and prefixes,
        deleted sessions included): exact, what this process counted included."""
        if session_id is None:
            return Usage.of(self.tenant, None, await self.usage_log.read(self.tenant, None))
        manifest = await self._manifest(session_id)
        counts = await self.usage_log.read(self.tenant, session_id)
        resident = await self.chunks.resident(named_keys(manifest))
        stored = {tier: size for tier, (n, size) in resident.items() if n}
        return Usage.of(self.tenant, session_id, counts, last_hit_at=manifest.last_hit_at, bytes_stored=stored)

    async def gc(self, on_step: Callable[[GcStep], None] | None = None) -> int:
        """Delete expired sessions, then chunks and tails nothing references; returns how many went.
        `on_step` hears of each step of a local catalog's pass (the CLI's progress bar).

        Local catalog: a whole pass of `gc_step` (steps of `gc_step_keys`): every local durable
        tier is swept, and a key goes only when the catalog's count (tails counted too) is zero
        and nothing pins it, decided after it is marked, so a commit running beside gc never
        loses what it names. Shared catalog: mark and sweep, every tier of this host and the
        remote tiers, where a chunk is deleted only if unused for `gc_grace_seconds` (a
        snapshot on another host may be about to name it); that needs every manifest at once.
        """
        if self.catalog.shared:
            removed = await self._expire(None)
            live = await self.catalog.prefix_keys()
            for manifest in await self.catalog.manifests(None):
                live.update(manifest.chunk_keys)
                if manifest.tail_key:
                    live.add(manifest.tail_key)
            return removed + await self.scope.freeing(lambda: self.chunks.sweep_shared(self.scope.key_prefixes, live))
        cursor, removed, done = self._gc_cursor(), 0, False
        while not done:
            step = await self._gc_step(cursor, self.config.gc_step_keys)
            removed, done = removed + step.removed, step.done
            if on_step is not None:
                on_step(step)
        return removed

    async def gc_step(self, limit: int, *, restart: bool = False) -> GcStep:
        """One bounded step of gc (local catalog): this tenant's next `limit` sessions checked
        for expiry and the next `limit` stored keys swept, each from where this tenant's last
        step stopped (`restart`, or the last pass done: from the start). A step costs the same in
        a store of a thousand sessions and of millions; `done` says the pass reached the end of
        both. Steps of one tenant share one pass; `gc()` runs a whole pass of its own.
        """
        if self.catalog.shared:
            raise InvalidArgumentError("gc steps need a local catalog; a shared one is swept whole (gc)")
        cursor = None if restart else self.scope.gc_cursors.get(self.tenant)
        if cursor is None:
            cursor = self.scope.gc_cursors[self.tenant] = self._gc_cursor()
        step = await self._gc_step(cursor, limit)
        if step.done and self.scope.gc_cursors.get(self.tenant) is cursor:
            del self.scope.gc_cursors[self.tenant]
        return step

    def _gc_cursor(self) -> GcCursor:
        return GcCursor(sweep=self.chunks.sweep_cursor(self.scope.key_prefixes))

    async def _gc_step(self, cursor: GcCursor, limit: int) -> GcStep:
        if limit < 1:
            raise InvalidArgumentError(f"a gc step takes at least one key, not {limit}")
        page = await self.catalog.manifest_page(self.tenant, cursor.after, limit) if not cursor.expired else []
        if len(page) < limit:
            cursor.expired = True
        else:
            cursor.after = page[-1].session_id
        expired = await self._expire(page)
        sweep = await self.scope.freeing(lambda: self.chunks.sweep_step(cursor.sweep, self.catalog.refcounts, limit))
        done = cursor.expired and sweep.done
        return GcStep(removed=expired + sweep.removed, sessions=len(page), keys=sweep.scanned, done=done)

    async def _expire(self, manifests: Sequence[SessionManifest] | None) -> int:
        """Delete the expired sessions among `manifests` (None: all of this tenant's)."""
        removed = 0
        for manifest in await self.catalog.manifests(self.tenant) if manifests is None else manifests:
            if self._hit_known(manifest).expired():
                with contextlib.suppress(SessionNotFoundError):
                    await self.delete(manifest.session_id)
                    removed += 1
        return removed


@dataclass
class GcCursor:
    """Where one gc pass stands: the last session id its expiry reached, and its sweep."""

    sweep: SweepCursor
    after: str = ""
    expired: bool = False
    """every session was checked"""


@dataclass(frozen=True)
class GcStep:
    """What one step of gc did."""

    removed: int
    """expired sessions, and chunks and tails nothing referenced"""
    sessions: int
    """sessions checked for expiry"""
    keys: int
    """stored keys swept"""
    done: bool
    """the pass reached the end: the next step starts a new one"""


def _key_tokens(manifest: SessionManifest) -> list[int]:
    """Tokens in each of `kv_keys(manifest)`."""
    return [manifest.chunk_tokens] * len(manifest.chunk_keys) + ([manifest.tail_tokens] if manifest.tail_key else [])


def leading(ok: Sequence[bool]) -> int:
    """How many of `ok` are true before the first false: the chunks a read restored, from the start."""
    for i, good in enumerate(ok):
        if not good:
            return i
    return len(ok)
