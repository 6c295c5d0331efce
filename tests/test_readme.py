"""The README as a new user follows it, so that it stays right.

Every ```python block runs as written, each in an empty directory of its own. The SDK block runs
against `agentstate serve` started as the README's service block says (its spec.json and
tokens.json written by its own lines). The blocks that talk to a vLLM server (the agent-framework
ones, which read AGENTSTATE_URL) are compiled and their imports resolved here, and run against a
real vLLM server by tests/test_adapter_vllm_frameworks.py.
Every `agentstate` command line of the ```bash blocks names a command and flags that exist, and the
admin block runs line by line, in order, on a directory like the one the demo leaves (sessions
agent-0 .. agent-3, recorded spec and config); its `--url` line against `agentstate serve` on it.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentstate import StateStore
from tests.cli_process import run_cli
from tests.conftest import SPEC4, random_kv, random_tokens
from tests.ports import free_port
from tests.readme_blocks import NEEDS_SERVER, NEEDS_SERVICE, PYTHON, SHELL
from tests.test_service_limits import wait_until


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
    env = dict(os.environ)
    with contextlib.ExitStack() as stack:
        if NEEDS_SERVICE in code:
            env[NEEDS_SERVICE] = stack.enter_context(_served(tmp_path, tmp_path / "DATA"))
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                              timeout=600, check=False, env=env)  # fmt: skip
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


@contextlib.contextmanager
def _served(cwd: Path, data: Path, recorded: bool = False) -> Iterator[str]:
    """`agentstate serve` as the README's service block starts it (its files written by its own
    lines), on `data` and a free port; yields its URL once /healthz answers. `recorded`: `data`
    already has a spec (recorded by its writer), so no --spec."""
    block = next(b for b in SHELL if "agentstate serve" in b)
    lines = [line for line in block.splitlines() if line.strip()]
    setup = [line for line in lines if not line.startswith("agentstate serve")]
    subprocess.run(["bash", "-euc", "\n".join(setup)], cwd=cwd, check=True, timeout=60)
    (serve,) = [line for line in lines if line.startswith("agentstate serve")]
    args = [str(data) if a == "DATA" else a for a in shlex.split(serve)[1:]]
    if recorded:
        at = args.index("--spec")
        del args[at : at + 2]
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "agentstate", *args, "--port", str(port)], cwd=cwd,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _healthy(server, url), "agentstate serve answering /healthz")
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


def _healthy(server: subprocess.Popen[str], url: str) -> bool:
    assert server.poll() is None, server.stderr.read() if server.stderr else ""
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_the_service_blocks_files_are_what_serve_reads(tmp_path: Path) -> None:
    from agentstate import ModelSpec
    from agentstate.server.service import load_tokens

    with _served(tmp_path, tmp_path / "DATA") as url:
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
    spec = ModelSpec.model_validate_json((tmp_path / "spec.json").read_text())
    assert spec == ModelSpec.model_validate_json((tmp_path / "DATA" / "spec.json").read_text())  # recorded
    assert set(load_tokens(tmp_path / "tokens.json").values()) == {"default", "acme"}


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

    with _served(tmp_path, tmp_path / "agentstate-demo", recorded=True) as url:
        for line in remote:  # as written, against the server: its port, and a token of its tokens.json
            args = shlex.split(line.replace("http://127.0.0.1:8470", url).replace("--token T", "--token my-token"))
            done = run_cli(*args[1:], cwd=tmp_path, env={**os.environ, "COLUMNS": "120"})
            assert done.returncode == 0 and "agent-3" in done.stdout, f"{line}\n{done.stdout}\n{done.stderr}"
