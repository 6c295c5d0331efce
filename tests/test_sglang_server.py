"""AgentStateStorage as the L3 of a REAL SGLang server (CPU, tiny random-weight Qwen2, float32, HiCache on).

Each server is `tests/sglang_launch.py` in its own process group (tests/sglang_server.py; 17-33 s to start),
greedy and one request at a time, so only the cache decides what is computed. Two server processes share
one agentstate data directory:

- first: `layer_first` host layout, the v1 (zero-copy) interface. A cold request, its pages written to L3
  (SGLang's own backup counter), `/flush_cache` (device and host pool), the same prompt again: every
  full page of the prompt comes from storage, and the output logprobs equal the cold run's bit for bit;
- second: a NEW process on the same directory, `page_first_direct` layout and the generic (non-v1)
  interface: its first request finds the pages the first process stored, with the same logprobs again;
  then a new prompt makes the same round trip as in the first server, through this layout.

Page size 16. With page size 1, SGLang's own `file` L3 and this one alike give logprobs a few ulp
(~5e-7) off the cold run's after a storage hit, while greedy tokens stay equal: not compared here.

Needs requirements-sglang.txt and requirements-sglang-server.txt in this venv (CI fails instead of
skipping), a C++ compiler, ninja and OpenSSL headers (SGLang's page-hash extension is built here once).
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tests.requires import require_module, skip_or_fail

HINT = "pip install --no-deps -c constraints.txt -r requirements-sglang.txt -r requirements-sglang-server.txt"
require_module("sglang", HINT)
for _name in ("uvloop", "openai_harmony", "tiktoken"):  # what only a full server imports
    require_module(_name, HINT)

from tests.sglang_server import SGLangServer, build_native_hash, make_model

PAGE = 16
PROMPT = [random.Random(1).randrange(3, 512) for _ in range(300)]  # 18 full pages, then 12 tokens
PROMPT2 = [random.Random(2).randrange(3, 512) for _ in range(300)]
FULL = len(PROMPT) // PAGE * PAGE
MAX_NEW = 8
EXTRA = {"lmdb_map_size": 64 << 20, "host_capacity_bytes": 64 << 20}


def logprobs(out: dict[str, Any]) -> list[float]:
    return [float(lp) for lp, _tok, _text in out["meta_info"]["output_token_logprobs"]]


def cached(out: dict[str, Any]) -> dict[str, Any]:
    return dict(out["meta_info"].get("cached_tokens_details") or {})


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang-server")


@pytest.fixture(scope="module")
def model(tmp: Path) -> str:
    return make_model(tmp / "model")


@pytest.fixture(scope="module")
def extensions(tmp: Path) -> Path:
    if not (shutil.which("c++") or shutil.which("g++")):
        skip_or_fail("no C++ compiler: SGLang's HiCache page-hash extension is built from source (apt: g++)")
    t = time.monotonic()
    ext = build_native_hash(tmp / "torch-extensions")
    print(f"native hash extension built in {time.monotonic() - t:.1f} s")
    return ext


@pytest.fixture(scope="module")
def first(tmp: Path, model: str, extensions: Path) -> dict[str, Any]:
    """Cold request, its pages backed up to L3, /flush_cache, the same prompt again: one server."""
    server = SGLangServer(model, tmp / "first", data_dir=tmp / "data", extensions_dir=extensions, page_size=PAGE,
                          layout="layer_first", interface_v1=True, extra=EXTRA)  # fmt: skip
    with server:
        cold = server.generate(PROMPT, MAX_NEW)
        backed_up = server.wait_backed_up(FULL)
        server.flush_cache()
        t = time.monotonic()
        warm = server.generate(PROMPT, MAX_NEW)
        warm_s = time.monotonic() - t
        metrics = server.metrics()
    print(f"first server: started in {server.startup_s:.1f} s, storage-hit request {warm_s:.3f} s")
    return {"cold": cold, "warm": warm, "warm_s": warm_s, "backed_up": backed_up, "metrics": metrics,
            "startup_s": server.startup_s}  # fmt: skip


@pytest.fixture(scope="module")
def second(tmp: Path, model: str, extensions: Path, first: dict[str, Any]) -> dict[str, Any]:
    """A new server process on the first one's data directory (another host layout and interface)."""
    server = SGLangServer(model, tmp / "second", data_dir=tmp / "data", extensions_dir=extensions, page_size=PAGE,
                          layout="page_first_direct", interface_v1=False, extra=EXTRA)  # fmt: skip
    with server:
        t = time.monotonic()
        out = server.generate(PROMPT, MAX_NEW)
        first_s = time.monotonic() - t
        metrics = server.metrics()
        # and its own write path: a new prompt's pages leave through the page_first_direct host pool
        before = metrics.get("backuped_tokens_total", 0.0)
        cold2 = server.generate(PROMPT2, MAX_NEW)
        server.wait_backed_up(int(before) + FULL)
        server.flush_cache()
        warm2 = server.generate(PROMPT2, MAX_NEW)
    print(f"second server: started in {server.startup_s:.1f} s, first request {first_s:.3f} s")
    return {"out": out, "metrics": metrics, "cold2": cold2, "warm2": warm2, "startup_s": server.startup_s}


def test_flush_then_storage_hit_equal_logprobs(first: dict[str, Any], tmp: Path) -> None:
    cold, warm = first["cold"], first["warm"]
    assert cold["meta_info"]["cached_tokens"] == 0 and not cached(cold).get("storage")
    assert first["backed_up"] >= FULL
    assert list((tmp / "data").glob("tp0-1.*")), "no per-rank agentstate directory under the data dir"
    details = cached(warm)
    assert details["storage_backend"] == "AgentStateStorage"
    assert details["storage"] == FULL and details["device"] == 0 and details["host"] == 0, details
    assert warm["meta_info"]["cached_tokens"] == FULL
    assert first["metrics"].get("storage_prefetch_hit_tokens_total") == FULL
    assert warm["output_ids"] == cold["output_ids"]
    assert logprobs(warm) == logprobs(cold)  # bit for bit: the KV read back is the KV SGLang computed


def test_new_process_hits_storage_equal_logprobs(first: dict[str, Any], second: dict[str, Any]) -> None:
    out, cold = second["out"], first["cold"]
    details = cached(out)
    assert details["storage_backend"] == "AgentStateStorage"
    assert details["storage"] == FULL and details["device"] == 0 and details["host"] == 0, details
    assert out["output_ids"] == cold["output_ids"]
    assert logprobs(out) == logprobs(cold)


def test_new_process_writes_through_page_first_direct(second: dict[str, Any]) -> None:
    cold, warm = second["cold2"], second["warm2"]
    assert cold["meta_info"]["cached_tokens"] == 0
    details = cached(warm)
    assert details["storage"] == FULL and details["device"] == 0 and details["host"] == 0, details
    assert warm["output_ids"] == cold["output_ids"] and logprobs(warm) == logprobs(cold)
