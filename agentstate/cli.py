"""The `agentstate` command line (typer + rich).

Every admin command opens a data directory under the ModelSpec recorded in `<path>/spec.json`
(or `--spec FILE`), runs one operation from `agentstate.ops.admin`, `agentstate.ops.verify` or
`agentstate.ops.archive`, and prints its report: a rich table, or the report's JSON with `--json`.
Progress bars go to stderr, so `--json` output on stdout stays parseable. Exit codes: 0 done,
1 the operation failed with a typed error (printed to stderr) or `verify` found damage it did not
repair, 2 bad usage.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from agentstate.errors import AgentStateError
from agentstate.spec import ModelSpec
from agentstate.store import StateStore

app = typer.Typer(help="agentstate: KV-state persistence for LLM agents", no_args_is_help=True)
out = Console()
err = Console(stderr=True)
T = TypeVar("T")

PathOpt = Annotated[
    Path, typer.Option("--path", "-p", envvar="AGENTSTATE_PATH", help="data directory", show_default=True)
]
SpecOpt = Annotated[Path | None, typer.Option("--spec", help="ModelSpec JSON (default: <path>/spec.json)")]
TenantOpt = Annotated[
    str | None, typer.Option("--tenant", "-t", help="tenant (default: AGENTSTATE_TENANT or 'default')")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the report as JSON")]
DEFAULT_PATH = Path("agentstate-data")


class _Bars:
    """admin.Progress drawn as rich bars on stderr."""

    def __init__(self, bars: RichProgress) -> None:
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
    from agentstate.ops.admin import QUIET

    if not enabled:
        yield QUIET
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with RichProgress(*columns, console=err, transient=False) as bars:
        yield _Bars(bars)


def _run(op: Callable[[], Awaitable[T]]) -> T:
    """Run one async operation; a typed error is a one-line message and exit code 1."""
    try:
        return asyncio.run(op())  # type: ignore[arg-type]
    except AgentStateError as exc:
        err.print(f"[red]error[/red] ({type(exc).__name__}): {exc}", highlight=False)
        raise typer.Exit(1) from None


def _with_store(
    path: Path, spec: Path | None, tenant: str | None, fn: Callable[[StateStore], Awaitable[T]], *,
    create: bool = False, model: ModelSpec | None = None, read_only: bool = False,
) -> T:  # fmt: skip
    from agentstate.ops.admin import open_store

    async def go() -> T:
        async with open_store(
            path, tenant=tenant, spec_file=spec, spec=model, create=create, read_only=read_only
        ) as store:
            return await fn(store)

    return _run(go)


def _emit(report: BaseModel | list[Any], as_json: bool, render: Callable[[], None]) -> None:
    from agentstate.ops.admin import dumps

    if as_json:
        sys.stdout.write(dumps(report) + "\n")
    else:
        render()


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
    from agentstate.demo import main as run

    if not run(data_dir, agents, turns):
        raise typer.Exit(1)


@app.command("ls")
def ls(path: PathOpt = DEFAULT_PATH, spec: SpecOpt = None, tenant: TenantOpt = None, json: JsonOpt = False) -> None:
    """List the tenant's sessions."""
    from agentstate.ops.admin import list_sessions

    rows = _with_store(path, spec, tenant, list_sessions, read_only=True)

    def render() -> None:
        table = Table("session", "version", "tokens", "chunks", "tail", "size", "parent", "pinned", "ttl s")
        for r in rows:
            ttl = f"{r.ttl_seconds:g}" if r.ttl_seconds else "-"
            table.add_row(
                r.session_id, str(r.version), str(r.tokens), str(r.chunks), str(r.tail_tokens), _size(r.bytes),
                r.parent or "-", "yes" if r.pinned else "", ttl,
            )  # fmt: skip
        out.print(table)
        out.print(f"{len(rows)} sessions")

    _emit(rows, json, render)


@app.command()
def inspect(
    session: Annotated[str, typer.Argument(help="session id")],
    path: PathOpt = DEFAULT_PATH,
    spec: SpecOpt = None,
    tenant: TenantOpt = None,
    json: JsonOpt = False,
) -> None:
    """A session's manifest, and for each chunk its key, size and the tiers that hold it."""
    from agentstate.ops.admin import inspect_session

    d = _with_store(path, spec, tenant, lambda s: inspect_session(s, session), read_only=True)

    def render() -> None:
        out.print(
            f"[bold]{d.tenant}/{d.session_id}[/bold] version {d.version}, {d.num_tokens} tokens "
            f"({len(d.chunks)} chunks of {d.chunk_tokens}, tail {d.tail_tokens}), {_size(d.bytes)}, "
            f"spec {d.fingerprint}, {d.missing} missing"
        )
        if d.state:
            out.print(f"state: {d.state}")
        table = Table("#", "kind", "tokens", "size", "tiers", "key")
        for c in d.chunks:
            tiers = ", ".join(c.tiers) or "[red]missing[/red]"
            table.add_row(str(c.index), c.kind, f"{c.first_token}+{c.tokens}", _size(c.bytes), tiers, c.key)
        out.print(table)

    _emit(d, json, render)


@app.command()
def stats(path: PathOpt = DEFAULT_PATH, spec: SpecOpt = None, tenant: TenantOpt = None, json: JsonOpt = False) -> None:
    """Tiers, sessions and what sharing saves."""
    from agentstate.ops.admin import stats as run

    r = _with_store(path, spec, tenant, run, read_only=True)

    def render() -> None:
        out.print(
            f"[bold]{r.path}[/bold]: spec {r.spec.model_id} ({r.spec.fingerprint}), {r.chunk_tokens} tokens/chunk"
        )
        table = Table("tier", "record", "durable", "remote", "capacity", "chunks")
        for t in r.tiers:
            cap = _size(t.capacity_bytes) if t.capacity_bytes is not None else "-"
            flags = ["yes" if f else "" for f in (t.record, t.durable, t.remote)]
            table.add_row(t.name, *flags, cap, str(t.chunks))
        out.print(table)
        saved = 1 - r.unique_bytes / r.logical_bytes if r.logical_bytes else 0.0
        out.print(
            f"{r.tenant_sessions} sessions, {r.session_tokens} tokens, {r.unique_chunks} distinct chunks + {r.tails} "
            f"tails: {_size(r.unique_bytes)} stored for {_size(r.logical_bytes)} of sessions ({saved:.0%} shared)"
        )

    _emit(r, json, render)


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

    r = _with_store(path, spec, None, run)
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
        table = Table("tier", "checked", "ok", "corrupt", "missing", "repaired")
        for t in r.tiers:
            table.add_row(t.tier, *(str(v) for v in (t.checked, t.ok, t.corrupt, t.missing, t.repaired)))
        out.print(table)
        for b in r.corrupt:
            out.print(f"[red]corrupt[/red] {b.tier} {b.key}: {b.problem}", highlight=False)
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

    with _progress(not json) as bars:
        r = _with_store(
            path, spec, tenant,
            lambda s: export_sessions(s, archive, session_ids=session or (), all_tenants=all_tenants, progress=bars),
            read_only=True,
        )  # fmt: skip
    _emit(r, json, lambda: out.print(
        f"exported {r.sessions} sessions ({r.tokens} tokens, {r.chunks} chunks) to {r.archive}, {_size(r.bytes)}"
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
    from agentstate.ops.admin import record_spec, recorded_spec
    from agentstate.ops.archive import import_sessions, new_directory_undone, read_spec

    fresh = spec is None and recorded_spec(path) is None
    model = _run(lambda: asyncio.to_thread(read_spec, archive)) if fresh else None
    with new_directory_undone(path), _progress(not json) as bars:  # a failed import leaves no new directory
        r = _with_store(
            path, spec, tenant, lambda s: import_sessions(s, archive, tenant=tenant, force=force, progress=bars),
            create=True, model=model,
        )  # fmt: skip
        if model is not None:
            record_spec(path, model)
    _emit(r, json, lambda: out.print(
        f"imported {r.sessions} sessions ({r.tokens} tokens) from {r.archive}, {r.replaced} replaced"
    ))  # fmt: skip


@app.command()
def serve(
    path: PathOpt = DEFAULT_PATH,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    tokens_file: Annotated[
        Path | None, typer.Option(help="JSON {bearer token: tenant} (default: env AGENTSTATE_TOKENS)")
    ] = None,
    spec: SpecOpt = None,
) -> None:
    """Serve the session resume API (HTTP, OpenAPI at /docs) until SIGINT/SIGTERM."""
    from agentstate.ops.admin import read_spec_file
    from agentstate.server.service import run

    try:
        run(path, host=host, port=port, tokens_file=tokens_file, spec=read_spec_file(spec) if spec else None)
    except AgentStateError as exc:
        err.print(f"[red]error[/red] ({type(exc).__name__}): {exc}", highlight=False)
        raise typer.Exit(1) from None


@app.command()
def version() -> None:
    """Print the installed version."""
    from agentstate import __version__

    typer.echo(__version__)


def main() -> None:
    app()
