"""One exception tree for everything agentstate raises on purpose.

Every error a caller can provoke with bad input, or meet because stored data is missing, corrupt
or full, is a subclass of `AgentStateError`, so one `except AgentStateError` catches them all and
the subclass says which. Errors that mean "retry may help" carry `retryable = True`.
"""

from __future__ import annotations


class AgentStateError(Exception):
    """Base class of every error agentstate raises on purpose."""

    retryable: bool = False


class InvalidArgumentError(AgentStateError, ValueError):
    """A caller passed something malformed: a bad id, a wrong shape, an unknown option."""


class InvalidSessionIdError(InvalidArgumentError):
    """A session or tenant id breaks the length or charset rules; it is never used as a path."""


class KVShapeError(InvalidArgumentError):
    """A KV tensor does not have the shape or dtype the ModelSpec says, or disagrees with the tokens."""


class NotFoundError(AgentStateError, LookupError):
    """The thing asked for does not exist (or is not visible to this tenant)."""


class SessionNotFoundError(NotFoundError):
    """No session with that id exists for this tenant."""


class SpecMismatchError(AgentStateError):
    """Stored state belongs to another ModelSpec (fingerprint); it is never served to this one."""


class CorruptDataError(AgentStateError):
    """Stored bytes fail a check (magic, version, fingerprint, shape, length, checksum)."""


class CapacityError(AgentStateError):
    """A tier is full and nothing can be evicted, or a configured size limit was reached."""


class DataDirLockedError(AgentStateError):
    """Another opener holds the data directory (a writer excludes everyone else; readers share).

    `pid` is the writer's process id when it recorded one."""

    retryable = True

    def __init__(self, message: str, *, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid


class ConflictError(AgentStateError):
    """A concurrent writer changed the same object first (e.g. a session version)."""

    retryable = True


class BackendError(AgentStateError):
    """A storage backend failed (I/O error, closed, unreachable)."""

    retryable = True


class BackendRefusedError(BackendError):
    """A storage backend answered and refused the command (a bad request, a read-only replica):
    the same call would fail again, so it is not retryable. A full remote store is CapacityError."""

    retryable = False
