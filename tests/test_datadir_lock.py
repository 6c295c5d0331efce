"""One writer per data directory: a second opener, in this process or another, gets a typed error
naming the holder; the admin CLI's write commands refuse a directory a running server holds, and
nothing stored changes (issue 13). The lock is the kernel's: a killed holder leaves none behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from agentstate import StateStore
from agentstate.ops.admin import record_spec
from agentstate.errors import AgentStateError, DataDirLockedError
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.test_cli import AGENTSTATE, CHUNK, cli
from tests.test_service import _free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
HOLD = """
import asyncio, sys
from agentstate import StateStore
from tests.conftest import SPEC4
async def main():
    store = await StateStore.open(sys.argv[1], SPEC4, chunk_tokens=64, read_only=sys.argv[2] == "read")
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await store.close()
asyncio.run(main())
"""


@contextlib.contextmanager
def holder(data: Path, mode: str = "write") -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(data), mode], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def write_one(data: Path) -> tuple[list[int], object]:
    tokens, kv = random_tokens(150), random_kv(SPEC4, 150)
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK) as store:
        await store.snapshot("s", tokens, kv)
    record_spec(data, SPEC4)
    return tokens, kv


async def test_second_opener_in_this_process_is_refused(tmp_path: Path) -> None:
    async with StateStore.open(tmp_path / "d", SPEC4) as first:
        for read_only in (False, True):
            with pytest.raises(DataDirLockedError) as err:
                await StateStore.open(tmp_path / "d", SPEC4, read_only=read_only)
            assert err.value.pid == os.getpid() and str(os.getpid()) in str(err.value)
        await first.snapshot("s", [1, 2, 3], random_kv(SPEC4, 3))
    async with StateStore.open(tmp_path / "d", SPEC4) as again:  # closed: free again
        assert (await again.resume("s")).restored_tokens == 3


async def test_another_process_holding_it_is_named(tmp_path: Path) -> None:
    tokens, kv = await write_one(tmp_path / "d")
    with holder(tmp_path / "d") as proc:
        for read_only in (False, True):
            with pytest.raises(DataDirLockedError) as err:
                await StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=CHUNK, read_only=read_only)
            assert err.value.pid == proc.pid and f"process {proc.pid}" in str(err.value)
        proc.send_signal(signal.SIGKILL)  # dies holding it: the kernel releases the lock
        proc.wait()
    async with StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=CHUNK) as store:
        r = await store.resume("s")
        assert r.restored_tokens == 150 and bits_equal(r.kv, kv)


async def test_readers_share_and_exclude_writers(tmp_path: Path) -> None:
    await write_one(tmp_path / "d")
    with holder(tmp_path / "d", "read"):
        async with StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=CHUNK, read_only=True) as reader:
            assert (await reader.resume("s")).restored_tokens == 150
        with pytest.raises(DataDirLockedError):
            await StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=CHUNK)
        assert cli("ls", "-p", tmp_path / "d").returncode == 0  # another reader is welcome
        assert cli("gc", "-p", tmp_path / "d").returncode == 1


def test_the_error_is_typed() -> None:
    assert issubclass(DataDirLockedError, AgentStateError)


@contextlib.asynccontextmanager
async def serving(data: Path, tmp_path: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"t": "default"}))
    port = _free_port()
    env = {**os.environ, "AGENTSTATE_CHUNK_TOKENS": str(CHUNK)}
    assert AGENTSTATE is not None
    proc = await asyncio.create_subprocess_exec(
        AGENTSTATE, "serve", "-p", str(data), "--port", str(port), "--tokens-file", str(tokens), env=env,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
            await wait_healthy(c, proc)
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 60)


async def test_cli_write_commands_refuse_a_directory_a_server_holds(tmp_path: Path) -> None:
    data = tmp_path / "d"
    tokens, kv = await write_one(data)
    archive = tmp_path / "a.tar"
    assert cli("export", archive, "-p", data).returncode == 0
    async with serving(data, tmp_path) as proc:
        for args in (
            ["gc", "-p", data],
            ["evict", "host", "--budget", "0", "-p", data],
            ["verify", "--repair", "-p", data],
            ["import", archive, "-p", data, "--force"],
        ):
            done = cli(*args)
            assert done.returncode == 1, (args, done.stdout, done.stderr)
            assert "DataDirLockedError" in done.stderr and f"process {proc.pid}" in done.stderr, done.stderr
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK) as store:
        r = await store.resume("s")
        assert r.restored_tokens == 150 and bits_equal(r.kv, kv) and r.manifest.version == 1
