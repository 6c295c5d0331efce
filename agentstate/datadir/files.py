"""What a data directory records about itself (`spec.json`, `config.json`), written atomically.

The spec and the config are recorded by whoever writes the directory (the library's
`StateStore.open` among them), so that every later opener, an admin command in another process
included, opens the same spec and the same tiers. The spec is the directory's identity: recorded
once, then checked on every open; a spec that differs is refused naming the fields that differ,
since the same directory opened under another spec would show its sessions as missing. The
config is the last writer's: a writer that opens with other tiers records them (the directory's
chunks stay where its tiers' paths say; the record only tells readers where to look).
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import ValidationError

from agentstate.errors import AgentStateError, BackendError, CapacityError, InvalidArgumentError, NotFoundError
from agentstate.errors import SpecMismatchError
from agentstate.spec import ModelSpec

if TYPE_CHECKING:
    from agentstate.config import StoreConfig
    from agentstate.settings import ConfigFile

SPEC = "spec.json"
"""The directory's ModelSpec (JSON)."""
CONFIG = "config.json"
"""The effective StoreConfig its last writer opened it with (JSON, no secrets)."""
CATALOG = "catalog"
"""The local catalog's folder (LMDB: manifests, prefix records, reference counts)."""
REDACTED = "***"
"""What a recorded URL holds in place of its password."""

Pathish = str | os.PathLike[str]


# -- atomic writes ---------------------------------------------------------------------------------


def write_atomic(file: Path, text: str) -> Path:
    """Write `text` as `file`: a temp file beside it, fsync'd, renamed over it, then the directory
    fsync'd, so a crash leaves the old content or the new one, never a torn file. A full disk is
    CapacityError, another OS error BackendError; no temp file is left either way."""
    root = file.parent
    tmp = root / f".{file.name}.{os.getpid()}.tmp"
    try:
        root.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "w", encoding="utf-8") as out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, file)
        finally:
            tmp.unlink(missing_ok=True)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _os_error(file, exc) from exc
    return file


def _os_error(file: Path, exc: OSError) -> AgentStateError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CapacityError(f"cannot write {file}: the disk is full ({exc})")
    return BackendError(f"cannot write {file}: {exc}")


def is_store(path: Pathish, *, shared_catalog: bool = False) -> bool:
    """`path` is a data directory: it has a catalog or a recorded spec (a lost catalog must not
    hide its chunks), or its catalog is a shared one elsewhere."""
    root = Path(path)
    return shared_catalog or (root / CATALOG).is_dir() or (root / SPEC).is_file()


# -- spec.json -------------------------------------------------------------------------------------


def read_spec_file(file: Pathish) -> ModelSpec:
    """A ModelSpec JSON file; missing is NotFoundError, unreadable or invalid InvalidArgumentError."""
    try:
        return ModelSpec.model_validate_json(Path(file).read_text())
    except FileNotFoundError:
        raise NotFoundError(f"no spec file {file}") from None
    except (OSError, ValidationError) as exc:
        raise InvalidArgumentError(f"{file} is not a ModelSpec (JSON): {_short(exc)}") from None


def recorded_spec(path: Pathish) -> ModelSpec | None:
    """The spec recorded in data directory `path`, or None (a new directory, or an older version's)."""
    file = Path(path) / SPEC
    return read_spec_file(file) if file.exists() else None


def spec_differences(given: ModelSpec, recorded: ModelSpec) -> list[str]:
    """The fields in which `given` differs from `recorded`, as `name given != recorded`."""
    return [
        f"{name} {getattr(given, name)!r} != {getattr(recorded, name)!r}"
        for name in type(given).model_fields
        if getattr(given, name) != getattr(recorded, name)
    ]


def check_spec(path: Pathish, spec: ModelSpec, *, source: str = "spec") -> ModelSpec | None:
    """Refuse `spec` (SpecMismatchError naming the fields) if `path` records another; returns the
    recorded one (None: none is recorded). `source` names where `spec` came from in the message."""
    recorded = recorded_spec(path)
    if recorded is not None and recorded.fingerprint != spec.fingerprint:
        raise SpecMismatchError(
            f"{source} differs from the one recorded in {Path(path) / SPEC} (given != recorded):"
            f" {', '.join(spec_differences(spec, recorded))}; open the directory under its spec, or use another"
            " directory"
        )
    return recorded


def adopt_spec(path: Pathish, spec: ModelSpec, *, source: str = "spec") -> None:
    """Make `spec` the directory's: recorded if none is, nothing if it is already, refused
    (SpecMismatchError naming the fields) if another is. A recorded spec is never replaced."""
    if check_spec(path, spec, source=source) is None:
        write_atomic(Path(path) / SPEC, spec.model_dump_json(indent=2) + "\n")


record_spec = adopt_spec
"""The name admin code and tests know `adopt_spec` by."""


def directory_spec(
    path: Pathish, given: ModelSpec | None = None, *, source: str = "spec",
    hint: str = "pass --spec FILE (ModelSpec JSON)",
) -> ModelSpec:  # fmt: skip
    """The spec to open `path` under: `given`, checked against the recorded one, else the recorded
    one; neither is NotFoundError (ending with `hint`), never a guess: a directory opened under a
    guessed spec would show its sessions as missing."""
    if given is not None:
        check_spec(path, given, source=source)
        return given
    recorded = recorded_spec(path)
    if recorded is None:
        raise NotFoundError(f"no ModelSpec recorded in {Path(path) / SPEC}: {hint}")
    return recorded


# -- config.json -----------------------------------------------------------------------------------


def record_config(config: StoreConfig, writer: str) -> Path:
    """Write `config` as `<config.path>/config.json` (atomically), every tier spelled out and every
    URL's password replaced by `***`; `writer` is noted in its `recorded` table."""
    import json

    from agentstate._version import __version__

    root = Path(config.path)
    values = config.model_dump(mode="json")
    values["path"] = str(root.resolve())
    values["tiers"] = [{"kind": t.kind, **t.model_dump(mode="json", exclude_defaults=True)} for t in config.tier_list()]
    values = redacted(values)
    file = root / CONFIG
    if _recorded_as(file, values, writer, __version__):
        return file  # a reopen with the same config by the same writer: nothing to rewrite (no fsyncs)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    values["recorded"] = {"by": writer, "at": stamp, "pid": os.getpid(), "agentstate": __version__}
    return write_atomic(file, json.dumps(values, indent=2) + "\n")


def _recorded_as(file: Path, values: dict[str, Any], writer: str, version: str) -> bool:
    """`file` records `values` already, by `writer` under this version."""
    import json

    try:
        found = json.loads(file.read_text(encoding="utf-8"))
        stamp = found.pop("recorded")
        return bool(found == values and stamp["by"] == writer and stamp["agentstate"] == version)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False


def record_config_unheld(config: StoreConfig, writer: str) -> Path:
    """`record_config` by a writer that does not hold the directory's lock: the lock is taken for
    the write, so a directory another writer holds is refused (DataDirLockedError), not rewritten."""
    from agentstate.datadir.lock import DataDirLock

    lock = DataDirLock.acquire(Path(config.path))
    try:
        return record_config(config, writer)
    finally:
        lock.release()


def recorded_config(path: Pathish) -> ConfigFile | None:
    """The config recorded in data directory `path` (its `path` is the directory, wherever it
    moved), or None: a directory of an older version, or never written, opens under the env."""
    from agentstate.settings import read_config_file

    file = Path(path) / CONFIG
    if not file.is_file():
        return None
    found = read_config_file(file)
    found.store["path"] = str(Path(path))
    return found


def record(config: StoreConfig, spec: ModelSpec, writer: str) -> None:
    """What a writer records once it holds the directory: its spec (checked against the recorded
    one) and the config it opened with."""
    adopt_spec(config.path, spec)
    record_config(config, writer)


def redacted(value: Any) -> Any:
    """`value` (JSON data) with the password of every URL in it replaced by `***`: the user-info
    password (`redis://user:pw@host`) and a `password` query parameter (`redis://host/0?password=pw`)."""
    if isinstance(value, dict):
        return {k: redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redacted(v) for v in value]
    if not isinstance(value, str) or "://" not in value:
        return value
    try:
        url = original = urlsplit(value)
        if url.password:
            url = url._replace(netloc=f"{url.username or ''}:{REDACTED}@{url.netloc.rpartition('@')[2]}")
        query = parse_qsl(url.query, keep_blank_values=True)
        if any(k.lower() == "password" for k, _ in query):
            hidden = [(k, REDACTED if k.lower() == "password" else v) for k, v in query]
            url = url._replace(query=urlencode(hidden, safe="*"))
    except ValueError:
        return value
    return value if url == original else urlunsplit(url)


def is_redacted(value: str) -> bool:
    """`value` is a URL whose password `redacted` removed (it must be given again to be used)."""
    return f":{REDACTED}@" in value or f"password={REDACTED}" in value.lower()


def _short(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors()[:3])
    return str(exc)
