"""Backends registered where they live (issue 26): each kind's config model names its backend's
module, whose `from_config` builds it; a backend outside the repository is one file named by
`module_path` in the config (the worked example in docs/design.md, Backends)."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from agentstate import codec
from agentstate.backends.base import Backend
from agentstate.chunks.registry import backend_module
from agentstate.config import TIER_KINDS, ExternalTier, StoreConfig, TierConfig
from agentstate.errors import InvalidArgumentError
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens

CHUNK = 64
CHUNK_BYTES = codec.encoded_size(CHUNK * SPEC4.token_bytes)
MY_TIER = '''
"""A tier outside the repository: values in a dict of this process."""
from collections import Counter

from agentstate.backends.base import Backend, BackendStats, InMemory


class DictBackend(InMemory, Backend):
    def __init__(self, label: str) -> None:
        self.label = label
        self._items, self._used, self._counts = {}, 0, Counter()

    async def read(self, keys, sink):
        found = [k in self._items for k in keys]
        for i, key in enumerate(keys):
            if found[i]:
                sink(i, memoryview(self._items[key]))
        return found

    async def put(self, keys, values):
        for key, value in zip(keys, values):
            if key not in self._items:
                self._items[key] = bytes(value)
                self._used += len(self._items[key])

    async def stats(self):
        return BackendStats(name=self.name, items=len(self._items), bytes_used=self._used, capacity_bytes=None)

    async def close(self):
        self._items.clear()


def from_config(cfg, store):
    return DictBackend(cfg.options["label"])
'''
CONFIG = """
[[tiers]]
kind = "dict"
module_path = "{module}"
capacity_bytes = {capacity}
options = {{ label = "mine" }}

[[tiers]]
kind = "lmdb"
"""


@pytest.mark.parametrize("how", ["file", "dotted"])
async def test_a_backend_outside_the_repository_selected_by_config(open_store, tmp_path: Path, monkeypatch, how: str) -> None:  # type: ignore[no-untyped-def]
    """One file defines the backend; a TOML tier table selects it (by file, or by module name on
    sys.path); the chunk layer evicts it to its capacity, LRU, and every prefix comes back exact."""
    (tmp_path / "my_tier.py").write_text(MY_TIER)
    module = str(tmp_path / "my_tier.py")
    if how == "dotted":
        monkeypatch.syspath_prepend(str(tmp_path))
        module = "my_tier"
    tiers = tomllib.loads(CONFIG.format(module=module, capacity=3 * CHUNK_BYTES))["tiers"]
    prefixes = [(random_tokens(CHUNK, seed=s), random_kv(SPEC4, CHUNK, seed=s)) for s in range(4)]
    async with open_store(tiers=tiers) as store:
        backend = store.chunks.backend("dict")
        assert type(backend).__name__ == "DictBackend" and backend.label == "mine" and isinstance(backend, Backend)
        for tokens, kv in prefixes:
            await store.put_prefix(tokens, kv)
        assert [(await store.match(t)).tiers for t, _ in prefixes] == [["lmdb"], ["dict"], ["dict"], ["dict"]]
        assert (await backend.stats()).items == 3
        for tokens, kv in prefixes:
            into = torch.zeros_like(kv)
            assert await store.load(tokens, into) == CHUNK and bits_equal(into, kv)
    sys.modules.pop("my_tier", None)


def test_the_same_tier_from_env_json_and_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = {"kind": "dict", "module_path": "my_tier", "options": {"label": "x"}}
    monkeypatch.setenv("AGENTSTATE_TIERS", json.dumps([tier, {"kind": "lmdb"}]))
    from_env = StoreConfig().tier_list()
    assert from_env == [TierConfig(**tier), TierConfig(kind="lmdb")]
    assert isinstance(from_env[0], ExternalTier) and from_env[0].capacity_managed


def test_each_kind_has_its_model_and_its_module() -> None:
    for kind, model in TIER_KINDS.items():
        cfg = TierConfig(kind=kind)
        assert type(cfg) is model and TierConfig.model_validate({"kind": kind}) == cfg
        assert backend_module(cfg).__name__ == f"agentstate.backends.{kind}"
        assert callable(backend_module(cfg).from_config)
    assert {k for k, m in TIER_KINDS.items() if m.capacity_managed} == {"device", "host", "file"}


def test_bad_external_backends_are_typed_errors(open_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "empty.py").write_text("x = 1\n")
    (tmp_path / "wrong.py").write_text("def from_config(cfg, store):\n    return object()\n")
    cases = {str(tmp_path / "absent.py"): "cannot import", "no_such_module_anywhere": "cannot import",
             str(tmp_path / "empty.py"): "no from_config", str(tmp_path / "wrong.py"): "not a Backend"}  # fmt: skip
    for module, error in cases.items():
        with pytest.raises(InvalidArgumentError, match=error):
            open_store(tiers=[{"kind": "mine", "module_path": module}, {"kind": "lmdb"}])
    with pytest.raises(ValueError, match="unknown tier kind 'nvme'"):
        StoreConfig(tiers=[{"kind": "nvme"}])
    with pytest.raises(ValueError, match="Extra inputs"):  # a key of another kind is refused, not ignored
        StoreConfig(tiers=[{"kind": "host", "url": "redis://x"}])
