"""The data directory describes itself (issue 26): every writer, the library's `StateStore.open`
included, records its spec and config; every reader opens exactly that; a spec that differs from
the recorded one is refused everywhere, naming the fields that differ.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import unquote

import pytest
import torch

from agentstate import ModelSpec, StateStore
from agentstate.config import StoreConfig, TierConfig
from agentstate.datadir import CONFIG, SPEC, adopt_spec, record_config, recorded_config, write_atomic
from agentstate.errors import InvalidArgumentError, SpecMismatchError
from agentstate.settings import store_config
from tests.cli_process import run_cli
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.test_cli import CHUNK, cli

SMALL = ModelSpec(model_id="meta-llama/Llama-3.1-8B", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16")
"""The README's first example, with a smaller KV shape"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("AGENTSTATE_")}


async def test_readme_example_then_agentstate_ls(tmp_path: Path) -> None:
    data = tmp_path / "agentstate-data"
    async with StateStore.open(data, SMALL) as store:  # the README's first example, as a new user runs it
        tokens = list(range(1000))
        kv = torch.zeros(SMALL.kv_shape(len(tokens)), dtype=torch.bfloat16)
        await store.put_prefix(tokens, kv)
        await store.snapshot("agent-42", tokens, kv, state={"messages": []})
        await store.fork("agent-42", "agent-42b")
    assert ModelSpec.model_validate_json((data / SPEC).read_text()) == SMALL
    recorded = json.loads((data / CONFIG).read_text())
    assert recorded["recorded"]["by"] == "agentstate.StateStore" and recorded["chunk_tokens"] == 256
    assert [t["kind"] for t in recorded["tiers"]] == ["host", "lmdb"]
    assert sorted(n for n in os.listdir(data) if n.startswith(".")) == []  # no temp file left
    done = run_cli("ls", "-p", data, "--json", env=_clean_env())
    assert done.returncode == 0, done.stderr
    assert [r["session_id"] for r in json.loads(done.stdout)] == ["agent-42", "agent-42b"]


def _file_chunks(root: Path) -> dict[str, Path]:
    """The file tier's chunk files under `root`, by key."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            key = unquote(name)
            if key.startswith("c/"):
                found[key] = Path(folder) / name
    return found


async def test_verify_opens_the_tiers_the_library_wrote_with(tmp_path: Path) -> None:
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere" / "kv"
    tiers = [
        TierConfig(kind="host", capacity_bytes=64 << 20),
        TierConfig(kind="file", path=Path("nvme")),
        TierConfig(kind="lmdb", path=elsewhere),  # another LMDB path, outside the data directory
    ]
    n = 5 * CHUNK + 10
    written = {f"s{i}": (random_tokens(n, seed=i), random_kv(SPEC4, n, seed=i)) for i in range(2)}
    async with StateStore.open(data, SPEC4, tiers=tiers, chunk_tokens=CHUNK, lmdb_map_size=64 << 20) as store:
        for sid, (tokens, kv) in written.items():
            await store.snapshot(sid, tokens, kv)
    clean = cli("verify", "-p", data, "--json")
    assert clean.returncode == 0, clean.stdout + clean.stderr  # every session whole, in every tier
    report = json.loads(clean.stdout)
    assert [t["tier"] for t in report["tiers"]] == ["host", "file", "lmdb"] and report["affected"] == []
    assert {t["tier"]: t["ok"] for t in report["tiers"]}["lmdb"] == len(written) * 6
    files = _file_chunks(data / "nvme")
    a, b = sorted(files)[:2]
    first, second = files[a].read_bytes(), files[b].read_bytes()
    files[a].write_bytes(second)
    files[b].write_bytes(first)
    damaged = cli("verify", "-p", data, "--json")
    assert damaged.returncode == 1, "two swapped chunks must fail verify"
    report = json.loads(damaged.stdout)
    assert {(c["tier"], c["key"]) for c in report["corrupt"]} == {("file", a), ("file", b)}
    assert all("misplaced" in c["problem"] for c in report["corrupt"])
    assert report["affected"] == [] and report["missing"] == []  # the LMDB tier holds good copies
    lmdb = next(t for t in report["tiers"] if t["tier"] == "lmdb")
    assert (lmdb["corrupt"], lmdb["missing"]) == (0, 0)
    async with StateStore.open(data, SPEC4, tiers=tiers, chunk_tokens=CHUNK, lmdb_map_size=64 << 20) as store:
        for sid, (tokens, kv) in written.items():
            r = await store.resume(sid)  # a wrong byte is never served
            assert r.complete and bits_equal(r.kv, kv)


async def test_another_spec_is_refused_everywhere_naming_the_fields(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK) as store:
        await store.snapshot("s", random_tokens(100), random_kv(SPEC4, 100))
    other = SPEC4.model_copy(update={"num_layers": 8, "dtype": "float16"})
    fields = "dtype 'float16' != 'bfloat16', num_layers 8 != 4"
    with pytest.raises(SpecMismatchError, match=fields):  # the library
        await StateStore.open(data, other, chunk_tokens=CHUNK)
    with pytest.raises(SpecMismatchError, match=fields):  # read-only openers too
        await StateStore.open(data, other, chunk_tokens=CHUNK, read_only=True)
    spec_b = tmp_path / "b.json"
    spec_b.write_text(other.model_dump_json())
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"t": "default"}))
    served = cli("serve", "-p", data, "--spec", spec_b, "--tokens-file", tokens, "--port", "1")
    assert served.returncode == 1 and "SpecMismatchError" in served.stderr and fields in served.stderr
    assert str(data / SPEC) in served.stderr and other.fingerprint not in served.stderr
    listed = cli("ls", "-p", data, "--spec", spec_b)
    assert listed.returncode == 1 and fields in listed.stderr
    config = tmp_path / "with-spec.toml"
    spec_table = 'model_id = "test/tiny"\nnum_layers = 8\nnum_kv_heads = 2\nhead_dim = 64\n'
    config.write_text(f'path = "{data}"\n[spec]\n{spec_table}')
    from_file = cli("--config", config, "ls")
    assert from_file.returncode == 1 and "num_layers 8 != 4" in from_file.stderr and "[spec]" in from_file.stderr
    assert ModelSpec.model_validate_json((data / SPEC).read_text()) == SPEC4  # never replaced
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK) as store:
        assert (await store.resume("s")).complete


async def test_a_directory_of_an_older_version_still_opens(tmp_path: Path) -> None:
    data = tmp_path / "data"
    kv = random_kv(SPEC4, 100)
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK) as store:
        await store.snapshot("s", random_tokens(100), kv)
    (data / CONFIG).unlink()  # an older library recorded neither
    (data / SPEC).unlink()
    unknown = cli("ls", "-p", data)
    assert unknown.returncode == 1 and "--spec" in unknown.stderr  # a spec is never guessed
    (data / SPEC).write_text(SPEC4.model_dump_json())  # as an older `agentstate serve` recorded it
    listed = cli("ls", "-p", data, "--json")  # no config.json: the env and defaults, as before
    assert listed.returncode == 0, listed.stderr
    assert [r["session_id"] for r in json.loads(listed.stdout)] == ["s"] and not (data / CONFIG).exists()
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK) as store:  # the next writer records it
        assert bits_equal((await store.resume("s")).kv, kv)
    assert recorded_config(data) is not None


async def test_a_read_only_opener_records_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with StateStore.open(data, SPEC4, chunk_tokens=CHUNK):
        pass
    (data / CONFIG).unlink()
    async with StateStore.open(data, SPEC4, chunk_tokens=32, read_only=True):
        pass
    assert not (data / CONFIG).exists()


def test_recorded_config_hides_passwords(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiers = [
        TierConfig(kind="host", capacity_bytes=1 << 20),
        TierConfig(kind="redis", url="redis://cache:6379/0?password=hunter2&db=0"),
    ]
    catalog = "redis://user:hunter2@catalog:6379/0"
    config = StoreConfig(path=tmp_path, tiers=tiers, catalog_url=catalog)
    text = record_config(config, "test").read_text()
    assert "hunter2" not in text and "password=***" in text and "user:***@catalog" in text
    with pytest.raises(InvalidArgumentError, match="tiers.1.url .* had its password removed"):
        store_config(recorded_config(tmp_path))  # a redacted URL is asked for again, never used
    monkeypatch.setenv("AGENTSTATE_TIERS", json.dumps([t.model_dump(mode="json") for t in tiers]))
    with pytest.raises(InvalidArgumentError, match="catalog_url .* had its password removed"):
        store_config(recorded_config(tmp_path))
    monkeypatch.setenv("AGENTSTATE_CATALOG_URL", catalog)
    assert store_config(recorded_config(tmp_path)).catalog_url == catalog


def test_records_are_written_atomically_and_a_spec_never_replaced(tmp_path: Path) -> None:
    target = write_atomic(tmp_path / "d" / "x.json", "{}\n")
    assert target.read_text() == "{}\n" and os.listdir(target.parent) == ["x.json"]
    adopt_spec(tmp_path / "d", SPEC4)
    before = (tmp_path / "d" / SPEC).stat().st_mtime_ns
    adopt_spec(tmp_path / "d", SPEC4)  # the same spec: nothing rewritten
    assert (tmp_path / "d" / SPEC).stat().st_mtime_ns == before
    with pytest.raises(SpecMismatchError, match="model_id 'other' != 'test/tiny'"):
        adopt_spec(tmp_path / "d", SPEC4.model_copy(update={"model_id": "other"}))
    assert recorded_config(tmp_path / "nowhere") is None
