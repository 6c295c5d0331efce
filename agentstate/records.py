"""Records: what an agent framework keeps beside a session's KV, under the same session id.

A LangGraph thread's checkpoints and pending writes, an Agents SDK session's conversation items:
the framework's own state, which today lives in another database than the KV it describes. Here
it lives in the session's catalog, so one id names both, and the session's life is theirs:
`delete` removes its records, `fork` copies them, gc removes them with an expired session,
`export`/`import` carry them. A session may have records before it has any KV (a thread is
checkpointed before its first model call); its TTL applies once it has a manifest.

A record is named bytes: names are 1-240 printable ASCII characters without spaces (frameworks
encode their own ids into them, see `agentstate.adapters.langgraph`), values at most
`StoreConfig.max_record_bytes`. Each value is stored with its xxh3-64 checksum, checked on every
read: a damaged record is a CorruptDataError, never bytes handed to a framework's deserializer.
Writes of one call are atomic (one catalog transaction, or one Redis hash command).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import xxhash

from agentstate.errors import CorruptDataError, InvalidArgumentError
from agentstate.keys import validate_id

if TYPE_CHECKING:  # the SDK imports the names' check from here, without torch
    from agentstate.store_base import StoreScope

_NAME = re.compile(r"[!-~]{1,240}")
_SUM = 8


def validate_name(name: object) -> str:
    """`name` if it is a valid record name (or prefix, when empty is allowed by the caller), else InvalidArgumentError."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        shown = repr(name)[:100]
        raise InvalidArgumentError(f"invalid record name {shown}: 1-240 printable ASCII characters, no spaces")
    return name


def validate_names(names: Iterable[str]) -> list[str]:
    """`names` as a list of valid record names (a single string is refused, not read as characters)."""
    if isinstance(names, str):
        raise InvalidArgumentError("names must be a list of record names, not one string")
    return [validate_name(n) for n in names]


def validate_items(items: object) -> dict[str, bytes]:
    """`items` (record name -> bytes) checked, as bytes; InvalidArgumentError for a bad name or value."""
    if not isinstance(items, Mapping):
        raise InvalidArgumentError("records must be a mapping of name -> bytes")
    out = {}
    for name, value in items.items():
        validate_name(name)
        if not isinstance(value, bytes | bytearray | memoryview):
            raise InvalidArgumentError(f"record {name!r}: value must be bytes, not {type(value).__name__}")
        out[name] = bytes(value)
    return out


def frame(where: str, name: str, value: bytes) -> bytes:
    """A record as stored: a checksum over its place (`tenant/session`), its name and its bytes,
    then its bytes; bound to its place, a record copied or swapped onto another fails its check."""
    return _sum(where, name, value) + value


def unframe(stored: bytes, where: str, name: str) -> bytes:
    """The bytes of a stored record, checked; CorruptDataError when they are not what was written there."""
    value = stored[_SUM:]
    if len(stored) < _SUM or _sum(where, name, value) != stored[:_SUM]:
        raise CorruptDataError(f"record {name!r} of {where} is damaged (checksum mismatch)")
    return value


def _sum(where: str, name: str, value: bytes) -> bytes:
    h = xxhash.xxh3_64(f"{where}\0{name}\0".encode())
    h.update(value)
    return h.digest()


class Records:
    """The record operations of one tenant's view of a store (see the module docstring)."""

    def __init__(self, scope: StoreScope) -> None:
        self.scope = scope

    def _check(self, session_id: str) -> None:
        validate_id(session_id)

    def _where(self, session_id: str) -> str:
        return f"{self.scope.tenant}/{session_id}"

    async def put(self, session_id: str, items: Mapping[str, bytes]) -> None:
        """Write `items` (name -> bytes) for `session_id`, all or none; a name there is replaced."""
        self._check(session_id)
        limit = self.scope.config.max_record_bytes
        where = self._where(session_id)
        framed = {}
        for name, value in validate_items(items).items():
            if len(value) > limit:
                raise InvalidArgumentError(f"record {name!r} is {len(value)} bytes; the limit is {limit} (max_record_bytes)")
            framed[name] = frame(where, name, value)
        async with self.scope.session_lock(session_id):
            await self.scope.freeing(lambda: self.scope.catalog.put_records(self.scope.tenant, session_id, framed))

    async def get(self, session_id: str, prefix: str = "", names: Sequence[str] | None = None) -> dict[str, bytes]:
        """The records of `session_id` whose name starts with `prefix`, in name order, or (`names`)
        those of these names that exist, in that order; each checked."""
        self._check(session_id)
        if prefix:
            validate_name(prefix)
        if names is not None:
            wanted = list(dict.fromkeys(validate_names(names)))
            rows = await self.scope.catalog.records_named(self.scope.tenant, session_id, wanted)
        else:
            rows = await self.scope.catalog.records(self.scope.tenant, session_id, prefix)
        where = self._where(session_id)
        return {name: unframe(stored, where, name) for name, stored in rows}

    async def names(self, session_id: str, prefix: str = "") -> list[str]:
        """The names of the records of `session_id` that start with `prefix`, in name order."""
        self._check(session_id)
        if prefix:
            validate_name(prefix)
        return await self.scope.catalog.record_names(self.scope.tenant, session_id, prefix)

    async def delete(self, session_id: str, names: Sequence[str] | None = None) -> int:
        """Remove the named records of `session_id` (None: all); how many were there."""
        self._check(session_id)
        if names is not None:
            names = validate_names(names)
        async with self.scope.session_lock(session_id):
            return await self.scope.freeing(
                lambda: self.scope.catalog.remove_records(self.scope.tenant, session_id, names)
            )

    async def copy(self, source_id: str, new_id: str) -> int:
        """Copy every record of `source_id` to `new_id` (which has none); how many. Used by fork."""
        values = await self.get(source_id)  # checked: damage is not copied on as if it were whole
        new = self._where(new_id)
        if values:
            await self.scope.catalog.put_records(
                self.scope.tenant, new_id, {n: frame(new, n, v) for n, v in values.items()}
            )
        return len(values)
