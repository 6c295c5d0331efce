"""The CLI's operator surface: fast `--help`, logging, install hints, `rm` and `fork`, `--url` against
a live `agentstate serve`, serve's refusal without a spec, and handle secrets shared by replicas.

Commands run in subprocesses (the installed `agentstate`, or `python -c` driving `agentstate.cli.main`
where a module must be blocked from importing, as if its extra were not installed).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentstate import StateStore
from agentstate.client import AsyncClient
from agentstate.ops.admin import SPEC_FILE
from agentstate.server.gate import Limits
from agentstate.wire import ChunkNotFoundError
from tests.conftest import SPEC4, bits_equal
from tests.test_cli import AGENTSTATE, CHUNK, WRITTEN, check_sessions, cli, ok_json, session, write_store
from tests.test_service import ALICE, _free_port, serving, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
TOKEN, BOB_TOKEN = "t-default-0123456789", "t-bob-0123456789"
SECRET = "replicas-share-this-handle-secret"

# Runs `agentstate ARGS` in this interpreter with the modules named in argv[1] unimportable, then
# reports on stderr's last line which heavy modules the command imported.
DRIVER = """
import json, sys

class Blocked:
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

blocked, args = sys.argv[1], sys.argv[2:]
sys.meta_path.insert(0, Blocked(set(filter(None, blocked.split(",")))))
sys.argv = ["agentstate", *args]
from agentstate.cli import main
try:
    main()
    code = 0
except SystemExit as exc:
    code = exc.code
heavy = ["torch", "numpy", "agentstate.store", "agentstate.server.service", "fastapi", "httpx"]
print(json.dumps({"code": code, "imported": [m for m in heavy if m in sys.modules]}), file=sys.stderr)
"""


def drive(*args: str | Path, blocked: str = "", env: dict[str, str] | None = None) -> tuple[int, str, str, list[str]]:
    """(exit code, stdout, stderr without the report line, heavy modules imported)."""
    full = {**os.environ, "AGENTSTATE_CHUNK_TOKENS": str(CHUNK), "COLUMNS": "200", **(env or {})}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, blocked, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
        env=full, timeout=300, check=False,
    )  # fmt: skip
    *lines, last = done.stderr.rstrip("\n").split("\n")
    report = json.loads(last)
    return report["code"], done.stdout, "\n".join(lines), report["imported"]


def test_help_and_version_import_no_torch() -> None:
    from agentstate._version import __version__

    for args in (["--help"], ["version"], ["serve", "--help"], ["ls", "--help"]):
        code, _, stderr, imported = drive(*args)
        assert code == 0, stderr
        assert imported == [], f"agentstate {' '.join(args)} imported {imported}"
    assert drive("version")[1].strip() == __version__
    assert "8470" in drive("serve", "--help")[1]  # the default port, named in the help


def test_local_ls_inspect_stats_verify_need_no_torch(data: Path) -> None:
    """Reading a local directory's catalog and chunk headers (and checking every chunk's bytes) is all
    ls, inspect, stats and verify do: they run with torch unimportable (it is most of a command's
    start-up: ~3 s of the ~3.5 s they took)."""
    for args in (["ls"], ["inspect", "agent-1"], ["stats"], ["ls", "--json"], ["verify"]):
        code, stdout, stderr, imported = drive(*args, "-p", data, blocked="torch")
        assert code == 0, (args, stderr)
        assert "torch" not in imported and ("agent-1" in stdout or args[0] in ("stats", "verify")), (args, stdout)
    assert "3 sessions" in drive("stats", "-p", data, blocked="torch")[1]


def test_default_port_is_no_engines() -> None:
    from agentstate.cli import DEFAULT_PORT
    from agentstate.server import service

    assert DEFAULT_PORT == service.DEFAULT_PORT == 8470
    assert DEFAULT_PORT not in (8000, 30000, 8080, 3000, 11434)


@pytest.fixture
async def data(tmp_path: Path) -> Path:
    await write_store(tmp_path / "data")
    return tmp_path / "data"


def test_missing_extras_are_one_line_naming_the_extra(data: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({TOKEN: "default"}))
    redis_tiers = json.dumps([{"kind": "redis", "url": "redis://127.0.0.1:1/0"}, {"kind": "lmdb", "path": "chunks"}])
    cases = [
        (("serve", "-p", data, "--tokens-file", tokens), "fastapi", {}, "agentstate-kv[service]"),
        (("serve", "-p", data, "--tokens-file", tokens), "uvicorn,fastapi,starlette", {}, "agentstate-kv[service]"),
        (("demo", "--data-dir", tmp_path / "demo"), "transformers", {}, "agentstate-kv[demo]"),
        (("ls", "--url", "http://127.0.0.1:1", "--token", TOKEN), "httpx", {}, "agentstate-kv[client]"),
        (("ls", "-p", data), "redis", {"AGENTSTATE_TIERS": redis_tiers}, "agentstate-kv[remote]"),
        (("fork", "agent-1", "agent-1c", "-p", data), "torch", {}, "agentstate-kv[store]"),  # KV needs torch
        (("inspect", "agent-1", "-p", data), "lmdb", {}, "agentstate-kv[store]"),
        (("verify", "-p", data), "torch,numpy,lmdb", {}, "agentstate-kv[store]"),
    ]
    for args, blocked, env, extra in cases:
        code, _, stderr, _ = drive(*args, blocked=blocked, env=env)
        assert code == 1, f"{args} without {blocked}: {stderr}"
        assert f"agentstate {args[0]}" in stderr and f"pip install '{extra}'" in stderr, stderr
        assert "MissingDependencyError" in stderr, stderr
        assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr


def test_serve_refuses_to_start_without_a_spec(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({TOKEN: "default"}))
    empty = tmp_path / "empty"
    done = cli("serve", "-p", empty, "--tokens-file", tokens, "--port", str(_free_port()))
    assert done.returncode == 1 and "--spec" in done.stderr and "NotFoundError" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (empty / SPEC_FILE).exists()
    short = tmp_path / "short"
    short.write_text("too short\n")
    (tmp_path / "spec.json").write_text(SPEC4.model_dump_json())
    refused = cli(
        "serve", "-p", empty, "--tokens-file", tokens, "--spec", tmp_path / "spec.json", "--handle-secret-file", short
    )
    assert refused.returncode == 1 and "at least 16" in refused.stderr and "Traceback" not in refused.stderr


async def test_rm_and_fork_in_a_data_directory(data: Path) -> None:
    fork = ok_json("fork", "agent-1", "agent-1b", "-p", data)
    assert (fork["session_id"], fork["parent"], fork["version"]) == ("agent-1b", "agent-1", 1)
    assert fork["num_tokens"] == len(session(1)[0])
    again = cli("fork", "agent-1", "agent-1b", "-p", data)
    assert again.returncode == 1 and "ConflictError" in again.stderr

    removed = ok_json("rm", "agent-1", "agent-2", "-p", data)
    assert removed == {"removed": ["agent-1", "agent-2"], "missing": []}
    partly = cli("rm", "agent-0", "nobody", "-p", data, "--json")
    assert partly.returncode == 1 and json.loads(partly.stdout) == {"removed": ["agent-0"], "missing": ["nobody"]}
    bad = cli("rm", "bob-1", "../x", "-p", data, "--tenant", "bob")
    assert bad.returncode == 1 and "InvalidSessionIdError" in bad.stderr  # checked before anything goes
    text = cli("rm", "bob-1", "-p", data, "--tenant", "bob")
    assert text.returncode == 0 and "removed bob-1" in text.stdout
    await check_sessions(data, {("default", "agent-1b"): WRITTEN[("default", "agent-1")]})  # the fork kept its chunks


async def _spawn_serve(
    data: Path, tmp_path: Path, *options: str, serve: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Any:
    """`agentstate OPTIONS serve -p DATA SERVE...` answering /healthz: (process, url)."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({TOKEN: "default", BOB_TOKEN: "bob", ALICE: "alice"}))
    port = _free_port()
    assert AGENTSTATE is not None
    proc = await asyncio.create_subprocess_exec(
        AGENTSTATE, *options, "serve", "-p", str(data), "--port", str(port), "--tokens-file", str(tokens), *serve,
        env={**os.environ, "AGENTSTATE_CHUNK_TOKENS": str(CHUNK), **(env or {})}, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
        await wait_healthy(c, proc)
    return proc, f"http://127.0.0.1:{port}"


async def _stop(proc: Any) -> str:
    """SIGTERM the server; its stderr."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, stderr = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return stderr.decode()


async def test_url_mode_prints_the_local_reports(data: Path, tmp_path: Path) -> None:
    local = {
        "ls": ok_json("ls", "-p", data),
        "bob": ok_json("ls", "-p", data, "--tenant", "bob"),
        "inspect": ok_json("inspect", "agent-1", "-p", data),
        "stats": ok_json("stats", "-p", data),
    }
    secret = tmp_path / "handle-secret"
    secret.write_text(SECRET + "\n")
    proc, url = await _spawn_serve(data, tmp_path, "--log-json", serve=("--handle-secret-file", str(secret)))
    try:
        remote = ["--url", url, "--token", TOKEN]
        assert ok_json("ls", *remote) == local["ls"]
        assert ok_json("ls", "--url", url, "--token", BOB_TOKEN) == local["bob"]
        assert ok_json("inspect", "agent-1", *remote) == local["inspect"]
        st = ok_json("stats", *remote)
        assert st["tenant"] == "default" and st["sessions"] == local["stats"]["tenant_sessions"]
        for field in ("session_tokens", "unique_chunks", "tails", "logical_bytes", "unique_bytes"):
            assert st[field] == local["stats"][field], field
        table = cli("stats", *remote)
        assert table.returncode == 0 and "3 sessions" in table.stdout and "shared" in table.stdout
        # a client-only install (no torch, numpy or LMDB) runs the same remote commands
        for args, want in ((("ls", "--json"), local["ls"]), (("inspect", "agent-1", "--json"), local["inspect"])):
            code, stdout, stderr, imported = drive(*args, *remote, blocked="torch,numpy,lmdb")
            assert code == 0 and json.loads(stdout) == want and "torch" not in imported, stderr
        code, stdout, stderr, _ = drive("stats", "--json", *remote, blocked="torch,numpy,lmdb")
        assert code == 0 and json.loads(stdout)["sessions"] == local["stats"]["tenant_sessions"], stderr

        # the same commands through env vars; the server holds the directory, so local writes are refused
        env = {"AGENTSTATE_URL": url, "AGENTSTATE_TOKEN": TOKEN}
        assert json.loads(cli("ls", "--json", env=env).stdout) == local["ls"]
        typed_url = cli("ls", *remote, "--json", env={"AGENTSTATE_PATH": str(data)})
        assert json.loads(typed_url.stdout) == local["ls"]  # a typed --url wins over AGENTSTATE_PATH
        locked = cli("rm", "agent-0", "-p", data, env=env)  # typed --path wins: the server holds the directory
        assert locked.returncode == 1 and "DataDirLockedError" in locked.stderr and "--url" in locked.stderr

        fork = ok_json("fork", "agent-0", "agent-0b", *remote)
        assert (fork["session_id"], fork["parent"]) == ("agent-0b", "agent-0")
        assert ok_json("rm", "agent-0", "agent-2", *remote) == {"removed": ["agent-0", "agent-2"], "missing": []}
        gone = cli("inspect", "agent-0", *remote)
        assert gone.returncode == 1 and "SessionNotFoundError" in gone.stderr
        stranger = cli("ls", "--url", url, "--token", "not-a-token")
        assert stranger.returncode == 1 and "UnauthorizedError" in stranger.stderr
        for bad in (["--path", str(data)], ["--tenant", "bob"]):
            usage = cli("ls", *remote, *bad)
            assert usage.returncode == 2 and "not with --url" in usage.stderr
        assert cli("ls", "--url", url).returncode == 2  # no token

        # a replica given the same secret file takes the handles this server gives out
        toks, kv = WRITTEN[("bob", "bob-1")]
        async with AsyncClient(url, ALICE, spec=SPEC4) as alice:
            await alice.put_prefix(toks, kv)
            handle = (await alice.match(toks)).handles[0]
            raw = await alice.get_chunk(handle)
        async with (
            StateStore.open(tmp_path / "replica", SPEC4, chunk_tokens=CHUNK) as store,
            serving(store, Limits(handle_secret_file=secret)) as replica,
            AsyncClient(replica, ALICE) as there,
        ):
            assert raw is not None and await there.put_chunk(handle, raw) and await there.has_chunk(handle)
    finally:
        stderr = await _stop(proc)
    logs = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    said = [r for r in logs if r["logger"] == "agentstate.server.service" and "serving" in r["message"]]
    assert said and said[0]["level"] == "INFO" and url.removeprefix("http://") in said[0]["message"]
    assert {"time", "level", "logger", "message"} <= set(said[0])
    assert not any("secret made for this process" in r["message"] for r in logs)  # it was given one
    assert any(r["logger"].startswith("uvicorn") for r in logs)  # uvicorn's own lines in the same format
    assert all(line.startswith("{") for line in stderr.splitlines() if line.strip()), stderr[-2000:]
    expect = {k: v for k, v in WRITTEN.items() if k not in {("default", "agent-0"), ("default", "agent-2")}}
    await check_sessions(data, expect | {("default", "agent-0b"): WRITTEN[("default", "agent-0")]})


async def test_log_level_hides_info_lines(data: Path, tmp_path: Path) -> None:
    proc, _ = await _spawn_serve(data, tmp_path, env={"AGENTSTATE_LOG_LEVEL": "warning"})
    quiet = await _stop(proc)
    assert proc.returncode == 0 and "serving" not in quiet
    proc, url = await _spawn_serve(data, tmp_path, "--log-level", "DEBUG")
    loud = await _stop(proc)
    assert f"INFO agentstate.server.service: serving {data}" in loud and url.removeprefix("http://") in loud
    assert "secret made for this process" in loud  # no handle secret configured: said so
    assert cli("--log-level", "chatty", "version").returncode == 2


async def test_replicas_with_one_secret_accept_each_others_handles(tmp_path: Path) -> None:
    """A handle minted by one service is accepted by another given the same secret (by file or by
    value), and refused (404, ChunkNotFoundError) by one with another secret or none."""
    file = tmp_path / "secret"
    file.write_text(SECRET + "\n")
    tokens = list(WRITTEN[("default", "agent-1")][0][: 2 * CHUNK])
    kv = WRITTEN[("default", "agent-1")][1][:, :, : 2 * CHUNK]
    same = [Limits(handle_secret_file=file), Limits(handle_secret=SECRET)]
    other = [Limits(handle_secret="another-secret-0123456789"), Limits()]
    for i, limits in enumerate(same + other):
        accepted = i < len(same)
        dirs = (tmp_path / f"a{i}", tmp_path / f"b{i}")
        async with (
            StateStore.open(dirs[0], SPEC4, chunk_tokens=CHUNK) as a,
            StateStore.open(dirs[1], SPEC4, chunk_tokens=CHUNK) as b,
            serving(a, Limits(handle_secret_file=file)) as url_a,
            serving(b, limits) as url_b,
            AsyncClient(url_a, ALICE) as minted_by,
            AsyncClient(url_b, ALICE) as used_at,
        ):
            await minted_by.put_prefix(tokens, kv)
            handles = (await minted_by.match(tokens)).handles
            raw = await minted_by.get_chunk(handles[0])
            assert raw is not None
            if accepted:
                assert await used_at.put_chunk(handles[0], raw) is True
                assert await used_at.get_chunk(handles[0]) == raw
                assert bits_equal(await used_at.decode_chunk(handles[0], raw), kv[:, :, :CHUNK])
            else:
                with pytest.raises(ChunkNotFoundError):
                    await used_at.put_chunk(handles[0], raw)
                assert not await used_at.has_chunk(handles[0])
