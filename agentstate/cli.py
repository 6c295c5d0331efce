"""The `agentstate` command line (typer + rich)."""

from __future__ import annotations

import typer

app = typer.Typer(help="agentstate: KV-state persistence for LLM agents", no_args_is_help=True)


@app.command()
def version() -> None:
    """Print the installed version."""
    from agentstate import __version__

    typer.echo(__version__)


def main() -> None:
    app()
