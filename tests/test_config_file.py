"""One config file (agentstate.settings, agentstate.configured): byte sizes with units, the layering
flags > env > file > defaults, a typed error for every class of bad file (nothing written), every CLI
command and the demo run from a file alone, the effective config recorded in the data directory and
used by the admin commands, SGLang's rank directories, and docs/config.md generated from the models.

`python -m tests.test_config_file` prints the reference tables of docs/config.md.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import types
import typing
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from agentstate import StateStore
from agentstate.config import SIZE, TIER_KINDS, ExternalTier, StoreConfig, TierConfig
from agentstate.configured import ServiceKeys, load, open_configured, service_settings
from agentstate.errors import AgentStateError, InvalidArgumentError, NotFoundError, SpecMismatchError
from agentstate.settings import RECORDED, read_config_file, record_config, recorded_config, store_config
from agentstate.spec import ModelSpec
from tests.cli_process import run_cli
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.requires import skip_or_fail

ROOT = Path(__file__).resolve().parent.parent
AGENTSTATE = shutil.which("agentstate")
TOKEN = "t-config-0123456789"
SPEC_TABLE = "\n".join(f"{k} = {json.dumps(v)}" for k, v in SPEC4.model_dump().items())
CONFIG = f"""
path = "data"
chunk_tokens = 64
lmdb_map_size = "64MiB"
host_capacity_bytes = "32MiB"

[[tiers]]
kind = "host"
capacity_bytes = "16MiB"

[[tiers]]
kind = "file"
path = "files"
capacity_bytes = "1GiB"

[[tiers]]
kind = "lmdb"
path = "chunks"

[spec]
{SPEC_TABLE}

[service]
tokens_file = "tokens.json"
max_body_bytes = "256MiB"
"""


def clean_env(**extra: str) -> dict[str, str]:
    """This process's env without any AGENTSTATE_* variable (a config file alone), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTSTATE_")}
    return {**env, "COLUMNS": "200", **extra}


def cli(
    *args: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    if AGENTSTATE is None:
        skip_or_fail("the agentstate command is not on PATH (pip install -e .)")
    return run_cli(*args, env=env or clean_env(), cwd=cwd)  # its own process (tests/cli_process.py)


def ok_json(*args: str | Path, cwd: Path | None = None) -> Any:
    done = cli(*args, "--json", cwd=cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def disk(root: Path) -> dict[str, str]:
    """Every file below `root` and a digest of its bytes: what "changes nothing on disk" compares."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


async def write_sessions(config: StoreConfig, count: int = 3) -> dict[str, tuple[list[int], Any]]:
    written = {}
    async with StateStore.open(config, SPEC4) as store:
        for i in range(count):
            tokens = random_tokens(150 + 20 * i, seed=i)
            kv = random_kv(SPEC4, len(tokens), seed=10 + i)
            await store.snapshot(f"s{i}", tokens, kv)
            written[f"s{i}"] = (tokens, kv)
    return written


# -- sizes and layering ---------------------------------------------------------------------------


def test_sizes_take_units_everywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for given, expected in (("32GiB", 32 << 30), ("512MiB", 512 << 20), (1073741824, 1 << 30), ("1.5 KiB", 1536),
                            ("2GB", 2 * 10**9), ("4096", 4096)):  # fmt: skip
        tier = TierConfig.model_validate({"kind": "host", "capacity_bytes": given})
        mooncake = TierConfig.model_validate({"kind": "mooncake", "segment_bytes": given, "buffer_bytes": given})
        keys = ("host_capacity_bytes", "restore_pool_bytes", "lmdb_map_size", "lmdb_max_map_size", "batch_bytes")
        c = StoreConfig.model_validate({**dict.fromkeys(keys, given), "tiers": [tier, mooncake]})
        sizes = [getattr(c, k) for k in keys] + [tier.capacity_bytes, mooncake.segment_bytes, mooncake.buffer_bytes]
        assert sizes == [expected] * 8 and all(type(v) is int for v in sizes)
    monkeypatch.setenv("AGENTSTATE_LMDB_MAP_SIZE", "8GiB")
    monkeypatch.setenv("AGENTSTATE_TIERS", '[{"kind": "host", "capacity_bytes": "2GiB"}, {"kind": "lmdb"}]')
    from_env = StoreConfig()
    assert from_env.lmdb_map_size == 8 << 30 and from_env.tier_list()[0].capacity_bytes == 2 << 30
    file = tmp_path / "sizes.toml"
    file.write_text('[service]\nmax_body_bytes = "64MiB"\nmax_inflight_bytes = "1GiB"\ndrain_bytes = 1024\n')
    monkeypatch.setenv("AGENTSTATE_SERVICE_MAX_JSON_BYTES", "2MiB")
    _, limits = service_settings(read_config_file(file))
    assert (limits.max_body_bytes, limits.max_inflight_bytes, limits.drain_bytes) == (64 << 20, 1 << 30, 1024)
    assert limits.max_json_bytes == 2 << 20
    assert StoreConfig().model_dump(mode="json")["lmdb_map_size"] == 8 << 30  # recorded as plain ints


def test_flags_beat_env_beat_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "layers.toml"
    file.write_text('path = "from-file"\ntenant = "file-t"\nchunk_tokens = 32\nio_depth = 3\n'
                    '[service]\nport = 9001\nmax_body_bytes = "1MiB"\nmax_json_bytes = "1MiB"\n')  # fmt: skip
    loaded = load(file)
    assert (loaded.store.path, loaded.store.tenant, loaded.store.chunk_tokens) == (tmp_path / "from-file", "file-t", 32)
    monkeypatch.setenv("AGENTSTATE_CHUNK_TOKENS", "48")
    monkeypatch.setenv("AGENTSTATE_TENANT", "env-t")
    monkeypatch.setenv("AGENTSTATE_PATH", str(tmp_path / "from-env"))
    monkeypatch.setenv("AGENTSTATE_SERVICE_MAX_BODY_BYTES", "2MiB")
    env = load(file)
    assert (env.store.path, env.store.tenant, env.store.chunk_tokens, env.store.io_depth) == (
        tmp_path / "from-env", "env-t", 48, 3)  # fmt: skip
    flags = load(file, path=tmp_path / "from-flag", tenant="flag-t")
    assert (flags.store.path, flags.store.tenant) == (tmp_path / "from-flag", "flag-t")
    assert flags.recordable.tenant == "env-t"  # a command's --tenant is not what the directory records
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    monkeypatch.setenv("AGENTSTATE_SERVICE_HANDLE_SECRET_FILE", str(tmp_path / "env-secret"))
    keys, limits = service_settings(env.file, handle_secret_file=secret)
    assert keys.port == 9001 and limits.max_body_bytes == 2 << 20 and limits.max_json_bytes == 1 << 20
    assert limits.handle_secret_file == secret
    monkeypatch.setenv("AGENTSTATE_CHUNK_TOKENS", "0")
    with pytest.raises(InvalidArgumentError, match="chunk_tokens .env AGENTSTATE_CHUNK_TOKENS."):
        load(file)  # the error names where the bad value came from


# -- bad files ------------------------------------------------------------------------------------

BAD: dict[str, tuple[str, str, str]] = {  # case: (file name, contents, error class)
    "unknown key": ("c.toml", "chunk_tokens = 64\nchunk_size = 256\n", "InvalidArgumentError"),
    "unknown tier key": ("c.toml", '[[tiers]]\nkind = "host"\nmax_size = 5\n', "ConfigError"),
    "bad size": ("c.toml", 'lmdb_map_size = "32 parsecs"\n', "ConfigError"),
    "bad tier size": ("c.yaml", "tiers:\n  - kind: host\n    capacity_bytes: 12XB\n", "ConfigError"),
    "bad tier kind": ("c.toml", '[[tiers]]\nkind = "nvme"\n', "ConfigError"),
    "bad spec": ("c.toml", '[spec]\nmodel_id = "m"\nnum_layers = 0\n', "ConfigError"),
    "missing file": ("absent.toml", "", "NotFoundError"),
    "a directory": ("dir.toml", "", "InvalidArgumentError"),
    "not UTF-8": ("c.toml", "\udcff", "InvalidArgumentError"),
    "TOML syntax": ("c.toml", "chunk_tokens = = 3\n", "InvalidArgumentError"),
    "YAML syntax": ("c.yaml", "chunk_tokens: [1, 2\n", "InvalidArgumentError"),
    "JSON syntax": ("c.json", '{"chunk_tokens": 64,}', "InvalidArgumentError"),
    "not a table": ("c.yaml", "- 1\n- 2\n", "InvalidArgumentError"),
    "unknown format": ("c.ini", "chunk_tokens = 64\n", "InvalidArgumentError"),
}


def bad_file(tmp_path: Path, case: str) -> Path:
    name, text, _ = BAD[case]
    file = tmp_path / "bad" / name
    file.parent.mkdir(exist_ok=True)
    if case == "a directory":
        file.mkdir()
    elif case == "not UTF-8":
        file.write_bytes(b"chunk_tokens = 64 # \xff\xfe\n")
    elif case != "missing file":
        file.write_text(text)
    return file


@pytest.fixture
async def data(tmp_path: Path) -> Path:
    config = StoreConfig(path=tmp_path / "data", chunk_tokens=64)
    await write_sessions(config, 2)
    record_config(config, "test")
    from agentstate.ops.admin import record_spec

    record_spec(config.path, SPEC4)
    return Path(config.path)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_is_a_typed_error_that_writes_nothing(tmp_path: Path, case: str) -> None:
    file = bad_file(tmp_path, case)
    with pytest.raises(AgentStateError) as raised:
        load(file)
    assert type(raised.value).__name__ == BAD[case][2], raised.value
    assert str(file) in str(raised.value) or file.name in str(raised.value)


async def test_bad_config_through_the_cli_changes_nothing(data: Path, tmp_path: Path) -> None:
    """A writer (gc), a reader (ls) and serve, each given a bad file: exit 1, one typed line, nothing written."""
    before = disk(data)
    for case in ("unknown key", "bad size", "bad tier kind", "a directory", "TOML syntax", "YAML syntax"):
        file = bad_file(tmp_path, case)
        commands = (("gc", "-p", data), ("ls", "-p", data), ("serve", "-p", data, "--port", "1"))
        for args in commands if case in ("bad size", "YAML syntax") else commands[:1]:
            done = cli("--config", file, *args)
            assert done.returncode == 1 and BAD[case][2] in done.stderr, (case, args, done.stderr)
            assert "Traceback" not in done.stderr and "ValidationError" not in done.stderr, done.stderr
        assert disk(data) == before, case
        shutil.rmtree(file.parent)
    service = tmp_path / "service.toml"
    service.write_text(f'path = "{data}"\n[service]\nmax_body_byte = 5\nport = 1\n')
    done = cli("--config", service, "serve")
    assert done.returncode == 1 and "ConfigError" in done.stderr and "max_body_byte" in done.stderr
    service.write_text(f'path = "{data}"\n[service]\nmax_body_bytes = "lots"\n')
    done = cli("--config", service, "serve")
    assert done.returncode == 1 and "service.max_body_bytes" in done.stderr, done.stderr
    assert disk(data) == before


# -- a config file alone ----------------------------------------------------------------------------


async def test_every_cli_command_runs_from_a_config_file_alone(tmp_path: Path) -> None:
    """No env var, no --path or --spec: the file says where, what tiers (a file tier, a 64 MiB LMDB
    map) and which spec; admin commands afterwards, without the file, open what was recorded."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "agentstate.toml").write_text(CONFIG)
    (work / "tokens.json").write_text(json.dumps({TOKEN: "default"}))
    source = StoreConfig(path=tmp_path / "source", chunk_tokens=64)
    written = await write_sessions(source)
    from agentstate.ops.admin import record_spec

    record_spec(source.path, SPEC4)
    archive = tmp_path / "sessions.tar"
    assert cli("export", archive, "-p", source.path, env=clean_env(AGENTSTATE_CHUNK_TOKENS="64")).returncode == 0

    def run(*args: str | Path) -> Any:
        return ok_json("--config", "agentstate.toml", *args, cwd=work)

    assert run("import", archive)["sessions"] == 3
    data = work / "data"
    recorded = json.loads((data / RECORDED).read_text())
    assert [t["kind"] for t in recorded["tiers"]] == ["host", "file", "lmdb"]
    assert recorded["lmdb_map_size"] == 64 << 20 and recorded["chunk_tokens"] == 64
    assert recorded["recorded"]["by"].endswith("import")
    assert [r["session_id"] for r in run("ls")] == ["s0", "s1", "s2"]
    assert run("inspect", "s1")["num_tokens"] == 170
    stats = run("stats")
    assert [(t["name"], t["capacity_bytes"]) for t in stats["tiers"]] == [
        ("host", 16 << 20), ("file", 1 << 30), ("lmdb", None)]  # fmt: skip
    assert stats["tiers"][1]["chunks"] > 0  # the file tier the import wrote through
    assert run("verify")["clean"]
    assert run("fork", "s0", "s0-copy")["parent"] == "s0"
    assert run("rm", "s2")["removed"] == ["s2"]
    assert run("evict", "file", "--budget", "0")["evicted"] > 0
    assert run("gc")["removed"] >= 0
    assert run("export", tmp_path / "again.tar")["sessions"] == 3

    # without the file: the recorded config (file tier, map size), the recorded spec
    bare = ok_json("stats", "-p", data)
    assert [t["name"] for t in bare["tiers"]] == ["host", "file", "lmdb"] and bare["chunk_tokens"] == 64
    assert [r["session_id"] for r in ok_json("ls", "-p", data)] == ["s0", "s0-copy", "s1"]

    port = str(_free_port())
    proc = await asyncio.create_subprocess_exec(
        AGENTSTATE or "agentstate", "--config", "agentstate.toml", "serve", "--port", port, cwd=work,
        env=clean_env(), stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"authorization": f"Bearer {TOKEN}"}
        ) as c:
            await wait_healthy(c, proc)
            assert (await c.get("/v1/spec")).json()["fingerprint"] == SPEC4.fingerprint
            assert [s["session_id"] for s in (await c.get("/v1/sessions")).json()] == ["s0", "s0-copy", "s1"]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert json.loads((data / RECORDED).read_text())["recorded"]["by"].endswith("serve")
    async with StateStore.open(store_config(recorded_config(data)), SPEC4) as store:
        for sid in ("s0", "s1"):
            r = await store.resume(sid)
            assert r.complete and r.kv is not None and bits_equal(r.kv, written[sid][1])


def test_demo_runs_from_a_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentstate import demo

    monkeypatch.setattr(demo, "run_demo", functools.partial(demo.run_demo, system_tokens=300, user_tokens=40, layers=2))
    file = tmp_path / "demo.yaml"
    file.write_text("path: demo-data\nchunk_tokens: 128\ntiers:\n  - {kind: host, capacity_bytes: 64MiB}\n"
                    "  - {kind: file, path: files}\n  - {kind: lmdb, path: chunks, name: lmdb}\n")  # fmt: skip
    for key in [k for k in os.environ if k.startswith("AGENTSTATE_")]:
        monkeypatch.delenv(key)
    assert demo.main(None, 2, 2, config_file=file)
    data = tmp_path / "demo-data"
    recorded = json.loads((data / RECORDED).read_text())
    assert [t["kind"] for t in recorded["tiers"]] == ["host", "file", "lmdb"] and recorded["chunk_tokens"] == 128
    assert [r["session_id"] for r in ok_json("ls", "-p", data)] == ["agent-0", "agent-1"]
    assert [t["name"] for t in ok_json("stats", "-p", data)["tiers"]] == ["host", "file", "lmdb"]


# -- the recorded config -------------------------------------------------------------------------------


async def test_recorded_config_has_no_secrets_and_asks_for_them_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = StoreConfig(
        path=tmp_path / "d", catalog_url="redis://admin:hunter2@db.example:6379/0",
        tiers=[TierConfig(kind="redis", url="rediss://:sesame@cache.example:6380/1"), TierConfig(kind="lmdb")],
    )  # fmt: skip
    file = record_config(config, "test")
    text = file.read_text()
    assert "hunter2" not in text and "sesame" not in text and "admin:***@db.example" in text
    assert sorted(os.listdir(file.parent)) == [RECORDED]  # the temp file went
    for key in [k for k in os.environ if k.startswith("AGENTSTATE_")]:
        monkeypatch.delenv(key)
    with pytest.raises(InvalidArgumentError, match="tiers.0.url .* password removed"):
        load(path=file.parent)
    monkeypatch.setenv("AGENTSTATE_TIERS", '[{"kind": "lmdb"}]')
    with pytest.raises(InvalidArgumentError, match="catalog_url .*AGENTSTATE_CATALOG_URL"):
        load(path=file.parent)
    monkeypatch.setenv("AGENTSTATE_CATALOG_URL", "redis://admin:hunter2@db.example:6379/0")
    assert load(path=file.parent).store.catalog_url == config.catalog_url


async def test_a_given_spec_must_agree_with_the_recorded_one(data: Path, tmp_path: Path) -> None:
    other = SPEC4.model_copy(update={"num_layers": 2})
    file = tmp_path / "other.json"
    file.write_text(json.dumps({"path": str(data), "spec": other.model_dump()}))
    with pytest.raises(SpecMismatchError):
        async with open_configured(load(file), read_only=True):
            pass
    with pytest.raises(NotFoundError, match="no agentstate data directory"):
        async with open_configured(load(file, path=tmp_path / "nowhere"), read_only=True):
            pass


# -- SGLang's rank directories ---------------------------------------------------------------------


def test_sglang_rank_directory_opens_in_the_admin_commands(tmp_path: Path) -> None:
    from tests.requires import require_module

    require_module("sglang.srt.mem_cache.storage.backend_factory", "install requirements-sglang.txt as .ci/run does")
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from tests.test_adapter_sglang import StandInHostPool, config, pages

    file = tmp_path / "engine.toml"
    file.write_text('path = "hicache"\nlmdb_map_size = "64MiB"\n[[tiers]]\nkind = "host"\ncapacity_bytes = "8MiB"\n'
                    '[[tiers]]\nkind = "file"\npath = "files"\n[[tiers]]\nkind = "lmdb"\npath = "chunks"\n'
                    '[sglang]\ntimeout_s = 30\n')  # fmt: skip
    pool = StandInHostPool()
    storage = config(tmp_path / "ignored", config_file=str(file))
    storage.extra_config.pop("path")  # the file's path is the data root
    storage.extra_config.pop("lmdb_map_size")
    storage.extra_config.pop("host_capacity_bytes")
    backend = StorageBackendFactory.create_backend("dynamic", storage, pool)
    try:
        backend.register_mem_pool_host(pool)
        assert backend.settings.timeout_s == 30
        keys = [f"{i:064x}" for i in range(5)]
        assert backend.batch_set_v1(keys, pages(*range(5))) == [True] * 5
    finally:
        backend.close()
    (rank,) = (tmp_path / "hicache").iterdir()
    assert rank.name == "tp0-1.pp0-1.cp0-1"
    recorded = json.loads((rank / RECORDED).read_text())
    assert [t["kind"] for t in recorded["tiers"]] == ["host", "file", "lmdb"] and recorded["lmdb_map_size"] == 64 << 20
    assert ModelSpec.model_validate_json((rank / "spec.json").read_text()).model_id == "test/tiny"
    stats = ok_json("stats", "-p", rank)  # the engine's spec and tiers, with no flag but the directory
    backends = {t["name"]: t["items"] for t in stats["store"]["tiers"]}
    assert backends["lmdb"] == 5 and backends["file"] == 5  # its pages, as stored values
    assert ok_json("ls", "-p", rank) == []  # pages are not sessions
    assert ok_json("verify", "-p", rank)["clean"]


def test_adapter_settings_take_a_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.requires import require_module

    require_module("torch", "the adapters need torch")
    from agentstate.adapters.sglang_pages import SglangSettings

    for key in [k for k in os.environ if k.startswith("AGENTSTATE_")]:
        monkeypatch.delenv(key)
    file = tmp_path / "engine.yaml"
    file.write_text(
        "path: kv\nchunk_tokens: 64\nio_depth: 2\nlmdb_map_size: 1GiB\nsglang:\n  timeout_s: 9\n  model_id: m\n"
    )
    settings, rest = SglangSettings.split({"config_file": str(file), "model_id": "inline", "io_depth": 4})
    assert (settings.path, settings.timeout_s, settings.model_id) == (tmp_path / "kv", 9, "inline")
    assert rest == {"chunk_tokens": 64, "io_depth": 4, "lmdb_map_size": "1GiB"}
    monkeypatch.setenv("AGENTSTATE_CHUNK_TOKENS", "128")
    _, rest = SglangSettings.split({"config_file": str(file)})
    assert "chunk_tokens" not in rest and StoreConfig(**rest).chunk_tokens == 128  # the env beats the file
    monkeypatch.setenv("AGENTSTATE_CONFIG_FILE", str(file))
    assert SglangSettings.split({})[0].timeout_s == 9
    file.write_text("sglang:\n  timeout: 9\n")
    with pytest.raises(InvalidArgumentError, match="timeout"):
        SglangSettings.split({})


# -- docs/config.md -------------------------------------------------------------------------------


def _type(annotation: Any, metadata: list[Any]) -> str:
    if SIZE in metadata:
        return "size"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f'"{a}"' for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a, []) for a in args).replace("NoneType", "null")
    if origin is list:
        return f"list of {_type(args[0], [])}"
    if origin is typing.Annotated:
        return _type(args[0], list(args[1:]))
    name = getattr(annotation, "__name__", str(annotation))
    return {"int": "int", "float": "float", "str": "string", "bool": "bool", "Path": "path"}.get(name, name)


def reference(model: type[BaseModel], sizes: bool = False) -> str:
    """A markdown table of `model`'s keys: key, type, default, description (`sizes`: its `*_bytes`
    ints take sizes with units too, as [service] reads them)."""
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, f in model.model_fields.items():
        if f.is_required():
            default = "required"
        elif f.default_factory is not None:
            default = "computed"
        else:
            value = f.get_default(call_default_factory=False)
            default = "`" + json.dumps(str(value) if isinstance(value, Path) else value) + "`"
        kind = "size" if sizes and name.endswith("_bytes") and f.annotation is int else _type(f.annotation, f.metadata)
        description = (f.description or "").replace("|", "\\|")
        rows.append(f"| `{name}` | {kind} | {default} | {description} |")
    return "\n".join(rows)


def tables() -> dict[str, type[BaseModel]]:
    from agentstate.server.gate import Limits

    models: dict[str, type[BaseModel]] = {"StoreConfig": StoreConfig, "TierConfig": TierConfig, "ModelSpec": ModelSpec,
                                          "ServiceKeys": ServiceKeys, "Limits": Limits}  # fmt: skip
    models.update({m.__name__: m for m in [*TIER_KINDS.values(), ExternalTier]})  # one model per tier kind
    try:
        from agentstate.adapters.sglang_pages import SglangSettings

        models["AdapterSettings"] = SglangSettings
    except ImportError:
        pass
    return models


def test_docs_list_every_key() -> None:
    doc = (ROOT / "docs" / "config.md").read_text()
    for name, model in tables().items():
        table = reference(model, sizes=name == "Limits")
        assert table in doc, f"docs/config.md: the {name} table is stale (python -m tests.test_config_file)"


def _free_port() -> int:
    from tests.test_service import _free_port as free

    return free()


async def wait_healthy(client: httpx.AsyncClient, proc: asyncio.subprocess.Process) -> None:
    from tests.test_service import wait_healthy as wait

    await wait(client, proc)


if __name__ == "__main__":
    for title, model in tables().items():
        print(f"### {title}\n\n{reference(model, sizes=title == 'Limits')}\n")
