"""The installed `agentstate` command, run in a subprocess on real data directories (LMDB on disk).

A store is written here in-process, closed, and then inspected, verified, repaired, exported and
imported by the CLI; what the CLI claims is checked against the store opened again afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from agentstate import ModelSpec, StateStore
from agentstate.ops.admin import record_spec
from tests.cli_process import run_cli
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.requires import skip_or_fail
from tests.test_corruption import rewrite_lmdb_value
from tests.test_service import _free_port, wait_healthy

AGENTSTATE = shutil.which("agentstate")
if AGENTSTATE is None:
    skip_or_fail("the agentstate command is not on PATH (pip install -e .; .ci/run puts .venv-ci/bin on PATH)")
CHUNK = 64
SYSTEM = random_tokens(3 * CHUNK, seed=90)  # a system prompt of three whole chunks, shared by everyone


def cli(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `agentstate ARGS`; the data directory's chunk size comes from the env, as in a deployment."""
    full = {**os.environ, "AGENTSTATE_CHUNK_TOKENS": str(CHUNK), "COLUMNS": "200", **(env or {})}
    return run_cli(*args, env=full)  # the CLI in a process of its own, torch pre-imported (tests/cli_process.py)


def ok_json(*args: str | Path) -> Any:
    done = cli(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def session(i: int) -> tuple[list[int], torch.Tensor]:
    tokens = SYSTEM + random_tokens(40 + 30 * i, seed=i)
    kv = random_kv(SPEC4, len(tokens), seed=100 + i)
    kv[:, :, : len(SYSTEM)] = random_kv(SPEC4, len(SYSTEM), seed=99)  # the shared prefix's KV
    return tokens, kv


WRITTEN = {("default", f"agent-{i}"): session(i) for i in range(3)} | {("bob", "bob-1"): session(7)}


async def write_store(data: Path, spec: ModelSpec = SPEC4) -> None:
    async with StateStore.open(data, spec, chunk_tokens=CHUNK) as store:
        for (tenant, sid), (tokens, kv) in WRITTEN.items():
            await store.for_tenant(tenant).snapshot(sid, tokens, kv, {"owner": sid})
    record_spec(data, spec)


async def check_sessions(data: Path, expect: dict[tuple[str, str], tuple[list[int], torch.Tensor]]) -> None:
    """Every session of `expect` resumes bit-exact from `data`, and no other session is there."""
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK) as store:
        for tenant in {t for t, _ in expect} | {"default", "bob"}:
            found = {m.session_id async for m in store.for_tenant(tenant).sessions()}
            assert found == {sid for t, sid in expect if t == tenant}
        for (tenant, sid), (tokens, kv) in expect.items():
            r = await store.for_tenant(tenant).resume(sid)
            assert r.complete and r.tokens == tokens and bits_equal(r.kv, kv), f"{tenant}/{sid}"


@pytest.fixture
async def data(tmp_path: Path) -> Path:
    await write_store(tmp_path / "data")
    return tmp_path / "data"


async def test_ls_inspect_stats_report_what_is_stored(data: Path) -> None:
    rows = ok_json("ls", "-p", data)
    assert [(r["session_id"], r["tokens"]) for r in rows] == [(f"agent-{i}", len(session(i)[0])) for i in range(3)]
    assert [r["session_id"] for r in ok_json("ls", "-p", data, "--tenant", "bob")] == ["bob-1"]

    detail = ok_json("inspect", "agent-1", "-p", data)
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK) as store:
        m = await store.session("agent-1")
    assert [c["key"] for c in detail["chunks"]] == [*m.chunk_keys, m.tail_key]
    assert all(c["tiers"] == ["lmdb"] for c in detail["chunks"]) and detail["missing"] == 0
    assert detail["state"] == {"owner": "agent-1"} and detail["num_tokens"] == len(session(1)[0])

    st = ok_json("stats", "-p", data)
    assert st["tenant_sessions"] == 3 and st["unique_chunks"] == 3 + sum((40 + 30 * i) // CHUNK for i in range(3))
    assert st["unique_bytes"] < st["logical_bytes"]  # the system prompt's chunks are stored once

    table = cli("ls", "-p", data)
    assert table.returncode == 0 and "agent-2" in table.stdout and "3 sessions" in table.stdout
    one = cli("ls", "-p", data, "--tenant", "bob")
    assert one.returncode == 0 and "1 session" in one.stdout and "1 sessions" not in one.stdout


async def test_ls_that_finds_none_says_which_tenants_have_sessions(tmp_path: Path) -> None:
    async with StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=CHUNK) as store:
        for sid in ("b1", "b2"):
            await store.for_tenant("bob").snapshot(sid, *session(1))
        await store.for_tenant("carol").snapshot("c1", *session(2))
    record_spec(tmp_path / "d", SPEC4)
    done = cli("ls", "-p", tmp_path / "d")
    shown = " ".join(done.stdout.split())
    assert done.returncode == 0 and "0 sessions" in shown and "bob (2), carol (1)" in shown and "--tenant" in shown
    assert ok_json("ls", "-p", tmp_path / "d") == []  # --json stays the rows


LONG_IDS = [f"customer-support-agent-{i}-2026-12-05T13:00:00Z-{'abcdef' * 4}" for i in range(3)]


@pytest.mark.parametrize("width", [80, 200])
async def test_tables_never_cut_an_id_or_a_number(tmp_path: Path, width: int) -> None:
    """At 80 and 200 columns, every session id, chunk key, token count and size the --json report
    has appears whole in the table (no `…`); what does not fit is dropped whole, and said so."""
    data = tmp_path / "d"
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK) as store:
        for i, sid in enumerate(LONG_IDS):
            await store.snapshot(sid, *session(i), {"i": i})
    record_spec(data, SPEC4)
    env = {"COLUMNS": str(width)}
    ls = cli("ls", "-p", data, env=env)
    assert ls.returncode == 0 and "…" not in ls.stdout, ls.stdout
    rows = ok_json("ls", "-p", data)
    if width == 200:  # a table with every column, each row on one line
        table = [line for line in ls.stdout.splitlines() if line[:1] in "┏┃┡│└"]
        assert max(len(line) for line in table) <= width and "guaranteed" in ls.stdout, ls.stdout
        for row in rows:
            line = next((line for line in table if row["session_id"] in line), "")
            assert str(row["tokens"]) in line.split() and row["session_id"] in line.split(), ls.stdout
    else:  # id and tokens alone are wider than 80 columns: one block per session
        for row in rows:
            block = next((b for b in ls.stdout.split("\n\n") if b.startswith(f"session {row['session_id']}\n")), "")
            assert re.search(rf"^ +tokens +{row['tokens']}$", block, re.M), ls.stdout
            assert re.search(rf"^ +chunks +{row['chunks']}$", block, re.M), ls.stdout
    narrow = cli("ls", "-p", data, env={"COLUMNS": "110"})  # a table without the least useful columns
    assert "not shown" in narrow.stdout and all(sid in narrow.stdout for sid in LONG_IDS), narrow.stdout
    assert max(len(line) for line in narrow.stdout.splitlines() if line[:1] in "┏┃┡│└") <= 110
    for sid in LONG_IDS[:2]:
        shown = cli("inspect", sid, "-p", data, env=env)
        detail = ok_json("inspect", sid, "-p", data)
        assert shown.returncode == 0 and "…" not in shown.stdout, shown.stdout
        lines = shown.stdout.splitlines()
        keys = [c["key"] for c in detail["chunks"]]
        assert len(set(keys)) == len(keys) and all(any(k in line for line in lines) for k in keys), shown.stdout
        full = len(detail["chunks"]) - 1
        assert f"{full} chunks of {CHUNK}, tail {detail['tail_tokens']}" in " ".join(shown.stdout.split())


def test_serve_on_a_port_in_use_says_so_and_leaves_nothing(tmp_path: Path) -> None:
    import socket

    (tmp_path / "tokens.json").write_text(json.dumps({"token-0123456789abcdef": "default"}))
    (tmp_path / "spec.json").write_text(SPEC4.model_dump_json())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = cli("serve", "-p", tmp_path / "new", "--spec", tmp_path / "spec.json", "--tokens-file",
                   tmp_path / "tokens.json", "--port", str(port))  # fmt: skip
    shown = " ".join(done.stderr.split())
    assert done.returncode == 1 and f"port {port} on 127.0.0.1 is in use" in shown and "--port" in shown, done.stderr
    assert "serving" not in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "new").exists()  # nothing written: the port is bound before the store opens


def test_serve_without_its_tokens_file_says_what_to_give(tmp_path: Path) -> None:
    (tmp_path / "spec.json").write_text(SPEC4.model_dump_json())
    done = cli("serve", "-p", tmp_path / "new", "--spec", tmp_path / "spec.json", "--tokens-file",
               tmp_path / "missing.json", "--port", str(_free_port()))  # fmt: skip
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) <= 2, done.stderr  # a long path wraps
    shown = " ".join(done.stderr.split())
    assert "no tokens file" in shown and "--tokens-file" in shown and "Traceback" not in done.stderr
    assert not (tmp_path / "new").exists()


def test_version_is_a_flag_and_a_command() -> None:
    from agentstate._version import __version__

    for args in (("--version",), ("version",)):
        done = cli(*args)
        assert done.returncode == 0 and done.stdout.strip() == __version__, (args, done.stdout, done.stderr)


def test_the_installed_command_answers_as_the_test_runner_does(data: Path, tmp_path: Path) -> None:
    """The other tests run the CLI forked from a process that imported it once (tests/cli_process.py);
    the console script in a fresh interpreter gives the same answers, exit codes and files."""
    env = {**os.environ, "AGENTSTATE_CHUNK_TOKENS": str(CHUNK), "COLUMNS": "200"}

    def installed(*args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([AGENTSTATE, *map(str, args)], check=False, capture_output=True, text=True, env=env,
                              timeout=300)  # type: ignore[list-item]  # fmt: skip

    for args in (("ls", "-p", data, "--json"), ("inspect", "agent-1", "-p", data, "--json"),
                 ("inspect", "nobody", "-p", data), ("ls", "-p", tmp_path / "none"), ("verify", "-p", data, "--json")):  # fmt: skip
        a, b = installed(*args), cli(*args)
        assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr), args
    for run, name in ((installed, "a.tar"), (cli, "b.tar")):
        assert run("export", tmp_path / name, "-p", data, "--json").returncode == 0
    assert (tmp_path / "a.tar").stat().st_size == (tmp_path / "b.tar").stat().st_size > 0


async def test_verify_reports_flipped_bytes_and_repair_drops_them(data: Path) -> None:
    assert ok_json("verify", "-p", data)["clean"]
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK) as store:
        victim = (await store.session("agent-2")).chunk_keys[3]  # the session's own fourth chunk
    rewrite_lmdb_value(data, victim, lambda raw: raw[:100] + bytes([raw[100] ^ 0x10]) + raw[101:])

    found = cli("verify", "-p", data, "--json")
    assert found.returncode == 1, "damage must fail verify"
    report = json.loads(found.stdout)
    assert [(b["tier"], b["key"]) for b in report["corrupt"]] == [("lmdb", victim)]
    assert "checksum" in report["corrupt"][0]["problem"]
    [hit] = report["affected"]
    assert (hit["session_id"], hit["restorable_tokens"]) == ("agent-2", 3 * CHUNK)
    assert "verify lmdb" in cli("verify", "-p", data).stderr  # the progress bar

    repaired = cli("verify", "--repair", "-p", data, "--json")
    assert repaired.returncode == 0 and json.loads(repaired.stdout)["repaired"]
    after = json.loads(cli("verify", "-p", data, "--json").stdout)
    assert after["corrupt"] == [] and after["missing"] == [victim]  # dropped: a miss now, not bad bytes

    tokens, kv = WRITTEN[("default", "agent-2")]
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK) as store:
        r = await store.resume("agent-2")
        assert r.restored_tokens == 3 * CHUNK and bits_equal(r.kv, kv[:, :, : 3 * CHUNK])
        await store.snapshot("agent-2", tokens, kv, {"owner": "agent-2"})  # the engine recomputed it
    assert ok_json("verify", "-p", data)["clean"]
    await check_sessions(data, WRITTEN)


async def test_export_import_round_trips_bit_exact(data: Path, tmp_path: Path) -> None:
    archive = tmp_path / "all.tar"
    report = ok_json("export", archive, "--all-tenants", "-p", data)
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    # the system prompt's three chunks once per tenant (tenants do not share a namespace), then
    # each session's own chunks and its tail
    own = sum(len(t) // CHUNK - 3 + 1 for t, _ in WRITTEN.values())
    assert report["chunks"] == len(names) - 1 == 2 * 3 + own and "index.json" in names

    copy = tmp_path / "copy"
    imported = ok_json("import", archive, "-p", copy)
    assert (imported["sessions"], imported["replaced"]) == (4, 0)
    await check_sessions(copy, WRITTEN)

    mine = ok_json("export", tmp_path / "one.tar", "agent-1", "-p", data)
    assert mine["sessions"] == 1
    ok_json("import", tmp_path / "one.tar", "-p", copy, "--tenant", "carol")
    async with StateStore.open(copy, SPEC4, chunk_tokens=CHUNK) as store:
        r = await store.for_tenant("carol").resume("agent-1")
        assert r.complete and bits_equal(r.kv, WRITTEN[("default", "agent-1")][1])

    again = cli("import", archive, "-p", copy)
    assert again.returncode == 1 and "ConflictError" in again.stderr
    assert ok_json("import", archive, "-p", copy, "--force")["replaced"] == 4
    await check_sessions(copy, WRITTEN | {("carol", "agent-1"): WRITTEN[("default", "agent-1")]})


def _flip_member_byte(archive: Path, member: str, at: int) -> None:
    with tarfile.open(archive) as tar:
        offset = tar.getmember(member).offset_data + at
    with archive.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


async def test_damaged_or_foreign_archives_import_nothing(data: Path, tmp_path: Path) -> None:
    archive = tmp_path / "all.tar"
    ok_json("export", archive, "--all-tenants", "-p", data)
    target = tmp_path / "target"
    await write_store(target)  # a populated target: a failed import must leave it as it was
    async with StateStore.open(target, SPEC4, chunk_tokens=CHUNK) as store:
        await store.delete("agent-0")
    left = {k: v for k, v in WRITTEN.items() if k != ("default", "agent-0")}

    cases: list[tuple[str, Path, str]] = []
    flipped = tmp_path / "flipped.tar"
    shutil.copy(archive, flipped)
    _flip_member_byte(flipped, "chunks/000004.kv", 200)  # a chunk late in the archive: caught up front
    cases.append(("flipped chunk", flipped, "CorruptDataError"))
    index = tmp_path / "index.tar"
    shutil.copy(archive, index)
    _flip_member_byte(index, "index.json", 40)
    cases.append(("damaged index", index, "CorruptDataError"))
    cut = tmp_path / "cut.tar"
    cut.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    cases.append(("truncated", cut, "CorruptDataError"))
    junk = tmp_path / "junk.tar"
    junk.write_bytes(os.urandom(5000))
    cases.append(("not a tar", junk, "CorruptDataError"))
    other = ModelSpec(model_id="test/other", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    await write_store(tmp_path / "other", other)
    ok_json("export", tmp_path / "other.tar", "-p", tmp_path / "other")
    cases.append(("another model's KV", tmp_path / "other.tar", "SpecMismatchError"))
    cases.append(("no such file", tmp_path / "absent.tar", "NotFoundError"))

    for what, bad, error in cases:
        done = cli("import", bad, "-p", target, "--force")
        assert done.returncode == 1 and error in done.stderr, f"{what}: {done.stderr}"
        assert "Traceback" not in done.stderr
    await check_sessions(target, left)


async def test_bad_arguments_are_clear_errors(data: Path, tmp_path: Path) -> None:
    missing = cli("inspect", "nobody", "-p", data)
    assert missing.returncode == 1 and "SessionNotFoundError" in missing.stderr
    nothing = cli("ls", "-p", tmp_path / "nowhere")
    assert nothing.returncode == 1 and "no agentstate data directory" in nothing.stderr
    assert "-p DIR or AGENTSTATE_PATH" in " ".join(nothing.stderr.split())  # what to do about it
    refused = cli("ls", "--url", "http://127.0.0.1:1", "--token", "t")
    shown = " ".join(refused.stderr.split())
    assert refused.returncode == 1 and "cannot connect to http://127.0.0.1:1" in shown and "server running" in shown
    assert len(refused.stderr.strip().splitlines()) <= 2 and "Traceback" not in refused.stderr
    (data / "spec.json").unlink()
    unknown = cli("ls", "-p", data)
    assert unknown.returncode == 1 and "--spec" in unknown.stderr  # never guesses a spec
    record_spec(data, SPEC4)
    record = cli("evict", "lmdb", "--budget", "0", "-p", data)
    assert record.returncode == 1 and "record tier" in record.stderr
    await check_sessions(data, WRITTEN)


async def test_serve_answers_until_sigterm(data: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"t-bob": "bob"}))
    port = _free_port()
    env = {**os.environ, "AGENTSTATE_CHUNK_TOKENS": str(CHUNK)}
    proc = await asyncio.create_subprocess_exec(
        AGENTSTATE, "serve", "-p", str(data), "--port", str(port), "--tokens-file", str(tokens), env=env,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"authorization": "Bearer t-bob"}
        ) as c:
            await wait_healthy(c, proc)
            assert (await c.get("/v1/spec")).json()["fingerprint"] == SPEC4.fingerprint  # the recorded spec
            assert [s["session_id"] for s in (await c.get("/v1/sessions")).json()] == ["bob-1"]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
