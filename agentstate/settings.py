"""One config file for a store, `agentstate serve` and the engine adapters, layered under the env.

A config file is TOML (`.toml`), YAML (`.yaml`, `.yml`; needs PyYAML, `agentstate-kv[yaml]`) or JSON
(`.json`). Its top level holds `StoreConfig` keys; its tables are `spec` (a ModelSpec, used where
`--spec` would be), `service` (`agentstate serve`: host, port, tokens_file and every `Limits` key),
one table per engine adapter (its own keys, under the name the adapter declares: `agentstate.edges`)
and `recorded` (what agentstate notes when it records a config; ignored when read). Relative paths
in it (`path`, `service.tokens_file`, `service.handle_secret_file`, `<adapter>.path`) are relative
to the file's directory; a tier's `path` stays relative to the store's `path`. docs/config.md
lists every key.

Precedence, highest first: command-line flags (an engine's inline extra-config keys), env vars
(`AGENTSTATE_*`, `AGENTSTATE_SERVICE_*`), the config file, defaults. The file is `--config`, else
`AGENTSTATE_CONFIG_FILE`, else (admin commands and `serve`) the config a writer recorded in the data
directory, `DATA/config.json`. A writer (serve, an engine, a CLI write command) records the config it
opened with there, secrets removed (a URL's password becomes `***`), so that every later command
opens the same tiers.

The layering is done here, with pydantic-settings' own env source, rather than by a file source
inside StoreConfig: which file applies is decided per command (flag, env var, or the directory's
record), one file feeds several models (StoreConfig, ModelSpec, Limits, the adapters' settings),
and every plain `StoreConfig()` keeps reading the env alone, as the library and server code expect.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ConfigDict, ValidationError, create_model
from pydantic_settings import BaseSettings, EnvSettingsSource
from pydantic_settings.exceptions import SettingsError

from agentstate.config import StoreConfig
from agentstate.datadir.files import CONFIG, REDACTED, is_redacted  # noqa: F401  (REDACTED re-exported)
from agentstate.datadir.files import record_config, record_config_unheld, recorded_config  # noqa: F401  (re-exported)
from agentstate import edges
from agentstate.errors import ConfigError, InvalidArgumentError, MissingDependencyError, NotFoundError
from agentstate.spec import ModelSpec

CONFIG_ENV = "AGENTSTATE_CONFIG_FILE"
RECORDED = CONFIG
"""The config a writer recorded in its data directory (next to spec.json)."""
CORE_TABLES = ("spec", "service", "recorded")
"""The config file's tables the core reads; each engine adapter adds its own (`agentstate.edges.tables`)."""
S = TypeVar("S", bound=BaseSettings)
_StoreKeys = create_model(  # StoreConfig's keys checked alone: no env read, no defaults filled in
    "StoreKeys", __config__=ConfigDict(extra="forbid"),
    **{name: (f.annotation, f) for name, f in StoreConfig.model_fields.items()},  # type: ignore[call-overload]
)  # fmt: skip


@dataclass(frozen=True)
class ConfigFile:
    """A config file, read and checked: its StoreConfig keys and its tables."""

    source: Path
    store: dict[str, Any]
    spec: ModelSpec | None = None
    service: dict[str, Any] = field(default_factory=dict)
    adapters: dict[str, dict[str, Any]] = field(default_factory=dict)


def read_config_file(file: str | os.PathLike[str]) -> ConfigFile:
    """Read and check a config file; a bad one is NotFoundError, InvalidArgumentError or
    MissingDependencyError (YAML without PyYAML), never a pydantic or parser exception."""
    source = Path(file)
    raw = _parse(source)
    if not isinstance(raw, dict):
        raise InvalidArgumentError(f"config file {source}: the top level must be a table of keys")
    edge_tables = edges.tables()
    tables = (*CORE_TABLES, *edge_tables)
    unknown = sorted(set(raw) - set(tables) - set(StoreConfig.model_fields))
    if unknown:
        raise InvalidArgumentError(
            f"config file {source}: unknown key(s) {unknown}: the top level takes StoreConfig keys and the tables"
            f" {list(tables)} (docs/config.md)"
        )
    for table in tables:
        if not isinstance(raw.get(table, {}), dict):
            raise InvalidArgumentError(f"config file {source}: {table} must be a table")
    base = source.absolute().parent
    store = {k: v for k, v in raw.items() if k not in tables}
    _relative(store, base, "path")
    try:
        _StoreKeys.model_validate(store)
        spec = ModelSpec.model_validate(raw["spec"]) if "spec" in raw else None
    except ValidationError as exc:
        raise ConfigError(f"config file {source}: {problems(exc)}", key=first_key(exc)) from None
    service = dict(raw.get("service", {}))
    _relative(service, base, "tokens_file", "handle_secret_file")
    adapters = {name: dict(raw.get(name, {})) for name in edge_tables}
    for keys in adapters.values():
        _relative(keys, base, "path")
    return ConfigFile(source, store, spec, service, adapters)


def _parse(source: Path) -> object:
    kind = source.suffix.lower()
    if kind not in (".toml", ".yaml", ".yml", ".json"):
        raise InvalidArgumentError(f"config file {source}: name it .toml, .yaml, .yml or .json (its format)")
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NotFoundError(f"no config file {source}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"cannot read config file {source}: {exc}") from None
    try:
        if kind == ".json":
            return json.loads(text)
        if kind == ".toml":
            return _toml().loads(text)
        return _yaml().safe_load(text)
    except Exception as exc:  # noqa: BLE001 - each parser has its own error class; all mean bad syntax
        raise InvalidArgumentError(f"config file {source} is not valid {kind[1:].upper()}: {exc}") from None


def _toml() -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib


def _yaml() -> Any:
    try:
        import yaml
    except ModuleNotFoundError:
        raise MissingDependencyError(
            "a YAML config file needs PyYAML, which is not installed: pip install 'agentstate-kv[yaml]'"
            " (or write the file as TOML or JSON)", module="yaml", extra="yaml",
        ) from None  # fmt: skip
    return yaml


def _relative(table: dict[str, Any], base: Path, *keys: str) -> None:
    for key in keys:
        if isinstance(table.get(key), str) and table[key]:
            table[key] = str(base / Path(table[key]).expanduser())


# -- layering: flags > env > file > defaults --------------------------------------------------------


def env_values(cls: type[BaseSettings]) -> dict[str, Any]:
    """The fields of `cls` the environment sets, as pydantic-settings reads them."""
    try:
        return EnvSettingsSource(cls)()
    except SettingsError as exc:
        raise InvalidArgumentError(f"env vars of {cls.__name__}: {exc}") from None


def layered(
    cls: type[S], file: dict[str, Any], flags: dict[str, Any], *, file_name: str, env_prefix: str,
    env: dict[str, Any] | None = None,
) -> S:  # fmt: skip
    """`cls` from `file` < env < `flags` (< each default); errors name where the bad value came from."""
    env = env_values(cls) if env is None else env
    values = {**file, **env, **flags}

    def source(key: str) -> str:
        if key in flags:
            return "argument"
        if key in env:
            return f"env {env_prefix}{key.upper()}"
        return file_name if key in file else "default"

    try:
        return cls(**values)
    except ValidationError as exc:
        raise ConfigError(f"{cls.__name__}: {problems(exc, source)}", key=first_key(exc)) from None


def store_config(file: ConfigFile | None = None, **flags: Any) -> StoreConfig:
    """The StoreConfig of `file` (may be None) under the env, under `flags` (e.g. path, tenant)."""
    name = str(file.source) if file else ""
    config = layered(StoreConfig, file.store if file else {}, flags, file_name=name, env_prefix="AGENTSTATE_")
    for key, value in _strings(config.model_dump(mode="json")):
        if is_redacted(value):
            raise InvalidArgumentError(
                f"{key} in {file.source if file else 'the config'} had its password removed when it was recorded:"
                f" give it again (env AGENTSTATE_{key.split('.')[0].upper()}, or --config FILE)"
            )
    return config


def adapter_keys(table: str, own: dict[str, Any], rest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An engine adapter's (own keys, StoreConfig keys) with its config file folded in: the file is
    `config_file` in `own`, else env AGENTSTATE_CONFIG_FILE. Inline keys win over the env, the env
    over the file: file keys the env also sets are dropped here, so that `StoreConfig(**rest)` reads
    them from the env. The file's `[table]` holds the adapter's keys; its top-level `path` is the
    data root unless the adapter's keys name one."""
    name = own.get("config_file") or os.environ.get(CONFIG_ENV)
    if not name:
        return own, rest
    file = read_config_file(name)
    top = {"path": file.store["path"]} if "path" in file.store else {}
    own = {**top, **file.adapters.get(table, {}), **own, "config_file": name}
    env = env_values(StoreConfig)
    rest = {**{k: v for k, v in file.store.items() if k not in env and k != "path"}, **rest}
    return own, rest


# -- the config recorded in a data directory: `agentstate.datadir` owns it -------------------------


def _strings(value: Any, key: str = "") -> list[tuple[str, str]]:
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(v, f"{key}.{k}" if key else k)]
    if isinstance(value, list):
        return [s for i, v in enumerate(value) for s in _strings(v, f"{key}.{i}")]
    return [(key, value)] if isinstance(value, str) else []


def first_key(exc: ValidationError) -> str | None:
    """The setting the first problem of `exc` is about (`lmdb_map_size`, `tiers.0.compression`)."""
    errors = exc.errors()
    return ".".join(map(str, errors[0]["loc"])) or None if errors else None


def problems(exc: ValidationError, source: Callable[[str], str] | None = None) -> str:
    """A ValidationError as one line: `key.sub (where it came from): message; ...`."""
    lines = []
    for e in exc.errors()[:5]:
        loc = ".".join(map(str, e["loc"])) or "value"
        where = f" ({source(str(e['loc'][0]))})" if source and e["loc"] else ""
        lines.append(f"{loc}{where}: {e['msg']}")
    more = len(exc.errors()) - len(lines)
    return "; ".join(lines) + (f"; and {more} more" if more > 0 else "")
