"""The vLLM connector across tensor-parallel sizes, on real vLLM engines (CPU, tiny random Llama with
4 KV heads, float32): a prefix a TP 1 engine stored hits a TP 2 engine, each rank loading its two
heads; a prefix the TP 2 engine stored (each rank its heads) hits a TP 1 engine, assembled; a session
resumes at TP 2 with each rank's own tail. The engines share one Redis tier, each rank its own LMDB
directory (agentstate.slices explains the keys).

Engine runs: `tp1` stores P1; `tp2` runs P1 salted (another tenant: its cold reference), then P1
(hit from TP 1's chunks), P2 (stored as halves) and session turn 1, then turn 2; `tp1b` runs P2 salted
(cold), then P2 (hit from the halves). Runs under the venv that has vLLM; CI fails instead of skipping.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.requires import require_module

vllm = require_module("vllm", "pip install -c constraints.txt -r requirements-vllm.txt (a venv of its own: .ci/run)")

from agentstate import ModelSpec, StateStore, codec
from agentstate.config import StoreConfig
from agentstate.datadir import recorded_config
from tests.conftest import bits_equal
from tests.test_adapter_vllm import EXTRA, MAX, P1, P2, S1, SESSION, SESSION2, req, run_engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_engine import make_model


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-tp")


@pytest.fixture(scope="module")
def fleet(tmp: Path, redis_server: Any) -> dict[str, Any]:
    model = make_model(str(tmp / "model"), heads=4, kv_heads=4)
    tiers = {"tiers": [{"kind": "host"}, {"kind": "lmdb"}, {"kind": "redis", "url": redis_server.url, "prefix": "vllm-tp:"}]}
    one = run_engine(tmp, "tp1", {"model": model, "connector": {"path": str(tmp / "data-tp1"), **tiers}, "rounds": [[req(P1)]]})
    session2 = {"continue": [1, 2], "extra": EXTRA, "max_tokens": MAX, "params": SESSION2}
    two = run_engine(tmp, "tp2", {
        "model": model, "tp": 2, "connector": {"path": str(tmp / "data-tp2"), **tiers},
        "rounds": [[req(P1, salt="cold")], [req(P1), req(P2), req(S1, params=SESSION)], [session2]],
    }, timeout=600)  # fmt: skip
    back = run_engine(tmp, "tp1b", {"model": model, "connector": {"path": str(tmp / "data-tp1b"), **tiers},
                                    "rounds": [[req(P2, salt="cold")], [req(P2)]]})  # fmt: skip
    return {"tp1": one, "tp2": two, "tp1b": back, "model": model}


def test_tp1_prefix_hits_at_tp2(fleet: dict[str, Any]) -> None:
    cold, (p1, _, _) = fleet["tp2"]["rounds"][0][0], fleet["tp2"]["rounds"][1]
    assert fleet["tp1"]["rounds"][0][0]["cached"] == 0 and cold["cached"] == 0
    assert p1["cached"] == 512  # the two whole chunks TP 1 stored, one prompt token left to compute
    assert p1["tokens"] == cold["tokens"]
    m = fleet["tp2"]["metrics"]
    assert m["vllm:agentstate_load_error_blocks"] == 0 and m["vllm:agentstate_errors"] == 0


def test_tp2_prefix_hits_at_tp1_assembled(fleet: dict[str, Any]) -> None:
    assert fleet["tp2"]["rounds"][1][1]["cached"] == 0
    cold, p2 = fleet["tp1b"]["rounds"][0][0], fleet["tp1b"]["rounds"][1][0]
    assert cold["cached"] == 0 and p2["cached"] == 1024
    assert p2["tokens"] == cold["tokens"]


def test_session_resumes_at_tp2_with_each_ranks_tail(fleet: dict[str, Any]) -> None:
    s2 = fleet["tp2"]["rounds"][2][0]
    assert s2["cached"] == len(S1) + MAX - 1  # every token with KV: whole chunks and each rank's tail


def test_each_rank_holds_exactly_its_heads_of_what_tp1_stored(fleet: dict[str, Any], tmp: Path) -> None:
    """The chunks a TP 2 rank brought in, read back from its own directory, are its heads of the
    chunks the TP 1 engine stored, bit for bit."""

    async def chunks(path: Path) -> tuple[ModelSpec, list[Any]]:
        spec = ModelSpec.model_validate_json((path / "spec.json").read_text())
        recorded = recorded_config(path)  # the tiers the engine opened (its Redis tier too)
        assert recorded is not None
        async with StateStore.open(StoreConfig(**recorded.store), spec, read_only=True) as store:
            keys = store.prefix_keys(P1)
            values = [await store.chunks.read_value(k, 256) for k in keys]
            assert all(v is not None for v in values)
            kv = [codec.decode(v, key=k, fingerprint=spec.fingerprint, dtype=spec.torch_dtype).clone()
                  for k, v in zip(keys, values)]  # fmt: skip
        return spec, kv

    whole_spec, whole = asyncio.run(chunks(tmp / "data-tp1"))
    assert whole_spec.tp_size == 1 and whole_spec.num_kv_heads == 4 and len(whole) == 2
    for rank in (0, 1):
        spec, mine = asyncio.run(chunks(tmp / "data-tp2" / f"tp{rank}-2.pp1"))
        assert spec == whole_spec.slicing(2, rank)
        first, end = spec.head_range
        for a, b in zip(mine, whole):
            assert bits_equal(a, b[:, :, :, first:end])
