"""The Catalog interface: session manifests, shared-prefix records and what keeps chunks alive.

Two implementations: `LMDBCatalog` (one data directory; exact reference counts committed in the
same transaction as the manifest) and `RedisCatalog` (shared by every host; no counts, gc marks
and sweeps). Sessions (`StateStore`) talk to this interface only.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from agentstate.manifest import SessionManifest


class Committed(NamedTuple):
    zeroed: list[str]
    """chunk and tail keys that lost their last reference (the caller collects them)"""
    old_tail: str | None
    """a shared catalog's replaced tail, which it does not count (the caller deletes it); the
    local catalog counts tails like chunks and reports them in `zeroed`"""


def kv_keys(manifest: SessionManifest) -> list[str]:
    """The keys of a manifest's KV: its chunks and its tail (not a hybrid model's state, which is
    another spec's value: read with `ModelSpec.state_spec`, never as KV)."""
    return [*manifest.chunk_keys, *([manifest.tail_key] if manifest.tail_key else [])]


def named_keys(manifest: SessionManifest) -> list[str]:
    """Every key a manifest keeps alive: its chunks, its tail and a hybrid model's state. The tail and
    the state are counted too, so gc decides about them by the same atomic count as chunks, never by a
    list read at another time."""
    return [*manifest.chunk_keys, *([manifest.tail_key] if manifest.tail_key else []),
            *([manifest.state_key] if manifest.state_key else [])]  # fmt: skip


class Catalog(ABC):
    """Where sessions and prefix records live. Every write is atomic; a commit is a compare-and-set
    on the session's version."""

    shared: bool = False
    """True when every host reads and writes this catalog (gc then marks and sweeps)."""
    created: bool = False
    """True when this open found no catalog and made an empty one."""

    @abstractmethod
    async def get(self, tenant: str, session_id: str) -> SessionManifest | None:
        """The committed manifest, with `last_hit_at` from the session's hit record."""

    @abstractmethod
    async def manifests(self, tenant: str | None = None) -> list[SessionManifest]:
        """Every manifest of `tenant` (None: of every tenant), expired ones included."""

    async def manifest_page(self, tenant: str, after: str, limit: int) -> list[SessionManifest]:
        """Up to `limit` manifests of `tenant` whose session ids sort after `after`, in id order
        (what one step of gc's expiry reads). This default lists them all; a catalog that keeps
        them in order reads only the page."""
        found = sorted((m for m in await self.manifests(tenant) if m.session_id > after), key=lambda m: m.session_id)
        return found[:limit]

    async def version(self, tenant: str, session_id: str) -> int:
        manifest = await self.get(tenant, session_id)
        return manifest.version if manifest else 0

    @abstractmethod
    async def commit(self, manifest: SessionManifest, expected_version: int | None) -> Committed:
        """Write `manifest` if the stored version is `expected_version` (None: must not exist),
        else ConflictError."""

    async def commit_all(self, changes: Sequence[tuple[SessionManifest, SessionManifest | None]]) -> list[Committed]:
        """Write each `(manifest, prev)`: `manifest` if the stored one is `prev` by version (None:
        must not exist), else ConflictError; one Committed per change, in order.

        What an import commits at once. Here: one `commit` after another, and on any failure the
        ones that landed are put back (`prev` committed again over them, or the session removed),
        best effort, before the error is raised; what they replaced is not collected here (the
        caller collects on success only). `LMDBCatalog` overrides it with one transaction: all
        or nothing, whatever fails (a full disk included).
        """
        done: list[tuple[SessionManifest, SessionManifest | None]] = []
        out: list[Committed] = []
        try:
            for manifest, prev in changes:
                out.append(await self.commit(manifest, prev.version if prev else None))
                done.append((manifest, prev))
        except BaseException:
            for manifest, prev in reversed(done):
                with contextlib.suppress(Exception):  # the first error is the one to report
                    if prev is None:
                        await self.remove(manifest.tenant, manifest.session_id)
                    else:
                        await self.commit(prev, manifest.version)
            raise
        return out

    @abstractmethod
    async def remove(self, tenant: str, session_id: str) -> tuple[SessionManifest | None, list[str]]:
        """Remove a session's manifest (its records: `remove_records`); the manifest (None if
        absent) and the keys that lost their last reference."""

    @abstractmethod
    async def add_prefix(self, keys: Sequence[str]) -> bool:
        """Record a shared prefix (named by its last key) so its chunks are kept; False if known."""

    @abstractmethod
    async def remove_prefix(self, last_key: str) -> list[str]: ...

    @abstractmethod
    async def prefix_keys(self) -> set[str]:
        """Every chunk key some shared prefix names (gc's mark phase)."""

    @abstractmethod
    async def refcounts(self, keys: Sequence[str]) -> list[int]:
        """How many manifests and prefixes reference each key (a shared catalog answers 1 for all:
        it deletes nothing on the strength of a count)."""

    @abstractmethod
    async def add_usage(
        self, deltas: Mapping[tuple[str, str], Mapping[str, int]], hits: Mapping[tuple[str, str], float]
    ) -> None:
        """Add counters per (tenant, session id; "" for the tenant's totals) and raise sessions'
        last hit times, atomically. A hit of a session that no longer exists is dropped."""

    @abstractmethod
    async def usage(self, tenant: str, session_id: str) -> dict[str, int]:
        """The counters stored for (tenant, session id; "" for the tenant's totals)."""

    @abstractmethod
    async def session_count(self) -> int: ...

    # -- records: what a framework keeps beside a session's KV (`agentstate.records`) ---------

    @abstractmethod
    async def put_records(self, tenant: str, session_id: str, items: Mapping[str, bytes]) -> None:
        """Write named records of one session, all of them or none (an existing name is replaced)."""

    @abstractmethod
    async def records(self, tenant: str, session_id: str, prefix: str = "") -> list[tuple[str, bytes]]:
        """The session's records whose name starts with `prefix`, in name order."""

    @abstractmethod
    async def records_named(self, tenant: str, session_id: str, names: Sequence[str]) -> list[tuple[str, bytes]]:
        """The session's records of these names that exist, in the order of `names`."""

    async def record_names(self, tenant: str, session_id: str, prefix: str = "") -> list[str]:
        """The names of the session's records that start with `prefix`, in name order."""
        return [name for name, _ in await self.records(tenant, session_id, prefix)]

    @abstractmethod
    async def record_sessions(self, tenant: str | None = None) -> list[tuple[str, str]]:
        """(tenant, session id) of every session of `tenant` (None: of every tenant) that has records."""

    @abstractmethod
    async def remove_records(self, tenant: str, session_id: str, names: Sequence[str] | None = None) -> int:
        """Remove the named records of one session (None: all of them); how many were there."""

    @abstractmethod
    async def close(self) -> None: ...
