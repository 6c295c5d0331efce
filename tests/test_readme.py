"""The README as a new user follows it, so that it stays right.

Every ```python block runs as written, each in an empty directory of its own. The blocks that talk
to a vLLM server (the agent-framework ones, which read AGENTSTATE_URL) are compiled and their
imports resolved here, and run against a real vLLM server by tests/test_adapter_vllm_frameworks.py.
Every `agentstate` command line of the ```bash blocks names a command and flags that exist, and the
admin block runs line by line, in order, on a directory like the one the demo leaves (sessions
agent-0 .. agent-3, recorded spec and config); its `--url` line against `agentstate serve` on it.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentstate import StateStore
from tests.cli_process import run_cli
from tests.conftest import SPEC4, random_kv, random_tokens
from tests.ports import free_port
from tests.readme_blocks import NEEDS_SERVER, PYTHON, SHELL


def _commands() -> list[list[str]]:
    """Every `agentstate ...` invocation in the shell blocks, comments dropped, split as a shell would."""
    found = []
    for block in SHELL:
        for line in block.splitlines():
            for part in re.split(r"&&|;", line.split("  #")[0]):
                words = shlex.split(part.strip())
                if words and words[0] == "agentstate":
                    found.append(words[1:])
    return found


def test_the_readme_has_what_this_test_checks() -> None:
    assert len(PYTHON) >= 5 and sum(NEEDS_SERVER in b for b in PYTHON) == 2
    assert ["demo"] in _commands() and any(c[:1] == ["ls"] for c in _commands())


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_python_block_runs_as_written(index: int, tmp_path: Path) -> None:
    code = PYTHON[index]
    ast.parse(code)
    if NEEDS_SERVER in code:  # run against a real vLLM server by the frameworks test: here, its imports
        imports = [ast.unparse(n) for n in ast.parse(code).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        code = "\n".join(imports)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, f"README python block {index}:\n{PYTHON[index]}\n{done.stderr[-3000:]}"


def test_every_command_line_names_a_command_and_flags_that_exist() -> None:
    helps: dict[str, str] = {}
    for words in _commands():
        command = words[0]
        if command not in helps:
            done = run_cli(command, "--help", env={**os.environ, "COLUMNS": "250"})
            assert done.returncode == 0, f"agentstate {command}: {done.stderr}"
            helps[command] = done.stdout
        for flag in (w.split("=")[0] for w in words[1:] if w.startswith("-")):
            assert re.search(rf"(^|[\s,│]){re.escape(flag)}([\s,]|$)", helps[command], re.MULTILINE), (words, flag)


def _demo_like(data: Path) -> None:
    async def write() -> None:
        async with StateStore.open(data, SPEC4, chunk_tokens=64) as store:  # records spec.json and config.json
            system = random_tokens(128, seed=5)
            for i in range(4):
                tokens = system + random_tokens(50 + 10 * i, seed=i)
                await store.snapshot(f"agent-{i}", tokens, random_kv(SPEC4, len(tokens), seed=i), {"turn": 3})

    asyncio.run(write())


def test_the_admin_block_runs_line_by_line_on_a_demo_directory(tmp_path: Path) -> None:
    _demo_like(tmp_path / "agentstate-demo")
    block = next(b for b in SHELL if "agentstate ls -p agentstate-demo" in b)
    lines = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    local, remote = [x for x in lines if "--url" not in x], [x for x in lines if "--url" in x]
    for line in local:
        done = run_cli(*shlex.split(line)[1:], cwd=tmp_path, env={**os.environ, "COLUMNS": "120"})
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        assert "Traceback" not in done.stderr
    assert (tmp_path / "all.tar").stat().st_size > 0 and (tmp_path / "elsewhere" / "spec.json").exists()

    (tmp_path / "tokens.json").write_text('{"T": "default"}')
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "agentstate", "serve", "-p", "agentstate-demo", "--tokens-file", "tokens.json",
         "--port", str(port)], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for _ in range(600):
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        for line in remote:  # as written, the port the server got instead of the default
            args = shlex.split(line.replace("127.0.0.1:8470", f"127.0.0.1:{port}"))[1:]
            done = run_cli(*args, cwd=tmp_path, env={**os.environ, "COLUMNS": "120"})
            assert done.returncode == 0 and "agent-3" in done.stdout, f"{line}\n{done.stdout}\n{done.stderr}"
    finally:
        server.terminate()
        server.wait(timeout=60)
