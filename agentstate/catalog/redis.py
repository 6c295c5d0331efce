"""A catalog every host shares: session manifests and shared-prefix records in Redis.

With it, any engine host can resume any session: the manifest says which chunks and which tail
make the session, and the remote tier (the record tier in this mode) holds them.

- A session is one hash `m/<tenant>/<session>` with fields `version`, `body` (the manifest JSON)
  and `tail`. A commit is one Lua script on that one key: it writes only if the stored version is
  the one the writer started from, so two hosts writing one session never interleave; the loser
  gets a ConflictError (or retries on top of the winner when it asked for `force`).
- A session's last hit time (field `hit`) and its accounting (fields `u:<counter>`) live in its
  own hash, added to by one script that does nothing when the session is gone, so they go with
  it and never make a session appear; a tenant's totals are the hash `u/<tenant>` (HINCRBY).
- A shared prefix is one string `x/<fingerprint>/<last chunk key>` listing its chunk keys.
- There are no shared reference counts: keeping counts exact across hosts would need a multi-key
  transaction over every slot a manifest touches. Chunks are reclaimed instead by a mark-and-sweep
  gc (StateStore.gc): whatever no manifest or prefix names, and nobody has used for a grace
  period, is deleted. A snapshot touches every chunk it reuses before it commits, so a chunk a
  commit is about to name is never "unused" when gc looks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from agentstate.catalog.base import Catalog, Committed
from agentstate.errors import BackendError, ConflictError
from agentstate.manifest import SessionManifest, decode_manifest, encode_manifest

T = TypeVar("T")

_COMMIT = """
local found = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if found ~= tonumber(ARGV[1]) then return {0, found} end
local old = redis.call('HGET', KEYS[1], 'tail') or ''
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'body', ARGV[3], 'tail', ARGV[4])
return {1, old}
"""

_USAGE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[1] ~= '' then
  local old = tonumber(redis.call('HGET', KEYS[1], 'hit') or '0') or 0
  if tonumber(ARGV[1]) > old then redis.call('HSET', KEYS[1], 'hit', ARGV[1]) end
end
for i = 2, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], 'u:' .. ARGV[i], ARGV[i + 1]) end
return 1
"""

_REMOVE = """
local body = redis.call('HGET', KEYS[1], 'body')
if body then redis.call('DEL', KEYS[1]) end
return body
"""


class RedisCatalog(Catalog):
    """The Catalog interface over a Redis server or cluster."""

    shared = True

    def __init__(self, url: str, *, cluster: bool = False, prefix: str = "agentstate:", timeout_s: float = 5.0) -> None:
        import redis.asyncio as aioredis  # optional dependency: loaded only when a shared catalog is chosen

        opts: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        cls = aioredis.RedisCluster if cluster else aioredis.Redis
        self._client: Any = cls.from_url(url, **opts)
        self._errors = (aioredis.RedisError, OSError, asyncio.TimeoutError)
        self._prefix, self._timeout_s = prefix, timeout_s

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Every catalog call is bounded and fails as one typed, retryable error."""
        try:
            return await asyncio.wait_for(fn(), self._timeout_s)
        except self._errors as exc:
            raise BackendError(f"shared catalog unavailable: {type(exc).__name__}: {exc}") from exc

    def _skey(self, tenant: str, session_id: str) -> str:
        return f"{self._prefix}m/{tenant}/{session_id}"

    @staticmethod
    def _parse(raw: bytes | None, hit: bytes | None = None) -> SessionManifest | None:
        if raw is None:
            return None
        manifest = decode_manifest(raw)
        if hit:
            try:
                manifest.last_hit_at = float(hit)
            except ValueError:
                pass  # a damaged hit time: the TTL counts from the last write
        return manifest

    def _tkey(self, tenant: str) -> str:
        return f"{self._prefix}u/{tenant}"

    # -- sessions ------------------------------------------------------------------------------

    async def get(self, tenant: str, session_id: str) -> SessionManifest | None:
        body, hit = await self._call(lambda: self._client.hmget(self._skey(tenant, session_id), ["body", "hit"]))
        return self._parse(body, hit)

    async def add_usage(
        self, deltas: Mapping[tuple[str, str], Mapping[str, int]], hits: Mapping[tuple[str, str], float]
    ) -> None:
        async def run() -> None:
            pipe = self._client.pipeline(transaction=False)
            for (tenant, session_id), counts in deltas.items():
                if not session_id:
                    for what, n in counts.items():
                        pipe.hincrby(self._tkey(tenant), what, int(n))
            for tenant, session_id in {k for k in [*deltas, *hits] if k[1]}:
                at = hits.get((tenant, session_id))
                pairs = [x for what, n in deltas.get((tenant, session_id), {}).items() for x in (what, int(n))]
                pipe.eval(_USAGE, 1, self._skey(tenant, session_id), "" if at is None else repr(float(at)), *pairs)
            await pipe.execute()

        if deltas or hits:
            await self._call(run)

    async def usage(self, tenant: str, session_id: str) -> dict[str, int]:
        if not session_id:
            raw = await self._call(lambda: self._client.hgetall(self._tkey(tenant)))
            return {_text(k): int(v) for k, v in raw.items()}
        raw = await self._call(lambda: self._client.hgetall(self._skey(tenant, session_id)))
        return {_text(k)[2:]: int(v) for k, v in raw.items() if _text(k).startswith("u:")}

    async def version(self, tenant: str, session_id: str) -> int:
        raw = await self._call(lambda: self._client.hget(self._skey(tenant, session_id), "version"))
        return int(raw or 0)

    async def _scan(self, pattern: str) -> list[str]:
        async def run() -> list[str]:
            return [
                k.decode() if isinstance(k, bytes) else k
                async for k in self._client.scan_iter(match=pattern, count=1000)
            ]

        return list(await self._call(run))

    async def manifests(self, tenant: str | None = None) -> list[SessionManifest]:
        keys = await self._scan(f"{self._prefix}m/{'*' if tenant is None else _glob_escape(tenant) + '/*'}")

        async def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.hmget(key, ["body", "hit"])
            return list(await pipe.execute())

        rows = await self._call(run) if keys else []
        return [m for m in (self._parse(body, hit) for body, hit in rows) if m is not None]

    async def commit(self, manifest: SessionManifest, expected_version: int | None) -> Committed:
        """Write `manifest` if the stored version is `expected_version` (None: must not exist)."""
        key = self._skey(manifest.tenant, manifest.session_id)
        args = (expected_version or 0, manifest.version, encode_manifest(manifest), manifest.tail_key or "")
        done, found = await self._call(lambda: self._client.eval(_COMMIT, 1, key, *args))
        if not int(done):
            raise ConflictError(
                f"session {manifest.session_id!r} is at version {int(found)}, expected {expected_version}"
            )
        old_tail = found.decode() if isinstance(found, bytes) else str(found)
        return Committed(zeroed=[], old_tail=old_tail or None)

    async def remove(self, tenant: str, session_id: str) -> tuple[SessionManifest | None, list[str]]:
        raw = await self._call(lambda: self._client.eval(_REMOVE, 1, self._skey(tenant, session_id)))
        return self._parse(raw), []

    # -- records: one hash per session (`r/<tenant>/<session>`, field = name) ------------------

    def _rkey(self, tenant: str, session_id: str) -> str:
        return f"{self._prefix}r/{tenant}/{session_id}"

    async def put_records(self, tenant: str, session_id: str, items: Mapping[str, bytes]) -> None:
        if items:  # one HSET: atomic on its one key
            await self._call(lambda: self._client.hset(self._rkey(tenant, session_id), mapping=dict(items)))

    async def records(self, tenant: str, session_id: str, prefix: str = "") -> list[tuple[str, bytes]]:
        raw = await self._call(lambda: self._client.hgetall(self._rkey(tenant, session_id)))
        found = ((_text(k), bytes(v)) for k, v in raw.items())
        return sorted((k, v) for k, v in found if k.startswith(prefix))

    async def records_named(self, tenant: str, session_id: str, names: Sequence[str]) -> list[tuple[str, bytes]]:
        if not names:
            return []
        raw = await self._call(lambda: self._client.hmget(self._rkey(tenant, session_id), list(names)))
        return [(n, bytes(v)) for n, v in zip(names, raw) if v is not None]

    async def record_sessions(self, tenant: str | None = None) -> list[tuple[str, str]]:
        head = f"{self._prefix}r/"
        keys = await self._scan(f"{head}{'*' if tenant is None else _glob_escape(tenant) + '/*'}")
        out = []
        for key in sorted(keys):
            t, _, s = key[len(head) :].partition("/")
            out.append((t, s))
        return out

    async def record_names(self, tenant: str, session_id: str, prefix: str = "") -> list[str]:
        raw = await self._call(lambda: self._client.hkeys(self._rkey(tenant, session_id)))
        return sorted(n for n in map(_text, raw) if n.startswith(prefix))

    async def remove_records(self, tenant: str, session_id: str, names: Sequence[str] | None = None) -> int:
        key = self._rkey(tenant, session_id)
        if names is None:
            count = await self._call(lambda: self._client.hlen(key))
            await self._call(lambda: self._client.delete(key))
            return int(count)
        return int(await self._call(lambda: self._client.hdel(key, *names))) if names else 0

    async def session_count(self) -> int:
        return len(await self._scan(f"{self._prefix}m/*"))

    # -- shared prefixes -----------------------------------------------------------------------

    def _pkey(self, last_key: str) -> str:
        return f"{self._prefix}x/{last_key}"

    async def add_prefix(self, keys: Sequence[str]) -> bool:
        if not keys:
            return False
        body = "\n".join(keys)
        return bool(await self._call(lambda: self._client.set(self._pkey(keys[-1]), body, nx=True)))

    async def remove_prefix(self, last_key: str) -> list[str]:
        await self._call(lambda: self._client.delete(self._pkey(last_key)))
        return []

    async def prefix_keys(self) -> set[str]:
        """Every chunk key some shared prefix names (gc's mark phase)."""
        names = await self._scan(f"{self._prefix}x/*")

        async def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            return list(await pipe.execute())

        bodies = await self._call(run) if names else []
        return {k for b in bodies if b for k in (b.decode() if isinstance(b, bytes) else b).split("\n")}

    async def refcounts(self, keys: Sequence[str]) -> list[int]:
        """Shared stores keep no counts (see the module docstring): every key counts as referenced,
        so nothing is deleted on the strength of a count; gc's mark phase decides instead."""
        return [1] * len(keys)

    async def close(self) -> None:
        await self._client.aclose()


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
