"""The `agentstate` command line (typer + rich)."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="agentstate: KV-state persistence for LLM agents", no_args_is_help=True)


@app.command()
def demo(
    data_dir: Path | None = typer.Option(None, help="data directory (default: a temporary one, removed after)"),
    agents: int = typer.Option(8, min=1, max=256, help="agents sharing one system prompt"),
    turns: int = typer.Option(4, min=1, max=64, help="turns per agent, a snapshot after each"),
    keep: bool = typer.Option(False, help="keep the temporary data directory"),
) -> None:
    """Store and resume multi-turn agent sessions on the embedded default (host tier + LMDB)."""
    from agentstate.demo import main as run

    if not run(data_dir, agents, turns, keep):
        raise typer.Exit(1)


@app.command()
def version() -> None:
    """Print the installed version."""
    from agentstate import __version__

    typer.echo(__version__)


def main() -> None:
    app()
