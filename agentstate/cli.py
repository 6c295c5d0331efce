"""The `agentstate` command line (typer + rich).

Every admin command opens a data directory under the ModelSpec recorded in `<path>/spec.json`
(or `--spec FILE`), runs one operation from `agentstate.ops.admin`, `agentstate.ops.verify` or
`agentstate.ops.archive`, and prints its report: a rich table, or the report's JSON with `--json`.
`ls`, `inspect`, `stats`, `rm` and `fork` also take `--url URL --token TOKEN` (env
`AGENTSTATE_URL`, `AGENTSTATE_TOKEN`) to ask a running `agentstate serve` through the SDK instead,
as the token's tenant, and print the same reports (`stats`: the tenant's part of it).
Progress bars and log lines go to stderr, so `--json` output on stdout stays parseable. Exit
codes: 0 done, 1 the operation failed with a typed error (one line on stderr, no traceback; a
missing optional dependency names the extra to install) or `verify` found damage it did not
repair, 2 bad usage.

Configuration (`agentstate.settings`, docs/config.md): flags > env vars > the config file (`--config`
or `AGENTSTATE_CONFIG_FILE`, else the one a writer recorded in `<path>/config.json`) > defaults. Write
commands record the config they opened with there.

Heavy modules (torch, the store, the service) are imported inside the commands that use them, so
`--help` and `version` answer in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import json as jsonlib
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from agentstate.cli_tables import Column, print_table
from agentstate.errors import (
    AgentStateError,
    DataDirLockedError,
    InvalidArgumentError,
    MissingDependencyError,
    NotFoundError,
    SessionNotFoundError,
)

if TYPE_CHECKING:
    from pydantic import BaseModel

    from agentstate.client import AsyncClient
    from agentstate.configured import Loaded
    from agentstate.spec import ModelSpec
    from agentstate.store import StateStore

app = typer.Typer(help="agentstate: KV-state persistence for LLM agents", no_args_is_help=True)
out = Console()
err = Console(stderr=True)
T = TypeVar("T")
_command = "agentstate"
"""the command running, as typed (`agentstate serve`): what an install hint says needs the extra"""
_config_file: Path | None = None
"""--config / AGENTSTATE_CONFIG_FILE"""

PathOpt = Annotated[
    Path, typer.Option("--path", "-p", envvar="AGENTSTATE_PATH", help="data directory", show_default=True)
]
SpecOpt = Annotated[Path | None, typer.Option("--spec", help="ModelSpec JSON (default: <path>/spec.json)")]
TenantOpt = Annotated[
    str | None, typer.Option("--tenant", "-t", help="tenant (default: AGENTSTATE_TENANT or 'default')")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the report as JSON")]
DEFAULT_PATH = Path("agentstate-data")
DEFAULT_PORT = 8470
"""agentstate.server.service.DEFAULT_PORT, written here too so that `--help` needs no FastAPI."""
# where --url is allowed the data directory has no default, so that --url and --path exclude each other
LocalPathOpt = Annotated[
    Path | None,
    typer.Option("--path", "-p", envvar="AGENTSTATE_PATH", help=f"data directory (default: {DEFAULT_PATH})"),
]
UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url", envvar="AGENTSTATE_URL", help="a running `agentstate serve` to ask instead of a data directory"
    ),
]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", envvar="AGENTSTATE_TOKEN", help="bearer token for --url (its tenant is the one shown)"),
]


class LogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"
    critical = "critical"


class _JsonLines(logging.Formatter):
    """One JSON object per log line: time (UTC, ISO 8601), level, logger, message[, exception]."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return jsonlib.dumps(line)


def configure_logging(level: str = "info", as_json: bool = False) -> None:
    """Send the `agentstate` loggers' lines at `level` and above to stderr (plain or JSON lines),
    and uvicorn's (the service's startup and access lines) the same way, so `--log-json` gives one
    format; the service then leaves uvicorn's loggers as configured here (`uvicorn_config`)."""
    handler = logging.StreamHandler(sys.stderr)
    plain = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler.setFormatter(_JsonLines() if as_json else plain)
    from agentstate.server.logcut import ShortArgs

    handler.addFilter(ShortArgs())  # a client-sent 100,000-character id is cut in every line
    logger = logging.getLogger("agentstate")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
    server = logging.getLogger("uvicorn")  # uvicorn.error and uvicorn.access propagate to it
    server.handlers[:] = [handler]
    server.setLevel(level.upper())
    server.propagate = False


@app.callback()
def _options(
    ctx: typer.Context,
    log_level: Annotated[
        LogLevel,
        typer.Option(
            "--log-level", envvar="AGENTSTATE_LOG_LEVEL", case_sensitive=False, help="agentstate's log lines on stderr"
        ),
    ] = LogLevel.info,
    log_json: Annotated[
        bool, typer.Option("--log-json", envvar="AGENTSTATE_LOG_JSON", help="log lines as JSON objects, one a line")
    ] = False,
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=lambda v: _print_version(v), help="print the version and exit"),
    ] = False,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            envvar="AGENTSTATE_CONFIG_FILE",
            help="config file (TOML, YAML or JSON; docs/config.md): env vars and flags override it; default: the one"
            " recorded in the data directory",
        ),
    ] = None,
) -> None:
    global _command, _config_file
    _command = f"{ctx.command_path} {ctx.invoked_subcommand}"
    _config_file = config
    configure_logging(log_level.value, log_json)


def _print_version(wanted: bool) -> None:
    if wanted:
        from agentstate._version import __version__

        typer.echo(__version__)
        raise typer.Exit()


def _n(count: int, noun: str) -> str:
    """`1 session`, `2 sessions`."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


class _Bars:
    """admin.Progress drawn as rich bars on stderr."""

    def __init__(self, bars: Any) -> None:
        self.bars = bars
        self.task: Any = None

    def start(self, description: str, total: int) -> None:
        if self.task is not None:
            self.bars.update(self.task, completed=self.bars.tasks[-1].total)
        self.task = self.bars.add_task(description, total=total)

    def advance(self, n: int = 1) -> None:
        self.bars.advance(self.task, n)


@contextmanager
def _progress(enabled: bool = True) -> Iterator[Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
    from rich.progress import Progress as RichProgress

    from agentstate.ops.admin import QUIET

    if not enabled:
        yield QUIET
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with RichProgress(*columns, console=err, transient=False) as bars:
        yield _Bars(bars)


def _fail(exc: Exception, hint: str = "") -> typer.Exit:
    err.print(f"[red]error[/red] ({type(exc).__name__}): {escape(str(exc) + hint)}", highlight=False)
    return typer.Exit(1)


@contextmanager
def _reported(extra: str | None = None, url_hint: bool = False, needs: str = "") -> Iterator[None]:
    """A typed error is one line on stderr and exit code 1; so is a missing optional dependency:
    the line says the command (and `needs`, what in it) needs it, and names the extra to install
    (`extra` overriding the usual one)."""
    try:
        yield
    except DataDirLockedError as exc:
        raise _fail(exc, " (or ask the server: --url URL --token TOKEN)" if url_hint else "") from None
    except MissingDependencyError as exc:  # raised by a module of ours (the SDK): said for the command
        missing = ModuleNotFoundError(name=exc.name)
        raise _fail(MissingDependencyError.of(missing, _command + needs, extra or exc.extra) or exc) from None
    except AgentStateError as exc:
        raise _fail(exc) from None
    except ModuleNotFoundError as exc:
        hint = MissingDependencyError.of(exc, _command + needs, extra)
        if hint is None:
            raise
        raise _fail(hint) from None
    except OSError as exc:  # a path the command was given (missing, a directory, unreadable): one line
        raise _fail(exc) from None


def _output_file(file: Path, what: str) -> None:
    """Refuse, before any work, a file the command is to write that cannot be: a directory, or one
    whose parent directory does not exist (an export would read every chunk first, then fail)."""
    if file.is_dir():
        raise InvalidArgumentError(f"{what} {file} is a directory, not a file")
    parent = file.parent
    if not parent.is_dir():
        why = "does not exist" if not parent.exists() else "is not a directory"
        raise NotFoundError(f"cannot write {what} {file}: {parent} {why}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"cannot write {what} {file}: directory {parent} is not writable")


def _run(op: Callable[[], Awaitable[T]], url_hint: bool = False, needs: str = "") -> T:
    """Run one async operation; errors as `_reported` says."""
    import asyncio

    with _reported(url_hint=url_hint, needs=needs):
        return asyncio.run(op())  # type: ignore[arg-type]
    raise AssertionError("unreachable")  # _reported raises or re-raises


def _with_store(
    path: Path, spec: Path | None, tenant: str | None, fn: Callable[[StateStore], Awaitable[T]], *,
    create: bool = False, model: ModelSpec | None = None, read_only: bool = False, url_hint: bool = False,
) -> T:  # fmt: skip
    async def go() -> T:
        from agentstate.configured import open_configured

        async with open_configured(
            _configured(path, tenant), spec_file=spec, spec=model, create=create, read_only=read_only, writer=_command
        ) as store:
            return await fn(store)

    return _run(go, url_hint=url_hint)


def _configured(path: Path | None, tenant: str | None = None) -> Loaded:
    """The command's configuration (see the module docstring); a --path left at its default gives
    way to the config file's."""
    from agentstate.configured import load

    return load(_config_file, path=path if _given("path") else None, tenant=tenant, default_path=path or DEFAULT_PATH)


def _given(option: str) -> bool:
    """The command's `option` was typed or came from its env var (it beats the config file)."""
    import click

    ctx = click.get_current_context(silent=True)
    return ctx is not None and getattr(ctx.get_parameter_source(option), "name", "DEFAULT") != "DEFAULT"


def _data_dir(path: Path) -> Path:
    with _reported():
        return Path(_configured(path).store.path)
    raise AssertionError("unreachable")  # _reported raises or re-raises


def _remote(
    ctx: typer.Context, url: str | None, token: str | None, path: Path | None, spec: Path | None, tenant: str | None
) -> tuple[str, str] | None:
    """(url, token) when the command asks a server, else None (a data directory). A server takes no
    --path, --spec or --tenant (it knows its data and spec, the token its tenant); where one of
    --url and --path was typed and the other came from the environment, the typed one wins."""
    if url is None:
        return None
    typed = {name: getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE" for name in ("url", "path")}
    if path is not None and typed["url"] != typed["path"]:
        if typed["path"]:
            return None
        path = None
    where = "--url" if typed["url"] else "AGENTSTATE_URL"
    for given, name in ((path, "--path"), (spec, "--spec"), (tenant, "--tenant")):
        if given is not None:
            raise typer.BadParameter(f"not with {where} (the server knows its data and spec, the token its tenant)",
                                     param_hint=name)  # fmt: skip
    if not token:
        raise typer.BadParameter(f"{where} needs a bearer token (--token or AGENTSTATE_TOKEN)", param_hint="--token")
    return url, token


def _ask(server: tuple[str, str], fn: Callable[[AsyncClient], Awaitable[T]]) -> T:
    """One operation against a running service, through the SDK."""

    async def go() -> T:
        from agentstate.client import AsyncClient

        async with AsyncClient(*server) as client:
            return await fn(client)

    return _run(go, needs=" --url")


def _emit(report: BaseModel | list[Any] | RemoveReport, as_json: bool, render: Callable[[], None]) -> None:
    if not as_json:
        render()
    elif dataclasses.is_dataclass(report):
        sys.stdout.write(jsonlib.dumps(dataclasses.asdict(report), indent=2) + "\n")
    else:
        from agentstate.ops.reports import dumps

        sys.stdout.write(dumps(report) + "\n")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


# -- commands ----------------------------------------------------------------------------------------


@app.command()
def demo(
    data_dir: Annotated[
        Path | None, typer.Option(help="data directory (default ./agentstate-demo, emptied first and kept)")
    ] = None,
    agents: Annotated[int, typer.Option(min=1, max=256, help="agents sharing one system prompt")] = 4,
    turns: Annotated[int, typer.Option(min=1, max=64, help="turns per agent, a snapshot after each")] = 4,
) -> None:
    """Agents on a small random-weight model, with and without agentstate: TTFT and hit rate."""
    with _reported(extra="demo"):
        from agentstate.demo import main as run

        done = run(data_dir, agents, turns, config_file=_config_file)
    if not done:
        raise typer.Exit(1)


def _when(at: float | None, now: float | None = None) -> str:
    """A wall-clock time relative to now, as an operator reads it: `in 4m10s`, `2h03m ago`, `-`."""
    if at is None:
        return "-"
    delta = at - (time.time() if now is None else now)
    left = abs(delta)
    if left < 60:
        text = f"{left:.0f}s"
    elif left < 3600:
        text = f"{int(left // 60)}m{int(left % 60):02d}s"
    elif left < 86400:
        text = f"{int(left // 3600)}h{int(left % 3600 // 60):02d}m"
    else:
        text = f"{left / 86400:.1f}d"
    return f"in {text}" if delta >= 0 else f"{text} ago"


@app.command("ls")
def ls(
    ctx: typer.Context,
    path: LocalPathOpt = None,
    spec: SpecOpt = None,
    tenant: TenantOpt = None,
    json: JsonOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """List the tenant's sessions."""
    server = _remote(ctx, url, token, path, spec, tenant)
    if server:
        from pydantic import RootModel

        from agentstate.ops.reports import SessionRow

        rows = _ask(server, lambda c: c.get_json("/v1/admin/sessions", RootModel[list[SessionRow]])).root
        others: dict[str, int] = {}  # a server shows one tenant's sessions only
    else:
        from agentstate.ops.admin import list_sessions, other_tenants

        async def listing(store: Any) -> tuple[Any, dict[str, int]]:
            found = await list_sessions(store)
            return found, ({} if found else await other_tenants(store))

        rows, others = _with_store(path or DEFAULT_PATH, spec, tenant, listing, read_only=True, url_hint=True)

    def render() -> None:
        columns = [
            Column("session"), Column("version", 7, True), Column("tokens", right=True), Column("chunks", 5, True),
            Column("tail", 6, True), Column("size", 2, True), Column("parent", 8), Column("pinned", 9),
            Column("ttl s", 10, True), Column("guaranteed", 11), Column("expires", 4), Column("last hit", 3),
            Column("lossy", 12),
        ]  # fmt: skip
        cells = [
            [
                r.session_id, str(r.version), str(r.tokens), str(r.chunks), str(r.tail_tokens), _size(r.bytes),
                r.parent or "-", "yes" if r.pinned else "", f"{r.ttl_seconds:g}" if r.ttl_seconds else "-",
                _when(r.guaranteed_until), "never" if r.expires_at is None else _when(r.expires_at),
                _when(r.last_hit_at), "fp8" if r.lossy else "",
            ]
            for r in rows
        ]
        if rows:
            print_table(out, columns, cells)
        out.print(_n(len(rows), "session"))
        if not rows and others:
            where = ", ".join(f"{t} ({n})" for t, n in others.items())
            out.print(f"sessions of other tenants here: {where}; list them with --tenant T", markup=False)

    _emit(rows, json, render)


@app.command()
def inspect(
    ctx: typer.Context,
    session: Annotated[str, typer.Argument(help="session id")],
    path: LocalPathOpt = None,
    spec: SpecOpt = None,
    tenant: TenantOpt = None,
    json: JsonOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """A session's manifest, and for each chunk its key, size and the tiers that hold it."""
    server = _remote(ctx, url, token, path, spec, tenant)
    if server:
        from agentstate.keys import validate_id
        from agentstate.ops.reports import SessionDetail

        with _reported():
            route = f"/v1/admin/sessions/{validate_id(session)}"  # checked ids are URL-safe
        d = _ask(server, lambda c: c.get_json(route, SessionDetail))
    else:
        from agentstate.ops.admin import inspect_session

        d = _with_store(
            path or DEFAULT_PATH, spec, tenant, lambda s: inspect_session(s, session), read_only=True, url_hint=True
        )

    def render() -> None:
        out.print(
            f"[bold]{d.tenant}/{d.session_id}[/bold] version {d.version}, {d.num_tokens} tokens "
            f"({_n(len(d.chunks) - bool(d.tail_key), 'chunk')} of {d.chunk_tokens}, tail {d.tail_tokens}), {_size(d.bytes)}, "
            f"spec {d.fingerprint}, {d.missing} missing"
        )
        if d.lossy:
            out.print(
                f"lossy: stored where tiers keep fp8 ({', '.join(d.lossy_tiers) or 'when it was written'}): a resume may"
                " give back KV within fp8's error bound, not bit-exact (ResumeResult.exact)"
            )
        ttl = f"ttl {d.ttl_seconds:g}s (refreshed by hits)" if d.ttl_seconds else "no ttl"
        out.print(
            f"retention: {'pinned' if d.pinned else ttl}, guaranteed until {_when(d.guaranteed_until)}, "
            f"expires {'never' if d.expires_at is None else _when(d.expires_at)}, last hit {_when(d.last_hit_at)}"
            + (f", held by a {d.hint} hint until {_when(d.hint_held_until)}" if d.hint else "")
        )
        if d.usage is not None:
            u = d.usage
            read = ", ".join(f"{tier} {_size(n)}" for tier, n in sorted(u.bytes_read.items()) if n) or "none"
            out.print(
                f"usage: {_n(u.resumes, 'resume')}, {_n(u.snapshots, 'snapshot')}, {_n(u.hints, 'hint')}; tokens read {u.tokens_read},"
                f" written {u.tokens_written} (deduped {u.tokens_deduped}), recomputed {u.tokens_recomputed};"
                f" bytes written {_size(u.bytes_written)}, read {read}"
            )
        if d.state:
            out.print(f"state: {d.state}", markup=False)
        if d.records:
            out.print(f"records: {d.records} (a framework's state kept with the session: checkpoints, items)")
        columns = [Column("#", right=True), Column("kind"), Column("tokens", right=True), Column("size", right=True),
                   Column("tiers"), Column("key")]  # fmt: skip
        cells = [
            [str(c.index), c.kind, f"{c.first_token}+{c.tokens}", _size(c.bytes), ", ".join(c.tiers) or "MISSING",
             c.key]
            for c in d.chunks
        ]
        print_table(out, columns, cells)

    _emit(d, json, render)


@app.command()
def stats(
    ctx: typer.Context,
    path: LocalPathOpt = None,
    spec: SpecOpt = None,
    tenant: TenantOpt = None,
    json: JsonOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Tiers, sessions and what sharing saves.

    With --url: the token's tenant's sessions only (tiers and counters are on the server's /metrics)."""
    server = _remote(ctx, url, token, path, spec, tenant)
    if server:
        t = _ask(server, lambda c: c.stats())

        def render_tenant() -> None:
            where = escape(server[0])
            out.print(f"[bold]{where}[/bold]: tenant {t.tenant}, spec {t.fingerprint}, {t.chunk_tokens} tokens/chunk")
            _sharing(t.sessions, t.session_tokens, t.unique_chunks, t.tails, t.unique_bytes, t.logical_bytes)

        _emit(t, json, render_tenant)
        return
    from agentstate.ops.admin import stats as run

    r = _with_store(path or DEFAULT_PATH, spec, tenant, run, read_only=True, url_hint=True)

    def render() -> None:
        out.print(
            f"[bold]{r.path}[/bold]: spec {r.spec.model_id} ({r.spec.fingerprint}), {r.chunk_tokens} tokens/chunk"
        )
        columns = [Column("tier"), Column("record"), Column("durable"), Column("remote"),
                   Column("capacity", right=True), Column("chunks", right=True)]  # fmt: skip
        cells = [
            [t.name, *("yes" if f else "" for f in (t.record, t.durable, t.remote)),
             _size(t.capacity_bytes) if t.capacity_bytes is not None else "-", str(t.chunks)]
            for t in r.tiers
        ]
        print_table(out, columns, cells)
        _sharing(r.tenant_sessions, r.session_tokens, r.unique_chunks, r.tails, r.unique_bytes, r.logical_bytes)
        from agentstate.edges import key_spaces

        for space in key_spaces():  # an adapter's own keys (agentstate.edges), e.g. an engine's pages
            if count := (r.model_extra or {}).get(space.report):
                out.print(f"{count} {space.label}")

    _emit(r, json, render)


def _sharing(sessions: int, tokens: int, chunks: int, tails: int, unique: int, logical: int) -> None:
    saved = 1 - unique / logical if logical else 0.0
    out.print(
        f"{_n(sessions, 'session')}, {_n(tokens, 'token')}, {chunks} distinct chunks + {_n(tails, 'tail')}: {_size(unique)} stored "
        f"for {_size(logical)} of sessions ({saved:.0%} shared)"
    )


@dataclass(frozen=True)
class RemoveReport:
    """What `agentstate rm` did: sessions removed, and those that did not exist (exit code 1)."""

    removed: list[str]
    missing: list[str]


@app.command("rm")
def rm(
    ctx: typer.Context,
    sessions: Annotated[list[str], typer.Argument(help="sessions to remove (their chunks go unless shared)")],
    path: LocalPathOpt = None,
    spec: SpecOpt = None,
    tenant: TenantOpt = None,
    json: JsonOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Remove sessions (a write: refused while a server holds the directory; use --url then)."""
    from agentstate.keys import validate_id

    with _reported():
        for sid in sessions:  # every id checked before anything is removed
            validate_id(sid)

    async def remove(delete: Callable[[str], Awaitable[None]]) -> RemoveReport:
        removed, missing = [], []
        for sid in dict.fromkeys(sessions):
            try:
                await delete(sid)
                removed.append(sid)
            except SessionNotFoundError:
                missing.append(sid)
        return RemoveReport(removed, missing)

    server = _remote(ctx, url, token, path, spec, tenant)
    if server:
        r = _ask(server, lambda c: remove(c.delete))
    else:
        r = _with_store(path or DEFAULT_PATH, spec, tenant, lambda s: remove(s.delete), url_hint=True)

    def render() -> None:
        if r.removed:
            out.print(f"removed {', '.join(r.removed)}", markup=False)
        for sid in r.missing:
            err.print(f"[red]error[/red] (SessionNotFoundError): no session {escape(repr(sid))}", highlight=False)

    _emit(r, json, render)
    if r.missing:
        raise typer.Exit(1)


@app.command()
def fork(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="session to fork")],
    new: Annotated[str, typer.Argument(help="id of the new session (must not exist)")],
    path: LocalPathOpt = None,
    spec: SpecOpt = None,
    tenant: TenantOpt = None,
    json: JsonOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """A new session sharing every chunk of SOURCE (no copy; a write, like rm)."""
    server = _remote(ctx, url, token, path, spec, tenant)
    if server:
        info = _ask(server, lambda c: c.fork(source, new))
    else:

        async def local(store: StateStore) -> Any:
            from agentstate.wire import SessionInfo

            return SessionInfo.of(await store.fork(source, new))

        info = _with_store(path or DEFAULT_PATH, spec, tenant, local, url_hint=True)
    _emit(info, json, lambda: out.print(
        f"forked {info.parent} -> {info.session_id}: version {info.version}, {info.num_tokens} tokens", markup=False
    ))  # fmt: skip


@app.command()
def evict(
    tier: Annotated[str, typer.Argument(help="cache tier to drop copies from (not the record tier)")],
    budget: Annotated[
        int | None, typer.Option(help="evict oldest first until the tier uses at most this many bytes")
    ] = None,
    session: Annotated[list[str] | None, typer.Option("--session", "-s", help="evict this session's chunks")] = None,
    path: PathOpt = DEFAULT_PATH,
    spec: SpecOpt = None,
    tenant: TenantOpt = None,
    json: JsonOpt = False,
) -> None:
    """Drop cached copies from a cache tier (written down first when no lower tier has them)."""
    from agentstate.ops.admin import evict as run

    r = _with_store(path, spec, tenant, lambda s: run(s, tier, budget_bytes=budget, sessions=session or ()))
    _emit(r, json, lambda: out.print(
        f"{r.tier}: evicted {r.evicted} ({_size(r.evicted_bytes)}), demoted {r.demoted}, kept {r.skipped_pinned} "
        f"pinned; {_size(r.used_before)} -> {_size(r.used_after)}"
    ))  # fmt: skip


@app.command()
def gc(path: PathOpt = DEFAULT_PATH, spec: SpecOpt = None, json: JsonOpt = False) -> None:
    """Remove expired sessions and chunks nothing references."""
    from agentstate.ops.admin import gc as run

    with _progress(not json) as bars:
        r = _with_store(path, spec, None, lambda s: run(s, bars))
    _emit(r, json, lambda: out.print(f"removed {r.removed}"))


@app.command()
def verify(
    repair: Annotated[
        bool, typer.Option(help="drop corrupt copies (they read as misses; the next snapshot rewrites them)")
    ] = False,
    path: PathOpt = DEFAULT_PATH,
    spec: SpecOpt = None,
    json: JsonOpt = False,
) -> None:
    """Check every stored chunk and tail, in every tier, against its checksum (all tenants)."""
    from agentstate.ops.verify import verify as run

    with _progress(not json) as bars:
        r = _with_store(path, spec, None, lambda s: run(s, repair=repair, progress=bars), read_only=not repair)

    def render() -> None:
        names = ["checked", "of which engine pages", "ok", "corrupt", "missing", "repaired"]
        cells = [[t.tier, *(str(v) for v in (t.checked, t.pages, t.ok, t.corrupt, t.missing, t.repaired))]
                 for t in r.tiers]
        print_table(out, [Column("tier"), *(Column(n, right=True) for n in names)], cells)
        for b in r.corrupt:
            out.print(f"[red]corrupt[/red] {b.tier} {b.key}: {escape(b.problem)}", highlight=False)
        for a in r.affected:
            out.print(f"session {a.tenant}/{a.session_id}: {a.restorable_tokens} of {a.tokens} tokens restorable")
        if r.catalog_lost:
            found = "no catalog was found (an empty one was made)" if r.catalog_created else "the catalog names none"
            out.print(
                f"[red]catalog lost[/red]: the record tier holds {len(r.orphans)} chunks and tails, but {found}:"
                " restore the catalog before anything else (gc would delete them all)", highlight=False,
            )  # fmt: skip
        elif r.orphans:
            out.print(f"{len(r.orphans)} chunks and tails no session or prefix names (gc removes them)")
        out.print("[green]clean[/green]" if r.clean else ("repaired" if r.repaired else "[red]damaged[/red]"))

    _emit(r, json, render)
    if r.catalog_lost or (not r.clean and not r.repaired):
        raise typer.Exit(1)


@app.command("export")
def export(
    archive: Annotated[Path, typer.Argument(help="archive file to write (a tar)")],
    session: Annotated[
        list[str] | None, typer.Argument(help="sessions to export (default: all of the tenant's)")
    ] = None,
    all_tenants: Annotated[bool, typer.Option(help="export every tenant's sessions")] = False,
    path: PathOpt = DEFAULT_PATH,
    spec: SpecOpt = None,
    tenant: TenantOpt = None,
    json: JsonOpt = False,
) -> None:
    """Write sessions to a portable archive (every chunk checked, shared chunks stored once)."""
    from agentstate.ops.archive import export_sessions

    with _reported():
        _output_file(archive, "archive")

    with _progress(not json) as bars:
        r = _with_store(
            path, spec, tenant,
            lambda s: export_sessions(s, archive, session_ids=session or (), all_tenants=all_tenants, progress=bars),
            read_only=True,
        )  # fmt: skip
    _emit(r, json, lambda: out.print(
        f"exported {_n(r.sessions, 'session')} ({_n(r.tokens, 'token')}, {_n(r.chunks, 'chunk')}) to {r.archive}, {_size(r.bytes)}"
    ))  # fmt: skip


@app.command("import")
def import_(
    archive: Annotated[Path, typer.Argument(help="archive written by `agentstate export`")],
    force: Annotated[bool, typer.Option(help="overwrite sessions that already exist")] = False,
    path: PathOpt = DEFAULT_PATH,
    spec: SpecOpt = None,
    tenant: TenantOpt = None,
    json: JsonOpt = False,
) -> None:
    """Store an archive's sessions here; the whole archive is checked before anything is written.

    A new data directory takes the archive's spec (recorded once the import succeeds) unless
    --spec says otherwise."""
    import asyncio

    from agentstate.ops.admin import record_spec, recorded_spec
    from agentstate.ops.archive import import_sessions, new_directory_undone, read_spec

    path = _data_dir(path)
    with _reported():
        fresh = spec is None and recorded_spec(path) is None

    async def archive_spec() -> ModelSpec:
        return await asyncio.to_thread(read_spec, archive)

    model = _run(archive_spec) if fresh else None
    with new_directory_undone(path), _progress(not json) as bars:  # a failed import leaves no new directory
        r = _with_store(
            path, spec, tenant, lambda s: import_sessions(s, archive, tenant=tenant, force=force, progress=bars),
            create=True, model=model,
        )  # fmt: skip
        if model is not None:
            with _reported():
                record_spec(path, model)
    _emit(r, json, lambda: out.print(
        f"imported {_n(r.sessions, 'session')} ({_n(r.tokens, 'token')}) from {r.archive}, {r.replaced} replaced"
    ))  # fmt: skip


@app.command()
def serve(
    path: PathOpt = DEFAULT_PATH,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option(
            min=1,
            max=65535,
            help="port to listen on; the default is no inference server's usual port (8000, 30000, 8080, 11434)",
        ),
    ] = DEFAULT_PORT,
    tokens_file: Annotated[
        Path | None, typer.Option(help="JSON {bearer token: tenant} (default: env AGENTSTATE_TOKENS)")
    ] = None,
    spec: Annotated[
        Path | None,
        typer.Option("--spec", help="ModelSpec JSON; needed once, then recorded in <path>/spec.json"),
    ] = None,
    handle_secret_file: Annotated[
        Path | None,
        typer.Option(
            help="file holding the key chunk handles are signed with (16+ bytes): replicas given the same one accept"
            " each other's handles (default: env AGENTSTATE_SERVICE_HANDLE_SECRET, else a key for this process only)"
        ),
    ] = None,
) -> None:
    """Serve the session resume API (HTTP, OpenAPI at /docs) until SIGINT/SIGTERM.

    A data directory is served under its ModelSpec: the first serve needs --spec, later ones read the one recorded; without either it refuses to start (it never guesses one)."""
    with _reported():
        import asyncio

        from agentstate.configured import file_spec, service_settings
        from agentstate.datadir import directory_spec, read_spec_file
        from agentstate.server.service import load_tokens
        from agentstate.server.service import serve as serving

        loaded = _configured(path)
        path = Path(loaded.store.path)
        model = read_spec_file(spec) if spec else file_spec(path, loaded.file)
        model = directory_spec(  # a spec other than the recorded one is refused, naming the fields that differ
            path, model, source=f"the spec of --spec {spec}",
            hint="pass --spec FILE (ModelSpec JSON: model_id, num_layers, num_kv_heads, head_dim, dtype), or a [spec]"
            " table in the config file, the first time; it is recorded and used from then on",
        )  # fmt: skip
        flags = {"handle_secret_file": handle_secret_file} if handle_secret_file else {}
        keys, limits = service_settings(loaded.file, **flags)  # flags > AGENTSTATE_SERVICE_* > [service]
        host = keys.host if keys.host is not None and not _given("host") else host
        port = keys.port if keys.port is not None and not _given("port") else port
        tokens_file = tokens_file or keys.tokens_file
        limits.secret()  # a bad secret file is refused before anything is written
        tokens = load_tokens(tokens_file)
        asyncio.run(serving(loaded.store, model, host=host, port=port, tokens=tokens, limits=limits, writer=_command))


@app.command()
def version() -> None:
    """Print the installed version."""
    from agentstate._version import __version__

    typer.echo(__version__)


def main() -> None:
    try:
        app()
    except ModuleNotFoundError as exc:  # an import outside `_reported`: the same one-line hint
        hint = MissingDependencyError.of(exc, _command)
        if hint is None:
            raise
        raise SystemExit(_fail(hint).exit_code) from None  # the one-line error `_reported` prints
