"""Retention and accounting as an operator sees them: `agentstate ls` and `inspect` on a data
directory (a separate process, read-only), and an export/import that keeps the contract."""

from __future__ import annotations

import time
from pathlib import Path

from agentstate import StateStore
from agentstate.ops.admin import record_spec
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.test_cli import CHUNK, cli, ok_json


async def test_ls_and_inspect_show_retention_hits_and_usage(tmp_path: Path) -> None:
    data = tmp_path / "data"
    until = time.time() + 7 * 86400
    toks, kv = random_tokens(3 * CHUNK + 5, seed=1), random_kv(SPEC4, 3 * CHUNK + 5, seed=1)
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK) as store:
        await store.snapshot("contract", toks, kv, ttl_seconds=300, guaranteed_until=until)
        await store.snapshot("sliding", toks, kv, ttl_seconds=3600)
        await store.snapshot("plain", toks, kv)
        await store.resume("sliding")
        await store.resume("sliding")
        await store.paused("sliding", 30)
    record_spec(data, SPEC4)
    rows = {r["session_id"]: r for r in ok_json("ls", "-p", data)}
    assert rows["contract"]["guaranteed_until"] == until and rows["contract"]["expires_at"] == until
    assert rows["plain"]["expires_at"] is None and rows["plain"]["last_hit_at"] is None
    hit = rows["sliding"]["last_hit_at"]
    assert hit is not None and rows["sliding"]["expires_at"] == hit + 3600  # the TTL counts from the last hit
    text = cli("ls", "-p", data)
    assert text.returncode == 0 and "guaranteed" in text.stdout and "last hit" in text.stdout and "never" in text.stdout

    d = ok_json("inspect", "sliding", "-p", data)
    u = d["usage"]
    assert (u["resumes"], u["snapshots"], u["hints"]) == (2, 1, 1)
    assert u["tokens_read"] == 2 * len(toks) and u["tokens_recomputed"] == 0
    assert u["tokens_written"] == 5 and u["tokens_deduped"] == 3 * CHUNK  # "contract" stored the chunks; its own tail
    assert sum(u["bytes_read"].values()) >= 2 * len(toks) * SPEC4.token_bytes
    assert d["expires_at"] == hit + 3600 and d["hint"] is None  # holds live in the serving process only
    shown = cli("inspect", "sliding", "-p", data)
    assert shown.returncode == 0 and "retention: ttl 3600s" in shown.stdout and "2 resumes" in shown.stdout
    # the read-only CLI counted nothing and changed nothing
    again = ok_json("inspect", "sliding", "-p", data)
    assert again["usage"] == u and again["last_hit_at"] == hit


async def test_export_import_keeps_the_retention_contract(tmp_path: Path) -> None:
    data, target, archive = tmp_path / "data", tmp_path / "target", tmp_path / "all.tar"
    until = time.time() + 86400
    toks, kv = random_tokens(2 * CHUNK + 3, seed=2), random_kv(SPEC4, 2 * CHUNK + 3, seed=2)
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK) as store:
        await store.snapshot("contract", toks, kv, ttl_seconds=60, guaranteed_until=until)
    record_spec(data, SPEC4)
    ok_json("export", archive, "-p", data)
    assert ok_json("import", archive, "-p", target)["sessions"] == 1
    async with StateStore.open(target, SPEC4, chunk_tokens=CHUNK) as store:
        m = await store.session("contract")
        assert m.guaranteed_until == until and m.ttl_seconds == 60
        assert bits_equal((await store.resume("contract")).kv, kv)
