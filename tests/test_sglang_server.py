"""AgentStateStorage as the L3 of a REAL SGLang server (CPU, tiny random-weight Qwen2, float32, HiCache on).

Each server is `tests/sglang_launch.py` in its own process group (tests/sglang_server.py; 15-33 s to start),
greedy and one request at a time, so only the cache decides what is computed. Two lanes of servers run side
by side (two cores), one per page size (16 and 1), each on one agentstate data directory:

- a chain of four servers through every host layout and interface: (`layer_first`, v1), (`page_first_direct`,
  generic), (`page_first_direct`, v1), (`layer_first`, generic). Each server: a cold prompt, its pages written
  to L3 (SGLang's own backup counter), `/flush_cache` (device and host pool), the same prompt again, which
  must come from storage, every full page; and, first of all, the prompt the previous server stored: a new
  process reading pages written under another layout and interface;
- page 16: a fifth server after one stored page was damaged on disk (LMDB, as a failing disk would): the
  damage is detected, that page and the rest of its prompt recomputed, outputs still equal the cold runs;
- page 1: the same damage against SGLang's own `file` L3 (HiCacheFile), recorded: it serves the zeroed
  pages as storage hits;
- then two servers at once with their own directories over one Redis tier and catalog: the second gets
  storage hits for the pages the first wrote;
- and one set of keys with transformers (`key_scheme="sglang"`): a prefix transformers stored is taken from
  storage by a server, a prompt a server stored is loaded by transformers from its tokens alone, over one data
  directory and over one Redis tier with both running.

Greedy tokens after a storage hit equal the cold run's; their logprobs are compared within LOGPROB_TOL,
not bit for bit. A storage hit prefills only the prompt's last tokens over the pages read back, the cold run
all 300 at once: the stored pages are the cold run's own bytes, but the matmuls of a 12-row prefill block
their rows otherwise than those of a 300-row one, so the last bits depend on the CPU (with page size 1
logprobs were measured ~5e-7 off, with SGLang's own `file` L3 too; with page size 16 equal on one machine
and not on another). Zeroed or misplaced pages move them by far more.

Needs requirements-sglang.txt and requirements-sglang-server.txt in this venv (CI fails instead of
skipping), a C++ compiler, ninja and OpenSSL headers (SGLang's page-hash extension is built here once).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import lmdb
import pytest

from tests.requires import require_module, skip_or_fail

HINT = "pip install --no-deps -c constraints.txt -r requirements-sglang.txt -r requirements-sglang-server.txt"
require_module("sglang", HINT)
for _name in ("uvloop", "openai_harmony", "tiktoken"):  # what only a full server imports
    require_module(_name, HINT)

from tests.sglang_server import ROOT, SGLangServer, build_native_hash, make_model

EXTRA = {"lmdb_map_size": 64 << 20, "host_capacity_bytes": 64 << 20}
CHAIN = [("layer_first", True), ("page_first_direct", False), ("page_first_direct", True), ("layer_first", False)]
MAX_NEW = 8
N = 300  # prompt length: with page 16, 18 full pages and 12 tokens


def prompt(page: int, i: int) -> list[int]:
    return [random.Random(1000 * page + i).randrange(3, 512) for _ in range(N)]


def full(page: int) -> int:
    """Tokens of a prompt SGLang can take from storage: its full pages, at least one token left to compute."""
    return (N - 1) // page * page


def logprobs(out: dict[str, Any]) -> list[float]:
    return [float(lp) for lp, _tok, _text in out["meta_info"]["output_token_logprobs"]]


def cached(out: dict[str, Any]) -> dict[str, Any]:
    return dict(out["meta_info"].get("cached_tokens_details") or {})


LOGPROB_TOL = {"rel_tol": 1e-5, "abs_tol": 1e-4}
"""How far a warm run's logprobs may be from the cold run's: rounding of another row blocking (see above)."""


def same_output(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same greedy tokens, and logprobs equal up to rounding (LOGPROB_TOL)."""
    if a["output_ids"] != b["output_ids"]:
        return False
    x, y = logprobs(a), logprobs(b)
    return len(x) == len(y) and all(math.isclose(p, q, **LOGPROB_TOL) for p, q in zip(x, y))


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


def round_trip(server: SGLangServer, tokens: list[int], page: int) -> dict[str, Any]:
    """Cold request, its pages backed up to L3, /flush_cache, the same prompt again."""
    before = server.metrics().get("backuped_tokens_total", 0.0)
    cold = server.generate(tokens, MAX_NEW)
    server.wait_backed_up(int(before) + full(page))
    server.flush_cache()
    warm = server.generate(tokens, MAX_NEW)
    return {"cold": cold, "warm": warm}


def damage_one_page(data: Path) -> bytes:
    """Flip one payload bit of one stored page in LMDB, under the store (as a failing disk would)."""
    (rank_dir,) = [d for d in data.iterdir() if d.name.startswith("tp0-1.")]
    env = lmdb.open(str(rank_dir / "chunks"), map_size=64 << 20, subdir=True, max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            keys = sorted(k for k, _ in txn.cursor() if k.startswith(b"p/"))
            key = keys[len(keys) // 2]
            value = bytearray(txn.get(key))
            value[len(value) // 2] ^= 0x10
            txn.put(key, bytes(value))
    finally:
        env.close()
    return key


def chain(tmp: Path, model: str, ext: Path, page: int, lane: dict[str, Any]) -> None:
    data = tmp / f"data-{page}"
    for i, (layout, v1) in enumerate(CHAIN):
        server = SGLangServer(model, tmp / f"p{page}-{i}", data_dir=data, extensions_dir=ext, page_size=page,
                              layout=layout, interface_v1=v1, extra=EXTRA)  # fmt: skip
        with server:
            got: dict[str, Any] = {"startup_s": server.startup_s}
            if i:
                got["previous"] = server.generate(prompt(page, i - 1), MAX_NEW)
            got.update(round_trip(server, prompt(page, i), page))
            got["metrics"] = server.metrics()
        lane.setdefault("chain", []).append(got)


def damaged_agentstate(tmp: Path, model: str, ext: Path, lane: dict[str, Any]) -> None:
    data = tmp / "data-16"
    lane["damaged_key"] = damage_one_page(data)
    server = SGLangServer(model, tmp / "p16-damaged", data_dir=data, extensions_dir=ext, page_size=16, extra=EXTRA)
    with server:
        lane["after_damage"] = [server.generate(prompt(16, i), MAX_NEW) for i in range(len(CHAIN))]


def damaged_file_l3(tmp: Path, model: str, ext: Path, lane: dict[str, Any]) -> None:
    """The same kind of damage under SGLang's own HiCacheFile: every stored page file zeroed."""
    data = tmp / "file-l3"
    server = SGLangServer(model, tmp / "file", data_dir=data, extensions_dir=ext, page_size=16, storage="file")
    with server:
        got = round_trip(server, prompt(16, 9), 16)
        files = [f for f in data.rglob("*") if f.is_file()]
        for f in files:
            f.write_bytes(bytes(f.stat().st_size))
        server.flush_cache()
        got["damaged"] = server.generate(prompt(16, 9), MAX_NEW)
        got["files"] = len(files)
    lane["file"] = got


def shared_redis(tmp: Path, model: str, ext: Path, url: str, name: str, lane: dict[str, Any],
                 written: threading.Event) -> None:  # fmt: skip
    """Two servers, own directories, one Redis tier and catalog: `a` writes, then `b` reads."""
    ns = f"sgl-{uuid.uuid4().hex[:8]}" if name == "a" else lane["ns"]
    extra = {**EXTRA, "tiers": [{"kind": "host"}, {"kind": "redis", "url": url, "prefix": f"{ns}:t:"}],
             "catalog_url": url, "catalog_prefix": f"{ns}:c:"}  # fmt: skip
    server = SGLangServer(model, tmp / f"redis-{name}", data_dir=tmp / f"redis-data-{name}", extensions_dir=ext,
                          page_size=16, extra=extra)  # fmt: skip
    with server:
        if name == "a":
            lane["ns"] = ns
            before = server.metrics().get("backuped_tokens_total", 0.0)
            lane["redis_cold"] = server.generate(prompt(16, 7), MAX_NEW)
            server.wait_backed_up(int(before) + full(16))
            written.set()
        else:
            assert written.wait(600), "the first Redis server never wrote"
            lane["redis_second"] = server.generate(prompt(16, 7), MAX_NEW)


@pytest.fixture(scope="module")
def runs(tmp: Path, model: str, extensions: Path, redis_server: Any) -> dict[str, Any]:
    """Both lanes, side by side (each server is mostly one busy core)."""
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    written = threading.Event()

    def lane_a() -> None:
        chain(tmp, model, extensions, 16, a)
        damaged_agentstate(tmp, model, extensions, a)
        shared_redis(tmp, model, extensions, redis_server.url, "a", a, written)

    def lane_b() -> None:
        chain(tmp, model, extensions, 1, b)
        damaged_file_l3(tmp, model, extensions, b)
        while "ns" not in a and not written.is_set():  # the second Redis server joins the first one's namespace
            time.sleep(0.5)
        b["ns"] = a.get("ns")
        shared_redis(tmp, model, extensions, redis_server.url, "b", b, written)

    errors: list[BaseException] = []

    def run(fn: Any) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(exc)
            written.set()

    threads = [threading.Thread(target=run, args=(fn,)) for fn in (lane_a, lane_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return {16: a, 1: b, "redis": {**a, **b}}


@pytest.mark.parametrize("page", [16, 1])
def test_flush_then_storage_hit_every_layout_and_interface(runs: dict[str, Any], page: int) -> None:
    for (layout, v1), got in zip(CHAIN, runs[page]["chain"]):
        cold, warm = got["cold"], got["warm"]
        assert cold["meta_info"]["cached_tokens"] == 0 and not cached(cold).get("storage"), (layout, v1)
        details = cached(warm)
        assert details["storage_backend"] == "AgentStateStorage", (layout, v1, details)
        assert details["storage"] == full(page) and details["device"] == 0 and details["host"] == 0, (layout, v1, details)
        assert same_output(warm, cold), (layout, v1)


def test_sglang_metrics_show_agentstate_l3(runs: dict[str, Any]) -> None:
    """AgentStateStorage.get_stats() feeds SGLang's own storage metrics (`--enable-metrics`): the pages
    each server read from and wrote to agentstate, and the bandwidth of those calls."""
    for page in (16, 1):
        for (layout, v1), got in zip(CHAIN, runs[page]["chain"]):
            m = got["metrics"]
            read = full(page) // page * (2 if got.get("previous") else 1)  # pages of the storage-hit requests
            assert m.get("prefetch_pgs_sum", 0) >= read and m.get("prefetch_pgs_count", 0) >= 1, (page, layout, v1)
            assert m.get("backup_pgs_sum", 0) >= full(page) // page, (page, layout, v1)
            assert m.get("prefetch_bandwidth_count", 0) >= 1, (page, layout, v1)


@pytest.mark.parametrize("page", [16, 1])
def test_new_process_reads_pages_another_layout_wrote(runs: dict[str, Any], page: int) -> None:
    """Server i's first request is the prompt server i-1 stored: a new process, another layout or interface."""
    steps = runs[page]["chain"]
    for i in range(1, len(CHAIN)):
        out, cold = steps[i]["previous"], steps[i - 1]["cold"]
        details = cached(out)
        assert details["storage"] == full(page) and details["device"] == 0, (CHAIN[i - 1], CHAIN[i], details)
        assert same_output(out, cold), (CHAIN[i - 1], CHAIN[i])


def test_damaged_page_is_detected_and_recomputed(runs: dict[str, Any]) -> None:
    got = runs[16]
    hits = [cached(out).get("storage", 0) for out in got["after_damage"]]
    # the prompt holding the damaged page reads only the pages before it; the others read everything
    assert sorted(hits)[1:] == [full(16)] * (len(CHAIN) - 1) and hits.count(full(16)) == len(CHAIN) - 1, hits
    assert min(hits) < full(16) and min(hits) % 16 == 0, hits
    for out, step in zip(got["after_damage"], got["chain"]):
        assert same_output(out, step["cold"])  # never a wrong token


def test_sglang_file_l3_serves_damaged_pages(runs: dict[str, Any]) -> None:
    """The negative control, recorded: SGLang's HiCacheFile reads zeroed page files back as hits."""
    got = runs[1]["file"]
    assert got["files"] > 0 and same_output(got["warm"], got["cold"])
    storage = cached(got["damaged"]).get("storage", 0)
    changed = not same_output(got["damaged"], got["cold"])
    print(f"HiCacheFile after zeroing {got['files']} page files: storage hits {storage}, output changed: {changed}")
    assert storage == full(16)  # served as hits: it has no checksum (if this fails, SGLang learned to check)


def test_two_servers_share_one_redis_tier(runs: dict[str, Any]) -> None:
    got = runs["redis"]
    cold, second = got["redis_cold"], got["redis_second"]
    assert cold["meta_info"]["cached_tokens"] == 0
    details = cached(second)
    assert details["storage"] == full(16) and details["device"] == 0, details
    assert same_output(second, cold)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentstate", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip


def test_admin_commands_see_the_pages_the_servers_wrote(runs: dict[str, Any], tmp: Path) -> None:
    """Each rank directory records its spec and config: `stats` counts the pages, `verify` checks every one
    of them with the codec, finds one damaged on disk and `--repair` drops it; `ls` opens it (no sessions)."""
    (rank,) = [d for d in (tmp / "data-1").iterdir() if d.name.startswith("tp0-1.")]
    stats = cli("stats", "-p", str(rank), "--json")
    assert stats.returncode == 0, stats.stderr
    pages = json.loads(stats.stdout)["sglang_pages"]
    assert pages >= len(CHAIN) * full(1)  # page size 1: a page per token of every stored prompt
    listed = cli("ls", "-p", str(rank), "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], (listed.stdout, listed.stderr)
    clean = cli("verify", "-p", str(rank), "--json")
    assert clean.returncode == 0, clean.stdout[-2000:] + clean.stderr[-2000:]
    report = json.loads(clean.stdout)
    lmdb_check = next(t for t in report["tiers"] if t["tier"] == "lmdb")
    assert report["clean"] and lmdb_check["pages"] == pages and lmdb_check["ok"] == lmdb_check["checked"]
    key = damage_one_page(tmp / "data-1")
    found = cli("verify", "-p", str(rank), "--json")
    assert found.returncode == 1
    bad = json.loads(found.stdout)["corrupt"]
    assert [b["key"] for b in bad] == [key.decode()], bad
    repaired = cli("verify", "-p", str(rank), "--repair", "--json")
    assert repaired.returncode == 0 and json.loads(repaired.stdout)["repaired"] is True, repaired.stdout[-2000:]
    again = cli("verify", "-p", str(rank), "--json")
    assert again.returncode == 0, again.stdout[-2000:]
    assert next(t for t in json.loads(again.stdout)["tiers"] if t["tier"] == "lmdb")["pages"] == pages - 1


# -- one set of keys: SGLang's pages and transformers' prefixes (key_scheme="sglang") ----------------

CROSS_TOL = {"rel_tol": 1e-4, "abs_tol": 1e-3}
"""Two engines' float32 KV of one model differ in their last bits (other kernels: torch_native attention
against transformers' own); a continuation over the other's KV is compared to each engine's cold run
within this."""


def test_sglang_page_keys_are_sglangs_own(extensions: Path) -> None:
    """`agentstate.adapters.sglang_keys.sglang_page_keys` against SGLang's `get_storage_hash_str` (its native extension)."""
    code = (
        "import json, sys\n"
        "from sglang.srt.mem_cache.utils import get_storage_hash_str\n"
        "class Key(list):\n    extra_key = None\n    cache_salt = None\n"
        "tokens = json.loads(sys.argv[1]); out = []\n"
        "for salt in (None, 'tenant-a'):\n"
        "    k = Key(tokens); k.cache_salt = salt\n"
        "    out.append(get_storage_hash_str(k, None, page_size=16))\n"
        "print(json.dumps(out))\n"
    )
    from tests.sglang_server import _env
    from agentstate.adapters.sglang_keys import sglang_page_keys

    tokens = [random.Random(7).randrange(0, 150_000) for _ in range(100)]
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(tokens)], env=_env(extensions / "tmp", extensions),
                          capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for salt, hashes in zip((None, "tenant-a"), theirs):
        ours = [k.rsplit("/", 1)[1] for k in sglang_page_keys(tokens, fingerprint="f", page_size=16, shard="s", salt=salt)]
        # SGLang's function also hashes a short last page; its storage only ever asks for whole ones
        assert len(ours) == 6 and ours == hashes[:6]


@pytest.fixture(scope="module")
def sglang_cold(tmp: Path, model: str, extensions: Path) -> dict[int, dict[str, Any]]:
    """SGLang's cold runs (no L3) of the interop prompts, by prompt number."""
    base = SGLangServer(model, tmp / "interop-cold", extensions_dir=extensions, page_size=16, storage=None).start()
    try:
        return {i: base.generate(prompt(16, i), MAX_NEW) for i in (501, 502, 503, 504)}
    finally:
        base.stop()


def transformers_continues(lm: Any, open_store: Any, tokens: list[int]) -> None:
    """`tokens`' stored prefix loaded by transformers by tokens alone (every whole page), and its
    continuation equal to transformers' own cold run: greedy tokens, first logits within CROSS_TOL."""
    import asyncio

    import torch

    from agentstate.adapters import transformers as hf

    async def load() -> tuple[int, Any]:
        async with open_store() as store:
            assert (await store.match(tokens)).tokens == full(16)  # every page SGLang wrote
            prefix = await hf.load_prefix(store, tokens, lm)
        return prefix.tokens, prefix.cache

    n, cache = asyncio.run(load())
    with torch.no_grad():
        warm = lm.generate(torch.tensor([tokens]), past_key_values=cache, max_new_tokens=4, do_sample=False,
                           output_logits=True, return_dict_in_generate=True)  # fmt: skip
        cold = lm.generate(torch.tensor([tokens]), max_new_tokens=4, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)  # fmt: skip
    assert n == full(16) and warm.sequences.tolist() == cold.sequences.tolist()
    assert torch.allclose(warm.logits[0], cold.logits[0], rtol=CROSS_TOL["rel_tol"], atol=CROSS_TOL["abs_tol"])


def transformers_stores(lm: Any, open_store: Any, tokens: list[int]) -> None:
    """transformers computes `tokens`' KV and stores its whole pages as a shared prefix."""
    import asyncio

    import torch

    from agentstate.adapters import transformers as hf

    async def put() -> int:
        with torch.no_grad():
            cache = lm(torch.tensor([tokens[: full(16)]]), use_cache=True).past_key_values
        async with open_store() as store:
            return await hf.put_prefix(store, tokens[: full(16)], cache)

    assert asyncio.run(put()) == full(16)


def sglang_reads_transformers_pages(server: SGLangServer, tokens: list[int], cold: dict[str, Any]) -> None:
    got = server.generate(tokens, MAX_NEW)
    details = cached(got)
    assert details.get("storage") == full(16) and details.get("device", 0) == 0, details  # every page from storage
    assert got["output_ids"] == cold["output_ids"]
    assert all(math.isclose(p, q, **CROSS_TOL) for p, q in zip(logprobs(got), logprobs(cold)))


def sglang_stores(server: SGLangServer, tokens: list[int], cold: dict[str, Any]) -> None:
    before = server.metrics().get("backuped_tokens_total", 0.0)
    got = server.generate(tokens, MAX_NEW)
    assert same_output(got, cold) and not cached(got).get("storage")
    server.wait_backed_up(int(before) + full(16))


def test_prefixes_cross_between_a_real_sglang_server_and_transformers(
    tmp: Path, model: str, extensions: Path, sglang_cold: dict[int, dict[str, Any]]
) -> None:
    """transformers stores a prefix, a real SGLang server (agentstate as L3) takes it from storage; the
    server stores a prompt, transformers loads it: one data directory, SGLang's page keys on both sides."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentstate import StateStore, StoreConfig
    from agentstate.adapters import transformers as hf

    name, data = "interop-tiny", tmp / "interop"
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    spec = hf.spec_for(lm, model_id=name)
    a, b = prompt(16, 501), prompt(16, 502)

    def open_store() -> StateStore:  # SGLang's rank directory, keyed as SGLang keys its pages
        cfg = StoreConfig(path=data / "tp0-1.pp0-1.cp0-1", chunk_tokens=16, key_scheme="sglang", **EXTRA)
        return StateStore.open(cfg, spec)  # type: ignore[return-value]

    transformers_stores(lm, open_store, a)
    server = SGLangServer(model, tmp / "interop-l3", data_dir=data, extensions_dir=extensions, page_size=16,
                          extra={**EXTRA, "model_id": name}).start()  # fmt: skip
    try:
        sglang_reads_transformers_pages(server, a, sglang_cold[501])
        sglang_stores(server, b, sglang_cold[502])
    finally:
        server.stop()  # one process writes a data directory at a time
    transformers_continues(lm, open_store, b)


def test_prefixes_cross_over_one_redis_tier_while_both_run(
    tmp: Path, model: str, extensions: Path, sglang_cold: dict[int, dict[str, Any]], redis_server: Any
) -> None:
    """Each side on a directory of its own, one Redis tier and catalog between them, both running."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentstate import StateStore, StoreConfig
    from agentstate.adapters import transformers as hf

    name, ns = "interop-tiny", f"x-{uuid.uuid4().hex[:8]}"
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    spec = hf.spec_for(lm, model_id=name)
    c, d = prompt(16, 503), prompt(16, 504)
    shared = {"tiers": [{"kind": "host"}, {"kind": "redis", "url": redis_server.url, "prefix": f"{ns}:t:"}],
              "catalog_url": redis_server.url, "catalog_prefix": f"{ns}:c:"}  # fmt: skip

    def open_store() -> StateStore:
        cfg = StoreConfig(path=tmp / "interop-redis-hf", chunk_tokens=16, key_scheme="sglang",
                          **{**EXTRA, **shared})  # fmt: skip
        return StateStore.open(cfg, spec)  # type: ignore[return-value]

    server = SGLangServer(model, tmp / "interop-redis-l3", data_dir=tmp / "interop-redis-sgl", extensions_dir=extensions,
                          page_size=16, extra={**EXTRA, **shared, "model_id": name}).start()  # fmt: skip
    try:
        transformers_stores(lm, open_store, c)  # while the server runs
        sglang_reads_transformers_pages(server, c, sglang_cold[503])
        sglang_stores(server, d, sglang_cold[504])
        transformers_continues(lm, open_store, d)
    finally:
        server.stop()


def test_pages_cross_tp_sizes_over_one_redis_tier(tmp: Path, model: str, extensions: Path, redis_server: Any) -> None:
    """A TP 1 server and a TP 2 server (each rank its own directory) over one Redis tier, both running:
    the TP 2 ranks take their heads of the pages TP 1 stored (a storage hit, outputs as TP 1's cold run
    within the tolerance TP 1 and TP 2 have with each other), and the TP 1 server takes the pages the
    two ranks stored as halves, assembled (agentstate.slices)."""
    ns = f"tp-{uuid.uuid4().hex[:8]}"
    extra = {**EXTRA, "tiers": [{"kind": "host"}, {"kind": "redis", "url": redis_server.url, "prefix": f"{ns}:"}]}
    a, b = prompt(16, 601), prompt(16, 602)

    def close(x: dict[str, Any], y: dict[str, Any]) -> bool:
        return x["output_ids"] == y["output_ids"] and all(
            math.isclose(p, q, abs_tol=1e-3) for p, q in zip(logprobs(x), logprobs(y))
        )

    one = SGLangServer(model, tmp / "tp-one", data_dir=tmp / "tp-data-one", extensions_dir=extensions, page_size=16,
                       extra=extra).start()  # fmt: skip
    try:
        before = one.metrics().get("backuped_tokens_total", 0.0)
        cold_a = one.generate(a, MAX_NEW)
        one.wait_backed_up(int(before) + full(16))
        with SGLangServer(model, tmp / "tp-two", data_dir=tmp / "tp-data-two", extensions_dir=extensions,
                          page_size=16, extra=extra, tp=2) as two:  # fmt: skip
            hit_a = two.generate(a, MAX_NEW)
            before = two.metrics().get("backuped_tokens_total", 0.0)
            cold_b = two.generate(b, MAX_NEW)
            two.wait_backed_up(int(before) + full(16))
        hit_b = one.generate(b, MAX_NEW)
    finally:
        one.stop()
    assert not cached(cold_a).get("storage") and not cached(cold_b).get("storage")
    assert cached(hit_a).get("storage") == full(16), cached(hit_a)
    assert cached(hit_b).get("storage") == full(16), cached(hit_b)
    assert close(hit_a, cold_a) and close(hit_b, cold_b)
    assert sorted(p.name for p in (tmp / "tp-data-two").iterdir()) == ["tp0-2.pp0-1.cp0-1", "tp1-2.pp0-1.cp0-1"]
