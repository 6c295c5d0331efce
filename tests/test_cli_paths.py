"""Every CLI command given a bad path says one line on stderr and exits non-zero, no traceback.

For each kind of path a command takes (the data directory, --spec, --config, an archive to read,
an archive to write, serve's --tokens-file and --handle-secret-file) and each way it can be bad: a
file that is missing, a missing parent directory, a directory where a file is expected, a file that
cannot be read (a Unix socket: open() fails with ENXIO, even for root). Also: 100,000-character ids
in the service's log lines (uvicorn's access line included) are cut to ~100 characters.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from agentstate import StateStore
from agentstate.ops.admin import record_spec
from agentstate.server.gate import Limits
from agentstate.server.logcut import MAX_TOKEN_CHARS
from agentstate.server.service import create_app
from tests.cli_process import run_cli
from tests.conftest import SPEC4, random_kv, random_tokens


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A data directory with one session, a directory, and an unreadable file (a socket)."""
    root = tmp_path_factory.mktemp("paths")

    async def write() -> None:
        async with StateStore.open(root / "data", SPEC4, chunk_tokens=64) as store:
            await store.snapshot("a", random_tokens(100), random_kv(SPEC4, 100))
        record_spec(root / "data", SPEC4)

    asyncio.run(write())
    (root / "adir").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "sock.json"))
    try:
        yield root
    finally:
        sock.close()


BAD = {
    "missing": "missing.json",
    "no-parent": "no/such/dir/x.json",
    "directory": "adir",
    "unreadable": "sock.json",
}
COMMANDS: dict[str, Callable[[str], list[str]]] = {
    "ls --spec": lambda p: ["ls", "--path", "data", "--spec", p],
    "inspect --spec": lambda p: ["inspect", "a", "--path", "data", "--spec", p],
    "stats --spec": lambda p: ["stats", "--path", "data", "--spec", p],
    "verify --spec": lambda p: ["verify", "--path", "data", "--spec", p],
    "rm --spec": lambda p: ["rm", "a", "--path", "data", "--spec", p],
    "--config": lambda p: ["--config", p, "ls", "--path", "data"],
    "import ARCHIVE": lambda p: ["import", "--path", "imported", p.replace(".json", ".tar")],
    "export ARCHIVE": lambda p: ["export", "--path", "data", p.replace(".json", ".tar")],
    "serve --tokens-file": lambda p: ["serve", "--path", "data", "--port", "1", "--tokens-file", p],
    "serve --handle-secret-file": lambda p: [
        "serve", "--path", "data", "--port", "1", "--handle-secret-file", p, "--tokens-file", "tokens.json",
    ],
}  # fmt: skip
DATA_DIRS = {
    "missing": "missing-data",
    "no-parent": "no/such/dir/data",
    "directory-is-a-file": "data/spec.json",
}


def _one_line(place: Path, args: list[str]) -> None:
    env = {**os.environ, "COLUMNS": "500", "AGENTSTATE_CHUNK_TOKENS": "64"}
    done = run_cli(*args, env=env, cwd=place, timeout=120)
    assert done.returncode != 0, (args, done.stdout)
    assert "Traceback" not in done.stderr, (args, done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error ("), (args, done.stderr[-2000:])


CASES = [
    (command, bad) for command in COMMANDS for bad in BAD
    if not (command == "export ARCHIVE" and bad in ("missing", "unreadable"))  # export writes that file: not bad
]  # fmt: skip


@pytest.mark.parametrize(("command", "bad"), CASES)
def test_a_bad_file_path_is_one_line(place: Path, command: str, bad: str) -> None:
    (place / "tokens.json").write_text('{"alice-token-0123456789": "alice"}')
    sock = BAD[bad]
    if command.endswith("ARCHIVE") and bad == "unreadable":
        sock = "sock.tar"
        if not (place / sock).exists():
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(place / sock))  # left bound: the module's directory goes with the test session
    arg = COMMANDS[command](sock if sock.endswith(".tar") else BAD[bad])
    _one_line(place, arg)
    assert not (place / "imported").exists()  # a refused import leaves no new directory


@pytest.mark.parametrize("bad", list(DATA_DIRS))
@pytest.mark.parametrize("command", ["ls", "stats", "verify", "gc", "export", "serve"])
def test_a_bad_data_directory_is_one_line(place: Path, command: str, bad: str) -> None:
    extra = {"export": ["out.tar"], "serve": ["--port", "1", "--tokens-file", "tokens.json", "--spec", "adir"]}
    (place / "tokens.json").write_text('{"alice-token-0123456789": "alice"}')
    _one_line(place, [command, "--path", DATA_DIRS[bad], *extra.get(command, [])])


async def test_long_ids_are_cut_in_the_service_log_lines(
    open_store: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    long_id = "x" * 100_000
    async with open_store() as store:
        app = create_app(store, {"alice-token-0123456789": "alice"}, Limits(max_json_bytes=1 << 20))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(app, lifespan="off", log_level="info", access_log=True, log_config=None,
                                h11_max_incomplete_event_size=1 << 20)  # fmt: skip
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            with caplog.at_level(logging.INFO):  # by hand: httpx refuses a URL this long
                reader, writer = await asyncio.open_connection(*sock.getsockname())
                writer.write(f"GET /v1/sessions/{long_id} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                             "authorization: Bearer alice-token-0123456789\r\n\r\n".encode())  # fmt: skip
                reply = (await reader.read()).decode()
                writer.close()
                await asyncio.sleep(0.2)
        finally:
            server.should_exit = True
            await task
            sock.close()
    assert reply.startswith(("HTTP/1.1 404", "HTTP/1.1 422")) and len(reply) < 2000, reply[:300]  # the id, cut
    access = [r for r in caplog.records if r.name == "uvicorn.access"]
    assert access, [r.name for r in caplog.records]
    for record in caplog.records:
        line = record.getMessage()
        assert "x" * (MAX_TOKEN_CHARS + 1) not in line and len(line) < 1000, (record.name, line[:300])
