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


class ConfigError(InvalidArgumentError):
    """A configuration value is out of bounds or cannot be used here; `key` names the setting
    (`lmdb_map_size`), so the operator knows what to change."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


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


class MissingDependencyError(AgentStateError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it
    (`pip install 'agentstate-kv[service]'`), `name` the missing module, `extra` the extra. Also an
    ImportError, so `except ImportError` guards written for the raw error keep working."""

    def __init__(self, message: str, *, module: str | None = None, extra: str | None = None) -> None:
        super().__init__(message, name=module)
        self.extra = extra

    @classmethod
    def of(cls, exc: ModuleNotFoundError, needed_for: str, extra: str | None = None) -> MissingDependencyError | None:
        """The hint for `exc` when it names one of agentstate's optional dependencies (`extra`
        overrides the extra named, e.g. `demo` for transformers), else None: a module missing
        from a broken install is not something an extra fixes."""
        top = (exc.name or "").partition(".")[0]
        if top not in OPTIONAL_MODULES:
            return None
        extra = extra or OPTIONAL_MODULES[top]
        return cls(f"{needed_for} needs {top}, which is not installed: pip install 'agentstate-kv[{extra}]'"
                   f" (from a checkout: pip install -e '.[{extra}]')", module=top, extra=extra)  # fmt: skip


OPTIONAL_MODULES = {
    "torch": "store",
    "lmdb": "store",
    "numpy": "store",
    "fastapi": "service",
    "starlette": "service",
    "uvicorn": "service",
    "httpx": "client",
    "redis": "remote",
    "hiredis": "remote",
    "mooncake": "mooncake",
    "transformers": "transformers",
    "matplotlib": "demo",
}
"""Top-level module -> the extra of pyproject.toml that installs it."""
