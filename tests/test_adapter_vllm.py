"""The vLLM connector on a real vLLM engine (CPU, tiny random-weight Llama, float32).

Each engine runs in its own process (tests/vllm_engine.py, ~30 s each); one request per `generate`
call and `reset_prefix_cache()` between rounds, so only the connector can supply hits and the
greedy tokens are deterministic. Engine runs, shared by the tests below:

- base: no connector, the reference tokens of every prompt;
- conn: round 0 stores P1, P2 and session turn 1; round 1 hits P1 and P2 and turn 2 hits all of
  the session;
- then, on the same directory, the library checks (session listed, resumed, continued in
  transformers; vLLM's stored KV against transformers'), a prefix stored through transformers,
  and bytes of one stored chunk damaged;
- again: a new engine process with chunked prefill on the same directory: old hits, the
  transformers prefix hit, the damaged chunk recomputed, new prompts stored and hit; then the
  blocks that prefix loaded into, found in the engine's own caches (a worker extension), against
  the blocks vLLM computed itself for the same tokens;
- redis: two engine processes with their own directories sharing one Redis tier and catalog;
- held: an engine kept running on its directory while a second engine starts on the same path.

Runs under the venv that has vLLM (.ci/run makes .venv-vllm); CI fails instead of skipping.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.requires import require_module

vllm = require_module("vllm", "pip install -c constraints.txt -r requirements-vllm.txt (a venv of its own: .ci/run)")
transformers = require_module("transformers")

from agentstate.adapters import transformers as hf
from agentstate.adapters.vllm.blocks import BlockLayout, BlocksTarget, gather, layout_for, scatter

from agentstate import ModelSpec, StateStore, codec, layouts
from agentstate.codec import decode
from agentstate.keys import chunk_keys, namespace_for

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "tests" / "vllm_engine.py"
sys.path.insert(0, str(ROOT / "tests"))
from vllm_engine import make_model


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


P1, P2, P3, P4, S1 = toks(700, 1), toks(1100, 2), toks(900, 3), toks(600, 4), toks(300, 5)
EXTRA = toks(40, 6)
SESSION = {"agentstate": {"session_id": "agent-1", "state": {"turn": 1}}}
SESSION2 = {"agentstate": {"session_id": "agent-1", "state": {"turn": 2}}}
MAX = 8


def req(tokens: list[int] | None = None, **kw: Any) -> dict[str, Any]:
    return {"tokens": tokens or [], "max_tokens": MAX, **kw}


def run_engine(tmp: Path, name: str, job: dict[str, Any], timeout: float = 400) -> dict[str, Any]:
    work = tmp / name
    work.mkdir(parents=True, exist_ok=True)
    (work / "tmp").mkdir(exist_ok=True)
    (work / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "TMPDIR": str(work / "tmp"), "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"), "VLLM_CPU_KVCACHE_SPACE": "1"}  # fmt: skip
    with open(work / "log.txt", "w") as log:
        proc = subprocess.Popen([sys.executable, str(ENGINE), str(work / "job.json"), str(work / "out.json")],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        rc = proc.wait(timeout)
    except BaseException:
        stop_group(proc)  # vLLM's engine and worker processes too
        raise
    text = (work / "log.txt").read_text()
    if rc != 0 or not (work / "out.json").exists():
        stop_group(proc)
        raise AssertionError(f"engine {name} failed (rc {rc}):\n{text[-6000:]}")
    return json.loads((work / "out.json").read_text())


def stop_group(proc: subprocess.Popen[Any]) -> None:
    """Kill what is left of an engine run started with its own session: its process group (vLLM's
    EngineCore and workers outlive a killed parent, holding the data directory)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def model(tmp: Path) -> str:
    return make_model(str(tmp / "model"))


@pytest.fixture(scope="module")
def base(tmp: Path, model: str) -> dict[str, Any]:
    s2 = {"continue": [2, 0], "extra": EXTRA, "max_tokens": MAX}
    rounds = [[req(P1)], [req(P2)], [req(S1)], [s2], [req(P3)], [req(P4)]]
    out = run_engine(tmp, "base", {"model": model, "connector": None, "rounds": rounds})
    names = ["P1", "P2", "S1", "S2", "P3", "P4"]
    return {n: r[0] for n, r in zip(names, out["rounds"])}


@pytest.fixture(scope="module")
def data(tmp: Path) -> Path:
    return tmp / "data"


@pytest.fixture(scope="module")
def conn(tmp: Path, model: str, data: Path) -> dict[str, Any]:
    rounds = [
        [req(P1), req(P2), req(S1, params=SESSION)],
        [req(P1), req(P2), {"continue": [0, 2], "extra": EXTRA, "max_tokens": MAX, "params": SESSION2},
         req(P1, salt="tenant-b")],
    ]
    return run_engine(tmp, "conn", {"model": model, "connector": {"path": str(data)}, "rounds": rounds})


def spec_of(data: Path) -> ModelSpec:
    return ModelSpec.model_validate_json((data / "spec.json").read_text())


# -- block layouts, no engine ------------------------------------------------------------------------


def test_cpu_layout_round_trip() -> None:
    """Canonical chunk -> CPU blocks -> canonical, bit-exact, and K really lies transposed in a block."""
    bs, h, d, layers = 32, 2, 16, 3
    lay = layout_for("CPU_ATTN", "vec", block_size=bs, heads=h, dim=d)
    caches = [torch.zeros(6, h, bs, 2 * d) for _ in range(layers)]
    planes = [lay.planes(c) for c in caches]
    src = torch.randn(layers, 2, 3 * bs, h, d)
    blocks = [4, 1, 5]
    target = BlocksTarget(planes, blocks, bs, first=0, num_tokens=3 * bs)
    target.write(0, src)
    assert torch.equal(gather(planes, blocks, bs, 0, 3 * bs, torch.empty_like(src)), src)
    assert torch.equal(gather(planes, blocks, bs, 0, 3 * bs, torch.empty_like(src), lay.orders), src)
    # token t of block 1's first position, head 0, dim 3: K at [d=3, t], V at [t, d=3]
    flat = caches[0][4, 0].reshape(-1)
    assert flat[3 * bs + 0] == src[0, 0, 0, 0, 3] and flat[bs * d + 0 * d + 3] == src[0, 1, 0, 0, 3]
    # tokens before `first` are left alone
    for c in caches:
        c.zero_()
    BlocksTarget(planes, blocks, bs, first=bs + 5, num_tokens=3 * bs).write(0, src)
    out = gather(planes, blocks, bs, 0, 3 * bs, torch.empty_like(src))
    assert not out[:, :, : bs + 5].any() and torch.equal(out[:, :, bs + 5 :], src[:, :, bs + 5 :])
    # nor tokens from `stop` on (a span may run past the blocks vLLM allocated)
    for c in caches:
        c.zero_()
    BlocksTarget(planes, blocks, bs, first=0, num_tokens=3 * bs, stop=2 * bs + 3).write(0, src)
    out = gather(planes, blocks, bs, 0, 3 * bs, torch.empty_like(src))
    assert torch.equal(out[:, :, : 2 * bs + 3], src[:, :, : 2 * bs + 3]) and not out[:, :, 2 * bs + 3 :].any()


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_scatter_gather_match_a_token_by_token_reference(data: st.DataObject) -> None:
    """Runs of consecutive blocks are copied at once: any block ids (runs, gaps, reversed), any start,
    length, `first` and layout give exactly what copying token by token gives, and nothing else moves."""
    bs = data.draw(st.sampled_from([1, 2, 4, 8]))
    nblocks = data.draw(st.integers(1, 6))
    pool = 12
    ids = data.draw(st.permutations(range(pool)))[:nblocks]
    if data.draw(st.booleans()):
        b0 = data.draw(st.integers(0, pool - nblocks))
        ids = list(range(b0, b0 + nblocks))  # one run
    name = data.draw(st.sampled_from(["cpu_vec", "flash_nhd", "flash_hnd"]))
    h, layers = 2, 2
    d = data.draw(st.sampled_from([3, 160]))  # 160: a token is 1280 bytes, the staged K copy (STAGE_FROM_BYTES)
    lay = BlockLayout(name, bs, h, d)
    shape = (pool, h, bs, 2 * d) if name == "cpu_vec" else ((2, pool, bs, h, d) if name == "flash_nhd" else (2, pool, h, bs, d))
    caches = [torch.randn(shape) for _ in range(layers)]
    before = [c.clone() for c in caches]
    planes = [lay.planes(c) for c in caches]
    total = nblocks * bs
    start = data.draw(st.integers(0, total - 1))
    n = data.draw(st.integers(1, total - start))
    first = data.draw(st.integers(0, total))
    src = torch.randn(layers, 2, n, h, d)
    orders = lay.orders if data.draw(st.booleans()) else ((0, 1, 2), (0, 1, 2))
    scatter(planes, ids, bs, start, src, first=first, orders=orders)
    ref = [lay.planes(c) for c in before]
    for t in range(max(start, first), start + n):
        for layer in range(layers):
            for p in (0, 1):
                ref[layer][p][ids[t // bs], t % bs] = src[layer, p, t - start]
    for c, r in zip(caches, before):
        assert torch.equal(c, r)
    out = gather(planes, ids, bs, start, n, torch.full_like(src, float("nan")), orders)
    want = torch.stack([torch.stack([ref[layer][p][ids[t // bs], t % bs] for t in range(start, start + n)])
                        for layer in range(layers) for p in (0, 1)]).view(layers, 2, n, h, d)  # fmt: skip
    assert torch.equal(out, want)


def test_import_agentstate_needs_no_vllm() -> None:
    code = ("import sys, agentstate, agentstate.adapters.transformers, agentstate.adapters.vllm.blocks,"
            " agentstate.adapters.vllm.lookup, agentstate.adapters.vllm.params, agentstate.adapters.vllm.config;"
            " assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm imported'")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_lookup_channel() -> None:
    """The scheduler's lookups reach the worker's loop; a worker that is gone is an OSError (a miss)."""
    from agentstate.adapters.runtime import LoopThread
    from agentstate.adapters.vllm.lookup import LookupClient, LookupServer, socket_name

    name = socket_name(f"/nonexistent/{os.getpid()}", 0)
    asked: list[dict[str, Any]] = []

    async def answer(request: dict[str, Any]) -> dict[str, Any]:
        asked.append(request)
        if request.get("boom"):
            raise RuntimeError("store down")
        return {"chunks": len(request["keys"])}

    loop = LoopThread("test-lookup")
    server = LookupServer(name, answer)
    client = LookupClient(name, timeout_s=2)
    try:
        loop.run(server.start(), 5)
        assert client.ask({"keys": ["a", "b"]}) == {"chunks": 2}
        assert client.ask({"keys": [], "boom": True})["error"].startswith("RuntimeError")
        assert client.ask({"keys": ["x"] * 5000}) == {"chunks": 5000}  # large messages
        loop.run(server.stop(), 5)
        with pytest.raises(OSError):
            client.ask({"keys": ["a"]})
    finally:
        client.close()
        loop.stop()
    assert len(asked) == 3


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_pipeline_parallelism_is_refused_at_startup(tmp_path: Path, tp: int, pp: int) -> None:
    """A stage holds some layers, which no key names yet: refused by both roles before anything is
    opened, rather than an engine that silently never hits (tensor parallelism alone is supported)."""
    from agentstate.adapters.vllm import AgentStateConnector
    from agentstate.errors import InvalidArgumentError
    from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    kv = KVTransferConfig(kv_connector="AgentStateConnector", kv_role="kv_both",
                          kv_connector_module_path="agentstate.adapters.vllm",
                          kv_connector_extra_config={"path": str(tmp_path / "data")})  # fmt: skip
    cfg = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                     kv_transfer_config=kv)  # fmt: skip
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(InvalidArgumentError, match="pipeline parallelism"):
            AgentStateConnector(cfg, role)
    assert not (tmp_path / "data").exists()


def test_a_shared_catalog_at_tp2_is_refused_at_startup(tmp_path: Path) -> None:
    """Each rank snapshots its heads of a session under the session's one name: in one catalog they
    would replace each other. Refused before anything opens; a TP 2 engine with per-rank catalogs
    (tests/test_adapter_vllm_tp.py) and a TP 1 engine with a shared catalog both start."""
    from agentstate.adapters.vllm.config import ConnectorConfig
    from agentstate.errors import InvalidArgumentError
    from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig

    extra = {"path": str(tmp_path / "data"), "catalog_url": "redis://127.0.0.1:1/0"}
    kv = KVTransferConfig(kv_connector="AgentStateConnector", kv_role="kv_both",
                          kv_connector_module_path="agentstate.adapters.vllm", kv_connector_extra_config=extra)  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="shared catalog"):
        ConnectorConfig.of(VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2), kv_transfer_config=kv))
    assert not (tmp_path / "data").exists()


@pytest.mark.gpu
def test_flash_layouts_round_trip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    bs, h, d = 16, 4, 64
    for variant, shape in (("NHD", (2, 8, bs, h, d)), ("HND", (2, 8, h, bs, d))):
        lay: BlockLayout = layout_for("FLASH_ATTN", variant, block_size=bs, heads=h, dim=d)
        caches = [torch.zeros(shape, device="cuda") for _ in range(2)]
        planes = [lay.planes(c) for c in caches]
        src = torch.randn(2, 2, 2 * bs, h, d, device="cuda")
        BlocksTarget(planes, [3, 6], bs, 0, 2 * bs).write(0, src)
        torch.cuda.synchronize()
        assert torch.equal(gather(planes, [3, 6], bs, 0, 2 * bs, torch.empty_like(src)), src)


# -- the real engine ---------------------------------------------------------------------------------


def test_round0_stores_round1_hits(base: dict[str, Any], conn: dict[str, Any]) -> None:
    r0, r1 = conn["rounds"]
    assert [r["cached"] for r in r0] == [0, 0, 0]
    assert r1[0]["cached"] == 512 and r1[1]["cached"] == 1024  # whole chunks, one prompt token left
    assert r1[3]["cached"] == 0 and r1[3]["tokens"] == base["P1"]["tokens"]  # cache_salt: another tenant's namespace
    assert r0[0]["tokens"] == base["P1"]["tokens"] and r1[0]["tokens"] == base["P1"]["tokens"]
    assert r0[1]["tokens"] == base["P2"]["tokens"] and r1[1]["tokens"] == base["P2"]["tokens"]
    m = conn["metrics"]
    assert m["vllm:external_prefix_cache_hits"] >= 512 + 1024
    assert m["vllm:agentstate_loaded_tokens"] >= 512 + 1024 and m["vllm:agentstate_stored_tokens"] >= 512 + 1024
    assert m["vllm:agentstate_load_error_blocks"] == 0 and m["vllm:agentstate_errors"] == 0


def test_session_turn2_hits_everything(base: dict[str, Any], conn: dict[str, Any]) -> None:
    s1, s2 = conn["rounds"][0][2], conn["rounds"][1][2]
    assert s1["tokens"] == base["S1"]["tokens"] and s2["tokens"] == base["S2"]["tokens"]
    stored = len(S1) + MAX - 1  # prompt and generated tokens with KV (the last sampled one has none yet)
    assert s2["cached"] == stored  # the tail too, not just whole chunks
    assert conn["metrics"]["vllm:agentstate_sessions_saved"] >= 1  # turn 2 may land after the metrics were read


@pytest.fixture(scope="module")
def library(conn: dict[str, Any], data: Path, model: str) -> bool:
    """The session in the CLI and the library; vLLM's KV against transformers'; resume continues in
    transformers token-identical to its own prefill. Then prepares the next engine run: a prefix
    stored through transformers, and damaged bytes."""
    spec = spec_of(data)
    lm = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    assert hf.spec_for(lm, model_id=model) == spec  # equal tokens give equal keys in both engines
    ls = subprocess.run([sys.executable, "-m", "agentstate", "ls", "--path", str(data), "--json"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert ls.returncode == 0, ls.stderr
    assert "agent-1" in ls.stdout
    for args in (["inspect", "agent-1"], ["verify"]):  # every chunk vLLM wrote decodes and checks
        cli = subprocess.run([sys.executable, "-m", "agentstate", *args, "--path", str(data), "--json"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert cli.returncode == 0, (args, cli.stdout[-2000:], cli.stderr[-2000:])
    s2 = conn["rounds"][1][2]
    turn2 = s2["prompt"] + s2["tokens"][:-1]

    async def check() -> None:
        async with StateStore.open(data, spec) as store:
            manifest = await store.session("agent-1")
            assert manifest.version == 2 and manifest.tokens == turn2 and manifest.state == {"turn": 2}
            res = await store.resume("agent-1")
            assert res.restored_tokens == len(turn2)
            # the session's full chunks were saved as vLLM computed them, in its CPU blocks' own layout:
            # this canonical reader got them converted (and, below, equal to transformers' KV)
            assert store.chunks.counters().get("layout_conversions", 0) >= len(turn2) // 256
            again = await store.resume("agent-1")
            assert torch.equal(res.kv.view(torch.uint8), again.kv.view(torch.uint8))  # type: ignore[union-attr]
            with torch.no_grad():
                ref = lm(torch.tensor([turn2]), use_cache=True).past_key_values
            ref_kv = hf.cache_to_kv(ref, spec)
            # Two engines' float32 kernels: equal to ~4e-5 on a quiet machine (bit-identical over six runs,
            # quiet, beside a CPU hog, beside the core suite), but once, in a CI run beside a hog and a demo
            # install, ~1e-3 in the last layer (values ~5; the layer-0 KV, which no context touches, equal).
            # A misplaced block, token or head differs by whole units: the controls show the tolerance
            # still tells those apart from the right KV.
            assert torch.allclose(res.kv, ref_kv, atol=5e-3, rtol=5e-3)  # type: ignore[arg-type]
            for wrong in (ref_kv.roll(1, dims=2), ref_kv.flip(3), ref_kv[:, [1, 0]]):  # a token off, heads, K/V
                assert not torch.allclose(res.kv, wrong, atol=5e-3, rtol=5e-3)  # type: ignore[arg-type]
            # resume in transformers and continue: identical to transformers' own prefill
            fork = await store.fork("agent-1", "agent-1-fork")  # forked and deleted like any session
            assert fork.tokens == turn2 and fork.parent == "agent-1"
            await store.delete("agent-1-fork")
            resumed = await hf.resume(store, "agent-1", lm)
            full = torch.tensor([turn2 + [s2["tokens"][-1]]])
            with torch.no_grad():
                a = lm.generate(full, past_key_values=resumed.cache, max_new_tokens=6, do_sample=False)
                b = lm.generate(full, max_new_tokens=6, do_sample=False)
            assert a[0, -6:].tolist() == b[0, -6:].tolist()
            # a prefix stored through transformers, for the next engine run
            with torch.no_grad():
                cache = lm(torch.tensor([P4[:512]]), use_cache=True).past_key_values
            assert await hf.put_prefix(store, P4[:512], cache) == 512
            from safetensors.torch import save_file  # what the next engine must find in its blocks

            save_file({"kv": hf.cache_to_kv(cache, spec).contiguous()}, str(data.parent / "p4.safetensors"))
            # damage one stored chunk of P2 (the third): the next engine run must detect it
            key = chunk_keys(P2[:1024], namespace=namespace_for("default"), fingerprint=spec.fingerprint,
                             chunk_tokens=256)[2]  # fmt: skip
            value = await store.chunks.read_value(key, 256)
            assert value is not None
            assert layouts.block_size_of(codec.read_header(value).layout) is not None  # vLLM's blocks, as they lie
            bad = bytearray(value)
            bad[-7] ^= 0x5A
            await store.chunks.backend("lmdb").put([key], [bad])  # under the store: as a disk would damage it

    asyncio.run(check())
    return True


def test_library_sees_what_vllm_stored(library: bool) -> None:
    assert library


@pytest.fixture(scope="module")
def again(tmp: Path, model: str, data: Path, library: bool, conn: dict[str, Any]) -> dict[str, Any]:
    # round 1: Q shares P3's first block (not its first chunk), so P3's local hit (128) ends inside a
    # chunk: the load writes only the chunk's tokens past it
    # and a prompt that is exactly the session's tokens: all but its last token load (the tail clipped)
    s2 = conn["rounds"][1][2]
    turn3 = {"tokens": s2["prompt"] + s2["tokens"][:-1], "max_tokens": 2,
             "params": {"agentstate": {"session_id": "agent-1", "state": {"turn": 3}}}}  # fmt: skip
    # P4 under another cache_salt: vLLM computes the same tokens itself, into other blocks
    rounds = [[req(P1), req(P2), req(P4), req(P4, salt="own"), req(P3)],
              [req(P3[:200] + toks(100, 8)), req(P3), turn3]]  # fmt: skip
    job = {"model": model, "connector": {"path": str(data)}, "rounds": rounds, "chunked_prefill": True,
           "probe": str(data.parent / "p4.safetensors")}  # fmt: skip
    return run_engine(tmp, "again", job)


def test_new_engine_process_chunked_prefill(base: dict[str, Any], again: dict[str, Any]) -> None:
    (p1, p2, p4, p4own, p3), (_, p3b, turn3) = again["rounds"]
    assert p4own["cached"] == 0 and p4own["tokens"] == base["P4"]["tokens"]
    assert p1["cached"] == 512 and p1["tokens"] == base["P1"]["tokens"]
    assert p4["cached"] == 512 and p4["tokens"] == base["P4"]["tokens"]  # stored by transformers
    assert p3["cached"] == 0 and p3b["cached"] == 768
    assert p3["tokens"] == base["P3"]["tokens"] and p3b["tokens"] == base["P3"]["tokens"]
    # the damaged chunk: detected, its blocks recomputed, the tokens still equal
    assert p2["tokens"] == base["P2"]["tokens"]
    assert again["metrics"]["vllm:agentstate_load_error_blocks"] == 4  # the damaged chunk's blocks, no more
    # the session's tokens again: loaded but the last, and the next token is the one vLLM sampled there
    assert turn3["cached"] == len(turn3["prompt"]) - 1
    assert turn3["tokens"][0] == base["S2"]["tokens"][-1]
    assert p2["cached"] < 1024 or again["metrics"]["vllm:agentstate_load_error_blocks"] > 0


def test_transformers_kv_lands_in_vllm_blocks_as_vllm_computes_it(again: dict[str, Any]) -> None:
    """P4's first 512 tokens, stored through transformers: every block the connector loaded holds
    exactly transformers' KV, and its raw memory equals, within fp32 tolerance, the block vLLM
    computed itself for the same tokens (P4 under another cache_salt)."""
    windows = again["probe"]
    assert len(windows) == 4
    for w in windows:
        assert len(w["blocks"]) == 2, w  # the loaded block and vLLM's own, nothing else near
        assert w["exact"], w  # the loaded block: transformers' bytes, bit for bit
        (raw,) = w["raw_vs_exact"].values()
        assert raw <= 1e-4, w  # vLLM's own block, raw memory against the loaded one


def test_damaged_chunk_stored_again(again: dict[str, Any], data: Path) -> None:
    """The corrupt copy was dropped on load, and the recomputed chunk saved again."""
    spec = spec_of(data)
    key = chunk_keys(P2[:1024], namespace=namespace_for("default"), fingerprint=spec.fingerprint, chunk_tokens=256)[2]

    async def check() -> None:
        async with StateStore.open(data, spec, read_only=True) as store:
            assert await store.chunks.read_value(key, 256) is not None

    asyncio.run(check())


def test_two_engines_share_redis_sync_load(tmp: Path, model: str, base: dict[str, Any], redis_server: Any) -> None:
    url = redis_server.url
    cfg = {"tiers": [{"kind": "host"}, {"kind": "redis", "url": url, "prefix": "vllmtest:"}], "catalog_url": url,
           "catalog_prefix": "vllmtest:"}  # fmt: skip
    first = run_engine(tmp, "redis1", {"model": model, "connector": {"path": str(tmp / "e1"), **cfg},
                                       "rounds": [[req(P1)]]})  # fmt: skip
    # the second engine loads synchronously (before the forward of the same step): the other load path
    second = run_engine(tmp, "redis2", {"model": model, "connector": {"path": str(tmp / "e2"), "load_mode": "sync", **cfg},
                                        "rounds": [[req(P1)]]})  # fmt: skip
    assert first["rounds"][0][0]["cached"] == 0
    assert second["rounds"][0][0]["cached"] == 512
    assert second["rounds"][0][0]["tokens"] == base["P1"]["tokens"]


def test_second_engine_on_a_held_directory_answers_without_hits(tmp: Path, model: str, base: dict[str, Any]) -> None:
    """Issue 25 item 2: an engine left running (its API server killed) holds the data directory; a new
    engine on the same path cannot open the store. Its scheduler must not ask the old engine's worker
    (which has the prompt stored, and would answer with hits the new worker cannot load: the engine
    rescheduled the request forever). The new engine answers its request without hits; its worker
    says once, in one line, that it runs without the store and which process holds it; its scheduler
    says once that its worker serves no lookups."""
    data = tmp / "held"
    work = tmp / "holder"
    work.mkdir(parents=True, exist_ok=True)
    (work / "tmp").mkdir(exist_ok=True)
    ready, release = work / "ready.json", work / "release"
    job = {"model": model, "connector": {"path": str(data)}, "rounds": [[req(P1)]],
           "hold": {"ready": str(ready), "release": str(release)}}  # fmt: skip
    (work / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "TMPDIR": str(work / "tmp"), "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"), "VLLM_CPU_KVCACHE_SPACE": "1"}  # fmt: skip
    with open(work / "log.txt", "w") as log:
        holder = subprocess.Popen([sys.executable, str(ENGINE), str(work / "job.json"), str(work / "out.json")],
                                  cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 400  # a hang guard: the engine starts in about 30 s
        while not ready.exists():
            assert holder.poll() is None, (work / "log.txt").read_text()[-4000:]
            assert time.monotonic() < deadline, "the first engine never got ready"
            time.sleep(0.5)
        first = json.loads(ready.read_text())["rounds"][0][0]
        assert first["cached"] == 0 and first["tokens"] == base["P1"]["tokens"]  # P1 is stored, in its store
        pid = int((data / "LOCK").read_text().strip())  # the first engine's worker holds the directory
        assert pid != holder.pid and os.path.exists(f"/proc/{pid}")
        # the request would never be answered before the fix: bounded by the engine run's timeout
        second = run_engine(tmp, "second", {"model": model, "connector": {"path": str(data)}, "rounds": [[req(P1)]]},
                            timeout=240)  # fmt: skip
    finally:
        release.touch()
        with contextlib.suppress(subprocess.TimeoutExpired):
            holder.wait(120)
        stop_group(holder)
    answer = second["rounds"][0][0]
    assert answer["cached"] == 0 and answer["tokens"] == base["P1"]["tokens"]
    assert answer["e2e"] < 60  # the bound (a hang guard: the request takes well under a second)
    m = second["metrics"]
    assert m.get("vllm:external_prefix_cache_hits", 0) == 0 and m.get("vllm:agentstate_load_error_blocks", 0) == 0
    lines = (tmp / "second" / "log.txt").read_text().splitlines()
    worker = [line for line in lines if "runs without its store" in line]
    assert len(worker) == 1 and f"process {pid}" in worker[0], worker
    scheduler = [line for line in lines if "serves no lookups" in line]
    assert len(scheduler) == 1, scheduler


def test_preempted_requests_never_store_wrong_kv(tmp: Path, model: str) -> None:
    """Copies out of the blocks run off the step: a request preempted meanwhile loses its blocks to
    others, so its copies in flight are revoked. Four requests decoding together in a pool too small
    for them (preemptions counted): every chunk stored, prompt or generated, holds the KV transformers
    computes for its tokens."""
    data = tmp / "preempt"
    prompts = [toks(300, 40 + i) for i in range(4)]
    job = {"model": model, "connector": {"path": str(data), "chunk_tokens": 128}, "num_blocks": 16,
           "max_model_len": 1024, "batched": True, "rounds": [[req(p, max_tokens=400) for p in prompts]]}  # fmt: skip
    out = run_engine(tmp, "preempt", job)
    assert out["metrics"].get("vllm:num_preemptions", 0) > 0, out["metrics"]
    assert out["metrics"]["vllm:agentstate_stored_tokens"] > 0
    spec = spec_of(data)
    lm = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    async def check() -> int:
        checked = 0
        async with StateStore.open(data, spec, chunk_tokens=128, read_only=True) as store:
            for r in out["rounds"][0]:
                seq = r["prompt"] + r["tokens"][:-1]  # the last sampled token has no KV
                keys = chunk_keys(seq, namespace=namespace_for("default"), fingerprint=spec.fingerprint,
                                  chunk_tokens=128)  # fmt: skip
                with torch.no_grad():
                    ref = hf.cache_to_kv(lm(torch.tensor([seq]), use_cache=True).past_key_values, spec)
                for j, key in enumerate(keys):  # each stored chunk on its own, gaps or not
                    value = await store.chunks.read_value(key, 128)
                    if value is None:
                        continue
                    kv = decode(value, key=key, fingerprint=spec.fingerprint, dtype=spec.torch_dtype,
                                shape=tuple(spec.empty_kv(128).shape))  # fmt: skip
                    assert torch.allclose(kv, ref[:, :, j * 128 : (j + 1) * 128], atol=1e-4, rtol=1e-4), (key, j)
                    checked += 1
        return checked

    assert asyncio.run(check()) >= 8


# -- agent hints in kv_transfer_params ------------------------------------------------------------------

HOST_BYTES = 4352 << 10  # 8 chunks of this model (256 tokens x 2 KiB each, encoded), not 9
PRESSURE = [toks(1100, 60 + i) for i in range(3)]  # 12 chunks: everything not held leaves the host tier


def hint(name: str, kind: str | list[str], **kw: Any) -> dict[str, Any]:
    return {"agentstate": {"agent_id": name, "hint": kind, **kw}}


BAD_HINTS = [
    hint("d", "paused"),  # no expected_s
    hint("d", "sleepy", expected_s=5),
    hint("bad id!", "resuming"),
    hint("d", "paused", expected_s="30"),  # a string is not seconds
    {"agentstate": {"hint": "done"}},  # no name
    hint("d", ["paused", "done"], expected_s=5),  # two hints for its end
]


@pytest.fixture(scope="module")
def hinted(tmp: Path, model: str) -> dict[str, Any]:
    """One engine on a host tier of 8 chunks over LMDB. Round 0 stores A (paused for 60 s), then B
    and C (no hint, more recent than A: plain LRU evicts A before them), and a named session S
    (another tenant) paused; round 1 is pressure (12 new chunks); then A returns (done), B returns,
    C returns with resuming (and done for its end); last, requests with malformed hints, one round each."""
    session = {"agentstate": {"session_id": "agent-h", "state": {}, "hint": "paused", "expected_s": 60}}
    rounds = [
        [req(P1[:600], params=hint("a", "paused", expected_s=60)), req(P3[:600]), req(P2[:600]),
         req(S1, params=session, salt="tenant-s")],
        [req(p) for p in PRESSURE],
        [req(P1, params=hint("a", "done"))],
        [req(P3)],
        [req(P2, params=hint("c", ["resuming", "done"]))],
        *([req(P4, params=bad)] for bad in BAD_HINTS),  # a round each: the connector serves P4 from the 2nd on
    ]  # fmt: skip
    tiers = [{"kind": "host", "capacity_bytes": HOST_BYTES}, {"kind": "lmdb"}]
    connector = {"path": str(tmp / "hints-data"), "tiers": tiers}
    job = {"model": model, "connector": connector, "rounds": rounds, "round_metrics": True,
           "sleep": [0, 1, 1], "wait_hints": {"1": 2}}  # fmt: skip
    out = run_engine(tmp, "hints", job)
    out["log"] = (tmp / "hints" / "log.txt").read_text()
    return out


def _delta(out: dict[str, Any], rnd: int, name: str, last: int | None = None) -> float:
    """How much a metric grew in rounds `rnd` .. `last` (default: that round alone)."""
    after = out["round_metrics"][rnd if last is None else last].get(name, 0)
    return after - (out["round_metrics"][rnd - 1].get(name, 0) if rnd else 0)


def test_paused_prefix_stays_in_host_memory_under_pressure(base: dict[str, Any], hinted: dict[str, Any]) -> None:
    """A was stored first and paused: the pressure that pushed B (newer, no hint) down to LMDB left
    A in host memory, so A's return reads no LMDB bytes and B's does."""
    lmdb, host = "vllm:agentstate_bytes_read{lmdb}", "vllm:agentstate_bytes_read{host}"
    (a,), (b,) = hinted["rounds"][2], hinted["rounds"][3]
    assert a["cached"] == 512 and a["tokens"] == base["P1"]["tokens"]
    assert b["cached"] == 512 and b["tokens"] == base["P3"]["tokens"]
    assert _delta(hinted, 3, lmdb) >= 512 * 2048  # the control: pressure did evict what no hint held
    assert hinted["rounds"][0][3]["tokens"] == base["S1"]["tokens"]
    assert hinted["round_metrics"][1]["vllm:agentstate_hints"] == 2  # A and the session S, paused
    assert _delta(hinted, 2, lmdb) == 0  # A stayed in host memory: held, no newcomer displaced it
    assert _delta(hinted, 2, host) >= 512 * 2048


def test_resuming_brings_the_prefix_up_before_its_load(base: dict[str, Any], hinted: dict[str, Any]) -> None:
    """C was pushed down to LMDB; its return carries resuming: the hint brought its chunks up into
    host memory and the load read none from LMDB; the output is a run without the store's."""
    (c,) = hinted["rounds"][4]
    assert c["cached"] == 512 and c["tokens"] == base["P2"]["tokens"]
    assert _delta(hinted, 4, "vllm:agentstate_hint_moved_bytes") >= 512 * 2048
    assert _delta(hinted, 4, "vllm:agentstate_bytes_read{lmdb}") == 0
    assert _delta(hinted, 4, "vllm:agentstate_bytes_read{host}") >= 512 * 2048
    m = hinted["metrics"]
    assert m["vllm:agentstate_hints"] == 5 and m["vllm:agentstate_hint_errors"] == 0  # + A's done, C's two
    assert m["vllm:agentstate_errors"] == 0 and m["vllm:agentstate_load_error_blocks"] == 0


def test_bad_hint_params_never_fail_the_request(base: dict[str, Any], hinted: dict[str, Any], tmp: Path) -> None:
    """Malformed hints: each request served as without one (its prefix stored and hit as usual),
    one warning per request with the typed error, no hint counted by the connector or the store."""
    bad = [r for (r,) in hinted["rounds"][5:]]
    assert all(r["tokens"] == base["P4"]["tokens"] for r in bad)
    assert [r["cached"] for r in bad] == [0] + [512] * (len(BAD_HINTS) - 1)  # stored by the first, loaded after
    last = len(hinted["rounds"]) - 1
    assert _delta(hinted, 5, "vllm:agentstate_hints_invalid", last) == len(BAD_HINTS)
    assert hinted["metrics"]["vllm:agentstate_hints"] == 5  # the valid hints of the rounds before, no more
    assert _delta(hinted, 5, "vllm:agentstate_hint_errors", last) == 0
    warnings = [line for line in hinted["log"].splitlines() if "served without its hint" in line]
    assert len(warnings) == len(BAD_HINTS), warnings
    assert all("InvalidArgumentError" in w or "InvalidSessionIdError" in w for w in warnings)
    data = tmp / "hints-data"

    async def check() -> None:
        async with StateStore.open(data, spec_of(data), read_only=True) as store:
            usage = await store.usage()
            assert usage.hints == 4  # A paused and done, C resuming and done (S's is tenant-s's): no bad one
            assert usage.loads == 3 + len(BAD_HINTS) - 1 and usage.tokens_read == 512 * usage.loads
            assert usage.bytes_read.get("lmdb", 0) >= 512 * 2048  # B's return

    asyncio.run(check())
