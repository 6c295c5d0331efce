"""What a command runs with: its configuration loaded (`agentstate.settings` layers the file, the
env and its flags), the data directory opened under it, and `agentstate serve`'s [service] keys.

The admin CLI's commands, `serve` and the library's `agentstate.ops.admin.open_store` use these;
what a data directory records about itself (spec.json, config.json) is `agentstate.datadir`'s.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentstate.config import StoreConfig, parse_size
from agentstate.datadir import check_spec, is_store
from agentstate.errors import InvalidArgumentError, NotFoundError
from agentstate.settings import (
    CONFIG_ENV,
    ConfigFile,
    env_values,
    layered,
    problems,
    read_config_file,
    recorded_config,
    store_config,
)
from agentstate.spec import ModelSpec

if TYPE_CHECKING:
    from agentstate.server.gate import Limits
    from agentstate.store import StateStore


@dataclass(frozen=True)
class Loaded:
    """What a command runs with: `store` (its flags applied), `recordable` (what a writer records:
    the same without per-command flags such as --tenant) and the file it came from, if any."""

    store: StoreConfig
    recordable: StoreConfig
    file: ConfigFile | None


def load(
    config_file: str | os.PathLike[str] | None = None, *, path: str | os.PathLike[str] | None = None,
    tenant: str | None = None, default_path: Path = Path("agentstate-data"), recorded: bool = True,
) -> Loaded:  # fmt: skip
    """A command's configuration. The file: `config_file`, else env AGENTSTATE_CONFIG_FILE, else
    (with `recorded`) the data directory's config.json. The directory: `path` (a flag), else env
    AGENTSTATE_PATH, else the file's `path`, else `default_path`."""
    name = config_file or os.environ.get(CONFIG_ENV) or None
    file = read_config_file(name) if name else None
    directory = Path(path or env_values(StoreConfig).get("path") or (file and file.store.get("path")) or default_path)
    if file is None and recorded:
        file = recorded_config(directory)
    base = store_config(file, path=directory)
    return Loaded(base if tenant is None else store_config(file, path=directory, tenant=tenant), base, file)


def directory_spec(path: Path, spec_file: Path | None, file: ConfigFile | None) -> ModelSpec:
    """The spec to open `path` under: `spec_file`, else the file's [spec], else the recorded one;
    a given one must be the recorded one (never guessed, never silently replaced)."""
    from agentstate.ops.admin import resolve_spec

    given = file_spec(path, file) if spec_file is None else None
    return given or resolve_spec(path, spec_file)


def file_spec(path: Path, file: ConfigFile | None) -> ModelSpec | None:
    """The [spec] of `file`, if it has one; SpecMismatchError naming the fields if `path` records another."""
    if file is None or file.spec is None:
        return None
    check_spec(path, file.spec, source=f"the [spec] of {file.source}")
    return file.spec


@contextlib.asynccontextmanager
async def open_configured(
    loaded: Loaded, *, spec_file: Path | None = None, spec: ModelSpec | None = None, create: bool = False,
    read_only: bool = False, writer: str = "agentstate",
) -> AsyncIterator[StateStore]:  # fmt: skip
    """Open a data directory as the admin commands do (see `agentstate.ops.admin.open_store`), under
    `loaded.store`. A writer (not `read_only`) records `loaded.recordable` as config.json, and the
    spec it opened under as spec.json where none is recorded (`StateStore.open` does both)."""
    from agentstate.store import StateStore

    config = loaded.store
    root = Path(config.path)
    if not create and not is_store(root, shared_catalog=config.catalog_url is not None):
        raise NotFoundError(
            f"no agentstate data directory at {root} (name the data directory with -p DIR or AGENTSTATE_PATH)"
        )
    model = spec or directory_spec(root, spec_file, loaded.file)
    async with StateStore.open(config, model, read_only=read_only, writer=writer, recorded=loaded.recordable) as store:
        yield store


class ServiceKeys(BaseModel):
    """The [service] keys that are not `Limits` keys (None: the command's default)."""

    model_config = ConfigDict(extra="forbid")

    host: str | None = Field(default=None, description="address to listen on (default 127.0.0.1)")
    port: int | None = Field(default=None, ge=1, le=65535, description="port to listen on (default 8470)")
    tokens_file: Path | None = Field(
        default=None, description="JSON {bearer token: tenant}; default: env AGENTSTATE_TOKENS"
    )


def service_settings(file: ConfigFile | None, **flags: Any) -> tuple[ServiceKeys, Limits]:
    """[service] of `file` as (its own keys, Limits under env AGENTSTATE_SERVICE_* under `flags`).
    Byte-size keys (`*_bytes`) take "1GiB" in the file and the env. Needs the service extra."""
    from agentstate.server.gate import Limits

    table = dict(file.service) if file else {}
    name = str(file.source) if file else ""
    try:
        keys = ServiceKeys.model_validate({k: table.pop(k) for k in list(table) if k in ServiceKeys.model_fields})
    except ValidationError as exc:
        raise InvalidArgumentError(f"config file {name}: service: {problems(exc)}") from None
    env = _sizes(env_values(Limits), lambda k: f"env AGENTSTATE_SERVICE_{k.upper()}")
    table = _sizes(table, lambda k: f"config file {name}: service.{k}")
    return keys, layered(Limits, table, flags, file_name=name, env_prefix="AGENTSTATE_SERVICE_", env=env)


def _sizes(values: dict[str, Any], where: Callable[[str], str]) -> dict[str, Any]:
    out = dict(values)
    for key, value in values.items():
        if key.endswith("_bytes") and isinstance(value, str):
            try:
                out[key] = int(parse_size(value))  # type: ignore[call-overload]
            except ValueError as exc:
                raise InvalidArgumentError(f"{where(key)}: {exc}") from None
    return out
