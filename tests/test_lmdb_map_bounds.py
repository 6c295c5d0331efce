"""`lmdb_map_size` is bounded where it is set, and a failed open leaves no files behind.

16 EiB used to raise an untyped OverflowError (and leave a LOCK in the new directory); sizes past the
address space a BackendError naming no setting (and LMDB's files). Now: a size past the platform's
largest map is refused by the config model, by the config file / env layer (ConfigError naming
`lmdb_map_size`) and, for a config that skipped validation, by the LMDB tier itself; a size the
kernel refuses (ENOMEM: a smaller address space) is the same ConfigError; and an open that fails
removes the directory it created, while a directory that existed keeps everything it held.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentstate import StateStore
from agentstate.config import MAX_MAP_BYTES, StoreConfig
from agentstate.errors import ConfigError
from agentstate.settings import read_config_file, store_config
from tests.cli_process import run_cli
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens

EIB16 = 1 << 64


def test_the_config_model_refuses_a_map_past_the_platform() -> None:
    for size in ("16EiB", EIB16, MAX_MAP_BYTES + 1):
        with pytest.raises(ValidationError, match="lmdb_map_size"):
            StoreConfig(lmdb_map_size=size)
    with pytest.raises(ValidationError, match="lmdb_max_map_size"):
        StoreConfig(lmdb_max_map_size="16EiB")
    assert StoreConfig(lmdb_map_size=MAX_MAP_BYTES).lmdb_map_size == MAX_MAP_BYTES


def test_file_and_env_layers_raise_config_error_naming_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "agentstate.toml"
    file.write_text('lmdb_map_size = "16EiB"\n')
    with pytest.raises(ConfigError, match="lmdb_map_size") as raised:
        read_config_file(file)
    assert raised.value.key == "lmdb_map_size"
    monkeypatch.setenv("AGENTSTATE_LMDB_MAP_SIZE", "16EiB")
    with pytest.raises(ConfigError, match="lmdb_map_size") as raised:
        store_config(None, path=tmp_path / "data")
    assert raised.value.key == "lmdb_map_size"
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("size", [EIB16, 1 << 62, MAX_MAP_BYTES * 2])
async def test_an_unvalidated_huge_map_is_a_config_error_and_leaves_no_files(tmp_path: Path, size: int) -> None:
    """A config built without validation (model_copy) reaches the LMDB tier: refused there, typed."""
    data = tmp_path / "new" / "data"
    config = StoreConfig(path=data).model_copy(update={"lmdb_map_size": size})
    with pytest.raises(ConfigError, match="lmdb_map_size") as raised:
        await StateStore.open(config, SPEC4)
    assert raised.value.key == "lmdb_map_size"
    assert list(tmp_path.iterdir()) == []  # neither LOCK nor LMDB files nor the directories made for them


async def test_a_failed_open_of_an_existing_directory_keeps_what_it_holds(tmp_path: Path) -> None:
    data = tmp_path / "data"
    kv, tokens = random_kv(SPEC4, 100), random_tokens(100)
    async with StateStore.open(data, SPEC4, chunk_tokens=64) as store:
        await store.snapshot("agent", tokens, kv)
    before = sorted(p.relative_to(data) for p in data.rglob("*"))
    config = StoreConfig(path=data, chunk_tokens=64).model_copy(update={"lmdb_map_size": EIB16})
    with pytest.raises(ConfigError):
        await StateStore.open(config, SPEC4)
    assert sorted(p.relative_to(data) for p in data.rglob("*")) == before
    async with StateStore.open(data, SPEC4, chunk_tokens=64) as store:
        result = await store.resume("agent")
    assert result.complete and bits_equal(result.kv, kv)


ENOMEM_CHILD = r"""
import asyncio, json, resource, sys
from pathlib import Path
from agentstate import StateStore
from agentstate.errors import ConfigError
from tests.conftest import SPEC4
data = Path(sys.argv[1])
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 30), vm + (4 << 30)))  # 4 GiB of address space to spare
try:
    asyncio.run(StateStore.open(data, SPEC4, lmdb_map_size=64 << 30))  # 64 GiB: valid here, not mappable
except ConfigError as exc:
    print(json.dumps({"key": exc.key, "message": str(exc)}))
"""


def test_a_map_the_kernel_refuses_is_a_config_error_and_leaves_no_files(tmp_path: Path) -> None:
    """ENOMEM from the map (a smaller address space than the bound assumes: RLIMIT_AS here)."""
    data = tmp_path / "data"
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", ENOMEM_CHILD, str(data)], capture_output=True, text=True,
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["key"] == "lmdb_map_size" and "Cannot allocate memory" in reply["message"]
    assert not data.exists()


def test_the_cli_says_one_line_naming_the_key(tmp_path: Path) -> None:
    data = tmp_path / "data"
    done = run_cli("ls", "--path", data, env={**os.environ, "AGENTSTATE_LMDB_MAP_SIZE": "16EiB", "COLUMNS": "300"})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error (ConfigError)") and "lmdb_map_size" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not data.exists()
